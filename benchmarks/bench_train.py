"""Training throughput and peak memory with CE only, CE + SMMD and CE + SMMD through the fused
linear head, side by side, how it scales, and the largest micro-batch that fits a memory budget.

For each world size (1, 2, 4 processes) and parallelism (ZeRO-3; ZeRO-3 + AutoTP TP=2 with a
vocabulary-parallel head where the world allows), train the same model on the same data with the
same config through launch/train.py and the deepspeed launcher, with
  ce             the model's own loss, what users run today (``--framework_loss``: HF's
                 ForCausalLMLoss, or DeepSpeed's VocabParallelCausalLMLoss under AutoTP);
  ce+smmd        smmd_scale's fused CE + SMMD on the head's logits (``--numeric_loss smmd:1``);
  ce+smmd fused  the same loss from the head's input, no logits (``--fused_linear``).
Each set runs ``--repeats`` times in rotating order; a run's throughput is the median
``perf/tokens_per_second`` over its steps after the first few (warm-up), its peak memory the
run's ``summary/peak_memory_gib`` (max over ranks: peak RSS on CPU, max allocated on CUDA), and a
row reports medians over its repeats. ``--vocab_size V`` trains a copy of the preset with a
V-token head (the tokenizer stays small), which is where the logits' memory shows.
``--budget_gib B`` then also runs a short job per micro-batch size in ``--budget_micro_batches``
(world 1) with and without ``--fused_linear`` and reports the largest that stays under B.
Every run logs to one TensorBoard logdir.

    python -m benchmarks.bench_train                         # CPU: tiny Llama, worlds 1 2 4
    python -m benchmarks.bench_train --vocab_size 32000 --worlds 1 2 --budget_gib 2.5
    python -m benchmarks.bench_train --model 125m --device cuda --worlds 1 2 4 8 --steps 60
"""

import argparse
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.common import (
    REPO,  # noqa: E402
    results_dir_option,
    write_results,
)
from smmd_train.config.arguments import train_command
from smmd_train.monitor.dashboards import write_experiment
from smmd_train.monitor.metrics_file import read_metrics

WARMUP_STEPS = 3
LOSSES = {"ce": dict(framework_loss=True), "ce+smmd": dict(numeric_loss=["smmd:1"]),
          "ce+smmd fused": dict(numeric_loss=["smmd:1"], fused_linear=True)}


@dataclass(frozen=True)
class TrainOptions:
    model: str = option("--model", default="tiny")
    worlds: tuple = option("--worlds", type=int, nargs="+", default=(1, 2, 4))
    steps: int = option("--steps", type=int, default=30)
    seq_len: int = option("--seq_len", type=int, default=128)
    micro_batch_size: int = option("--micro_batch_size", type=int, default=8)
    device: str = option("--device", choices=["cpu", "cuda"], default="cpu")
    work_dir: str = option("--work_dir", default=str(REPO / "benchmarks" / "runs" / "bench_train"))
    repeats: int = option("--repeats", type=int, default=2, help="runs per (setting, loss), alternating")
    quick: bool = option("--quick", action="store_true", default=False,
                         help="worlds 1 2, few steps, one repeat: a smoke run")
    results_dir: Optional[str] = results_dir_option()
    losses: tuple = option("--losses", nargs="+", default=tuple(LOSSES), choices=list(LOSSES))
    vocab_size: Optional[int] = option("--vocab_size", type=int, default=None,
                                       help="train the preset with a head of this many tokens")
    budget_gib: Optional[float] = option("--budget_gib", type=float, default=None,
                                         help="also find the largest micro-batch under this peak memory")
    budget_micro_batches: tuple = option("--budget_micro_batches", type=int, nargs="+", default=(8, 16, 32, 64, 128))


def parse_args() -> TrainOptions:
    """The options; ``--quick`` sets worlds 1 2, 10 steps and one repeat."""
    options, _ = parse_options(TrainOptions, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return replace(options, worlds=(1, 2), steps=10, repeats=1) if options.quick else options


def prepare_data(work: Path) -> tuple:
    """The training text and tokenizer: Tier A's arithmetic and its Llama-3-style tokenizer (0..999 one
    token each; ``smmd_numeracy.tier_a.data_and_tokenizer``)."""
    from smmd_numeracy import tier_a

    data = tier_a.data_and_tokenizer(work)
    return data["train"], Path(data["tokenizer"])


def model_with_vocabulary(args: TrainOptions, work: Path, tokenizer_dir: Path) -> str:
    """The preset, or (``--vocab_size``) a fresh copy of it with a ``--vocab_size``-token head saved
    as a Hugging Face dir (the tokenizer's tokens are its first rows)."""
    if not args.vocab_size:
        return args.model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smmd_train.model.presets import preset_config

    directory = work / f"{args.model}_vocab{args.vocab_size}"
    if not (directory / "config.json").is_file():
        AutoModelForCausalLM.from_config(preset_config(args.model, args.vocab_size,
                                                       max_position_embeddings=max(args.seq_len, 128))
                                         ).save_pretrained(directory)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return str(directory)


def run(args: TrainOptions, work: Path, data, tokenizer_dir, world: int, tp_size: int, loss: str, repeat: int, *,
        model=None, micro_batch_size=None, steps=None) -> dict:
    micro_batch_size, steps = micro_batch_size or args.micro_batch_size, steps or args.steps
    name = (f"{'zero3_autotp' if tp_size > 1 else 'zero3'}_world{world}_mb{micro_batch_size}_"
            f"{loss.replace(' ', '_')}_run{repeat}")
    output = work / name
    shutil.rmtree(output, ignore_errors=True)
    command = train_command(processes=world, deepspeed_config=REPO / "ds_configs" / "zero3.json", tp=tp_size,
                            model=model or args.model, tokenizer=tokenizer_dir, data=[data], seq_len=args.seq_len,
                            micro_batch_size=micro_batch_size, max_steps=steps, warmup_steps=5,
                            output_dir=output, cache_dir=work / "cache", tensorboard_dir=work / "tensorboard" / name,
                            **LOSSES[loss])
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu")
    began = time.monotonic()
    completed = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{name} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    records = read_metrics(output)
    steps = [r for r in records if "perf/tokens_per_second" in r and r["step"] > WARMUP_STEPS]
    rates = [r["perf/tokens_per_second"] for r in steps]
    summary = next(r for r in records if "summary/peak_memory_gib" in r)
    return {"tokens_per_second": statistics.median(rates), "loss_bytes_per_step": steps[-1]["comm/loss_bytes"],
            "peak_memory_gib": summary["summary/peak_memory_gib"], "wall_seconds": time.monotonic() - began}


def largest_micro_batch(args: TrainOptions, work: Path, data, tokenizer_dir, model) -> list:
    """Per loss (materialized, fused): the peak memory of a short world-1 run at each micro-batch
    size, and the largest size under ``--budget_gib``."""
    rows = []
    for loss in ("ce+smmd", "ce+smmd fused"):
        peaks = {}
        for micro_batch_size in args.budget_micro_batches:
            peaks[micro_batch_size] = run(args, work, data, tokenizer_dir, 1, 1, loss, 0, model=model,
                                          micro_batch_size=micro_batch_size, steps=WARMUP_STEPS + 2)["peak_memory_gib"]
            print(f"budget: {loss} micro-batch {micro_batch_size}: peak {peaks[micro_batch_size]:.2f} GiB", flush=True)
            if peaks[micro_batch_size] > args.budget_gib:
                break
        fitting = [size for size, peak in peaks.items() if peak <= args.budget_gib]
        rows.append({"loss": loss, "budget_gib": args.budget_gib, "peak_gib_by_micro_batch": peaks,
                     "largest_micro_batch": max(fitting) if fitting else None,
                     "largest_tokens": max(fitting) * args.seq_len if fitting else None})
    return rows


def main():
    args = parse_args()
    work = Path(args.work_dir)
    shutil.rmtree(work / "tensorboard", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    data, tokenizer_dir = prepare_data(work)
    model = model_with_vocabulary(args, work, tokenizer_dir)
    rows = []
    for world in args.worlds:
        for tp_size in (1, 2):
            if tp_size > 1 and (world < tp_size or world % tp_size):
                continue
            runs = {loss: [] for loss in args.losses}
            for repeat in range(args.repeats):  # rotate the order so drift hits every loss alike
                order = args.losses[repeat % len(args.losses):] + args.losses[:repeat % len(args.losses)]
                for loss in order:
                    runs[loss].append(run(args, work, data, tokenizer_dir, world, tp_size, loss, repeat,
                                          model=model))
            for loss, measured in runs.items():
                rates = [m["tokens_per_second"] for m in measured]
                rows.append({"run": f"{'zero3_autotp' if tp_size > 1 else 'zero3'}_world{world}", "world": world,
                             "tp": tp_size, "dp": world // tp_size, "loss": loss,
                             "tokens_per_second": statistics.median(rates),
                             "tokens_per_second_per_rank": statistics.median(rates) / world,
                             "repeats_tokens_per_second": rates,
                             "spread": (max(rates) - min(rates)) / statistics.median(rates),
                             "loss_bytes_per_step": measured[-1]["loss_bytes_per_step"],
                             "peak_memory_gib": statistics.median(m["peak_memory_gib"] for m in measured)})
                print(f"{rows[-1]['run']} {loss}: {rows[-1]['tokens_per_second']:.0f} tokens/s {rates}", flush=True)
    by_key = {(r["world"], r["tp"], r["loss"]): r for r in rows}
    for row in rows:
        if (row["world"], row["tp"], "ce") in by_key:
            ce = by_key[(row["world"], row["tp"], "ce")]
            row["throughput_vs_ce"] = row["tokens_per_second"] / ce["tokens_per_second"]
            row["peak_vs_ce"] = row["peak_memory_gib"] / ce["peak_memory_gib"]
        single = by_key.get((1, 1, row["loss"]))
        if single:  # tokens/s per device relative to one process of the same loss
            row["scaling_efficiency"] = row["tokens_per_second"] / (row["world"] * single["tokens_per_second"])
    columns = [("run", "run", "s"), ("world", "world", "d"), ("tp", "TP", "d"), ("dp", "DP", "d"),
               ("loss", "loss", "s"), ("tokens_per_second", "tokens/s", ".0f"),
               ("tokens_per_second_per_rank", "tokens/s/rank", ".0f"), ("throughput_vs_ce", "vs CE", ".3f"),
               ("scaling_efficiency", "scaling eff.", ".2f"), ("peak_memory_gib", "peak GiB/rank", ".2f"),
               ("peak_vs_ce", "peak vs CE", ".2f"), ("loss_bytes_per_step", "loss bytes/step", ",.0f"),
               ("spread", "spread over repeats", ".0%")]
    print(markdown_table(rows, columns))
    smmd_rows = [r for r in rows if r["loss"] == "ce+smmd" and "throughput_vs_ce" in r]
    worst = min((r["throughput_vs_ce"] for r in smmd_rows), default=None)
    if worst is not None:
        print(f"target: throughput with SMMD >= 0.97x CE only; worst measured {worst:.3f} "
              f"({'pass' if worst >= 0.97 else 'fail'})")
    budget = largest_micro_batch(args, work, data, tokenizer_dir, model) if args.budget_gib else []
    for row in budget:
        print(f"largest micro-batch under {row['budget_gib']} GiB with {row['loss']}: {row['largest_micro_batch']} "
              f"sequences ({row['largest_tokens']} tokens); peaks {row['peak_gib_by_micro_batch']}")
    write_experiment(str(work / "tensorboard"))
    print(f"TensorBoard (all scales together): tensorboard --logdir {work / 'tensorboard'}")
    print("wrote", write_results("bench_train" + ("_quick" if args.quick else ""), rows, results_dir=args.results_dir,
                                 model=args.model, vocab_size=args.vocab_size, budget=budget,
                                 steps=args.steps, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                                 repeats=args.repeats,
                                 device=args.device, target={"smmd_throughput_vs_ce_min": worst,
                                                             "pass": worst is not None and worst >= 0.97}))


if __name__ == "__main__":
    main()
