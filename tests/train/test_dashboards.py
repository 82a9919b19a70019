"""What TensorBoard shows of train.py runs and of a sweep, read back through its own HParams and
Custom Scalars handlers (helpers.dashboards): one HParams row per run, its metric columns filled
whether TensorBoard is pointed at a log root or at the run alone, a resumed run in its own row;
a Custom Scalars layout of what each run writes (one tag per chart, so runs get their colours and
each quantity its axis); the sweep's scaling charts with the world-size-1 point inside the axis."""

import re
from types import SimpleNamespace

import pytest
import torch
from helpers.dashboards import Dashboards
from helpers.distributed import run_ranks, values_or_raise

pytestmark = pytest.mark.gloo

# Run a: SMMD, no held-out data, 1 rank; run b: SMMD + NTL-WAS (value units, hundreds), held-out data, 4 ranks.
RUNS = {
    "a": dict(hparams={"world_size": 1, "tp_size": 1, "numeric_loss": "1 smmd", "numeric_weight": 1.0,
                       "fused_linear": False, "lr": 3e-4},
              stats={"smmd": 0.9, "mmd": 0.6, "smooth": 0.3}, evaluate=False),
    "b": dict(hparams={"world_size": 4, "tp_size": 2, "numeric_loss": "1 smmd + 0.3 ntl-was", "numeric_weight": 1.0,
                       "fused_linear": True, "lr": 3e-4},
              stats={"smmd": 1.1, "mmd": 0.7, "smooth": 0.4, "ntl_was": 612.5}, evaluate=True),
}


class RecordingEngine:
    """The part of a DeepSpeed engine the monitor uses."""

    device = torch.device("cpu")
    monitor = SimpleNamespace(write_events=lambda events: None)

    def get_global_grad_norm(self):
        return 1.5


def _train(directory, hparams, stats, evaluate, steps):
    from smmd_train.monitor.training import TrainingMonitor

    monitor = TrainingMonitor(RecordingEngine(), world_size=1, tp_size=1, dp_size=1, dp_group=None,
                              flops_per_token=6e6, tensorboard_dir=str(directory), hparams=hparams)
    for step in steps:
        monitor.record_micro_batch((2.0 + step, 1.5 + step, 0.5), {
            "numeric_tokens": 4, "numeric_accuracy": 0.5, "numeric_mae": 3.0, "tokens": 100, "comm_bytes": 64,
            **stats})
        monitor.end_step(step, 1.0, tokens_in_step=1000, learning_rate=1e-3)
        if evaluate and step % 2 == 0:
            monitor.write_eval(step, {"eval/ce": 1.0 + 1 / step, "eval/numeric_accuracy": 0.25})
    return monitor.finish(steps[-1])


def _two_runs_and_a_resume(rank, world_size, root):
    summaries = {name: _train(root / name / "tensorboard", steps=range(1, 5), **run) for name, run in RUNS.items()}
    summaries["a"] = _train(root / "a" / "tensorboard", steps=range(5, 7), **RUNS["a"])  # run a resumed
    return summaries


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    values_or_raise(run_ranks(_two_runs_and_a_resume, 1, root, fresh=True))
    return root


def _metrics(group):
    return {value["name"]["tag"]: value["value"] for value in group["metricValues"]}


def test_each_run_is_its_own_hparams_row_with_its_metrics(root):
    from smmd_train.monitor.dashboards import RUN_METRICS, trial_id

    groups = {group["name"]: group for group in Dashboards(root).session_groups()}
    trials = {name: trial_id(root / name / "tensorboard") for name in RUNS}
    assert set(groups) == set(trials.values()) and trials["a"] != trials["b"]  # the resumed run kept its row
    for name, trial in trials.items():
        (session, ) = groups[trial]["sessions"]
        assert session["name"] == f"{name}/tensorboard"
    a, b = groups[trials["a"]], groups[trials["b"]]
    # Numbers as text as a command line writes them (the table prints numbers as 1.0000), booleans as they are.
    assert a["hparams"]["world_size"] == "1" and b["hparams"]["world_size"] == "4" and b["hparams"]["tp_size"] == "2"
    assert b["hparams"]["lr"] == "0.0003" and b["hparams"]["numeric_weight"] == "1"
    assert b["hparams"]["fused_linear"] is True
    # The metric columns hold each run's own latest values: a's after its resume (step 6), b's eval.
    assert _metrics(a)["loss/total"] == pytest.approx(8.0) and _metrics(b)["loss/total"] == pytest.approx(6.0)
    assert _metrics(b)["eval/ce"] == pytest.approx(1.25) and "eval/ce" not in _metrics(a)
    assert _metrics(a)["summary/tokens_per_second"] == pytest.approx(1000.0)
    experiment = Dashboards(root).experiment()
    assert {info["name"]["tag"] for info in experiment["metricInfos"]} == set(RUN_METRICS)


@pytest.mark.parametrize("name", list(RUNS))
def test_pointed_at_one_run_the_row_has_its_metrics(root, name):
    (group, ) = Dashboards(root / name / "tensorboard").session_groups()
    assert group["sessions"][0]["name"] == "."
    metrics = _metrics(group)
    assert metrics["loss/total"] == pytest.approx(8.0 if name == "a" else 6.0)
    assert metrics["summary/peak_memory_gib"] > 0


@pytest.mark.parametrize("name", list(RUNS))
def test_the_layout_charts_what_the_run_writes_one_tag_per_chart(root, name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from smmd_train.monitor.dashboards import FROM_ZERO

    run_dir = root / name / "tensorboard"
    tags = set()
    for event_file in run_dir.glob("events.out.tfevents.*"):
        events = EventAccumulator(str(event_file))
        events.Reload()
        tags |= set(events.Tags()["scalars"])
    layout = Dashboards(run_dir).layout()
    categories = {category["title"]: category["chart"] for category in layout["category"]}
    charted = []
    for charts in categories.values():
        for chart in charts:
            if "margin" in chart:  # a band from 0 up to the value (FROM_ZERO)
                (band, ) = chart["margin"]["series"]
                assert band == {"value": band["value"], "lower": FROM_ZERO[band["value"]], "upper": band["value"]}
                assert band["lower"] in tags
                charted.append(band["value"])
                continue
            (pattern, ) = chart["multiline"]["tag"]  # one tag: TensorBoard colours lines by run, not by tag
            (tag, ) = [tag for tag in tags if re.search(pattern, tag)]
            charted.append(tag)
    # Every scalar the run writes step by step has its chart, and no chart waits for a tag it never
    # writes; the fused head's backward bytes, 0 in both runs, have none; the zero tags are band edges.
    assert "comm/loss_backward_bytes" in tags and "comm/loss_backward_bytes" not in charted
    assert sorted(charted) == sorted(tag for tag in tags - {"comm/loss_backward_bytes", *FROM_ZERO.values()}
                                     if not tag.startswith("summary/"))
    assert not any(title.startswith("scaling") for title in categories)
    assert ("held-out (x = step)" in categories) == RUNS[name]["evaluate"]
    if name == "b":
        assert {"loss/smmd", "loss/ntl_was"} <= set(charted)  # each on its own axis


def _a_sweep(rank, world_size, root):
    from smmd_train.monitor import dashboards

    dashboards.write_experiment(str(root), differs=("world_size", "tp_size"))  # before the runs, as a sweep does
    for name, run in RUNS.items():
        _train(root / name, steps=range(1, 3), **run)


def test_runs_under_a_log_root_with_an_experiment_leave_it_the_columns(tmp_path):
    """TensorBoard reads one experiment, the first it finds: under a sweep's, the runs declare none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from smmd_train.monitor import dashboards

    values_or_raise(run_ranks(_a_sweep, 1, tmp_path, fresh=True))
    for name in RUNS:
        (events_file, ) = (tmp_path / name).glob("events.out.tfevents.*")
        events = EventAccumulator(str(events_file))
        events.Reload()
        assert "_hparams_/session_start_info" in events.Tags()["tensors"]
        assert "_hparams_/experiment" not in events.Tags()["tensors"]
    dashboard = Dashboards(tmp_path)
    assert [info["name"] for info in dashboard.experiment()["hparamInfos"] if info["differs"]] == ["tp_size",
                                                                                                   "world_size"]
    assert len(dashboard.session_groups()) == 2 and all(_metrics(group) for group in dashboard.session_groups())
    # The same experiment written again is left as it is; another one replaces it.
    (first, ) = tmp_path.glob("events.out.tfevents.*")
    dashboards.write_experiment(str(tmp_path), differs=("world_size", "tp_size"))
    assert list(tmp_path.glob("events.out.tfevents.*")) == [first]
    dashboards.write_experiment(str(tmp_path), differs=("world_size", ))
    (second, ) = tmp_path.glob("events.out.tfevents.*")
    assert second != first and dashboards.has_experiment(tmp_path) and not dashboards.has_experiment(tmp_path / "a")


def _quantile(values, fraction):
    """d3.quantile (linear interpolation between the sorted values), as TensorBoard's charts use it."""
    values = sorted(values)
    index = (len(values) - 1) * fraction
    low = int(index)
    return values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (index - low)


def test_the_scaling_charts_keep_every_world_size_on_the_axis(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from smmd_train.tools.scaling import Config, scaling_table, write_scaling_view

    configs = [Config(size, 1, 1, size) for size in (1, 2, 4)]
    results = {config.name: {"status": "ok", "summary": {
        "summary/tokens_per_second": 100.0 * config.world_size ** 0.5,
        "summary/tokens_per_second_per_rank": 100.0 / config.world_size ** 0.5,
        "summary/peak_memory_gib": 1.0 + 1.0 / config.world_size}} for config in configs}
    (run_dir, ) = write_scaling_view(tmp_path, scaling_table(configs, results), SimpleNamespace(weak=True))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    series = {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    (category, ) = Dashboards(tmp_path).layout()["category"]
    assert category["title"].startswith("scaling")
    charts = {chart["title"]: chart for chart in category["chart"]}
    for chart in charts.values():  # every tag a chart names is written, one point per world size
        tags = ([tag for band in chart["margin"]["series"] for tag in band.values()] if "margin" in chart
                else [tag[1:-1] for tag in chart["multiline"]["tag"]])
        assert all(len(series[tag]) == 3 for tag in tags), chart["title"]
    (efficiency, ) = [chart for title, chart in charts.items() if title.startswith("efficiency")]
    (band, ) = efficiency["margin"]["series"]
    assert series[band["value"]] == pytest.approx([1.0, 2 ** -0.5, 0.5]) and series[band["upper"]] == [1.0] * 3
    # "Ignore outliers in chart scaling" (on by default) scales the axis to the 5-95% quantiles of the
    # chart's values: alone, the world-size-1 efficiency 1.0 falls outside; with the band's upper edge it is
    # in, and so is every chart's world-size-1 point.
    alone = series[band["value"]]
    assert not _quantile(alone, 0.05) <= 1.0 <= _quantile(alone, 0.95)
    for chart in charts.values():
        (band, ) = chart["margin"]["series"]
        charted = [value for tag in band.values() for value in series[tag]]
        assert _quantile(charted, 0.05) <= series[band["value"]][0] <= _quantile(charted, 0.95), chart["title"]


def _long_named_runs(rank, world_size, root):
    for name in ("numeracy-tierA-ntl_mse-weight1e-4-seed1000-lr3e-3-steps1500", "numeracy-tierA-ntl_mse-weight1e-4"
                 "-seed1000-lr3e-3-steps3000"):
        _train(root / name / "tensorboard", steps=range(1, 2), **RUNS["a"])


def test_trial_ids_fit_the_hparams_column_and_stay_apart(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from smmd_train.monitor.dashboards import TRIAL_ID_CHARS

    values_or_raise(run_ranks(_long_named_runs, 1, tmp_path))
    written = []
    for events in sorted(tmp_path.glob("*/tensorboard/events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        content = accumulator.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
        written.append(plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.group_name)
    assert len(written) == 2 and len(set(written)) == 2, written
    assert all(len(trial) <= TRIAL_ID_CHARS and trial.startswith("numeracy-tierA-ntl_mse-weight1e-4") for trial in
               written), written


def _chart_values(chart, series):
    """The values a Custom Scalars chart draws (a Margin chart's band edges too) from ``series`` (tag -> values)."""
    if "margin" in chart:
        return [value for band in chart["margin"]["series"] for tag in band.values() for value in series[tag]]
    return [value for pattern in chart["multiline"]["tag"] for tag in series if re.search(pattern, tag)
            for value in series[tag]]


def _series(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series = {}
    for event_file in run_dir.glob("events.out.tfevents.*"):
        events = EventAccumulator(str(event_file))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            series.setdefault(tag, []).extend(event.value for event in events.Scalars(tag))
    return series


def test_the_memory_charts_start_at_zero(root, tmp_path):
    """Custom Scalars fits the y axis to a chart's values (to their 5-95% quantiles with "ignore
    outliers", on by default) and has no axis-minimum setting: peak memory of 0.64 and 0.66 GiB would
    span the whole chart, a 3% difference drawn as a cliff. Each memory chart draws a band from 0, so
    0 is on its axis and the heights compare as they are."""
    from smmd_train.tools.scaling import Config, scaling_table, write_scaling_view

    configs = [Config(size, 1, 1, size) for size in (1, 2, 4)]
    results = {config.name: {"status": "ok", "summary": {
        "summary/tokens_per_second": 100.0 * config.world_size, "summary/tokens_per_second_per_rank": 100.0,
        "summary/peak_memory_gib": 0.66 - 0.01 * config.world_size}} for config in configs}
    (scaling_dir, ) = write_scaling_view(tmp_path, scaling_table(configs, results), SimpleNamespace(weak=True))
    charts = {}
    for run_dir in (root / "a" / "tensorboard", root / "b" / "tensorboard", scaling_dir):
        layout = Dashboards(run_dir).layout()
        charts[run_dir] = [chart for category in layout["category"] for chart in category["chart"]
                           if chart["title"].startswith("peak memory GiB")]
    for run_dir, memory_charts in charts.items():
        (chart, ) = memory_charts
        series = _series(run_dir)
        (band, ) = chart["margin"]["series"]
        assert band["value"] in ("memory/peak_gib", "scaling/peak_memory_gib"), chart["title"]
        assert min(series[band["value"]]) > 0 and set(series[band["lower"]]) == {0.0}, chart["title"]
        # 0 at every point of a third of the chart's values: inside the 5-95% quantiles.
        assert _quantile(_chart_values(chart, series), 0.05) == 0.0, chart["title"]
    (scaling_band, ) = charts[scaling_dir][0]["margin"]["series"]
    assert _series(scaling_dir)[scaling_band["upper"]] == pytest.approx([0.65] * 3)  # the baseline's peak
