"""Tier A of the numeracy study: one-token arithmetic (``tier_a``), six pre-registered arms x seeds.

    python -m benchmarks.numeracy.run_study --tier a            # the full grid -> results/tier_a_*
    python -m benchmarks.numeracy.run_study --tier a --quick    # 2 seeds x 2 arms, checks its pipeline
    python -m benchmarks.numeracy.run_study --tier a --seeds 0 1 2 3 4 5 6 7 8 9   # extend the grid

1. Data (once per work dir): ``tier_a.build_data`` (train / val / test / out-of-range pairs), a
   Llama-3-style tokenizer trained on the training text (0..999 single tokens), tokenized once.
2. NTL-MSE's weight: one run per candidate weight on a selection seed that no arm uses, scored on
   the **validation** split (exact match, then MAE); the test split plays no part in the choice.
3. Runs, seed by seed (so an interrupted grid leaves whole seeds): every arm through
   ``launch/train.py`` (ZeRO-3, the installed loss, one process, one thread, ``nice``), a periodic
   held-out evaluation for the learning curve, then greedy answers on val / test / oor.
4. ``analyze_a.write_report``: paired per-seed differences against ``ce`` with bootstrap intervals,
   Holm within each metric, the minimal detectable effect; ``results/tier_a.json`` and
   ``results/tier_a_summary.md``.

Resumable like the first study: a run whose ``run.json`` records its evaluation is kept.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options

from benchmarks.common import REPO, machine
from benchmarks.numeracy import analyze_a
from benchmarks.numeracy.runner import EVALUATION_LOCK, RunFailed, child_environment, run_measured, write_json
from smmd_numeracy import tier_a
from smmd_train.config.arguments import train_command

HERE = Path(__file__).resolve().parent

ARMS = tier_a.ARMS
NTL_MSE_CANDIDATES = (1e-4, 1e-3)
SELECTION_SEED = 1000

SETTINGS = tier_a.SETTINGS
FULL_SEEDS, QUICK_SEEDS, QUICK_ARMS = (0, 1, 2, 3, 4), (0, 1), ("ce", "smmd")
# --quick checks the pipeline within 20 minutes on 2 cores: the same data and model, a quarter of the steps.
# --quick runs at the caller's priority (nice 0), as a pipeline check inside a test suite
QUICK_SETTINGS = dict(SETTINGS, steps=SETTINGS["steps"] // 4, warmup_steps=SETTINGS["warmup_steps"] // 4,
                      eval_every=SETTINGS["eval_every"] // 4, nice=0)


def tier_options(tier: str, arm_names, quick_help: str) -> type:
    """The command line of ``run_study --tier <tier>``, shared by the tiers: ``--quick`` (``quick_help``:
    what it runs), ``--arms`` (of ``arm_names``), ``--seeds``, ``--work_dir``, ``--results_dir``, ``--jobs``.
    :func:`parse_tier_options` fills in the defaults that depend on ``--quick``."""

    @dataclass(frozen=True)
    class TierOptions:
        quick: bool = option("--quick", action="store_true", help=f"{quick_help}, results in <work_dir>/results, "
                             "then checks the pipeline's output")
        arms: Optional[list] = option("--arms", nargs="+", choices=list(arm_names), help="override the arms")
        seeds: Optional[list] = option("--seeds", nargs="+", type=int,
                                       help="override the seeds (the same for every arm)")
        work_dir: Optional[Path] = option("--work_dir", type=Path,
                                          help=f"default benchmarks/numeracy/runs/tier_{tier}[_quick]")
        results_dir: Optional[Path] = option("--results_dir", type=Path, help="default benchmarks/numeracy/results "
                                             "(<work_dir>/results with --quick)")
        jobs: int = option("--jobs", type=int, default=1, help="runs side by side (each one process at the tier's "
                           "threads; default 1): the runs and their scores do not depend on it, their wall times do")

    return TierOptions


def parse_tier_options(tier: str, argv, doc: str, arms, quick_arms, quick_seeds, full_seeds, quick_help: str,
                       reserved_seeds: dict = None):
    """The options of ``run_study --tier <tier>`` (:func:`tier_options`) with every default filled in:
    ``work_dir`` (resolved; default runs/tier_<tier>[_quick]), ``results_dir`` (default results/,
    <work_dir>/results with --quick), ``arms`` and ``seeds`` (lists). ``reserved_seeds``: {seed: why no
    arm may use it}."""
    options, parser = parse_options(tier_options(tier, arms, quick_help), argv,
                                    prog=f"python -m benchmarks.numeracy.run_study --tier {tier}", description=doc,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    if options.jobs < 1:
        parser.error(f"--jobs {options.jobs}: give 1 or more")
    name = f"tier_{tier}_quick" if options.quick else f"tier_{tier}"
    work_dir = Path(options.work_dir or HERE / "runs" / name).resolve()
    options = replace(options, work_dir=work_dir,
                      results_dir=Path(options.results_dir or (work_dir / "results" if options.quick
                                                               else HERE / "results")),
                      arms=list(options.arms or (quick_arms if options.quick else arms)))
    if "ce" not in options.arms:
        parser.error("the arms must include ce: every test is against it")
    options = replace(options, seeds=list(options.seeds or (quick_seeds if options.quick else full_seeds)))
    for seed, why in (reserved_seeds or {}).items():
        if seed in options.seeds:
            parser.error(f"seed {seed} is {why}; choose others")
    return options


def parse_args(argv=None):
    return parse_tier_options("a", argv, __doc__, ARMS, QUICK_ARMS, QUICK_SEEDS, FULL_SEEDS,
                              f"{len(QUICK_SEEDS)} seeds x arms {QUICK_ARMS}",
                              reserved_seeds={SELECTION_SEED: "the NTL-MSE selection seed"})


def build_data(data_dir: Path, settings: dict) -> dict:
    return tier_a.build_data(data_dir, operand_range=settings["operand_range"],
                             held_out_share=settings["held_out_share"], oor_band=settings["oor_band"],
                             eval_per_split=settings["eval_per_split"],
                             counting_share=settings["counting_share"], seed=settings["data_seed"],
                             **({"oor_per_split": settings["oor_per_split"]} if "oor_per_split" in settings else {}))


def prepare(work_dir: Path, settings: dict, build=build_data) -> dict:
    """Data (``build(data_dir, settings)``), tokenizer and token cache of the work dir (each made
    once); paths and parameter count. The tokenizer keeps numbers of up to ``settings["max_digits"]``
    digits as one token (3, Llama-3's, unless the settings say otherwise)."""
    from transformers import AutoTokenizer

    from smmd_numeracy import train_numeric_tokenizer
    from smmd_train.data.packing import pack_files
    from smmd_train.model.build import model_config
    from smmd_train.model.presets import parameter_count

    record = work_dir / "data" / "data.json"
    if not record.is_file():
        write_json(record, build(work_dir / "data", settings))
    data = json.loads(record.read_text())
    tokenizer_dir = work_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        with open(data["train"]) as lines:
            texts = [json.loads(line)["text"] for line in lines]
        train_numeric_tokenizer(texts, vocab_size=settings["vocab_size"],
                                max_digits=settings.get("max_digits", 3)).save_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for split in ("train", "eval"):
        pack_files([data[split]], tokenizer, settings["seq_len"], cache_dir=work_dir / "cache")
    parameters = parameter_count(model_config(settings["model"], tokenizer, settings["seq_len"]))
    return {**data, "tokenizer": str(tokenizer_dir), "cache": str(work_dir / "cache"), "parameters": parameters}


def train_run(settings: dict, data: dict, flags: dict, seed: int, output_dir: Path) -> list:
    command = train_command(launcher="python", deepspeed_config=REPO / settings["deepspeed_config"],
                            model=settings["model"], tokenizer=data["tokenizer"], data=[data["train"]],
                            eval_data=[data["eval"]], eval_steps=settings["eval_every"],
                            eval_batches=settings["eval_batches"], cache_dir=data["cache"], seq_len=settings["seq_len"],
                            micro_batch_size=settings["micro_batch_size"], max_steps=settings["steps"],
                            lr=settings["lr"], warmup_steps=settings["warmup_steps"], seed=seed,
                            output_dir=output_dir, export_hf=output_dir / "hf", **flags)
    return ["nice", "-n", str(settings["nice"]), *command]


def execute(settings: dict, data: dict, name: str, flags: dict, seed: int, output_dir: Path, env: dict,
            evaluate=tier_a.evaluate_model, train=train_run) -> dict:
    """Train (unless recorded as trained) with ``train(settings, data, flags, seed, output_dir)``'s
    command and evaluate one run (``evaluate(hf_dir, qa_path)``, a report of metrics and the per-item
    answers); returns its run.json, with the wall and CPU seconds of both."""
    record_path = output_dir / "run.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if "eval" in record:
        if "eval_first_token" not in record and evaluate is evaluate_a:  # Tier A's post-hoc check, once
            add_first_token_scores(output_dir, data)
            record = json.loads(record_path.read_text())
        return record
    if "train_seconds" not in record or not (output_dir / "hf" / "config.json").is_file():
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)
        output_dir.mkdir(parents=True)
        command = train(settings, data, flags, seed, output_dir)
        record = {"arm": name, "seed": seed, "flags": flags, "train_command": command}
        record["train_seconds"], record["train_cpu_seconds"] = run_measured(command, output_dir / "train.log", env)
        write_json(record_path, record)
    # this thread's CPU: the evaluation runs in the calling thread (torch at one intra-op thread), and
    # with --jobs another thread may be evaluating beside it
    began, cpu_began = time.monotonic(), time.thread_time()
    with EVALUATION_LOCK:
        evaluation = evaluate(output_dir / "hf", data["qa_eval"])
    write_json(output_dir / "answers.json",
               {key: value for key, value in evaluation.items() if key.startswith("answers")})
    record["eval"] = evaluation["metrics"]
    if "metrics_first_token" in evaluation:  # Tier A's post-hoc check (tier_a.evaluate_model)
        record["eval_first_token"] = evaluation["metrics_first_token"]
    record["eval_seconds"] = time.monotonic() - began
    record["eval_cpu_seconds"] = time.thread_time() - cpu_began
    write_json(record_path, record)
    return record


def evaluate_a(hf_dir, qa_path) -> dict:
    """Tier A's evaluation: the pre-registered scoring and the post-hoc first-token check."""
    return tier_a.evaluate_model(hf_dir, qa_path, first_token=True)


def add_first_token_scores(output_dir: Path, data: dict) -> None:
    """The post-hoc first-token scoring (``tier_a.evaluate_model``) for a run evaluated before it
    existed: the greedy answers are generated again; the recorded pre-registered ``eval`` is kept as
    it is, and ``eval_reproduced`` says whether the new generation gave the same pre-registered
    metrics (greedy on one thread is deterministic, so it should). Runs that have it are left alone."""
    record = json.loads((output_dir / "run.json").read_text())
    if "eval_first_token" in record:
        return
    evaluation = evaluate_a(output_dir / "hf", data["qa_eval"])
    answers_path = output_dir / "answers.json"
    answers = json.loads(answers_path.read_text()) if answers_path.is_file() else {}
    record["eval_first_token"] = evaluation["metrics_first_token"]
    record["eval_reproduced"] = (evaluation["metrics"] == record["eval"]
                                 and answers.get("answers", evaluation["answers"]) == evaluation["answers"])
    write_json(answers_path, {**answers, "answers_first_token": evaluation["answers_first_token"]})
    write_json(output_dir / "run.json", record)


def _progress(label: str, record: dict, began: float, split: str = "test", tier: str = "a") -> None:
    metrics = record["eval"][split]
    mae = metrics["mae"] if metrics["mae"] is not None else float("nan")
    print(f"[tier {tier}] {label}: trained {record['train_seconds']:.0f} s, {split} exact match "
          f"{metrics['exact_match']:.1%}, MAE {mae:.1f}, within 1 {metrics['within_1']:.1%} "
          f"({time.monotonic() - began:.0f} s so far)", flush=True)


def select_ntl_mse_weight(settings: dict, data: dict, work_dir: Path, env: dict, began: float) -> dict:
    """One run per candidate weight on ``SELECTION_SEED``; the best validation exact match wins
    (then the lower validation MAE). Recorded in ``selection.json``."""
    path = work_dir / "selection.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = []
    for weight in NTL_MSE_CANDIDATES:
        record = execute(settings, data, f"ntl_mse@{weight:g}", tier_a.arm_flags("ntl_mse", weight), SELECTION_SEED,
                         work_dir / "selection" / f"ntl_mse-{weight:g}", env, evaluate_a)
        _progress(f"selection ntl_mse weight {weight:g}", record, began, split="val")
        val = record["eval"]["val"]
        rows.append({"weight": weight, "val_exact_match": val["exact_match"], "val_mae": val["mae"],
                     "train_seconds": record["train_seconds"], "train_cpu_seconds": record["train_cpu_seconds"]})
    best = max(rows, key=lambda row: (row["val_exact_match"], -(row["val_mae"] if row["val_mae"] is not None
                                                                 else float("inf"))))
    selection = {"criterion": "validation exact match, then lower validation MAE", "seed": SELECTION_SEED,
                 "candidates": rows, "weight": best["weight"]}
    write_json(path, selection)
    return selection


def select_on_validation(name: str, candidates: dict, reference: dict, grid: dict, seed: int, evaluate,
                         train=train_run, split: str = "val") -> dict:
    """Choose ``name``'s options on the validation split: one run per candidate ({label: train.py
    options}) on ``seed``, a seed no arm uses, and one ``reference`` run (CE alone: the weight 0); the
    higher ``split`` exact match wins, then the lower capped MAE; the test split plays no part.
    Recorded once in ``selection-<name>.json`` (candidates, chosen label and options, the reference,
    whether the chosen candidate beat it, the runs' CPU seconds); an interrupted selection resumes."""
    path = grid["work_dir"] / f"selection-{name}.json"
    if path.is_file():
        return json.loads(path.read_text())

    def run(label: str, flags: dict) -> dict:
        # the reference (CE on the selection seed) is one run shared by every arm's selection
        folder = "reference" if label == "reference" else f"{name}-{label}"
        output_dir = grid["work_dir"] / "selection" / folder
        if label == "reference" and (output_dir / "run.json").is_file():
            made_with = json.loads((output_dir / "run.json").read_text())["flags"]
            if made_with != flags:
                raise SystemExit(f"{output_dir} is a reference run made with {made_with}, not {flags}; delete it")
        record = execute(grid["settings"], grid["data"], f"{name}@{label}", flags, seed, output_dir, grid["env"],
                         evaluate, train)
        _progress(f"selection {name} {label}", record, grid["began"], split=split, tier=grid.get("tier", "a"))
        scores = record["eval"][split]
        return {"candidate": label, "flags": flags, f"{split}_exact_match": scores["exact_match"],
                f"{split}_mae_capped": scores["mae_capped"], "train_cpu_seconds": record["train_cpu_seconds"],
                "eval_cpu_seconds": record.get("eval_cpu_seconds", 0.0)}

    labelled = [*candidates.items(), ("reference", reference)]
    *rows, baseline = in_parallel(grid.get("jobs", 1), [lambda item=item: run(*item) for item in labelled])
    best = max(rows, key=lambda row: (row[f"{split}_exact_match"], -row[f"{split}_mae_capped"]))
    selection = {"arm": name, "criterion": f"{split} exact match, then lower {split} capped MAE", "seed": seed,
                 "candidates": rows, "chosen": best["candidate"], "flags": best["flags"], "reference": baseline,
                 "beats_reference": best[f"{split}_exact_match"] > baseline[f"{split}_exact_match"]}
    write_json(path, selection)
    return selection


def in_parallel(jobs: int, tasks: list) -> list:
    """The results of ``tasks`` (callables), ``jobs`` at a time in threads (each task waits on a train.py
    process or runs a one-thread evaluation), in the tasks' order; every task runs, and the first
    exception is raised once all have finished."""
    if jobs <= 1:
        return [task() for task in tasks]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(task) for task in tasks]
        return [future.result() for future in futures]


def run_order(arms: list, seeds: list) -> list:
    """(arm, seed) in the order they run: ``ce`` and ``smmd`` over every seed first (the headline
    comparison, so a grid cut short by the machine still pairs them on several seeds), then the other
    arms seed by seed, ``ntl_mse`` last (its weight is chosen on validation just before its first run)."""
    first = [arm for arm in arms if arm in ("ce", "smmd")]
    middle = [arm for arm in arms if arm not in first and arm != "ntl_mse"]
    last = [arm for arm in arms if arm == "ntl_mse"]
    return [(arm, seed) for group in (first, middle, last) for seed in seeds for arm in group]


def is_finished(output_dir: Path) -> bool:
    path = output_dir / "run.json"
    return path.is_file() and "eval" in json.loads(path.read_text())


def open_study(work_dir: Path, settings: dict, arms: list, seeds: list, tier: str = "a") -> dict:
    path = work_dir / "study.json"
    if path.is_file():
        study = json.loads(path.read_text())
        if study["settings"] != settings:
            changed = {key: (study["settings"].get(key), value) for key, value in settings.items()
                       if study["settings"].get(key) != value}
            raise SystemExit(f"{work_dir} holds runs made with other settings ({changed}); pass another "
                             f"--work_dir, or delete this one to start over")
    else:
        study = {"tier": tier, "settings": settings, "arms": [], "seeds": [], "invocations": []}
    study["arms"] = list(dict.fromkeys(study["arms"] + arms))
    study["seeds"] = list(dict.fromkeys(study["seeds"] + seeds))
    return study


def check_pipeline(results_dir: Path, arms: list, seeds: list, report: str = "tier_a",
                   splits: tuple = ("val", "test", "oor"), tested_metrics: dict = analyze_a.METRICS) -> list:
    """What --quick checks of its own output (``<report>.json``, ``<report>_summary.md``): every
    (arm, seed) run in the report, metrics of every split in range, the statistics present for every
    arm against ce. Returns the problems found (empty: passed)."""
    problems = []
    results = json.loads((results_dir / f"{report}.json").read_text())
    found = {(run["arm"], run["seed"]) for run in results["runs"]}
    missing = [(arm, seed) for arm in arms for seed in seeds if (arm, seed) not in found]
    if missing:
        problems.append(f"runs missing from the report: {missing}")
    for run in results["runs"]:
        for split in splits:
            metrics = run["eval"][split]
            for key in ("exact_match", "within_1", "unparseable"):
                if not 0 <= metrics[key] <= 1:
                    problems.append(f"{run['arm']} seed {run['seed']} {split} {key} = {metrics[key]} outside [0, 1]")
            if metrics["exact_match"] > metrics["within_1"]:
                problems.append(f"{run['arm']} seed {run['seed']} {split}: exact match above within +-1")
        if len(run["curve"]) < 2:
            problems.append(f"{run['arm']} seed {run['seed']}: {len(run['curve'])} periodic evaluations, need >= 2")
    for metric in tested_metrics:
        tested = {row["arm"] for row in results["tests"][metric]}
        if tested != set(arms) - {"ce"}:
            problems.append(f"{metric}: tests for {sorted(tested)}, expected {sorted(set(arms) - {'ce'})}")
    if not (results_dir / f"{report}_summary.md").is_file():
        problems.append(f"{report}_summary.md was not written")
    return problems


def flags_for(arm: str, grid: dict) -> dict:
    """train.py options of ``arm``; NTL-MSE's weight is chosen on validation before its first run."""
    if arm == "ntl_mse" and "ntl_mse_weight" not in grid:
        selection = select_ntl_mse_weight(grid["settings"], grid["data"], grid["work_dir"], grid["env"], grid["began"])
        grid["ntl_mse_weight"] = grid["study"]["ntl_mse_weight"] = selection["weight"]
        print(f"[tier a] NTL-MSE weight chosen on validation: {selection['weight']:g}", flush=True)
    return tier_a.arm_flags(arm, grid.get("ntl_mse_weight"))


def run_grid(tier: str, options, settings: dict, prepare_data, flags_for_arm, evaluate,
             split: str, backfill=None, train=train_run) -> None:
    """The runs of a tier (``options``: :func:`parse_tier_options`'s), shared by the tiers: the work dir's
    data (``prepare_data(work_dir, settings)``), then every (arm, seed) of ``run_order`` not finished yet,
    one at a time, with ``flags_for_arm(arm, grid)`` and ``evaluate``; ``study.json`` records the settings,
    the data sizes and every invocation's wall and CPU time. Progress lines show ``split``.
    ``backfill(output_dir, data)`` runs on every finished run (Tier A: ``add_first_token_scores``);
    ``train`` builds the train.py command (``train_run``: a model preset trained from scratch)."""
    env = child_environment(settings["threads"], on_gpu=False)
    os.environ.update({key: env[key] for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")})
    import torch

    torch.set_num_threads(settings["threads"])  # the in-process evaluation: one thread, like the runs
    work_dir = options.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    study = open_study(work_dir, settings, options.arms, options.seeds, tier)
    began, cpu_began = time.monotonic(), os.times()
    invocation = {"machine": machine(), "arms": options.arms, "seeds": options.seeds, "jobs": options.jobs,
                  "wall_seconds": 0.0, "cpu_seconds": 0.0, "runs_completed": 0}
    study["invocations"].append(invocation)
    data = prepare_data(work_dir, settings)
    study["parameters"] = data["parameters"]
    study["data"] = {key: value for key, value in data.items() if isinstance(value, int) and key != "parameters"}

    def save() -> None:
        now = os.times()
        invocation["wall_seconds"] = time.monotonic() - began
        invocation["cpu_seconds"] = (now.user + now.system + now.children_user + now.children_system
                                     - cpu_began.user - cpu_began.system - cpu_began.children_user
                                     - cpu_began.children_system)
        write_json(work_dir / "study.json", study)

    save()
    print(f"[tier {tier}] {len(options.arms)} arms x {len(options.seeds)} seeds, {settings['model']} model "
          f"({data['parameters'] / 1e6:.2f}M parameters), {settings['steps']} steps, work dir {work_dir}", flush=True)
    grid = {"settings": settings, "data": data, "work_dir": work_dir, "env": env, "began": began, "study": study,
            "tier": tier, "jobs": options.jobs}
    failures, lock = [], threading.Lock()
    pending = []
    for arm, seed in run_order(options.arms, options.seeds):
        output_dir = work_dir / f"{arm}-seed{seed}"
        if not is_finished(output_dir):
            pending.append((arm, seed, output_dir))
        elif backfill is not None:  # e.g. a check added after the run was scored
            backfill(output_dir, data)
    # side by side, every arm's options (and so its selection on validation) are fixed before the grid;
    # one at a time, an arm's selection runs just before its first grid run
    chosen = {arm: flags_for_arm(arm, grid) for arm in dict.fromkeys(arm for arm, _, _ in pending)} \
        if options.jobs > 1 else {}

    def one_run(arm: str, seed: int, output_dir: Path) -> None:
        flags = chosen[arm] if arm in chosen else flags_for_arm(arm, grid)
        try:
            record = execute(settings, data, arm, flags, seed, output_dir, env, evaluate, train)
        except RunFailed as error:
            with lock:
                failures.append(f"{arm} seed {seed}: {error}")
                print(f"[tier {tier}] {arm} seed {seed} FAILED", flush=True)
            return
        with lock:
            invocation["runs_completed"] += 1
            save()
            _progress(f"{arm} seed {seed}", record, began, split, tier)

    in_parallel(options.jobs, [lambda item=item: one_run(*item) for item in pending])
    save()
    if failures:
        raise SystemExit(f"[tier {tier}] some runs failed (finished runs are kept; rerun to retry):\n\n"
                         + "\n\n".join(failures))


def report_and_check(tier: str, options, began: float, write_report, check_pipeline) -> None:
    """What every tier does after its grid: ``write_report(work_dir, results_dir)``'s report, printed, and
    under ``--quick`` the check of its own output (``check_pipeline(results_dir, arms, seeds)``: problems)."""
    analysis = write_report(options.work_dir, options.results_dir)
    print(analysis["text"])
    print(f"[tier {tier}] {time.monotonic() - began:.0f} s wall; report in {options.results_dir}", flush=True)
    if options.quick:
        problems = check_pipeline(options.results_dir, options.arms, options.seeds)
        if problems:
            raise SystemExit(f"[tier {tier}] pipeline check FAILED:\n" + "\n".join(problems))
        print(f"[tier {tier}] pipeline check passed: every run reported, metrics in range, tests for every arm",
              flush=True)


def main(argv=None) -> None:
    options = parse_args(argv)
    settings = QUICK_SETTINGS if options.quick else SETTINGS
    began = time.monotonic()
    run_grid("a", options, settings, prepare, flags_for, evaluate_a, "test", backfill=add_first_token_scores)
    report_and_check("a", options, began, analyze_a.write_report, check_pipeline)
