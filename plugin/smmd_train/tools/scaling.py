"""Scaling sweeps: one training run per (world size, TP degree, SP degree), each launched as users
launch train.py, then the scaling view in TensorBoard (throughput, per-rank throughput, efficiency and
peak memory against world size) and a table.

    bash launch/scaling.sh --world_sizes 8,16,32 --tp 1,2 [--sp 1,2] --hostfile launch/hostfile --max_steps 30 \
        --output_dir sweeps/7b --deepspeed_config ds_configs/zero3.json --model 7b \
        --tokenizer /data/tokenizer --data /data/corpus.jsonl --seq_len 4096
    tensorboard --logdir sweeps/7b/tensorboard

Every option the sweep does not own is a train.py option, passed to every run (``--tp``, ``--sp`` and
``--output_dir`` are the sweep's; ``--sp`` is Ulysses sequence parallelism, whose ranks share each
sequence, so a run's data-parallel size is world / (TP x SP)). Strong scaling (default) keeps the global batch fixed
(``--global_batch`` sequences per optimizer step: each run gets gradient accumulation global /
(data-parallel size x micro batch)); ``--weak`` keeps each data-parallel replica's batch fixed
(micro batch x accumulation from the train.py options), so the global batch grows with the
replicas. In both, *efficiency* is tokens/s per rank over the baseline's (the fastest run of the
smallest world size): 1.0 is linear scaling, and it equals speed-up / ideal speed-up. Every TP
degree is measured against the same baseline, so TP and data parallelism compare at a given
world size (SP degrees likewise).

Before anything is launched, every configuration is planned in this process through train.py's
own parser and the plan stage of ``smmd_train.run.prepare_run`` (tokenizer, model, DeepSpeed config
and the flags against it, TP against the world size and what AutoTP can split (``smmd_train.model.autotp``:
uneven heads and vocabularies run, more ranks than KV heads do not), SP against the world size, the
sequence length and TP, the numeric vocabulary and loss): one that cannot run is refused with its
reason, a sweep that cannot run at all (options train.py does not know, a world size the machine or
the hostfile cannot place, a directory holding another sweep) fails in seconds. A run that fails is
reported (exit code, log) and the sweep goes on; finished runs are kept, and a sweep re-run in the
same directory (same settings) only runs what has not finished.

Layout of ``--output_dir``: ``sweep.json`` (the settings), ``runs/<name>/`` (each run's
output_dir: metrics.jsonl, run_config.json), ``logs/<name>.log``, ``tensorboard/<name>/`` (each
run's scalars, HParams session and the Custom Scalars layout), ``tensorboard/scaling-tp<T>/`` (one
point per world size: x = world size; ``scaling-tp<T>-sp<S>`` with SP), the HParams experiment in
``tensorboard/`` itself and ``scaling.json`` (the table). Run names read
``ws<world size>-tp<TP>[-sp<SP>]-zero<stage>-<loss>`` (``-sp`` when SP > 1, ``-fused`` with
``--fused_linear``), e.g. ``ws4-tp2-zero3-smmd``, ``ws4-tp1-sp2-zero3-smmd``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from ..components.loss_reporter import loss_reporter
from ..config.arguments import TRAIN_SCRIPT, train_flags
from ..config.arguments import parse_args as parse_train_args
from ..config.run_config import RunConfig
from ..distributed.launcher import launch_command, run_to_completion
from ..monitor import dashboards
from ..monitor.metrics_file import METRICS_FILE, read_metrics

# train.py options that the sweep sets per run.
# and --tp, --sp, --output_dir: the sweep's own options
SWEEP_OWNED = ("tensorboard_dir", "resume", "overwrite_output_dir", "local_rank")
# What each scaling-<layout> TensorBoard run holds, as scaling/<name> at x = world size; the ideal_*
# values are linear scaling from the baseline, baseline_peak_memory_gib the baseline's peak memory (the
# upper edges of the bands of smmd_train.monitor.dashboards.SCALING_LAYOUT), zero_gib 0 (the memory band's lower edge).
SCALING_SCALARS = ("tokens_per_second", "ideal_tokens_per_second", "tokens_per_second_per_rank",
                   "ideal_tokens_per_second_per_rank", "efficiency", "ideal_efficiency", "speedup", "peak_memory_gib",
                   "baseline_peak_memory_gib", "zero_gib", "loss_bytes_per_step")
SUMMARY_KEYS = ("tokens_per_second", "tokens_per_second_per_rank", "tflops_per_rank", "peak_memory_gib",
                "loss_bytes_per_step", "final_loss_total")


@dataclass(frozen=True)
class Config:
    world_size: int
    tp: int
    nodes: int  # nodes the run spans (1 without a hostfile)
    per_node: int  # processes per node
    label: str = ""  # what every run of the sweep trains, e.g. "zero3-smmd"
    sp: int = 1  # Ulysses sequence-parallel degree

    @property
    def layout(self) -> str:
        """``tp<T>`` or ``tp<T>-sp<S>``: the parallel layout whose runs form one scaling line."""
        return f"tp{self.tp}" + (f"-sp{self.sp}" if self.sp > 1 else "")

    @property
    def name(self) -> str:
        return f"ws{self.world_size}-{self.layout}" + (f"-{self.label}" if self.label else "")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.sp)


def sizes(text: str) -> list:
    """``"1,2,4"`` -> [1, 2, 4]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return values


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """The sweep's own options (the rest of its command line goes to train.py)."""

    world_sizes: list = option("--world_sizes", type=sizes, required=True, help="ranks per run, e.g. 1,2,4,8")
    tp: list = option("--tp", type=sizes, default=(1, ), help="AutoTP degrees, e.g. 1,2: one run per (world size, TP)")
    sp: list = option("--sp", type=sizes, default=(1, ), help="Ulysses sequence-parallel degrees, e.g. 1,2: one run "
                      "per (world size, TP, SP); TP and SP do not combine (such pairs are refused)")
    weak: bool = option("--weak", action="store_true", help="weak scaling: each data-parallel replica keeps its batch "
                        "(default: strong scaling, the global batch is fixed)")
    global_batch: Optional[int] = option("--global_batch", type=int,
                                         help="strong scaling: sequences per optimizer step in every run (default: "
                                         "the largest data-parallel size x --micro_batch_size)")
    output_dir: str = option("--output_dir", required=True)
    hostfile: Optional[str] = option("--hostfile", help="DeepSpeed hostfile ('host slots=N' lines): a world size "
                                     "above one node's slots spans whole nodes, taken in the file's order")
    slots: Optional[int] = option("--slots", type=int, help="processes one node runs (default: the hostfile's slots, "
                                  "else the visible GPUs, else the CPU cores)")
    rerun: bool = option("--rerun", action="store_true", help="run every configuration again, finished or not")
    timeout_minutes: float = option("--timeout_minutes", type=float, default=120.0, help="per run")


def parse_args(argv: Sequence[str]) -> tuple:
    """(the sweep's options, train.py's options): everything the sweep does not own goes to train.py."""
    sweep, train_argv, _ = parse_options(SweepOptions, argv, known_only=True, prog="launch/scaling.sh",
                                         description=__doc__, allow_abbrev=False,
                                         formatter_class=argparse.RawDescriptionHelpFormatter,
                                         usage="%(prog)s --world_sizes 1,2,4 [--tp 1,2] [--weak] --max_steps N "
                                         "--output_dir DIR [options] [train.py options ...]")
    if train_argv[:1] == ["--"]:
        train_argv = train_argv[1:]
    return sweep, list(train_argv)


def read_hostfile(path: str) -> list:
    """[(host, slots), ...] from a DeepSpeed hostfile; raises ValueError naming a bad line."""
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" slots=")
        if not slots.strip().isdigit() or not host.strip():
            raise ValueError(f"{path}:{number}: expected '<host> slots=<N>', got {line!r}")
        hosts.append((host.strip(), int(slots)))
    if not hosts:
        raise ValueError(f"{path} names no hosts")
    return hosts


def local_slots(accelerator: str) -> int:
    if accelerator == "cuda":
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def plan_sweep(sweep, accelerator: str, label: str = "") -> tuple:
    """(configurations, refused, warnings) for the sweep's arguments: every (world size, TP, SP), and
    ``refused`` mapping the name of each one that cannot run to the reason. Raises ValueError when a world size cannot
    be placed on this machine or the hostfile's nodes."""
    hosts = read_hostfile(sweep.hostfile) if sweep.hostfile else None
    slots = sweep.slots or (min(s for _, s in hosts) if hosts else local_slots(accelerator))
    nodes_available = len(hosts) if hosts else 1
    configs, refused, warnings = [], {}, []
    for world_size in sorted(set(sweep.world_sizes)):
        if world_size <= slots:
            nodes, per_node = 1, world_size
        elif world_size % slots == 0 and world_size // slots <= nodes_available:
            nodes, per_node = world_size // slots, slots
        elif accelerator == "cpu" and not hosts:
            nodes, per_node = 1, world_size
            warnings.append(f"world size {world_size} > {slots} CPU cores: its ranks share cores, so its tokens/s "
                            "per rank measure contention as much as scaling")
        else:
            raise ValueError(f"world size {world_size} does not fit: {nodes_available} node(s) of {slots} slots "
                             f"({'--hostfile ' + sweep.hostfile if hosts else 'this machine'}); a run larger than one "
                             "node must fill whole nodes")
        for tp in sorted(set(sweep.tp)):
            for sp in sorted(set(sweep.sp)):
                config = Config(world_size, tp, nodes, per_node, label, sp)
                configs.append(config)
                what = f"TP {tp}" + (f" x SP {sp}" if sp > 1 else "")
                if world_size % (tp * sp):
                    refused[config.name] = (f"{what} is larger than the world size {world_size}"
                                            if tp * sp > world_size else
                                            f"{what} does not divide the world size {world_size}")
    return configs, refused, warnings


def run_label(train_config: RunConfig) -> str:
    """What every run of the sweep trains, for its run names: ``zero3-smmd``, ``zero3-smmd+ntl-was-fused``,
    ``zero3-ce`` (CE only: --framework_loss, or every weight in --numeric_loss 0; ``LossReporter.label``)."""
    stage = (train_config.deepspeed.get("zero_optimization") or {}).get("stage", 0)
    return f"zero{stage}-{loss_reporter(train_config).label}" + ("-fused" if train_config.loss.fused_linear else "")


def run_options(sweep, train_config: RunConfig, config: Config, output_dir: Path) -> dict:
    """train.py options (``train_flags`` keywords) for one run of the sweep."""
    options = {"output_dir": str(output_dir / "runs" / config.name),
               "tensorboard_dir": str(output_dir / "tensorboard" / config.name), "tp": config.tp, "sp": config.sp,
               "cache_dir": train_config.model_data.cache_dir,  # the runs share one tokenized, packed copy of the data
               "overwrite_output_dir": True}  # an unfinished or re-run configuration starts clean
    if not sweep.weak:
        per_step = config.dp * train_config.optimization.micro_batch_size
        if sweep.global_batch % per_step:
            raise ValueError(f"--global_batch {sweep.global_batch} is not a multiple of data-parallel size "
                             f"{config.dp} x micro batch {train_config.optimization.micro_batch_size} ({config.name})")
        options["gradient_accumulation_steps"] = sweep.global_batch // per_step
    return options


def check_train_options(train_argv: Sequence[str], sweep) -> RunConfig:
    """train.py's own configuration of the options the sweep passes through; refuses those the sweep sets."""
    given = {arg[2:].split("=", 1)[0] for arg in train_argv if arg.startswith("--")}
    owned = sorted(given & set(SWEEP_OWNED))
    if owned:
        raise ValueError(f"the sweep sets {', '.join('--' + name for name in owned)} for each run; leave "
                         f"{'it' if len(owned) == 1 else 'them'} out")
    if not sweep.weak and "gradient_accumulation_steps" in given:
        raise ValueError("strong scaling sets --gradient_accumulation_steps per run from --global_batch; leave it out "
                         "(or pass --weak to keep each replica's batch fixed)")
    if sweep.weak and sweep.global_batch is not None:
        raise ValueError("--global_batch is for strong scaling (--weak keeps each replica's batch fixed)")
    return RunConfig.from_args(parse_train_args([*train_argv, "--output_dir", sweep.output_dir]))


def run_state(output_dir: Path, config: Config) -> Optional[dict]:
    """The finished run's summary (its summary/* record), or None if it has not finished."""
    run_dir = output_dir / "runs" / config.name
    if not (run_dir / METRICS_FILE).is_file():
        return None
    summaries = [record for record in read_metrics(run_dir) if "summary/tokens_per_second" in record]
    return summaries[-1] if summaries else None


def scaling_table(configs: Sequence[Config], results: dict) -> list:
    """One row per configuration: the run's summary and, against the baseline (the fastest finished
    run of the smallest world size, whatever its TP), speed-up and efficiency, so the TP degrees'
    lines are on one scale."""
    rows = []
    for config in configs:
        summary = results.get(config.name, {}).get("summary")
        row = {"name": config.name, "world_size": config.world_size, "tp": config.tp, "sp": config.sp,
               "layout": config.layout, "dp": config.dp,
               "nodes": config.nodes, "status": results.get(config.name, {}).get("status", "not run")}
        if summary:
            row.update({key: summary[f"summary/{key}"] for key in SUMMARY_KEYS if f"summary/{key}" in summary})
        rows.append(row)
    finished = [row for row in rows if "tokens_per_second" in row]
    if not finished:
        return rows
    smallest = min(row["world_size"] for row in finished)
    base = max((row for row in finished if row["world_size"] == smallest), key=lambda row: row["tokens_per_second"])
    for row in finished:
        row["baseline"] = base["name"]
        row["ideal_tokens_per_second"] = base["tokens_per_second"] * row["world_size"] / base["world_size"]
        row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
        row["efficiency"] = row["tokens_per_second_per_rank"] / base["tokens_per_second_per_rank"]
    return rows


def write_scaling_view(tensorboard_dir: Path, rows: Sequence[dict], sweep) -> list:
    """One TensorBoard run per layout (``scaling-tp<T>``, ``scaling-tp<T>-sp<S>``), x = world size,
    with the scaling charts' layout (:data:`smmd_train.monitor.dashboards.SCALING_LAYOUT`); returns their dirs."""
    written = []
    for layout in sorted({row["layout"] for row in rows}):
        points = [row for row in rows if row["layout"] == layout and "efficiency" in row]
        if not points:
            continue
        run_dir = tensorboard_dir / f"scaling-{layout}"
        if run_dir.exists():  # a re-run replaces the view rather than adding a second set of points
            for old in run_dir.glob("events.out.tfevents.*"):
                old.unlink()
        writer = dashboards.open_writer(str(run_dir))
        dashboards.write_layout(writer, dashboards.SCALING_LAYOUT)
        writer.add_text("sweep/settings", f"{mode(sweep)}, {layout.replace('-', ' ').upper()}, x = world size")
        baseline = {row["name"]: row for row in rows}[points[0]["baseline"]]
        for row in sorted(points, key=lambda row: row["world_size"]):
            linear = {"ideal_tokens_per_second_per_rank": row["ideal_tokens_per_second"] / row["world_size"],
                      "ideal_efficiency": 1.0}
            if "peak_memory_gib" in baseline:
                linear.update(baseline_peak_memory_gib=baseline["peak_memory_gib"], zero_gib=0.0)
            for key, value in {**row, **linear}.items():
                if key in SCALING_SCALARS:
                    writer.add_scalar(f"scaling/{key}", float(value), row["world_size"])
        writer.close()
        written.append(run_dir)
    return written


TABLE_COLUMNS = (("name", "run", ""), ("world_size", "ranks", ""), ("placement", "TP x SP x DP", ""),
                 ("nodes", "nodes", ""), ("tokens_per_second", "tokens/s", ".0f"),
                 ("tokens_per_second_per_rank", "per rank", ".0f"), ("speedup", "speed-up", ".2f"),
                 ("efficiency", "efficiency", ".2f"), ("peak_memory_gib", "peak GiB", ".2f"), ("status", "status", ""))


def format_table(rows: Sequence[dict]) -> str:
    # a refused layout (TP x SP above the world size) has no DP degree
    return markdown_table([{**row, "placement": f"{row['tp']} x {row['sp']} x {row['dp'] or '-'}"} for row in rows],
                          TABLE_COLUMNS)


def mode(sweep) -> str:
    return "weak scaling" if sweep.weak else f"strong scaling, {sweep.global_batch} sequences per step"


def main(argv: Optional[Sequence[str]] = None) -> int:
    sweep, train_argv = parse_args(list(sys.argv[1:] if argv is None else argv))
    from deepspeed.accelerator import get_accelerator

    from ..distributed.groups import Launch
    from ..run import prepare_run

    accelerator = get_accelerator()
    output_dir = Path(sweep.output_dir)
    try:
        train_config = check_train_options(train_argv, sweep)
        if not sweep.weak and sweep.global_batch is None:
            smallest_group = min(sweep.tp) * min(sweep.sp)
            sweep = replace(sweep, global_batch=max(size // smallest_group for size in sweep.world_sizes)
                            * train_config.optimization.micro_batch_size)
        configs, refused, warnings = plan_sweep(sweep, accelerator.device_name(), run_label(train_config))
        options = {}
        for config in configs:  # train.py's own plan for each run, before any is launched
            if config.name in refused:
                continue
            options[config.name] = run_options(sweep, train_config, config, output_dir)  # a bad batch fails the sweep
            try:
                run_config = RunConfig.from_args(parse_train_args([*train_argv, *train_flags(**options[config.name])]))
                plan = prepare_run(run_config, Launch(0, config.world_size, 0, config.world_size, "plan"),
                                   until="plan").plan
            except ValueError as error:
                refused[config.name] = str(error)
                continue
            warnings += [f"{config.name}: {warning}" for warning in plan.warnings]
        runnable = [config for config in configs if config.name not in refused]
        if not runnable:
            reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
            raise ValueError(f"no configuration can run: {reasons}")
        settings = {"world_sizes": sorted(set(sweep.world_sizes)), "tp": sorted(set(sweep.tp)),
                    "sp": sorted(set(sweep.sp)), "weak": sweep.weak, "global_batch": sweep.global_batch,
                    "train_options": train_argv}
        recorded = output_dir / "sweep.json"
        if recorded.is_file() and json.loads(recorded.read_text()) != settings:
            raise ValueError(f"{output_dir} holds a sweep with other settings ({recorded}); use another --output_dir")
    except (ValueError, FileNotFoundError) as error:
        print(f"scaling: {error}", file=sys.stderr)
        return 2
    output_dir.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(settings, indent=1))
    for name, reason in refused.items():
        print(f"scaling: refused {name}: {reason}", flush=True)
    for warning in warnings:
        print(f"scaling: warning: {warning}", flush=True)
    print(f"scaling: {len(runnable)} runs ({mode(sweep)}): " + ", ".join(config.name for config in runnable),
          flush=True)

    # The HParams view across the sweep's runs, written before them: TensorBoard takes the first
    # experiment it finds among the runs (each run declares its own), in order of their start.
    varying = {"world_size": {c.world_size for c in runnable}, "tp_size": {c.tp for c in runnable},
               "sp_size": {c.sp for c in runnable},
               "dp_size": {c.dp for c in runnable}, "grad_accum": {options[c.name].get("gradient_accumulation_steps")
                                                                  for c in runnable},
               "global_batch": {c.dp for c in runnable} if sweep.weak else set()}
    dashboards.write_experiment(str(output_dir / "tensorboard"),
                                 differs=[name for name, values in varying.items() if len(values) > 1])
    results = {name: {"status": f"refused: {reason}"} for name, reason in refused.items()}
    (output_dir / "logs").mkdir(exist_ok=True)
    for config in runnable:
        summary = None if sweep.rerun else run_state(output_dir, config)
        if summary is not None:
            results[config.name] = {"status": "ok (earlier)", "summary": summary}
            continue
        command = launch_command(TRAIN_SCRIPT, *train_argv, *train_flags(**options[config.name]),
                                 processes=config.per_node, nodes=config.nodes, hostfile=sweep.hostfile)
        log_path = output_dir / "logs" / f"{config.name}.log"
        print(f"scaling: {config.name}: {' '.join(command)}  (log: {log_path})", flush=True)
        began = time.monotonic()
        with open(log_path, "w") as log:
            code = run_to_completion(command, log, sweep.timeout_minutes * 60)  # a timeout ends the ranks too
        summary = run_state(output_dir, config)
        if code == 0 and summary is not None:
            status = "ok"
        else:
            status = (f"timed out after {sweep.timeout_minutes:g} min" if code is None else
                      f"failed (exit {code})" if code else "no summary written")
        results[config.name] = {"status": status, "summary": summary if code == 0 else None}
        print(f"scaling: {config.name}: {status} in {time.monotonic() - began:.0f} s", flush=True)

    rows = scaling_table(configs, results)  # refused configurations keep their row, with the reason
    views = write_scaling_view(output_dir / "tensorboard", rows, sweep)
    (output_dir / "scaling.json").write_text(json.dumps(
        {"settings": settings, "configs": [asdict(config) for config in configs], "rows": rows}, indent=1))
    print(format_table(rows))
    views = ", ".join(view.name for view in views) or "no scaling view: no run finished"
    print(f"scaling: table {output_dir / 'scaling.json'}; TensorBoard: tensorboard --logdir "
          f"{output_dir / 'tensorboard'} ({views})")
    failed = [row["name"] for row in rows if not row["status"].startswith(("ok", "refused"))]
    if failed:
        print(f"scaling: {len(failed)} run(s) did not finish: {', '.join(failed)} (see {output_dir / 'logs'})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
