"""Peak memory per rank with Ulysses sequence parallelism (``train.py --sp``), side by side.

At a long sequence one rank's peak is dominated by the activations kept for backward, which grow with
the tokens the rank holds; with ``--sp N`` each rank holds 1/N of every sequence (only the core
attention sees the whole sequence, for heads/N of the heads). For each SP degree this trains the
same model on the same data through launch/train.py and the deepspeed launcher (SP N on N processes,
one sequence-parallel group, so every run trains on the same global batch) twice: at ``--seq_len``
and at ``--short_seq_len``, whose peak is the fixed part (interpreter, libraries, model states,
buffers). A row gives the peak per rank (``summary/peak_memory_gib``: max over ranks of the peak
RSS on CPU, of max allocated on CUDA), the part above the fixed one, and both relative to SP 1.

    python -m benchmarks.bench_sp                           # CPU: tiny Llama, 8192 tokens, SP 1 and 2
    python -m benchmarks.bench_sp --seq_len 16384 --sp 1 2 4 --model 125m --device cuda
"""

import argparse
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.bench_train import prepare_data
from benchmarks.common import (
    REPO,  # noqa: E402
    results_dir_option,
    write_results,
)
from smmd_train.config.arguments import train_command
from smmd_train.monitor.metrics_file import read_metrics

COLUMNS = (("sp", "SP", ""), ("seq_len", "tokens / sequence", ""), ("peak_gib_per_rank", "peak GiB / rank", ".3f"),
           ("fixed_gib_per_rank", "fixed GiB / rank", ".3f"), ("above_fixed_gib", "above fixed GiB", ".3f"),
           ("peak_vs_sp1", "peak vs SP 1", ".2f"), ("above_fixed_vs_sp1", "above fixed vs SP 1", ".2f"),
           ("loss_step1", "step 1 loss/total", ".6f"))


@dataclass(frozen=True)
class SpOptions:
    model: str = option("--model", default="tiny")
    sp: tuple = option("--sp", type=int, nargs="+", default=(1, 2), help="SP degrees (one process per SP rank)")
    seq_len: int = option("--seq_len", type=int, default=8192)
    short_seq_len: int = option("--short_seq_len", type=int, default=256, help="the run whose peak is the fixed part")
    steps: int = option("--steps", type=int, default=2, help="optimizer steps per run (peak after the first)")
    fused_linear: bool = option("--fused_linear", action="store_true", default=False,
                                help="train through the fused linear head")
    device: str = option("--device", choices=["cpu", "cuda"], default="cpu")
    work_dir: str = option("--work_dir", default=str(REPO / "benchmarks" / "runs" / "bench_sp"))
    results_dir: Optional[str] = results_dir_option()


def parse_args(argv=None) -> SpOptions:
    return parse_options(SpOptions, argv, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)[0]


def run(args: SpOptions, work: Path, data, tokenizer_dir, sp_size: int, seq_len: int) -> dict:
    name = f"sp{sp_size}_seq{seq_len}"
    output = work / name
    shutil.rmtree(output, ignore_errors=True)
    command = train_command(processes=sp_size, deepspeed_config=REPO / "ds_configs" / "zero3.json", sp=sp_size,
                            model=args.model, tokenizer=tokenizer_dir, data=[data], seq_len=seq_len,
                            micro_batch_size=1, max_steps=args.steps, warmup_steps=1, output_dir=output,
                            cache_dir=work / "cache", fused_linear=args.fused_linear)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu")
    completed = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{name} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    records = read_metrics(output)
    summary = next(record for record in records if "summary/peak_memory_gib" in record)
    first = next(record for record in records if record["step"] == 1 and "loss/total" in record)
    return {"peak_gib": summary["summary/peak_memory_gib"], "loss_step1": first["loss/total"]}


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data, tokenizer_dir = prepare_data(work)
    rows = []
    for sp_size in args.sp:
        fixed = run(args, work, data, tokenizer_dir, sp_size, args.short_seq_len)["peak_gib"]
        long = run(args, work, data, tokenizer_dir, sp_size, args.seq_len)
        rows.append({"sp": sp_size, "seq_len": args.seq_len, "peak_gib_per_rank": round(long["peak_gib"], 3),
                     "fixed_gib_per_rank": round(fixed, 3), "above_fixed_gib": round(long["peak_gib"] - fixed, 3),
                     "loss_step1": round(long["loss_step1"], 6)})
        print(f"sp {sp_size}: peak {long['peak_gib']:.3f} GiB per rank at {args.seq_len} tokens, {fixed:.3f} GiB at "
              f"{args.short_seq_len}", flush=True)
    base = rows[0]
    for row in rows:
        row["peak_vs_sp1"] = round(row["peak_gib_per_rank"] / base["peak_gib_per_rank"], 3)
        row["above_fixed_vs_sp1"] = round(row["above_fixed_gib"] / base["above_fixed_gib"], 3)
    print(markdown_table(rows, COLUMNS))
    path = write_results(f"bench_sp_{args.device}", rows, args.results_dir, model=args.model,
                         short_seq_len=args.short_seq_len, steps=args.steps, fused_linear=args.fused_linear,
                         reference_sp=base["sp"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
