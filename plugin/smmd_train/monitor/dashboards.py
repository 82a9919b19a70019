"""TensorBoard views that relate runs to each other: HParams on every run, a Custom Scalars layout
of what the run writes, and the scaling summary a sweep writes.

Written with torch and tensorboard only (no TensorFlow): the HParams protos come from
``tensorboard.plugins.hparams.summary_v2`` and go into the run's own event file (not into a sub-run,
as ``SummaryWriter.add_hparams`` would put them); the layout is a ``custom_scalars`` summary.

What TensorBoard does that shapes these views (tensorboard 2.21):

* Custom Scalars colours a chart's lines by run, so two tags of one run in one chart share a colour:
  every per-step chart holds one tag (one line per run), which also gives each quantity its own
  axis (NTL-WAS in value units and SMMD near 1 never share one). The sweep's scaling charts are
  Margin charts: the measured line with a band up to linear scaling.
* Custom Scalars' "ignore outliers" (on by default) scales the y axis to the 5-95% quantiles of the
  chart's values, which drops the one point at 1.0 of a three-point efficiency curve; the band's
  upper edge (1.0 at every world size) keeps it in.
* Custom Scalars fits the y axis to a chart's values and has no axis-minimum setting: peak memory
  of 0.64 and 0.66 GiB would span the whole chart, a 3% difference drawn as a cliff. The memory
  charts are Margin charts whose band starts at 0 (a zero tag written next to the value at every
  point, :data:`FROM_ZERO`), so 0 is on their axis, inside the quantiles too.
* A run's layout is the last one it wrote, and the layouts of the runs are merged by category: a
  run writes the charts of the tags it has written (:func:`step_layout`), again when new ones
  appear (the first evaluation), and only a sweep's ``scaling-*`` runs write the scaling charts.
* HParams groups sessions into rows by trial id (a hash of the values when none is given): each
  run names its own (:func:`trial_id`). Pointed at one run directory, TensorBoard names the run
  ``.`` and finds none of its scalars unless the run declares its metric columns, so a run writes
  its own experiment (:func:`write_hparams`), unless it starts under a log root that declares one
  (a sweep's, :func:`write_experiment`): TensorBoard reads one experiment, the first it finds.
* The HParams table prints every number with five significant digits (``1.0000``,
  ``0.00030000``): the settings are written as text, as a command line writes them (``1``,
  ``0.0003``), and sort as text; the metric columns stay numbers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional, Sequence

from smmd_scale.registry import all_options, note_reader, options_in_use, statistic_names

from .. import compat

note_reader(__name__)  # the charts and HParams columns below copy the registry's losses

# Per-step charts, one tag each (tag -> title), by category; a run's layout holds those it writes.
STEP_CHARTS = {
    "loss (x = step)": {
        "loss/total": "total: CE + weight x numeric term", "loss/ce": "CE (mean per target token)",
        "loss/numeric": "numeric term (weighted sum of the numeric losses)",
        "loss/z": "z-loss (--z_loss x lse^2, mean per target token)",
        **{f"loss/{name}": f"{name} (mean per numeric position)" for name in statistic_names()},
    },
    "held-out (x = step)": {
        "eval/ce": "held-out CE", "eval/perplexity": "held-out perplexity",
        "eval/numeric_accuracy": "held-out numeric-token accuracy", "eval/numeric_mae": "held-out numeric-token MAE",
        "eval/numeric_tokens": "held-out numeric tokens",
    },
    "numeric tokens (x = step)": {
        "numeric/accuracy": "numeric-token accuracy", "numeric/mae": "numeric-token MAE",
        "numeric/positions": "numeric-target positions per step",
    },
    "throughput (x = step)": {
        "perf/tokens_per_second": "tokens/s", "perf/tokens_per_second_per_rank": "tokens/s per rank",
        "perf/tflops_per_rank": "TFLOP/s per rank", "perf/step_seconds": "seconds per step",
        "perf/count_seconds": "seconds counting the step's targets",
    },
    "memory and communication (x = step)": {
        "memory/peak_gib": "peak memory GiB (max over ranks; band from 0)",
        "comm/loss_bytes": "loss exchange bytes per step",
        "comm/exchange_rows": "numeric rows per loss exchange (--tp_exchange_capacity counted; the step's largest)",
        "comm/loss_backward_bytes": "fused linear head: d hidden all-reduce bytes per step",
    },
    "optimizer (x = step)": {
        "train/lr": "learning rate", "train/grad_norm": "gradient norm", "train/skipped_steps": "skipped steps (total)",
    },
}

# Per-step charts drawn as a band from 0 up to the value (tag -> the zero tag the run writes next to
# it in TensorBoard): their axis starts at 0, so a few percent look like a few percent.
FROM_ZERO = {"memory/peak_gib": "memory/zero_gib"}

# The scaling charts of a sweep's scaling-<layout> runs (x = world size): Margin charts draw the
# measured value with a band up to linear scaling, or from 0 up to the baseline's peak memory (value,
# lower, upper are exact tags); the bands also keep the baseline's point inside the y axis.
SCALING_LAYOUT = {
    "scaling (x = world size)": {
        "tokens/s (band: up to linear scaling)": [
            "Margin", ["scaling/tokens_per_second", "scaling/tokens_per_second", "scaling/ideal_tokens_per_second"]],
        "tokens/s per rank (band: up to linear scaling)": [
            "Margin", ["scaling/tokens_per_second_per_rank", "scaling/tokens_per_second_per_rank",
                       "scaling/ideal_tokens_per_second_per_rank"]],
        "efficiency: per-rank tokens/s / the baseline's (1 = linear)": [
            "Margin", ["scaling/efficiency", "scaling/efficiency", "scaling/ideal_efficiency"]],
        "peak memory GiB (max over ranks; band: 0 to the baseline's)": [
            "Margin", ["scaling/peak_memory_gib", "scaling/zero_gib", "scaling/baseline_peak_memory_gib"]],
    },
}

# The HParams dashboard's metric columns (tag -> display name): the latest losses (filled while a
# run trains) and the end-of-run summary (written by the monitor).
RUN_METRICS = {
    "loss/total": "loss (latest)",
    "loss/ce": "CE (latest)",
    "loss/numeric": "numeric term (latest)",
    "eval/ce": "held-out CE (latest)",
    "summary/tokens_per_second": "tokens/s (median after warm-up)",
    "summary/tokens_per_second_per_rank": "tokens/s per rank",
    "summary/tflops_per_rank": "TFLOP/s per rank",
    "summary/peak_memory_gib": "peak memory GiB (max over ranks)",
    "summary/loss_bytes_per_step": "loss exchange bytes per step (this rank)",
}


def open_writer(log_dir: str):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


# The settings every train.py run records for the HParams dashboard (smmd_train.monitor.training): the run's
# layout and objective, one column per numeric-loss option (smmd_scale.registry: ``smmd_sigmas``,
# ``ntl_reweigh``, ...; "unused" where the run's losses do not read it), then the rest. The dashboard
# shows five columns at first: those flagged ``differs``, then the rest by name. A log root's
# experiment flags the settings that vary; a run's own flags RUN_SHOWN.
LOSS_OPTION_COLUMNS = tuple(option.column for option in all_options())
RUN_HPARAMS = ("world_size", "tp_size", "dp_size", "sp_size", "numeric_loss", "numeric_values", "fused_linear",
               *LOSS_OPTION_COLUMNS,
               "z_loss", "label_smoothing", "zero_stage", "offload", "micro_batch", "grad_accum", "global_batch",
               "seq_len", "model", "lr", "warmup_steps", "max_steps", "launcher")
UNUSED_OPTION = "unused"
RUN_SHOWN = ("world_size", "tp_size", "numeric_loss", "fused_linear", "lr")


def run_hparams(config, plan, launcher: str) -> dict:
    """A train.py run's :data:`RUN_HPARAMS` from its plan (smmd_train.plan.RunPlan): the numbers the
    DeepSpeed config and the flags share come from the resolved config (what the run used); the
    loss's columns from the plan's loss (``smmd_train.components.loss_reporter``); the rest (sequence length,
    model, steps) from its configuration (``smmd_train.config.run_config.RunConfig``, whose fields name
    their columns)."""
    topology, ds_config = plan.topology, plan.ds_config
    zero = ds_config.get("zero_optimization", {})
    optimizer = (ds_config.get("optimizer") or {}).get("params", {})
    values = {
        "world_size": topology.world_size, "tp_size": topology.tp_size, "dp_size": topology.dp_size,
        "sp_size": topology.sp_size, **plan.loss.hparams(), "numeric_values": config.loss.numeric_values_label,
        "fused_linear": bool(config.loss.fused_linear), **loss_option_hparams(config.loss.options, plan.loss.terms()),
        "z_loss": config.loss.z_loss, "label_smoothing": config.loss.label_smoothing,
        "zero_stage": zero.get("stage", 0), "offload": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "micro_batch": ds_config["train_micro_batch_size_per_gpu"],
        "grad_accum": ds_config["gradient_accumulation_steps"], "global_batch": ds_config["train_batch_size"],
        "seq_len": config.model_data.seq_len, "model": str(config.model_data.model),
        "lr": optimizer.get("lr", config.optimization.lr),
        "warmup_steps": plan.warmup_steps,
        "max_steps": config.optimization.max_steps, "launcher": launcher,
    }
    return values


def loss_option_hparams(options, terms) -> dict:
    """The :data:`LOSS_OPTION_COLUMNS` of a run on the numeric losses ``terms`` (``[(name, weight)]``;
    none for the model's own loss) with the loss ``options`` (column -> value, ``RunConfig.loss.options``):
    each option they read as the flag gave it (several values joined
    by spaces, None as "none"), :data:`UNUSED_OPTION` for the others."""
    in_use = options_in_use(terms)
    values = {}
    for option in all_options():
        value = options[option.column]
        if option not in in_use:
            value = UNUSED_OPTION
        elif isinstance(value, (list, tuple)):
            value = " ".join(str(hparam_value(item)) for item in value)
        elif value is None:
            value = "none"
        values[option.column] = value
    return values


# The HParams table's trial column shows about this many characters of a trial id, then cuts it off.
TRIAL_ID_CHARS = 40


def trial_id(tensorboard_dir: str) -> str:
    """The run's HParams trial id, at most :data:`TRIAL_ID_CHARS` long: the start of its directory's
    name (the output dir's for the default ``<output_dir>/tensorboard``) and a short hash of the
    absolute path, so two runs never share a row (their names may share the start that fits) and a
    resumed run keeps its own."""
    path = Path(tensorboard_dir).resolve()
    name = path.parent.name if path.name == "tensorboard" else path.name
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:6]
    return f"{name[:TRIAL_ID_CHARS - len(digest) - 1]}-{digest}"


def hparam_value(value):
    """A setting as the HParams table should show it: numbers as text as a command line writes them
    (``1``, ``0.0003``, ``3e-05``: the table prints numbers with five significant digits, ``1.0000``,
    ``0.00030000``); booleans and text as they are."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return f"{value:g}" if isinstance(value, float) else str(value)


def experiment_pb(hparams: Sequence[str], metrics: dict, differs: Sequence[str] = ()):
    """The HParams experiment summary: columns ``hparams`` (those in ``differs`` flagged, which the
    dashboard lists first) and ``metrics`` (tag -> display name, read from each run itself)."""
    from tensorboard.plugins.hparams import plugin_data_pb2, summary_v2

    summary = summary_v2.hparams_config_pb([summary_v2.HParam(name) for name in hparams],
                                           [summary_v2.Metric(tag, display_name=name) for tag, name in metrics.items()])
    (value, ) = summary.value
    content = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in content.experiment.hparam_infos:
        info.differs = info.name in differs
    value.metadata.plugin_data.content = content.SerializeToString()
    return summary


def write_hparams(writer, hparams: dict, trial: str, experiment: bool = True) -> None:
    """Record ``hparams`` (name -> bool/number/str, :func:`hparam_value`) as ``writer``'s run's
    session, trial id ``trial`` (:func:`trial_id`), with the run's own experiment (columns: these
    settings, :data:`RUN_SHOWN` first, and :data:`RUN_METRICS`), so that TensorBoard pointed at the
    run alone fills them; ``experiment=False`` leaves it to the log root's (:func:`has_experiment`)."""
    from tensorboard.plugins.hparams import summary_v2

    file_writer = compat.tensorboard_file_writer(writer)
    if experiment:
        file_writer.add_summary(experiment_pb(list(hparams), RUN_METRICS, differs=RUN_SHOWN))
    file_writer.add_summary(summary_v2.hparams_pb({name: hparam_value(value) for name, value in hparams.items()},
                                                  trial_id=trial))


def has_experiment(log_root) -> bool:
    """Whether ``log_root`` itself holds an HParams experiment (:func:`write_experiment`): a sweep's or
    the demo's, written before its runs. TensorBoard reads one experiment per log dir, the first it
    finds, in no order the writer controls, so the runs under such a root declare none of their own."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.metadata import EXPERIMENT_TAG

    return any(value.tag == EXPERIMENT_TAG for path in Path(log_root).glob("events.out.tfevents.*")
               for event in EventFileLoader(str(path)).Load() for value in event.summary.value)


def write_experiment(log_root: str, hparams: Sequence[str] = RUN_HPARAMS, metrics: Optional[dict] = None,
                     differs: Sequence[str] = ()) -> None:
    """Write the HParams dashboard's experiment once at ``log_root``, the directory whose
    sub-directories are the runs that ``tensorboard --logdir log_root`` compares: its columns are
    ``hparams`` and the ``metrics`` tags (tag -> display name, default :data:`RUN_METRICS`, the
    columns every run declares too); ``differs`` names the settings that vary across the runs,
    which the dashboard lists (and shows) first. Write it before the runs: those that start under
    it then declare no experiment of their own (:func:`has_experiment`). An unchanged one is left as
    it is."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    summary = experiment_pb(hparams, RUN_METRICS if metrics is None else metrics, differs)
    Path(log_root).mkdir(parents=True, exist_ok=True)
    def experiments(summary_pb):
        return [(value.tag, value.metadata.plugin_data.content) for value in summary_pb.value]

    written = sorted(Path(log_root).glob("events.out.tfevents.*"))
    if len(written) == 1 and any(experiments(event.summary) == experiments(summary)
                                 for event in EventFileLoader(str(written[0])).Load()):
        return  # the same experiment: kept as it is
    for old in written:  # one experiment: a re-written one replaces it
        old.unlink()
    writer = open_writer(log_root)
    compat.tensorboard_file_writer(writer).add_summary(summary)
    writer.close()


def step_layout(tags: Iterable[str]) -> dict:
    """The Custom Scalars layout of a training run that has written ``tags``: a chart per tag of
    :data:`STEP_CHARTS` it wrote (anchored regex, one line per run; those of :data:`FROM_ZERO` a band
    from their zero tag up to the value), a category only when it holds one."""
    tags = set(tags)
    layout = {}
    for category, charts in STEP_CHARTS.items():
        written = {title: ["Margin", [tag, FROM_ZERO[tag], tag]] if tag in FROM_ZERO else ["Multiline", [f"^{tag}$"]]
                   for tag, title in charts.items() if tag in tags}
        if written:
            layout[category] = written
    return layout


def write_layout(writer, layout: dict, step: int = 0) -> None:
    """Write ``layout`` ({category: {title: ["Multiline", [regex, ...]] or ["Margin", [value, lower,
    upper]]}}) as the run's Custom Scalars layout at ``step`` (its latest one is the one shown)."""
    from torch.utils.tensorboard.summary import custom_scalars

    compat.tensorboard_file_writer(writer).add_summary(custom_scalars(layout), step)
