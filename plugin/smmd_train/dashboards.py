"""TensorBoard views that relate runs to each other: HParams on every run, a Custom Scalars layout
grouping the charts people compare across runs, and the scaling summary a sweep writes.

Written with torch and tensorboard only (no TensorFlow): the HParams protos come from
``tensorboard.plugins.hparams.summary_v2`` and go into the run's own event file (not into a sub-run,
as ``SummaryWriter.add_hparams`` would put them); the layout is ``SummaryWriter.add_custom_scalars``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from smmd_scale import compat
from smmd_scale.registry import statistic_names

# Charts compared across runs; tags are anchored regexes over the scalars train.py writes
# (smmd_train.monitor) and the sweep's summary runs write (scaling/*).
LAYOUT = {
    "scaling (a sweep's scaling-tp<T> runs; x = world size)": {
        "tokens/s: measured and linear": ["Multiline", [r"^scaling/(tokens_per_second|ideal_tokens_per_second)$"]],
        "efficiency (per-rank tokens/s / the smallest world size's)": ["Multiline", [r"^scaling/efficiency$"]],
        "tokens/s per rank": ["Multiline", [r"^scaling/tokens_per_second_per_rank$"]],
        "peak memory GiB (max over ranks)": ["Multiline", [r"^scaling/peak_memory_gib$"]],
    },
    "throughput (x = step)": {
        "tokens/s": ["Multiline", [r"^perf/tokens_per_second$"]],
        "tokens/s per rank": ["Multiline", [r"^perf/tokens_per_second_per_rank$"]],
        "TFLOP/s per rank": ["Multiline", [r"^perf/tflops_per_rank$"]],
        "seconds per step": ["Multiline", [r"^perf/step_seconds$"]],
    },
    "memory and communication (x = step)": {
        "peak memory GiB (max over ranks)": ["Multiline", [r"^memory/peak_gib$"]],
        "loss exchange bytes per step": ["Multiline", [r"^comm/loss_bytes$"]],
        "fused linear head: d hidden all-reduce bytes per step": ["Multiline", [r"^comm/loss_backward_bytes$"]],
    },
    "loss parts (x = step)": {
        "total, CE, numeric term": ["Multiline", [r"^loss/(total|ce|numeric)$"]],
        "numeric losses": ["Multiline", [rf"^loss/({'|'.join(statistic_names())})$"]],
        "held-out CE": ["Multiline", [r"^eval/ce$"]],
    },
    "numeric metrics (x = step)": {
        "numeric-token accuracy": ["Multiline", [r"^(numeric/accuracy|eval/numeric_accuracy)$"]],
        "numeric-token MAE": ["Multiline", [r"^(numeric/mae|eval/numeric_mae)$"]],
        "numeric-target positions per step": ["Multiline", [r"^numeric/positions$"]],
    },
}

# What the HParams dashboard compares: the run's end-of-run summary scalars (written by the monitor).
SUMMARY_METRICS = {
    "summary/tokens_per_second": "tokens/s (median after warm-up)",
    "summary/tokens_per_second_per_rank": "tokens/s per rank",
    "summary/tflops_per_rank": "TFLOP/s per rank",
    "summary/peak_memory_gib": "peak memory GiB (max over ranks)",
    "summary/loss_bytes_per_step": "loss exchange bytes per step (this rank)",
    "summary/final_loss_total": "final loss",
    "summary/final_loss_ce": "final CE",
    "summary/final_loss_numeric": "final numeric loss term",
    "summary/final_eval_ce": "final held-out CE",
}

def open_writer(log_dir: str):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


# The settings every train.py run records for the HParams dashboard (smmd_train.monitor), in the
# order of its columns (the first five show by default).
RUN_HPARAMS = ("world_size", "tp_size", "dp_size", "sp_size", "numeric_loss", "fused_linear", "numeric_weight",
               "zero_stage", "offload", "micro_batch", "grad_accum", "global_batch", "seq_len", "model", "lr",
               "warmup_steps", "max_steps", "launcher")


def run_hparams(args, plan, launcher: str, framework_loss: bool) -> dict:
    """A train.py run's :data:`RUN_HPARAMS` from its plan (smmd_train.plan.RunPlan): the numbers the
    DeepSpeed config and the flags share come from the resolved config (what the run used); the
    rest (loss, sequence length, model, steps) from its arguments."""
    topology, ds_config = plan.topology, plan.ds_config
    zero = ds_config.get("zero_optimization", {})
    optimizer = (ds_config.get("optimizer") or {}).get("params", {})
    values = {
        "world_size": topology.world_size, "tp_size": topology.tp_size, "dp_size": topology.dp_size,
        "sp_size": topology.sp_size, "numeric_loss": "none (framework loss)" if framework_loss else
        " + ".join(f"{weight:g} {name}" for name, weight in args.numeric_loss),
        "fused_linear": bool(args.fused_linear), "numeric_weight": plan.numeric_weight,
        "zero_stage": zero.get("stage", 0), "offload": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "micro_batch": ds_config["train_micro_batch_size_per_gpu"],
        "grad_accum": ds_config["gradient_accumulation_steps"], "global_batch": ds_config["train_batch_size"],
        "seq_len": args.seq_len, "model": str(args.model), "lr": optimizer.get("lr", args.lr),
        "warmup_steps": plan.warmup_steps,
        "max_steps": args.max_steps, "launcher": launcher,
    }
    return values


def write_hparams(writer, hparams: dict, description: str = "") -> None:
    """Record ``hparams`` (name -> bool/number/str) as ``writer``'s run's session for the HParams
    dashboard (its own event file, not a sub-run as ``SummaryWriter.add_hparams`` makes)."""
    from tensorboard.plugins.hparams import summary_v2

    compat.tensorboard_file_writer(writer).add_summary(summary_v2.hparams_pb(hparams, trial_id=description or None))


def write_experiment(log_root: str, hparams: Sequence[str] = RUN_HPARAMS, metrics: Optional[dict] = None,
                     differs: Sequence[str] = ()) -> None:
    """Write the HParams dashboard's experiment once at ``log_root``, the directory whose
    sub-directories are the runs that ``tensorboard --logdir log_root`` compares: its columns are
    ``hparams`` and the ``metrics`` tags (tag -> display name, default :data:`SUMMARY_METRICS`);
    ``differs`` names the settings that vary across the runs, which the dashboard lists (and
    shows) first. Without an experiment the dashboard offers every scalar tag as a metric, and
    it reads one experiment per log dir."""
    from tensorboard.plugins.hparams import plugin_data_pb2, summary_v2

    metrics = SUMMARY_METRICS if metrics is None else metrics
    summary = summary_v2.hparams_config_pb([summary_v2.HParam(name) for name in hparams],
                                           [summary_v2.Metric(tag, display_name=name) for tag, name in metrics.items()])
    (value, ) = summary.value
    content = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in content.experiment.hparam_infos:
        info.differs = info.name in differs
    value.metadata.plugin_data.content = content.SerializeToString()
    Path(log_root).mkdir(parents=True, exist_ok=True)
    for old in Path(log_root).glob("events.out.tfevents.*"):  # one experiment: a re-written one replaces it
        old.unlink()
    writer = open_writer(log_root)
    compat.tensorboard_file_writer(writer).add_summary(summary)
    writer.close()


def write_layout(writer) -> None:
    writer.add_custom_scalars(LAYOUT)
