"""The self-contained CPU demo: CE against CE + a numeric loss on one-token arithmetic, end to end,
nothing downloaded.

    bash launch/demo.sh                 # sets up .venv, then runs this: the study's 2,000 steps per run
    bash launch/demo.sh --arm ntl_was   # another of the study's arms beside CE
    bash launch/demo.sh --help          # this text; needs nothing installed

Time after set-up, measured 2026-11-27 on this project's 2-core machine (the demo at nice 5) from a
fresh clone: 289 s with no other job running: data and tokenizer 0 s, the two 1-process runs side by
side 257 s (two processes on the 2 cores are slower than one alone), the TP=2 segment 28 s (its 50
steps about 10 s, the rest the launcher, the universal conversion and the export), evaluation 4 s.
On cores shared with other jobs' test runs it took 381 s (load average 3.8-9.1) and 408 s (1.4-6.5).

The task and settings are Tier A of the numeracy study (benchmarks/numeracy/README.md, "Tier A"):

1. problems ``a+b=``, ``a-b=``, ``a~b=`` (|a - b|) whose operands and answer are each one token
   0..999 of a Llama-3-style tokenizer trained locally; training pairs, held-out test pairs
   (interpolation) and out-of-range pairs (an operand never seen as an operand);
2. two runs from scratch of a tiny Llama, same seed, data order and 2,000 steps: CE only, and CE +
   the numeric loss (default: SMMD, the loss the study is about, fixed in advance; ``--arm`` picks
   another study arm), each ZeRO-3 on one process as the study trains them, side by side (one per
   core), logging to TensorBoard;
3. the scale-out path: the numeric-loss run's step-1,950 checkpoint resumed under ZeRO-3 + AutoTP
   (TP=2, vocabulary-parallel head: the loss's one exchange per forward) on 2 processes through the
   deepspeed launcher, converted to a universal checkpoint on the way, trains steps 1,951-2,000
   again; the demo checks that its per-step losses equal the 1-process run's within 1e-5 relative
   (``TP_TOLERANCE``; measured 2.3e-7) and exports it too;
4. greedy answers of the three models on the held-out problems and a side-by-side table, with the
   study's own multi-seed numbers for the two arms and, in words, whether the numeric loss beat CE
   there (in the study every numeric arm had a lower mean test exact match than CE; SMMD's paired
   difference, -6.1 pp, has a 95% interval from -14.0 to +0.6: it did not beat CE).

Why this layout: a step of this tiny model is slower at TP=2 than on one process (0.147 s against
0.081 s on 2 idle cores: its ranks spend much of a step in collectives, waiting on each other), so
training both runs at TP=2 took 7.8 minutes (2 x 2,000 steps side by side on 4 processes); and at
1,000 steps CE has not learned the task yet (single-seed pilots at 800 and 1,000 steps reached
10.0% and 7.5% test exact match against 35% at 2,000: benchmarks/numeracy/results/tier_a_pilot.md).
So the learning happens where a step is cheap, one process per run, and AutoTP gets the segment
that shows it trains the same model: the TP=2 row of the table repeats the 1-process row's answers.

With the default settings the two 1-process runs are the study's own seed-0 runs (same settings,
seed, data and process layout): the demo reports whether its rows repeat the study's recorded test
exact match (on the machine the study ran on they do, exactly: CE 35.3%, CE + SMMD 23.3%). One seed
shows that the pipeline works and what the numbers look like; it cannot show that one loss is
better: the study's seed-to-seed spread and its paired difference for the arm are in the table.

The accuracy columns repeat bit for bit when the demo runs again on the same machine and code
(tests/launch/test_demo.py: two runs of 4 steps, side by side and one at a time: identical per-step
losses and tables); only tokens/s varies. Every process runs ``--threads`` (1) BLAS threads
whatever the caller's OMP_NUM_THREADS, since another thread count can sum in another order.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options

REPO = Path(__file__).resolve().parents[1]
STUDY_RESULTS = REPO / "benchmarks" / "numeracy" / "results" / "tier_a.json"
PRETRAINED_RESULTS = STUDY_RESULTS.with_name("tier_c.json")  # Tier C: a pretrained model fine-tuned
# The arms the demo can run beside CE (train.py flags: smmd_numeracy.tier_a.arm_flags; ntl_mse's weight is
# the one the study chose on validation). Here rather than in the package: --help prints before anything is installed.
ARM_LABELS = {"smmd": "CE + SMMD", "ntl_was": "CE + 0.3 NTL-WAS", "ntl_mse": "CE + NTL-MSE",
              "smmd_ntl_was": "CE + SMMD + 0.3 NTL-WAS", "random_kernel": "CE + SMMD, random kernel"}
DEFAULT_ARM = "smmd"  # the loss the study is about, fixed in advance (not picked from any result)
# How far the scale-out segment's per-step losses may lie from the 1-process run's same steps
# (relative). Both start from the same checkpoint and take the same batches; AutoTP splits the
# matmuls over the ranks and the vocabulary-parallel loss sums their softmax statistics, so float32
# sums run in another order: about 1e-7 relative in one step, compounded over the segment (measured:
# 2.3e-7 over the default 50 steps). A wrong shard or a missed exchange moves a loss by percents.
TP_TOLERANCE = 1e-5


def study_results() -> dict:
    return json.loads(STUDY_RESULTS.read_text()) if STUDY_RESULTS.is_file() else {}


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    work_dir: str = option("--work_dir", default=str(REPO / "demo_runs"), help="everything the demo writes")
    model: str = option("--model", default="tiny", help="preset trained from scratch (tiny on CPU)")
    steps: Optional[int] = option("--steps", type=int, help="optimizer steps per run (default: the study's)")
    arm: str = option("--arm", choices=list(ARM_LABELS), default=DEFAULT_ARM,
                      help="the study's arm to run beside CE (default: %(default)s)")
    tp_steps: int = option("--tp_steps", type=int, default=50, help="the last steps of the numeric-loss run that "
                           "train again from its checkpoint under ZeRO-3 + AutoTP (default: %(default)s)")
    gpus: int = option("--gpus", type=int, default=2, help="processes of that segment (deepspeed launcher)")
    tp: int = option("--tp", type=int, default=2, help="its AutoTP degree")
    deepspeed_config: str = option("--deepspeed_config", default=str(REPO / "ds_configs" / "zero3.json"))
    fused_linear: bool = option("--fused_linear", action="store_true",
                                help="train every run with train.py --fused_linear")
    one_at_a_time: bool = option("--one_at_a_time", action="store_true", help="train the two 1-process runs one "
                                 "after the other instead of side by side (one process per core); the same steps "
                                 "and losses")
    seed: int = option("--seed", type=int, default=0, help="training seed of both runs (the data are fixed)")
    threads: int = option("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process and "
                          "of the evaluation; fixed so the numbers repeat (a different thread count sums in "
                          "another order and changes them)")


def parse_args(argv=None) -> DemoOptions:
    options, _ = parse_options(DemoOptions, argv, prog="bash launch/demo.sh", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    return options


def refuse(message: str) -> None:
    """Bad arguments: one line, exit 2, before anything trains."""
    print(f"bash launch/demo.sh: error: {message}", file=sys.stderr)
    sys.exit(2)


def stage(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.monotonic()


def start_train(args, settings: dict, name: str, output_dir: Path, loss_flags: dict, data: dict, *,
                master_port: int, processes: int = 1, **layout) -> dict:
    """Start one train.py run, its output in its log file: one plain process (``processes`` 1, as
    the study runs), else ``processes`` ranks under the deepspeed launcher; ``layout``: more train.py
    options (``tp``, ``save_steps``, ``resume``)."""
    from smmd_train.config.arguments import train_command
    from smmd_train.monitor.metrics_file import METRICS_FILE

    command = train_command(processes=processes, launcher="python" if processes == 1 else "deepspeed",
                            master_port=None if processes == 1 else master_port,
                            deepspeed_config=args.deepspeed_config, model=args.model, tokenizer=data["tokenizer"],
                            data=[data["train"]], eval_data=[data["eval"]], eval_steps=settings["eval_every"],
                            eval_batches=settings["eval_batches"], cache_dir=Path(args.work_dir) / "cache",
                            seq_len=settings["seq_len"], micro_batch_size=settings["micro_batch_size"],
                            max_steps=settings["steps"], lr=settings["lr"], warmup_steps=settings["warmup_steps"],
                            seed=args.seed, output_dir=output_dir,
                            tensorboard_dir=Path(args.work_dir) / "tensorboard" / name, export_hf=output_dir / "hf",
                            fused_linear=args.fused_linear, **loss_flags, **layout)
    log = output_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "w")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if processes == 1:  # its own rendezvous port: two runs that start together must not pick the same one
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return {"name": name, "process": process, "log": log, "handle": handle, "output_dir": output_dir,
            "metrics": output_dir / METRICS_FILE}


def run_side_by_side(runs: list, steps: int, first_step: int = 0) -> None:
    """Wait for ``runs`` (from ``start_train``, each from step ``first_step`` to ``steps``) with one
    progress bar each: the steps rank 0 has written to metrics.jsonl, with the last loss and
    tokens/s. A failed run stops the others."""
    from tqdm import tqdm

    bars = [tqdm(total=steps, initial=first_step, desc=f"    {run['name']}", unit="step", dynamic_ncols=True,
                 leave=False, position=index) for index, run in enumerate(runs)]
    state = [{"done": first_step, "position": 0} for _ in runs]
    try:
        while True:
            finished = [run["process"].poll() is not None for run in runs]
            for run, bar, seen in zip(runs, bars, state):
                _advance(run["metrics"], bar, seen)
            failed = [run for run, over in zip(runs, finished) if over and run["process"].returncode != 0]
            if failed or all(finished):
                break
            time.sleep(0.5)
    finally:
        for bar in bars:
            bar.close()
        for run in runs:
            if run["process"].poll() is None:
                run["process"].terminate()
                run["process"].wait()
            run["handle"].close()
    for run in runs:
        if run["process"].returncode != 0:
            raise SystemExit(f"{run['name']} failed (exit {run['process'].returncode}); see {run['log']}:\n" +
                             "".join(run["log"].read_text().splitlines(keepends=True)[-30:]))


def _advance(metrics_path: Path, bar, seen: dict) -> None:
    if not metrics_path.is_file():
        return
    with open(metrics_path) as handle:
        handle.seek(seen["position"])
        for line in handle.readlines():
            if not line.endswith("\n"):  # a record still being written: read it next time
                break
            seen["position"] += len(line)
            record = json.loads(line)
            if "loss/total" in record and record["step"] > seen["done"]:
                bar.update(record["step"] - seen["done"])
                seen["done"] = record["step"]
                postfix = {"loss": f"{record['loss/total']:.3f}"}
                if "perf/tokens_per_second" in record:
                    postfix["tok/s"] = f"{record['perf/tokens_per_second']:.0f}"
                bar.set_postfix(postfix)


def training_summary(output_dir: Path) -> dict:
    from smmd_train.monitor.metrics_file import read_metrics

    records = read_metrics(output_dir)
    steps = [r for r in records if "loss/total" in r]
    evals = [r for r in records if "eval/ce" in r]
    return {"tokens_per_second": statistics.median(r["perf/tokens_per_second"] for r in steps
                                                   if "perf/tokens_per_second" in r),
            "final_ce": steps[-1]["loss/ce"], "eval_ce": evals[-1]["eval/ce"] if evals else float("nan")}


def step_losses(output_dir: Path) -> dict:
    from smmd_train.monitor.metrics_file import read_metrics

    return {record["step"]: record["loss/total"] for record in read_metrics(output_dir) if "loss/total" in record}


def compare_losses(reference: dict, segment: dict, steps: range) -> dict:
    """The segment's per-step losses against the reference run's for ``steps`` ({step: loss} each):
    the largest relative difference, and whether it is within TP_TOLERANCE."""
    largest = max(abs(segment[step] - reference[step]) / abs(reference[step]) for step in steps)
    return {"steps": [steps[0], steps[-1]], "max_relative_difference": largest, "tolerance": TP_TOLERANCE,
            "within": largest <= TP_TOLERANCE}


def compared_with_ce(row: dict) -> str:
    """A study's paired comparison with CE (a row of its ``tests``) in words: ``"beat CE: +1.2 pp [+0.1,
    +2.3]"`` where the 95% t-interval (the study's primary one) is above 0, "lost to CE" below it, else "did
    not beat CE"."""
    low, high = 100 * row["t95_low"], 100 * row["t95_high"]
    outcome = "beat CE" if low > 0 else "lost to CE" if high < 0 else "did not beat CE"
    return f"{outcome}: {100 * row['mean_difference']:+.1f} pp [{low:+.1f}, {high:+.1f}]"


def study_verdict(results: dict, arm: str) -> dict:
    """The study's cells for CE and ``arm`` (``results``: its tier_a.json, or {}): mean ± std test
    exact match over its seeds, and in words whether ``arm`` beat CE (the paired difference's 95%
    t-interval, the study's primary one, above 0), lost to it (below 0) or neither."""
    if not results:
        return {}
    cells = results["cells"]["exact_match"]["test"]
    verdict = {name: f"{100 * cells[name]['mean']:.1f}% ± {100 * cells[name]['std']:.1f}"
               for name in ("ce", arm) if name in cells}
    for row in results["tests"]["exact_match"]:
        if row["arm"] == arm and row["column"] == "test":
            verdict["outcome"] = f"{compared_with_ce(row)}, {row['n']} seeds"
    return verdict


def study_spread(results: dict, arm: str) -> str:
    """What one seed can show, in the study's own numbers (``results``: its tier_a.json, or {})."""
    if not results:
        return ("One seed cannot tell a loss effect from seed-to-seed variation; the multi-seed study "
                "(python -m benchmarks.numeracy.run_study --tier a) measures both.")
    cells = results["cells"]
    ce_em, ce_mae = cells["exact_match"]["test"]["ce"], cells["mae"]["test"]["ce"]
    tests = [row for row in results["tests"]["exact_match"] if row["column"] == "test"]
    below = [row for row in tests if row["mean_difference"] < 0]
    text = (f"What one seed can show: that both runs train and what their answers look like. What it cannot: "
            f"which loss is better. Across the study's {len(results['seeds'])} seeds, CE alone has test exact "
            f"match {100 * ce_em['mean']:.1f}% ± {100 * ce_em['std']:.1f} and MAE {ce_mae['mean']:.2f} ± "
            f"{ce_mae['std']:.2f} (mean ± std over seeds): a one-seed difference smaller than a few such stds says "
            f"nothing. In the study, {len(below)} of its {len(tests)} numeric-loss arms had a lower mean test exact "
            f"match than CE" + (" (every one)" if len(below) == len(tests) else "") + "; the column \"the study, "
            f"vs CE\" gives {ARM_LABELS[arm]}'s paired difference and its 95% t-interval.")
    return text + " All its comparisons: benchmarks/numeracy/results/tier_a_summary.md."


def pretrained_verdict(results: dict) -> str:
    """The closing word: what Tier C (``results``: its tier_c.json, or {}) found on a pretrained model, each
    numeric loss's paired difference from CE in test exact match with its 95% t-interval, and where a user
    reads which loss to choose."""
    where = ("Which loss and weight to start with for your tokenizer: docs/objective.md, \"Choosing a numeric "
             "loss\"")
    if not results:
        return where + "."
    settings, cells = results["study"]["settings"], results["cells"]["exact_match"]["test"]
    operations = ", ".join({"add": "a+b", "sub": "a-b", "dist": "|a-b|"}[name] for name in settings["operations"])
    arms = []
    for row in results["tests"]["exact_match"]:
        if row["column"] == "test" and row["t95_low"] is not None:
            words, numbers = compared_with_ce(row).split(": ")
            arms.append(f"{row['arm'].replace('_', '-').upper()} at weight {results['study']['weights'][row['arm']]:g} "
                        f"{words} ({numbers})")
    return (f"On a pretrained model (Tier C: SmolLM2-135M-Instruct fine-tuned on {operations} with operands "
            f"0..{settings['operand_range'] - 1}, {len(results['seeds'])} seeds), CE alone reached "
            f"{100 * cells['ce']['mean']:.1f}% ± {100 * cells['ce']['std']:.1f} test exact match; "
            + "; ".join(arms) + ". " + where
            + "; the report: benchmarks/numeracy/results/tier_c_summary.md.")


def study_runs(results: dict, settings: dict, args, rows: list) -> str:
    """Where the demo trained the study's own runs (its settings, seed and layout: one process, one
    thread), what the study recorded for them and whether the demo's rows (CE, the arm) repeat it;
    else ""."""
    layout = (args.model, Path(args.deepspeed_config).resolve(), args.fused_linear, args.threads)
    study_layout = (settings["model"], REPO / settings["deepspeed_config"], False, settings["threads"])
    if results.get("study", {}).get("settings") != settings or layout != study_layout or \
            args.seed not in results.get("seeds", ()):
        return ""
    recorded = {run["arm"]: run["eval"]["test"]["exact_match"] for run in results["runs"] if run["seed"] == args.seed}
    if "ce" not in recorded or args.arm not in recorded:
        return ""
    same = [recorded[name] == row["test exact"] for name, row in zip(("ce", args.arm), rows)]
    return (f"The study's own seed-{args.seed} runs of these two arms (the same settings, one process each) scored "
            f"{100 * recorded['ce']:.1f}% and {100 * recorded[args.arm]:.1f}% test exact match: "
            + ("the two 1-process rows above repeat them exactly." if all(same) else
               "the 1-process rows above differ (another machine or library version sums in another order)."))


def experiment_differs(loss_flags: list) -> tuple:
    """The HParams columns the demo's runs differ in, which its experiment shows first: the numeric loss
    (CE alone is ``smmd:0``), each loss option a run's flags in ``loss_flags`` set (the other runs show
    it as unused), and the scale-out segment's layout."""
    options = sorted({name for flags in loss_flags for name in flags if name != "numeric_loss"})
    return ("numeric_loss", *options, "tp_size", "world_size")


def main(argv=None) -> None:
    args = parse_args(argv)  # before any heavy import: --help needs nothing installed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from smmd_numeracy import tier_a

    settings = dict(tier_a.SETTINGS, **({"steps": args.steps} if args.steps else {}))
    if not 1 <= args.tp_steps < settings["steps"]:
        refuse(f"--tp_steps {args.tp_steps} must be between 1 and --steps - 1 = {settings['steps'] - 1}: the "
               f"scale-out segment resumes the {ARM_LABELS[args.arm]} run's checkpoint at step steps - tp_steps")
    results = study_results()
    try:
        flags = tier_a.arm_flags(args.arm, results.get("study", {}).get("ntl_mse_weight"))
    except ValueError as error:
        refuse(f"--arm {args.arm}: {error}; run the study first (python -m benchmarks.numeracy.run_study --tier a)")

    import torch
    from smmd_cli.tables import markdown_table
    from transformers import AutoTokenizer

    from smmd_train.checkpoint.saving import tag_for_step
    from smmd_train.distributed.launcher import free_port
    from smmd_train.monitor.dashboards import write_experiment

    torch.set_num_threads(args.threads)  # the evaluation below, like the training processes
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "tensorboard", ignore_errors=True)
    began = time.monotonic()

    started = stage("1/4 one-token arithmetic and a Llama-3-style tokenizer (0..999 are single tokens)")
    data = tier_a.data_and_tokenizer(work, settings)
    print(f"    {data['train_pairs']} training pairs (operands 0..{settings['operand_range'] - 1}); held out: "
          f"{data['test_pairs']} test pairs, {data['oor_pairs']} out-of-range pairs; "
          f"{len(AutoTokenizer.from_pretrained(work / 'tokenizer'))} tokens ({time.monotonic() - started:.0f} s)")

    steps, resume_step = settings["steps"], settings["steps"] - args.tp_steps
    label = ARM_LABELS[args.arm]
    plans = (("ce", "CE only", tier_a.ARMS["ce"], {}), (args.arm, label, flags, {"save_steps": resume_step}))
    ports = []
    while len(ports) < len(plans) + 1:  # one rendezvous port per run, distinct even when they start together
        port = free_port()
        if port not in ports:
            ports.append(port)
    for name, *_ in plans:
        shutil.rmtree(work / name, ignore_errors=True)
    described = " and ".join(f"{text} ({' '.join(loss['numeric_loss'])})" for _, text, loss, _ in plans)
    started = stage(f"2/4 {described}: {steps} steps each from scratch, seed {args.seed}, ZeRO-3 on 1 process each "
                    f"(as the study trains), " + ("one after the other" if args.one_at_a_time else "side by side"))
    pairs = list(zip(plans, ports))
    for batch in [[pair] for pair in pairs] if args.one_at_a_time else [pairs]:
        run_side_by_side([start_train(args, settings, name, work / name, loss, data, master_port=port, **extra)
                          for (name, _, loss, extra), port in batch], steps)
    print(f"    -> {', '.join(str(work / name) for name, *_ in plans)} ({time.monotonic() - started:.0f} s)")

    tp_name = f"{args.arm}_tp{args.tp}"
    tp_dir = work / tp_name
    layout = f"ZeRO-3 + AutoTP TP={args.tp} on {args.gpus} processes"
    started = stage(f"3/4 scale-out: {label}'s step-{resume_step} checkpoint resumed under {layout}, steps "
                    f"{resume_step + 1}-{steps} again (the checkpoint converted to a universal one)")
    shutil.rmtree(tp_dir, ignore_errors=True)
    tag = tag_for_step(resume_step)
    shutil.copytree(work / args.arm / tag, tp_dir / tag)
    run_side_by_side([start_train(args, settings, tp_name, tp_dir, flags, data, master_port=ports[-1],
                                  processes=args.gpus, tp=args.tp, resume=True)], steps, resume_step)
    check = compare_losses(step_losses(work / args.arm), step_losses(tp_dir), range(resume_step + 1, steps + 1))
    print(f"    per-step losses of steps {resume_step + 1}-{steps} at TP={args.tp} against the 1-process run's: "
          f"largest relative difference {check['max_relative_difference']:.1e} (tolerance {TP_TOLERANCE:.0e}: "
          f"the same model summed in another order) -> " + ("equal within it" if check["within"] else "NOT EQUAL")
          + f" ({time.monotonic() - started:.0f} s)")

    started = stage("4/4 greedy answers on held-out problems")
    verdict = study_verdict(results, args.arm)
    rows = []
    for name, text, output in (("ce", "CE only", work / "ce"), (args.arm, f"{label}", work / args.arm),
                               (args.arm, f"{label}, last {args.tp_steps} steps at TP={args.tp}", tp_dir)):
        report = tier_a.evaluate_model(output / "hf", data["qa_eval"])["metrics"]
        (output / "tier_a_eval.json").write_text(json.dumps(report, indent=1))
        summary = training_summary(output)
        test, oor = report["test"], report["oor"]
        rows.append({"run": text, "test exact": test["exact_match"], "test MAE": test["mae"],
                     "test within 1": test["within_1"], "out-of-range exact": oor["exact_match"],
                     "out-of-range MAE": oor["mae"], "eval CE": summary["eval_ce"],
                     "tokens/s": summary["tokens_per_second"], "study": verdict.get(name),
                     "study vs CE": verdict.get("outcome") if name != "ce" else None, "report": report})
    print(f"    ({time.monotonic() - started:.0f} s)")
    columns = [("run", "run", ""), ("test exact", "test exact match", ".1%"), ("test MAE", "test MAE", ".2f"),
               ("test within 1", "test within ±1", ".1%"), ("out-of-range exact", "out-of-range exact", ".1%"),
               ("out-of-range MAE", "out-of-range MAE", ".1f"), ("eval CE", "eval CE", ".3f"),
               ("tokens/s", "tokens/s", ".0f"), ("study", "the study: test exact", ""),
               ("study vs CE", "the study, vs CE", "")]
    print(f"\n{report['test']['count']} held-out test problems (operand pairs never trained) and "
          f"{report['oor']['count']} out-of-range problems; greedy answers; tokens/s = training throughput of the "
          f"run's processes (the only column that varies between runs of the demo); the study's columns: mean ± "
          f"std over its seeds, and the paired difference from CE with its paired 95% t-interval\n")
    print(markdown_table(rows, columns))
    print("\n" + study_spread(results, args.arm))
    reproduced = study_runs(results, settings, args, rows[:2])
    if reproduced:
        print("\n" + reproduced)
    closing = pretrained_verdict(json.loads(PRETRAINED_RESULTS.read_text()) if PRETRAINED_RESULTS.is_file() else {})
    print("\n" + closing)
    seconds = time.monotonic() - began
    (work / "demo_results.json").write_text(json.dumps({"args": asdict(args), "settings": settings, "rows": rows,
                                                        "tp_check": check, "pretrained": closing,
                                                        "seconds": seconds}, indent=1))
    print(f"\nper-split reports: {work}/*/tier_a_eval.json; everything: {work}/demo_results.json")
    write_experiment(str(work / "tensorboard"), differs=experiment_differs([loss for _, _, loss, _ in plans]))
    print(f"TensorBoard:  tensorboard --logdir {work / 'tensorboard'}")
    print(f"total {time.monotonic() - began:.0f} s")
    if not check["within"]:
        raise SystemExit(f"the TP={args.tp} segment's losses differ from the 1-process run's by more than "
                         f"{TP_TOLERANCE:.0e} (relative): see {tp_dir.with_suffix('.log')}")


if __name__ == "__main__":
    sys.exit(main())
