"""The monitor room: what a run shows. ``training`` (per-step metrics to TensorBoard, DeepSpeed's monitor
and ``metrics.jsonl``), ``dashboards`` (HParams, the Custom Scalars layout, the scaling summary),
``metrics_file`` (``metrics.jsonl``, written and read).
"""

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
