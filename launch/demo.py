"""The self-contained CPU demo: CE against CE + a numeric loss on one-token arithmetic, end to end,
nothing downloaded.

    bash launch/demo.sh                 # sets up .venv, then runs this with the study's 2,000 steps
    bash launch/demo.sh --steps 1000    # about half the time, before CE has learned much (below)
    python launch/demo.py --help        # this text; needs nothing installed

Time: 469 s (7.8 minutes) after set-up on 2 idle cores (measured 2026-11-25, CE against CE + SMMD +
0.3 NTL-WAS, 2 x 2,000 steps), over the 5 minutes it was meant to take. At TP=2 a step of this tiny
model is slower than on one process (0.147 s per step on 2 idle cores against 0.081 s for a
1-process ZeRO-3 run): its ranks spend much of a step in collectives, waiting on each other. So the
two runs train side by side (4 processes on the cores: 0.21-0.22 s per step each, about 1.4x the
throughput of one after the other; ``--one_at_a_time`` trains the same steps, identical losses,
sequentially). 5 minutes would allow about 1,100 steps, and there CE has not learned the task yet:
single-seed 1-process pilots at 800 and 1,000 steps (schedule scaled) reached 10.0% and 7.5% test
exact match against 35% at 2,000 (benchmarks/numeracy/results/tier_a_pilot.md), so the demo keeps
the study's 2,000 steps.

The task and settings are Tier A of the numeracy study (benchmarks/numeracy/README.md, "Tier A"):

1. problems ``a+b=``, ``a-b=``, ``a~b=`` (|a - b|) whose operands and answer are each one token
   0..999 of a Llama-3-style tokenizer trained locally; training pairs, held-out test pairs
   (interpolation) and out-of-range pairs (an operand never seen as an operand);
2. two runs from scratch of a tiny Llama, same seed, data order and steps: CE only, and CE + the
   numeric loss (default: the study's best, ``tier_a.best_arm``; ``--arm`` picks another study arm) -- each under
   ZeRO-3 + AutoTP (TP=2, vocabulary-parallel head) on 2 processes through the deepspeed launcher,
   side by side, logging to TensorBoard;
3. greedy answers of both on the held-out problems and a side-by-side table.

One seed shows that the pipeline works and what the numbers look like; it cannot show that one loss
is better: the study's seed-to-seed spread and its paired difference for the arm are printed under
the table for scale. (The measured run above: CE 21.8% and CE + SMMD + 0.3 NTL-WAS 38.3% test exact
match at TP=2 on seed 0, the opposite of the study's mean difference, -5.1 pp over 5 seeds; the
study's 1-process CE run on seed 0 reached 35.3%: a TP=2 run sums in another order and is another
sample of the same seed-to-seed spread.)

The accuracy columns repeat bit for bit when the demo runs again on the same machine and code (two
runs of 60 steps: identical per-step losses and tables); only tokens/s varies. Every process runs
``--threads`` (1) BLAS threads whatever the caller's OMP_NUM_THREADS, since another thread count
can sum in another order.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STUDY_RESULTS = REPO / "benchmarks" / "numeracy" / "results" / "tier_a.json"
# The arms the demo can run beside CE (train.py flags: smmd_numeracy.tier_a.arm_flags; ntl_mse's weight is
# the one the study chose on validation). By default it runs the study's best numeric loss (tier_a.best_arm).
# Here rather than in the package: --help prints before anything is installed.
ARM_LABELS = {"smmd": "CE + SMMD", "ntl_was": "CE + 0.3 NTL-WAS", "ntl_mse": "CE + NTL-MSE",
              "smmd_ntl_was": "CE + SMMD + 0.3 NTL-WAS", "random_kernel": "CE + SMMD, random kernel"}
FALLBACK_ARM = "smmd"  # without the study's results in the checkout


def study_results() -> dict:
    return json.loads(STUDY_RESULTS.read_text()) if STUDY_RESULTS.is_file() else {}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bash launch/demo.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", default=str(REPO / "demo_runs"), help="everything the demo writes")
    parser.add_argument("--model", default="tiny", help="preset trained from scratch (tiny on CPU)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the study's)")
    parser.add_argument("--arm", choices=list(ARM_LABELS), help="the study's arm to run beside CE (default: the "
                        "study's best numeric loss, the largest paired difference from CE in test exact match in "
                        f"benchmarks/numeracy/results/tier_a.json; {FALLBACK_ARM} without it)")
    parser.add_argument("--gpus", type=int, default=2, help="processes for the deepspeed launcher")
    parser.add_argument("--tp", type=int, default=2, help="AutoTP degree of both runs")
    parser.add_argument("--deepspeed_config", default=str(REPO / "ds_configs" / "zero3.json"))
    parser.add_argument("--fused_linear", action="store_true", help="train both runs with train.py --fused_linear")
    parser.add_argument("--one_at_a_time", action="store_true", help="train the two runs one after the other "
                        "instead of side by side (side by side, 4 processes share the cores: measured 1.4-1.6x the "
                        "throughput on 2 cores, since a tiny model's ranks spend much of a step waiting on each other)")
    parser.add_argument("--seed", type=int, default=0, help="training seed of both runs (the data are fixed)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process and "
                        "of the evaluation; fixed so the numbers repeat (a different thread count sums in "
                        "another order and changes them)")
    return parser.parse_args(argv)


def stage(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.monotonic()


def start_train(args, settings: dict, name: str, loss_flags: dict, data: dict, master_port: int) -> dict:
    """Start one train.py run under the deepspeed launcher, its output in its log file."""
    from smmd_train.arguments import train_command
    from smmd_train.metrics_file import METRICS_FILE

    output_dir = Path(args.work_dir) / name
    shutil.rmtree(output_dir, ignore_errors=True)
    command = train_command(processes=args.gpus, deepspeed_config=args.deepspeed_config, tp=args.tp,
                            master_port=master_port, model=args.model, tokenizer=data["tokenizer"],
                            data=[data["train"]], eval_data=[data["eval"]], eval_steps=settings["eval_every"],
                            eval_batches=settings["eval_batches"], cache_dir=Path(args.work_dir) / "cache",
                            seq_len=settings["seq_len"], micro_batch_size=settings["micro_batch_size"],
                            max_steps=settings["steps"], lr=settings["lr"], warmup_steps=settings["warmup_steps"],
                            seed=args.seed, output_dir=output_dir,
                            tensorboard_dir=Path(args.work_dir) / "tensorboard" / name, export_hf=output_dir / "hf",
                            fused_linear=args.fused_linear, **loss_flags)
    log = output_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "w")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return {"name": name, "process": process, "log": log, "handle": handle, "output_dir": output_dir,
            "metrics": output_dir / METRICS_FILE}


def run_side_by_side(runs: list, steps: int) -> None:
    """Wait for ``runs`` (from ``start_train``) with one progress bar each: the steps rank 0 has
    written to metrics.jsonl, with the last loss and tokens/s. A failed run stops the others."""
    from tqdm import tqdm

    bars = [tqdm(total=steps, desc=f"    {run['name']}", unit="step", dynamic_ncols=True, leave=False, position=index)
            for index, run in enumerate(runs)]
    state = [{"done": 0, "position": 0} for _ in runs]
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
    from smmd_train.metrics_file import read_metrics

    records = read_metrics(output_dir)
    steps = [r for r in records if "loss/total" in r]
    evals = [r for r in records if "eval/ce" in r]
    return {"tokens_per_second": statistics.median(r["perf/tokens_per_second"] for r in steps
                                                   if "perf/tokens_per_second" in r),
            "final_ce": steps[-1]["loss/ce"], "eval_ce": evals[-1]["eval/ce"] if evals else float("nan")}


def study_spread(results: dict, arm: str) -> str:
    """What one seed can show, in the study's own numbers (``results``: its tier_a.json, or {})."""
    if not results:
        return ("One seed cannot tell a loss effect from seed-to-seed variation; the multi-seed study "
                "(python -m benchmarks.numeracy.run_study --tier a) measures both.")
    cells = results["cells"]
    ce_em, ce_mae = cells["exact_match"]["test"]["ce"], cells["mae"]["test"]["ce"]
    text = (f"What one seed can show: that both runs train and what their answers look like. What it cannot: "
            f"which loss is better. Across the study's {len(results['seeds'])} seeds (1-process runs; these are "
            f"TP=2, so not the same numbers), CE alone has test exact match {100 * ce_em['mean']:.1f}% ± "
            f"{100 * ce_em['std']:.1f} and MAE {ce_mae['mean']:.2f} ± {ce_mae['std']:.2f} (mean ± std over "
            f"seeds): a one-seed difference smaller than a few such stds says nothing.")
    for row in results["tests"]["exact_match"]:
        if row["arm"] == arm and row["column"] == "test":
            text += (f" The study's paired difference {ARM_LABELS[arm]} - CE in test exact match: "
                     f"{100 * row['mean_difference']:+.1f} pp (95% bootstrap interval {100 * row['ci95_low']:+.1f} to "
                     f"{100 * row['ci95_high']:+.1f}, {row['n']} seeds).")
    return text + " All its comparisons: benchmarks/numeracy/results/tier_a_summary.md."


def main(argv=None) -> None:
    args = parse_args(argv)  # before any heavy import: --help needs nothing installed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoTokenizer

    from smmd_numeracy import tier_a, train_numeric_tokenizer
    from smmd_train.dashboards import write_experiment
    from smmd_train.tables import markdown_table

    torch.set_num_threads(args.threads)  # the evaluation below, like the training processes
    settings = dict(tier_a.SETTINGS, **({"steps": args.steps} if args.steps else {}))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "tensorboard", ignore_errors=True)
    began = time.monotonic()

    started = stage("1/3 one-token arithmetic and a Llama-3-style tokenizer (0..999 are single tokens)")
    data = tier_a.build_data(work / "data", operand_range=settings["operand_range"],
                             held_out_share=settings["held_out_share"], oor_band=settings["oor_band"],
                             eval_per_split=settings["eval_per_split"], counting_share=settings["counting_share"],
                             seed=settings["data_seed"])
    with open(data["train"]) as handle:
        texts = [json.loads(line)["text"] for line in handle]
    train_numeric_tokenizer(texts, vocab_size=settings["vocab_size"]).save_pretrained(work / "tokenizer")
    data["tokenizer"] = str(work / "tokenizer")
    print(f"    {data['train_pairs']} training pairs (operands 0..{settings['operand_range'] - 1}); held out: "
          f"{data['test_pairs']} test pairs, {data['oor_pairs']} out-of-range pairs; "
          f"{len(AutoTokenizer.from_pretrained(work / 'tokenizer'))} tokens ({time.monotonic() - started:.0f} s)")

    from smmd_train.launcher import free_port

    results = study_results()
    if args.arm is None:
        args.arm = tier_a.best_arm(results) if results else FALLBACK_ARM
        print(f"    beside CE: {ARM_LABELS[args.arm]}, " + (
            "the study's best numeric loss (largest paired difference from CE in test exact match)" if results
            else "the study's results are not in this checkout"))
    try:
        flags = tier_a.arm_flags(args.arm, results.get("study", {}).get("ntl_mse_weight"))
    except ValueError as error:
        raise SystemExit(f"--arm {args.arm}: {error}; run the study first "
                         "(python -m benchmarks.numeracy.run_study --tier a)") from None
    plans = (("ce", "CE only", tier_a.ARMS["ce"]), (args.arm, ARM_LABELS[args.arm], flags))
    described = " and ".join(f"{label} ({' '.join(flags['numeric_loss'])})" for _, label, flags in plans)
    layout = f"ZeRO-3 + AutoTP TP={args.tp} on {args.gpus} processes"
    ports = []
    while len(ports) < len(plans):  # one rendezvous port per run, distinct even when they start together
        port = free_port()
        if port not in ports:
            ports.append(port)
    runs = {}
    if args.one_at_a_time:
        for (name, label, flags), port in zip(plans, ports):
            started = stage(f"2/3 {label} ({' '.join(flags['numeric_loss'])}), {settings['steps']} steps from "
                            f"scratch, seed {args.seed}, {layout}")
            run_side_by_side([start_train(args, settings, name, flags, data, port)], settings["steps"])
            runs[name] = (label, Path(args.work_dir) / name)
            print(f"    -> {runs[name][1]} ({time.monotonic() - started:.0f} s)")
    else:
        started = stage(f"2/3 {described}: {settings['steps']} steps each from scratch, seed {args.seed}, side by "
                        f"side, each {layout}")
        run_side_by_side([start_train(args, settings, name, flags, data, port)
                          for (name, _, flags), port in zip(plans, ports)], settings["steps"])
        for name, label, _ in plans:
            runs[name] = (label, Path(args.work_dir) / name)
        print(f"    -> {', '.join(str(output) for _, output in runs.values())} ({time.monotonic() - started:.0f} s)")

    started = stage("3/3 greedy answers on held-out problems")
    rows = []
    for label, output in runs.values():
        report = tier_a.evaluate_model(output / "hf", data["qa_eval"])["metrics"]
        (output / "tier_a_eval.json").write_text(json.dumps(report, indent=1))
        summary = training_summary(output)
        test, oor = report["test"], report["oor"]
        rows.append({"run": label, "test exact": test["exact_match"], "test MAE": test["mae"],
                     "test within 1": test["within_1"], "out-of-range exact": oor["exact_match"],
                     "out-of-range MAE": oor["mae"], "eval CE": summary["eval_ce"],
                     "tokens/s": summary["tokens_per_second"], "report": report})
    print(f"    ({time.monotonic() - started:.0f} s)")
    columns = [("run", "run", ""), ("test exact", "test exact match", ".1%"), ("test MAE", "test MAE", ".2f"),
               ("test within 1", "test within ±1", ".1%"), ("out-of-range exact", "out-of-range exact", ".1%"),
               ("out-of-range MAE", "out-of-range MAE", ".1f"), ("eval CE", "eval CE", ".3f"),
               ("tokens/s", "tokens/s", ".0f")]
    print(f"\n{report['test']['count']} held-out test problems (operand pairs never trained) and "
          f"{report['oor']['count']} out-of-range problems; greedy answers; tokens/s = training throughput on "
          f"{args.gpus} processes (the only column that varies between runs of the demo)\n")
    print(markdown_table(rows, columns))
    print("\n" + study_spread(results, args.arm))
    (work / "demo_results.json").write_text(json.dumps({"args": vars(args), "settings": settings, "rows": rows,
                                                        "seconds": time.monotonic() - began}, indent=1))
    print(f"\nper-split reports: {work}/*/tier_a_eval.json; everything: {work}/demo_results.json")
    write_experiment(str(work / "tensorboard"), differs=("numeric_weight", "model", "max_steps", "lr"))
    print(f"TensorBoard:  tensorboard --logdir {work / 'tensorboard'}")
    print(f"total {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
