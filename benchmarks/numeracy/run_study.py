"""Multi-seed numeracy study: a tiny Llama trained from scratch with CE, CE + SMMD, its ablations
and CE + NTL on a generated numeric task suite, evaluated on held-out operands, with statistics.

    python -m benchmarks.numeracy.run_study --quick   # 7 methods x 3 seeds on CPU (~36 min, 2 cores) -> results/
    python -m benchmarks.numeracy.run_study --full    # 125m, 5 seeds, bf16, one GPU (untested; see README)
    python -m benchmarks.numeracy.run_study --full --launcher "deepspeed --num_gpus 8"   # each run on 8 GPUs
    python -m benchmarks.numeracy.run_study --smoke   # the same pipeline in miniature (~2 min), never -> results/
    python -m benchmarks.numeracy.run_study --tier a [--quick]   # Tier A, one-token arithmetic (study_a.py)
    python -m benchmarks.numeracy.run_study --tier b [--quick]   # Tier B, NTL's add_sub_multiple (study_b.py)
    python -m benchmarks.numeracy.run_study --tier aprime [--quick]  # Tier A', raw-distance SMMD (study_aprime.py)
    python -m benchmarks.numeracy.run_study --tier c [--quick]   # Tier C, fine-tuning SmolLM2 (study_c.py)

1. Data (once per work dir): ``smmd_numeracy.build_corpus`` with the tasks ``arithmetic``,
   ``clock`` and ``word_problems`` (held-out operand tuples never trained), a Llama-3-style
   tokenizer trained on it (0..999 single tokens), the corpus tokenized once into a shared cache.
2. Runs: for every seed, every method: ``launch/train.py`` under ZeRO-3 (a plain ``python`` process
   is a 1-rank run; ``--launcher`` runs it under ``deepspeed``/``torchrun``/... instead), same seed
   = same initialisation and data order for every method, so runs are paired by seed; then
   ``launch/evaluate.py``'s evaluation on the held-out problems (greedy generation), in this process
   (one at a time, one torch thread: a process per evaluation cost seconds of imports each). On CPU two
   runs share the cores (``--parallel``, one thread each on 2 cores).
3. ``analyze.py`` (also ``python -m benchmarks.numeracy.analyze``): mean ± std and 95% t-intervals of
   exact match and MAE per task and method, paired t-tests against ``ce`` with Holm's correction,
   ``results.json``, ``summary.md`` and ``study.png``.

Resumable: a run whose ``run.json`` records a finished evaluation is skipped, one that was trained
but not evaluated is only evaluated, anything else is trained again from scratch. ``study.json``
pins the settings of a work dir; a later invocation may add methods or seeds but not change them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options

from benchmarks.common import REPO, machine
from benchmarks.numeracy import analyze
from benchmarks.numeracy.runner import EVALUATION_LOCK, RunFailed, child_environment, run_measured, write_json
from smmd_train.config.arguments import train_command

HERE = Path(__file__).resolve().parent
TIERS = ["suite", "a", "b", "aprime", "c"]

TASKS = ("arithmetic", "clock", "word_problems")
# Name shown in the tables -> train.py options. "smmd" is the paper's defaults (gaussian kernel,
# sigma 2, distances squashed to [1, 9], alpha auto); the ablation kernels are seeded (seed 42)
# inside the loss, so they are the same matrix for every training seed.
METHODS = {
    "ce": {"numeric_loss": ["smmd:0"]},
    "smmd": {"numeric_loss": ["smmd:1"]},
    "mmd_only": {"numeric_loss": ["smmd:1"], "smmd_mode": "mmd"},
    "smooth_only": {"numeric_loss": ["smmd:1"], "smmd_mode": "smooth"},
    "random_kernel": {"numeric_loss": ["smmd:1"], "smmd_kernel": "random"},
    "shuffled_kernel": {"numeric_loss": ["smmd:1"], "smmd_kernel": "shuffled"},
    # The Number Token Loss, the plugin's own (same exchange as SMMD): NTL-WAS with the distances
    # squashed like SMMD's (factor 9); NTL-MSE's squared errors of values up to 999 reach 1e6, hence
    # its weight.
    "ntl_was": {"numeric_loss": ["ntl-was:1"], "ntl_squash_factor": 9.0},
    "ntl_mse": {"numeric_loss": ["ntl-mse:0.0001"]},
}


@dataclass(frozen=True)
class Preset:
    """Settings of one study size. ``steps`` are optimizer steps; warmup is a tenth of them."""

    model: str
    steps: int
    seq_len: int
    micro_batch_size: int
    lr: float
    train_per_task: int
    test_per_task: int
    eval_batches: int  # micro-batches of held-out documents for train.py's eval CE
    methods: tuple
    seeds: tuple
    deepspeed_config: str
    vocab_size: int = 2048
    plain_text_share: float = 0.2
    data_seed: int = 0


# quick: budgeted for 2 CPU cores (README "Budget"); smoke: the same shape in miniature (3 methods that
# cover the three loss paths CE, SMMD and NTL, 2 seeds, a few steps); full: a GPU box.
PRESETS = {
    "smoke": Preset(model="tiny", steps=12, seq_len=128, micro_batch_size=16, lr=3e-3, train_per_task=600,
                    test_per_task=40, eval_batches=2, methods=("ce", "smmd", "ntl_was"), seeds=(0, 1),
                    deepspeed_config="ds_configs/zero3.json"),
    "quick": Preset(model="tiny", steps=400, seq_len=128, micro_batch_size=16, lr=3e-3, train_per_task=10_000,
                    test_per_task=200, eval_batches=8, methods=tuple(METHODS), seeds=(0, 1, 2),
                    deepspeed_config="ds_configs/zero3.json"),
    "full": Preset(model="125m", steps=2000, seq_len=256, micro_batch_size=32, lr=6e-4, train_per_task=30_000,
                   test_per_task=1000, eval_batches=50, methods=tuple(METHODS), seeds=(0, 1, 2, 3, 4),
                   deepspeed_config="ds_configs/zero3.json"),
}


def _preset_help(name: str) -> str:
    preset = PRESETS[name]
    return (f"{preset.model} model, {len(preset.methods)} methods x {len(preset.seeds)} seeds, {preset.steps} steps "
            "per run")


@dataclass(frozen=True)
class StudyOptions:
    """The task suite's command line: one preset flag (:attr:`preset`) and overrides of its settings."""

    smoke: bool = option("--smoke", one_of="preset", action="store_true", help=_preset_help("smoke"))
    quick: bool = option("--quick", one_of="preset", action="store_true", help=_preset_help("quick"))
    full: bool = option("--full", one_of="preset", action="store_true", help=_preset_help("full"))
    tier: str = option("--tier", choices=TIERS, default="suite", help="suite (this help): the task suite; a: Tier A, "
                       "one-token arithmetic (--tier a --help); b: Tier B, DeepMind add_sub_multiple (--tier b "
                       "--help); aprime: Tier A', SMMD on raw value distances (--tier aprime --help); c: Tier C, "
                       "fine-tuning pretrained SmolLM2 (--tier c --help)")
    methods: Optional[list] = option("--methods", default=None, nargs="+", choices=list(METHODS),
                                     help="override the preset's methods")
    seeds: Optional[list] = option("--seeds", default=None, nargs="+", type=int,
                                   help="override the preset's seeds (the same for every method)")
    steps: Optional[int] = option("--steps", default=None, type=int,
                                  help="override the preset's optimizer steps per run")
    work_dir: Optional[Path] = option("--work_dir", default=None, type=Path, help="data, tokenizer, cache and one "
                                      "folder per run (default benchmarks/numeracy/runs/<preset>)")
    results_dir: Optional[Path] = option("--results_dir", default=None, type=Path, help="where results.json, "
                                         "summary.md and study.png are written (default benchmarks/numeracy/results, "
                                         "the committed report; <work_dir>/results for --smoke)")
    launcher: Optional[str] = option("--launcher", default=None, help='command that starts train.py, e.g. "deepspeed '
                                     '--num_gpus 8" (default: this python, a 1-process ZeRO-3 run)')
    deepspeed_config: Optional[str] = option("--deepspeed_config", default=None, help="override the preset's "
                                             "DeepSpeed config (relative to the repo root, or absolute)")
    parallel: Optional[int] = option("--parallel", default=None, type=int,
                                     help="runs at a time (default: 2 on CPU, 1 with a GPU)")

    @property
    def preset(self) -> str:
        """The name of the preset flag given."""
        return next(name for name in PRESETS if getattr(self, name))


def parse_args(argv=None) -> StudyOptions:
    """The suite's options, ``work_dir`` resolved (default runs/<preset>) and ``results_dir`` filled in."""
    options, parser = parse_options(StudyOptions, argv, description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    if options.steps is not None and options.steps < 1:
        parser.error(f"--steps must be >= 1; got {options.steps}")
    if options.parallel is not None and options.parallel < 1:
        parser.error(f"--parallel must be >= 1; got {options.parallel}")
    if options.launcher and (options.parallel or 1) > 1:
        parser.error("--launcher with --parallel > 1: concurrent launches would share the launcher's default "
                     "rendezvous port; run them one at a time (--parallel 1)")
    work_dir = Path(options.work_dir or HERE / "runs" / options.preset).resolve()
    # A smoke run is a test of the machinery: it never overwrites the committed report.
    return replace(options, work_dir=work_dir,
                   results_dir=Path(options.results_dir or (work_dir / "results" if options.preset == "smoke"
                                                            else HERE / "results")))


def study_settings(options: StudyOptions) -> tuple:
    """(the settings that define the runs and must not change within a work dir, methods, seeds)."""
    preset = PRESETS[options.preset]
    if options.steps is not None:
        preset = replace(preset, steps=options.steps)
    if options.deepspeed_config:
        preset = replace(preset, deepspeed_config=options.deepspeed_config)
    settings = {key: value for key, value in asdict(preset).items() if key not in ("methods", "seeds")}
    settings.update(preset=options.preset, warmup_steps=max(1, preset.steps // 10), tasks=list(TASKS),
                    launcher=options.launcher or "python")
    return settings, list(options.methods or preset.methods), list(options.seeds or preset.seeds)


def open_study(work_dir: Path, settings: dict, methods: list, seeds: list, parallel: int) -> dict:
    """``study.json`` of ``work_dir``, created or extended with ``methods`` and ``seeds``; refuses
    settings that differ from the ones its runs were made with."""
    path = work_dir / "study.json"
    if path.is_file():
        study = json.loads(path.read_text())
        changed = {key: (study["settings"].get(key), value) for key, value in settings.items()
                   if study["settings"].get(key) != value}
        if changed:
            differences = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
            raise SystemExit(f"{work_dir} holds runs made with other settings ({differences}); pass another "
                             f"--work_dir, or delete this one to start over")
    else:
        study = {"settings": settings, "methods": [], "seeds": [], "method_flags": {}, "invocations": []}
    study["methods"] = list(dict.fromkeys(study["methods"] + methods))
    study["seeds"] = list(dict.fromkeys(study["seeds"] + seeds))
    study["method_flags"].update({method: METHODS[method] for method in methods})
    study["parallel"] = parallel
    return study


def prepare_data(work_dir: Path, settings: dict) -> dict:
    """Corpus, tokenizer and tokenized cache of the study (each made once). Returns the paths and the
    model's parameter count."""
    from transformers import AutoTokenizer

    import smmd_numeracy as numeracy
    from smmd_train.data.packing import pack_files
    from smmd_train.model.build import model_config
    from smmd_train.model.presets import parameter_count

    data_dir, tokenizer_dir, cache_dir = work_dir / "data", work_dir / "tokenizer", work_dir / "cache"
    corpus_record = data_dir / "corpus.json"
    if not corpus_record.is_file():
        corpus = numeracy.build_corpus(data_dir, train_per_task=settings["train_per_task"],
                                       test_per_task=settings["test_per_task"],
                                       plain_text_share=settings["plain_text_share"], seed=settings["data_seed"],
                                       tasks=settings["tasks"])
        write_json(corpus_record, {key: str(value) for key, value in corpus.items()})
    corpus = json.loads(corpus_record.read_text())
    if not (tokenizer_dir / "tokenizer.json").is_file():
        with open(corpus["train"]) as lines:
            texts = [json.loads(line)["text"] for line in lines]
        numeracy.train_numeric_tokenizer(texts, vocab_size=settings["vocab_size"]).save_pretrained(tokenizer_dir)
    # Loaded as train.py loads it, so the cache fingerprints match and no run tokenizes again.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for split in ("train", "eval"):
        pack_files([corpus[split]], tokenizer, settings["seq_len"], cache_dir=cache_dir)
    parameters = parameter_count(model_config(settings["model"], tokenizer, settings["seq_len"]))
    return {**corpus, "tokenizer": str(tokenizer_dir), "cache": str(cache_dir), "parameters": parameters}


def run_command(settings: dict, data: dict, method: str, seed: int, output_dir: Path) -> list:
    launcher = "python" if settings["launcher"] == "python" else shlex.split(settings["launcher"])
    return train_command(launcher=launcher, deepspeed_config=REPO / settings["deepspeed_config"],
                         model=settings["model"], tokenizer=data["tokenizer"], data=[data["train"]],
                         eval_data=[data["eval"]], eval_batches=settings["eval_batches"], cache_dir=data["cache"],
                         seq_len=settings["seq_len"], micro_batch_size=settings["micro_batch_size"],
                         max_steps=settings["steps"], lr=settings["lr"], warmup_steps=settings["warmup_steps"],
                         seed=seed, output_dir=output_dir, export_hf=output_dir / "hf", **METHODS[method])


def eval_args(data: dict, output_dir: Path) -> list:
    """``launch/evaluate.py``'s arguments for one run's model on the held-out problems."""
    return [str(output_dir / "hf"), "--data", data["qa_test"], "--output", str(output_dir / "numeric_eval.json"),
            "--batch_size", "64"]


def evaluate_in_process(arguments: list, log: Path) -> float:
    """evaluate.py's evaluation of ``arguments`` in this process, its printed text in ``log``: the wall
    seconds, or ``RunFailed`` with what went wrong."""
    from smmd_numeracy import evaluate_cli

    began = time.monotonic()
    with EVALUATION_LOCK:
        try:
            _, text = evaluate_cli.evaluate(arguments)
        except (Exception, SystemExit) as error:  # argparse and a bad QA file exit; a failed load raises
            log.write_text(f"evaluate.py {' '.join(arguments)}\n{type(error).__name__}: {error}\n")
            raise RunFailed(f"evaluate.py {' '.join(arguments[:1])} ... failed: {error}; {log}") from error
    log.write_text(text + "\n")
    return time.monotonic() - began


def _run_logged(command: list, log: Path, env: dict) -> float:
    """``run_measured``'s wall seconds."""
    return run_measured(command, log, env)[0]


def execute(settings: dict, data: dict, method: str, seed: int, output_dir: Path, env: dict) -> dict:
    """Train (unless a finished training is recorded) and evaluate one (method, seed); returns its run.json."""
    record_path = output_dir / "run.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if "train_seconds" not in record or not (output_dir / "hf" / "config.json").is_file():
        shutil.rmtree(output_dir, ignore_errors=True)
        output_dir.mkdir(parents=True)
        command = run_command(settings, data, method, seed, output_dir)
        record = {"method": method, "seed": seed, "flags": METHODS[method], "train_command": command}
        record["train_seconds"] = _run_logged(command, output_dir / "train.log", env)
        write_json(record_path, record)
    record["eval_seconds"] = evaluate_in_process(eval_args(data, output_dir), output_dir / "eval.log")
    write_json(record_path, record)
    return record


def is_finished(output_dir: Path) -> bool:
    record_path = output_dir / "run.json"
    return (record_path.is_file() and "eval_seconds" in json.loads(record_path.read_text())
            and (output_dir / "numeric_eval.json").is_file())


@dataclass(frozen=True)
class TierChoice:
    """The tier, read first: every other option belongs to the tier's own command line."""

    tier: str = option("--tier", choices=TIERS, default="suite", help="suite: the task suite below; a: Tier A, "
                       "one-token arithmetic (benchmarks/numeracy/study_a.py); b: Tier B, DeepMind add_sub_multiple "
                       "with digit tokens (study_b.py); aprime: Tier A', SMMD on raw value distances "
                       "(study_aprime.py); c: Tier C, fine-tuning pretrained SmolLM2 (study_c.py)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest, _ = parse_options(TierChoice, argv, known_only=True, add_help=False)
    if known.tier == "a":
        from benchmarks.numeracy import study_a

        return study_a.main(rest)
    if known.tier == "b":
        from benchmarks.numeracy import study_b

        return study_b.main(rest)
    if known.tier == "aprime":
        from benchmarks.numeracy import study_aprime

        return study_aprime.main(rest)
    if known.tier == "c":
        from benchmarks.numeracy import study_c

        return study_c.main(rest)
    options = parse_args(rest)
    import torch

    on_gpu = torch.cuda.is_available()
    parallel = options.parallel or (1 if on_gpu else 2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = child_environment(max(1, cores // parallel), on_gpu)
    torch.set_num_threads(max(1, cores // parallel))  # the in-process evaluations, as each run's threads
    # This process imports smmd_scale (and so DeepSpeed) to prepare the data: same accelerator as the runs.
    os.environ.update({key: env[key] for key in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_PARALLELISM")
                       if key in env})
    settings, methods, seeds = study_settings(options)
    work_dir = options.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    study = open_study(work_dir, settings, methods, seeds, parallel)
    began = time.monotonic()

    print(f"[study] {options.preset}: {len(methods)} methods x {len(seeds)} seeds, {settings['model']} model, "
          f"{settings['steps']} steps, {parallel} run(s) at a time, work dir {work_dir}", flush=True)
    data = prepare_data(work_dir, settings)
    study["parameters"] = data["parameters"]
    invocation = {"machine": machine(), "wall_seconds": 0.0, "runs_completed": 0}
    study["invocations"].append(invocation)
    write_json(work_dir / "study.json", study)
    print(f"[study] data ready ({time.monotonic() - began:.0f} s): {data['train_problems']} training problems, "
          f"{data['test_problems']} held-out", flush=True)

    pending = [(method, seed) for seed in seeds for method in methods
               if not is_finished(work_dir / f"{method}-seed{seed}")]
    skipped = len(methods) * len(seeds) - len(pending)
    if skipped:
        print(f"[study] {skipped} run(s) already finished in {work_dir}; {len(pending)} to go", flush=True)
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(execute, settings, data, method, seed, work_dir / f"{method}-seed{seed}", env):
                   (method, seed) for method, seed in pending}
        for done, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            method, seed = futures[future]
            try:
                record = future.result()
            except RunFailed as error:
                failures.append(f"{method} seed {seed}: {error}")
                print(f"[study] [{done}/{len(pending)}] {method} seed {seed} FAILED", flush=True)
                continue
            report = json.loads((work_dir / f"{method}-seed{seed}" / "numeric_eval.json").read_text())
            invocation["runs_completed"] += 1
            invocation["wall_seconds"] = time.monotonic() - began
            write_json(work_dir / "study.json", study)
            print(f"[study] [{done}/{len(pending)}] {method} seed {seed}: trained {record['train_seconds']:.0f} s, "
                  f"evaluated {record['eval_seconds']:.0f} s, exact match {report['exact_match']:.1%} "
                  f"({time.monotonic() - began:.0f} s so far)", flush=True)
    invocation["wall_seconds"] = time.monotonic() - began
    write_json(work_dir / "study.json", study)
    if failures:
        raise SystemExit("[study] some runs failed (finished runs are kept; rerun the same command to retry the "
                         "rest):\n\n" + "\n\n".join(failures))

    analysis = analyze.write_report(work_dir, options.results_dir)
    for metric, (header, _, scale, unit) in analyze.METRICS.items():
        print(f"\n{header}{f' ({unit})' if unit else ''}, mean ± std over seeds (95% t-interval):")
        print(analyze.cells_table(analysis, metric, scale))
    print(f"\n[study] {time.monotonic() - began:.0f} s; report in {options.results_dir}: summary.md, results.json, "
          f"study.png", flush=True)


if __name__ == "__main__":
    main()
