"""What TensorBoard's dashboards read from a log dir, in process: the HParams and Custom Scalars
plugins' own HTTP routes over TensorBoard's event multiplexer and data provider (the handlers
``tensorboard --logdir`` serves to the browser), without a server."""

import json

HPARAMS_STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


class Dashboards:
    """``tensorboard --logdir logdir`` as its plugins answer: :meth:`session_groups` (the HParams
    table's rows), :meth:`experiment` (its columns) and :meth:`layout` (the merged Custom Scalars
    layout)."""

    def __init__(self, logdir):
        from tensorboard.backend.event_processing import data_provider
        from tensorboard.backend.event_processing import plugin_event_multiplexer as multiplexer
        from tensorboard.plugins import base_plugin
        from tensorboard.plugins.custom_scalar import custom_scalars_plugin
        from tensorboard.plugins.hparams import hparams_plugin

        events = multiplexer.EventMultiplexer()
        events.AddRunsFromDirectory(str(logdir))
        events.Reload()
        context = base_plugin.TBContext(logdir=str(logdir), multiplexer=events,
                                        data_provider=data_provider.MultiplexerDataProvider(events, str(logdir)))
        self.runs = sorted(events.Runs())
        self._hparams = hparams_plugin.HParamsPlugin(context).get_plugin_apps()
        self._custom_scalars = custom_scalars_plugin.CustomScalarsPlugin(context).get_plugin_apps()

    @staticmethod
    def _call(app, method, body=None):
        from werkzeug.test import Client
        from werkzeug.wrappers import Response

        response = Client(app, Response).open("/", method=method, data=None if body is None else json.dumps(body),
                                              headers={"Content-Type": "application/json", "X-XSRF-Protected": "1"})
        assert response.status_code == 200, response.get_data(as_text=True)
        return json.loads(response.get_data(as_text=True))

    def experiment(self) -> dict:
        return self._call(self._hparams["/experiment"], "POST", {"experimentName": ""})

    def session_groups(self) -> list:
        return self._call(self._hparams["/session_groups"], "POST", {
            "experimentName": "", "allowedStatuses": HPARAMS_STATUSES, "colParams": [], "startIndex": 0,
            "sliceSize": 100})["sessionGroups"]

    def layout(self) -> dict:
        return self._call(self._custom_scalars["/layout"], "GET")
