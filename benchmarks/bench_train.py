"""Training throughput with CE only vs CE + SMMD, side by side, and how it scales.

For each world size (1, 2, 4 processes) and parallelism (ZeRO-3; ZeRO-3 + AutoTP TP=2 with a
vocabulary-parallel head where the world allows), train the same model on the same data with the
same config through launch/train.py and the deepspeed launcher, with
  ce       the model's own loss, what users run today (``--framework_loss``: HF's
           ForCausalLMLoss, or DeepSpeed's VocabParallelCausalLMLoss under AutoTP);
  ce+smmd  smmd_scale's fused CE + SMMD (``--smmd_weight 1``).
Each pair runs ``--repeats`` times in alternating order; a run's throughput is the median
``perf/tokens_per_second`` over its steps after the first few (warm-up) and a row reports the
median over its repeats. Every run logs to one TensorBoard logdir, so the curves of all scales sit
together (the run's world/TP/DP sizes are logged as run/* scalars).

    python -m benchmarks.bench_train                         # CPU: tiny Llama, worlds 1 2 4
    python -m benchmarks.bench_train --model 125m --device cuda --worlds 1 2 4 8 --steps 60
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_results
from smmd_train.arguments import REPO, train_command
from smmd_train.tensorboard import write_experiment

WARMUP_STEPS = 3


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--work_dir", default=str(REPO / "benchmarks" / "runs" / "bench_train"))
    parser.add_argument("--repeats", type=int, default=2, help="runs per (setting, loss), alternating")
    parser.add_argument("--quick", action="store_true", help="worlds 1 2, few steps, one repeat: a smoke run")
    parser.add_argument("--results_dir", help="where the JSON goes (default benchmarks/results)")
    return parser.parse_args()


def prepare_data(work: Path) -> tuple:
    import smmd_numeracy as numeracy

    corpus = numeracy.build_corpus(work / "data", train_per_task=3000, test_per_task=10, seed=0)
    with open(corpus["train"]) as handle:
        tokenizer = numeracy.train_numeric_tokenizer([json.loads(line)["text"] for line in handle])
    tokenizer.save_pretrained(work / "tokenizer")
    return corpus["train"], work / "tokenizer"


def run(args, work: Path, data, tokenizer_dir, world: int, tp_size: int, loss: str, repeat: int) -> dict:
    name = f"{'zero3_autotp' if tp_size > 1 else 'zero3'}_world{world}_{loss}_run{repeat}"
    output = work / name
    shutil.rmtree(output, ignore_errors=True)
    command = train_command(processes=world, deepspeed_config=REPO / "ds_configs" / "zero3.json", tp=tp_size,
                            model=args.model, tokenizer=tokenizer_dir, data=[data], seq_len=args.seq_len,
                            micro_batch_size=args.micro_batch_size, max_steps=args.steps, warmup_steps=5,
                            output_dir=output, cache_dir=work / "cache", tensorboard_dir=work / "tensorboard" / name,
                            smmd_weight=1.0 if loss == "ce+smmd" else None, framework_loss=loss == "ce")
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu")
    began = time.monotonic()
    completed = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{name} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_second" in r and r["step"] > WARMUP_STEPS]
    rates = [r["perf/tokens_per_second"] for r in steps]
    return {"tokens_per_second": statistics.median(rates), "loss_bytes_per_step": steps[-1]["comm/loss_bytes"],
            "wall_seconds": time.monotonic() - began}


def main():
    args = parse_args()
    if args.quick:
        args.worlds, args.steps, args.repeats = [1, 2], 10, 1
    work = Path(args.work_dir)
    shutil.rmtree(work / "tensorboard", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    data, tokenizer_dir = prepare_data(work)
    rows = []
    for world in args.worlds:
        for tp_size in (1, 2):
            if tp_size > 1 and (world < tp_size or world % tp_size):
                continue
            runs = {"ce": [], "ce+smmd": []}
            for repeat in range(args.repeats):  # alternate the order so drift hits both alike
                order = ("ce", "ce+smmd") if repeat % 2 == 0 else ("ce+smmd", "ce")
                for loss in order:
                    runs[loss].append(run(args, work, data, tokenizer_dir, world, tp_size, loss, repeat))
            for loss, measured in runs.items():
                rates = [m["tokens_per_second"] for m in measured]
                rows.append({"run": f"{'zero3_autotp' if tp_size > 1 else 'zero3'}_world{world}", "world": world,
                             "tp": tp_size, "dp": world // tp_size, "loss": loss,
                             "tokens_per_second": statistics.median(rates),
                             "tokens_per_second_per_device": statistics.median(rates) / world,
                             "repeats_tokens_per_second": rates,
                             "spread": (max(rates) - min(rates)) / statistics.median(rates),
                             "loss_bytes_per_step": measured[-1]["loss_bytes_per_step"]})
                print(f"{rows[-1]['run']} {loss}: {rows[-1]['tokens_per_second']:.0f} tokens/s {rates}", flush=True)
    by_key = {(r["world"], r["tp"], r["loss"]): r for r in rows}
    for row in rows:
        ce = by_key[(row["world"], row["tp"], "ce")]["tokens_per_second"]
        row["throughput_vs_ce"] = row["tokens_per_second"] / ce
        single = by_key.get((1, 1, row["loss"]))
        if single:  # tokens/s per device relative to one process of the same loss
            row["scaling_efficiency"] = row["tokens_per_second"] / (row["world"] * single["tokens_per_second"])
    columns = [("run", "run", "s"), ("world", "world", "d"), ("tp", "TP", "d"), ("dp", "DP", "d"),
               ("loss", "loss", "s"), ("tokens_per_second", "tokens/s", ".0f"),
               ("tokens_per_second_per_device", "tokens/s/device", ".0f"), ("throughput_vs_ce", "vs CE", ".3f"),
               ("scaling_efficiency", "scaling eff.", ".2f"), ("loss_bytes_per_step", "loss bytes/step", ",.0f"),
               ("spread", "spread over repeats", ".0%")]
    print(markdown_table(rows, columns))
    smmd_rows = [r for r in rows if r["loss"] == "ce+smmd"]
    worst = min(r["throughput_vs_ce"] for r in smmd_rows)
    print(f"target: throughput with SMMD >= 0.97x CE only; worst measured {worst:.3f} "
          f"({'pass' if worst >= 0.97 else 'fail'})")
    write_experiment(str(work / "tensorboard"))
    print(f"TensorBoard (all scales together): tensorboard --logdir {work / 'tensorboard'}")
    print("wrote", write_results("bench_train" + ("_quick" if args.quick else ""), rows, results_dir=args.results_dir,
                                 model=args.model,
                                 steps=args.steps, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                                 repeats=args.repeats,
                                 device=args.device, target={"smmd_throughput_vs_ce_min": worst,
                                                             "pass": worst >= 0.97}))


if __name__ == "__main__":
    main()
