"""The training monitor on real gloo ranks: per-step scalars reduced over the data-parallel
replicas, the warm-up step kept out of the throughput and memory charts, the end-of-run summary,
and what rank 0 writes for TensorBoard (scalars, HParams, the Custom Scalars layout) and
metrics.jsonl, read back with TensorBoard's own readers."""

from types import SimpleNamespace

import pytest
import torch
from helpers.distributed import run_ranks, values_or_raise

from smmd_train.monitor.metrics_file import read_metrics

pytestmark = pytest.mark.gloo
STEP_SECONDS = {1: 5.0, 2: 1.0, 3: 2.0}  # step 1 is the warm-up
HPARAMS = {"world_size": 2, "tp_size": 1, "numeric_loss": "1 smmd", "fused_linear": False, "lr": 1e-3}


class RecordingEngine:
    """The part of a DeepSpeed engine the monitor uses; its monitor records what it is given."""

    device = torch.device("cpu")

    def __init__(self):
        self.events = []
        self.monitor = SimpleNamespace(write_events=self.events.extend)

    def get_global_grad_norm(self):
        return 1.5


def _three_steps(rank, world_size, directory):
    from smmd_train.monitor.training import TrainingMonitor

    engine = RecordingEngine()
    monitor = TrainingMonitor(engine, world_size=world_size, tp_size=1, dp_size=world_size, dp_group=None,
                              flops_per_token=6e6, metrics_path=f"{directory}/metrics.jsonl",
                              tensorboard_dir=f"{directory}/tensorboard", hparams=HPARAMS)
    monitor.log_run_shape()
    # Rank r: 4 (r + 1) numeric positions with SMMD 0.5 + r, losses (2 + r, 1.5 + r, 0.5).
    stats = {"numeric_tokens": 4 * (rank + 1), "smmd": 0.5 + rank, "mmd": 0.25 + rank, "smooth": 0.25,
             "numeric_accuracy": 0.5, "numeric_mae": 3.0 + rank, "tokens": 100, "comm_bytes": 64}
    returned = []
    for step, seconds in STEP_SECONDS.items():
        monitor.record_micro_batch((2.0 + rank, 1.5 + rank, 0.5), stats)
        returned.append(monitor.end_step(step, seconds, tokens_in_step=1000, learning_rate=1e-3 * step))
    monitor.write_eval(3, {"eval/ce": 1.25})
    return returned, monitor.finish(3), engine.events


def test_the_monitor_reduces_over_replicas_skips_the_warmup_and_writes_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    from smmd_train.monitor import dashboards

    (steps0, summary0, events0), (steps1, summary1, events1) = values_or_raise(run_ranks(_three_steps, 2, tmp_path,
                                                                                         fresh=True))
    assert steps0 == steps1 and summary0 == summary1  # every rank sees the reduced values
    first = steps0[0]
    assert first["loss/total"] == pytest.approx(2.5) and first["loss/ce"] == pytest.approx(2.0)
    assert first["loss/smmd"] == pytest.approx((0.5 * 4 + 1.5 * 8) / 12)  # per numeric position, over replicas
    assert first["numeric/mae"] == pytest.approx((3.0 * 4 + 4.0 * 8) / 12) and first["numeric/positions"] == 12
    assert [step["train/lr"] for step in steps0] == pytest.approx([1e-3, 2e-3, 3e-3])
    # The summary: throughput medians over the steps after the warm-up (1000 tokens in 1 s and 2 s).
    assert summary0["summary/tokens_per_second"] == pytest.approx(750.0)
    assert summary0["summary/tokens_per_second_per_rank"] == pytest.approx(375.0)
    assert summary0["summary/final_eval_ce"] == 1.25 and summary0["summary/final_loss_total"] == pytest.approx(2.5)

    # DeepSpeed's monitor (csv, wandb, ...) gets everything on every rank, the run's layout included.
    assert ("run/world_size", 2.0, 0) in events0 and ("loss/total", pytest.approx(2.5), 1) in events1

    # metrics.jsonl (rank 0 only): step 1 has no perf/ or memory/ values, the later steps have.
    records = read_metrics(tmp_path)
    assert records[0] == {"step": 0, "run/world_size": 2, "run/tp_size": 1, "run/dp_size": 2, "run/sp_size": 1}
    by_step = {record["step"]: record for record in records if "loss/total" in record}
    assert not any(key.startswith(("perf/", "memory/")) for key in by_step[1])
    assert by_step[2]["perf/tokens_per_second"] == 1000.0 and "memory/peak_gib" in by_step[3]

    # TensorBoard: one event file, from rank 0.
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    run = EventAccumulator(str(event_files[0]), size_guidance={"tensors": 0})
    run.Reload()
    scalars = set(run.Tags()["scalars"])
    assert {"loss/total", "loss/smmd", "numeric/accuracy", "eval/ce", "summary/tokens_per_second"} <= scalars
    assert not {tag for tag in scalars if tag.startswith("run/")}  # the layout is in the HParams instead
    assert [event.step for event in run.Scalars("perf/tokens_per_second")] == [2, 3]
    assert [event.value for event in run.Scalars("summary/tokens_per_second")] == [750.0]

    # HParams: the run's settings as its session, numbers as text, and its own experiment (so that
    # TensorBoard pointed at the run alone fills the metric columns); a log root's experiment is written
    # once by whoever gathers runs (a sweep, the demo) with the same columns. tests/train/test_dashboards.py
    # reads the rows back through TensorBoard's HParams handlers.
    def plugin_data(accumulator, tag):
        content = accumulator.SummaryMetadata(tag).plugin_data.content
        return plugin_data_pb2.HParamsPluginData.FromString(content)

    own = plugin_data(run, "_hparams_/experiment").experiment
    assert [info.name for info in own.hparam_infos] == list(HPARAMS)
    assert {info.name for info in own.hparam_infos if info.differs} == set(HPARAMS) & set(dashboards.RUN_SHOWN)
    assert {info.name.tag for info in own.metric_infos} == set(dashboards.RUN_METRICS)
    start = plugin_data(run, "_hparams_/session_start_info").session_start_info
    assert start.group_name == dashboards.trial_id(tmp_path / "tensorboard")
    assert start.hparams["world_size"].string_value == "2" and start.hparams["numeric_loss"].string_value == "1 smmd"
    assert start.hparams["fused_linear"].bool_value is False and start.hparams["lr"].string_value == "0.001"
    dashboards.write_experiment(str(tmp_path / "root"), differs=("world_size", "tp_size"))
    (experiment_file, ) = (tmp_path / "root").glob("events.out.tfevents.*")
    root = EventAccumulator(str(experiment_file), size_guidance={"tensors": 0})
    root.Reload()
    experiment = plugin_data(root, "_hparams_/experiment").experiment
    assert [info.name for info in experiment.hparam_infos] == list(dashboards.RUN_HPARAMS)
    assert [info.name for info in experiment.hparam_infos if info.differs] == ["world_size", "tp_size"]
    assert {info.name.tag for info in experiment.metric_infos} == set(dashboards.RUN_METRICS)
    assert set(dashboards.RUN_METRICS) <= set(summary0) | scalars  # every column has its value in the run

    # The Custom Scalars layout: the last one written charts every per-step tag the run wrote (its
    # evaluation's included), one tag per chart; peak memory as a band from its zero tag (TensorBoard
    # only: not in metrics.jsonl), written at each step that has the peak.
    layout = layout_pb2.Layout.FromString(run.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    charted = {tag[1:-1] for category in layout.category for chart in category.chart for tag in chart.multiline.tag}
    charted |= {tag for category in layout.category for chart in category.chart for band in chart.margin.series
                for tag in (band.value, band.lower, band.upper)}
    assert charted == {tag for tag in scalars if not tag.startswith("summary/")} - {"comm/loss_backward_bytes"}
    assert [(event.step, event.value) for event in run.Scalars("memory/zero_gib")] == [(2, 0.0), (3, 0.0)]
    assert [event.step for event in run.Scalars("memory/peak_gib")] == [2, 3]
    assert not any("memory/zero_gib" in record for record in records)
    assert "held-out (x = step)" in [category.title for category in layout.category]


def _killed_resumed_and_restarted(rank, world_size, directory):
    from smmd_train.monitor.training import TrainingMonitor

    def segment(start_step, steps, ce):
        """A process of the run: its monitor opened at ``start_step``, then ``steps`` trained at loss ``ce``."""
        monitor = TrainingMonitor(RecordingEngine(), world_size=1, tp_size=1, dp_size=1, dp_group=None,
                                  flops_per_token=6e6, metrics_path=f"{directory}/metrics.jsonl",
                                  start_step=start_step)
        if start_step == 0:
            monitor.log_run_shape()
        for step in steps:
            monitor.record_micro_batch((ce, ce, 0.0), None)
            monitor.end_step(step, 1.0, tokens_in_step=100, learning_rate=1e-3)
        return monitor

    segment(0, range(1, 6), ce=3.0)  # killed after step 5; its last committed checkpoint is step 4's
    segment(4, (5, 6), ce=2.0).finish(6)  # resumed from step 4: trains steps 5 and 6
    resumed = read_metrics(directory)
    segment(0, (1, ), ce=1.0)  # a new run from scratch in the same folder (no checkpoint was kept)
    return resumed, read_metrics(directory)


def test_a_resumed_run_s_metrics_hold_each_step_once(tmp_path):
    ((resumed, restarted), ) = values_or_raise(run_ranks(_killed_resumed_and_restarted, 1, tmp_path))
    trained = [(record["step"], record["loss/ce"]) for record in resumed if "loss/ce" in record]
    assert trained == [(1, 3.0), (2, 3.0), (3, 3.0), (4, 3.0), (5, 2.0), (6, 2.0)]  # step 5 from the resumed run
    assert [record["step"] for record in resumed if "run/world_size" in record] == [0]
    assert [record["step"] for record in resumed if "summary/final_loss_ce" in record] == [6]
    assert [(record["step"], record.get("loss/ce")) for record in restarted] == [(0, None), (1, 1.0)]


def test_a_resume_drops_a_damaged_metrics_line_instead_of_failing(tmp_path):
    """Rank 0 alone rewrites the file when it resumes: a line that is no record (damaged on disk) must
    not raise there while the other ranks go on into the step's collectives."""
    from smmd_train.monitor.metrics_file import keep_records_through

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss/ce": 2.5}\n{"step": 2, "loss/ce"\x00\n'
                    '["not", "a record"]\n{"step": 3, "loss/ce": 2.3}\n')
    assert keep_records_through(path, 2) == 3
    assert read_metrics(tmp_path) == [{"step": 1, "loss/ce": 2.5}]


def test_read_metrics_leaves_out_a_record_still_being_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/ce": 2.5}\n{"step": 2, "loss/ce": 2.4}\n{"step": 3, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss/ce": 2.5}, {"step": 2, "loss/ce": 2.4}]


def _shares(rank, world_size):
    from smmd_train.monitor.training import TrainingMonitor

    monitor = TrainingMonitor(RecordingEngine(), world_size=world_size, tp_size=1, dp_size=world_size, dp_group=None,
                              flops_per_token=6e6)
    steps = []
    # Step 1: two micro-batches per rank, each a share of the step's objective (n_valid 400, n_numeric 12).
    monitor.record_step_counts(400, 12)
    for micro in range(2):
        stats = {"numeric_tokens": 3, "smmd": 0.5 + rank + micro, "mmd": 0.5, "smooth": 0.0, "numeric_accuracy": 1.0,
                 "numeric_mae": 2.0, "tokens": 100, "comm_bytes": 0}
        ce, numeric = 0.25 * (rank + 1), (0.5 + rank + micro) * 3 / 12
        monitor.record_micro_batch((ce + 0.5 * numeric, ce, numeric), stats)
    steps.append(monitor.end_step(1, 1.0, tokens_in_step=400, learning_rate=1e-3))
    # Step 2: no numeric target anywhere.
    monitor.record_step_counts(400, 0)
    for _ in range(2):
        stats = {"numeric_tokens": 0, "smmd": 0.0, "mmd": 0.0, "smooth": 0.0, "numeric_accuracy": 0.0,
                 "numeric_mae": 0.0, "tokens": 100, "comm_bytes": 0}
        monitor.record_micro_batch((0.5, 0.5, 0.0), stats)
    steps.append(monitor.end_step(2, 1.0, tokens_in_step=400, learning_rate=1e-3))
    return steps


def test_shares_of_the_step_add_up_and_a_step_without_numbers_logs_zero():
    first, second = values_or_raise(run_ranks(_shares, 2, fresh=True))[0]
    # Summed over 2 micro-batches x 2 ranks (shares), not averaged.
    assert first["loss/ce"] == pytest.approx(2 * 0.25 + 2 * 0.5)
    smmd_sum = sum((0.5 + rank + micro) * 3 for rank in range(2) for micro in range(2))
    assert first["loss/numeric"] == pytest.approx(smmd_sum / 12) == pytest.approx(first["loss/smmd"])
    assert first["loss/total"] == pytest.approx(first["loss/ce"] + 0.5 * first["loss/numeric"])
    assert first["numeric/positions"] == 12
    assert second["loss/numeric"] == 0.0 and second["loss/smmd"] == 0.0 and second["numeric/positions"] == 0
    assert second["loss/total"] == pytest.approx(2.0) and "numeric/accuracy" not in second
    assert all(value == value for value in second.values() if isinstance(value, float))  # no NaN
