"""One global batch, several layouts: does train.py train the same objective?

Trains the tiny preset for a few steps with launch/train.py on a corpus where one document in five
carries numbers (so micro-batches hold very different numbers of numeric targets), with the same
global batch of 4 sequences split six ways: one rank with micro-batch 4 or 1 x accumulation 4, two
data-parallel ranks with micro-batch 2 or 1 x accumulation 2 (also through the fused linear head),
and ZeRO-3 + AutoTP TP=2. Prints each layout's per-step loss/total, loss/ce and loss/numeric, the
largest relative difference from the first layout over all steps, and the share of step time the
step's count all-reduce took (``perf/count_seconds / perf/step_seconds``, median, same runs).

    python -m benchmarks.bench_layouts                # the table, and results/bench_layouts.json
"""

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.common import REPO, write_results
from smmd_train.config.arguments import train_flags
from smmd_train.distributed.launcher import launch_command
from smmd_train.monitor.metrics_file import read_metrics

STEPS, SEQ_LEN, GLOBAL_BATCH = 4, 32, 4
LAYOUTS = {  # name: (processes, micro-batch, accumulation, extra train.py options)
    "1 rank, micro-batch 4": (1, 4, 1, {}),
    "1 rank, micro-batch 1 x accumulation 4": (1, 1, 4, {}),
    "DP=2, micro-batch 2": (2, 2, 1, {}),
    "DP=2, micro-batch 1 x accumulation 2": (2, 1, 2, {}),
    "DP=2, micro-batch 1 x accumulation 2, fused linear": (2, 1, 2, {"fused_linear": True}),
    "ZeRO-3 + AutoTP TP=2, micro-batch 4": (2, 4, 1, {"tp": 2}),
}
NUMERIC_LOSS = ["smmd:1", "ntl-was:0.3"]


def write_corpus(root: Path) -> Path:
    """400 documents, every fifth an addition, and a Llama-3-style tokenizer trained on them (0..999
    are single tokens)."""
    from smmd_numeracy.tokenizer import train_numeric_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    generator = random.Random(5)
    words = "the of boxes a river stone counted we little green under over".split()
    texts = []
    for line in range(400):
        if line % 5 == 0:
            a, b = generator.randint(0, 499), generator.randint(0, 499)
            texts.append(f"Q: {a} + {b} = ? A: {a + b}.")
        else:
            texts.append(" ".join(generator.choice(words) for _ in range(generator.randint(8, 30))) + ".")
    (root / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    train_numeric_tokenizer(texts).save_pretrained(root / "tokenizer")
    return root


def layout_command(corpus: Path, output: Path, processes: int, micro_batch_size: int, accumulation: int,
                   options: dict) -> list:
    flags = train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny",
                        tokenizer=corpus / "tokenizer", data=[corpus / "train.jsonl"], seq_len=SEQ_LEN,
                        micro_batch_size=micro_batch_size, gradient_accumulation_steps=accumulation,
                        max_steps=STEPS, warmup_steps=1, lr=3e-3, output_dir=output, numeric_loss=NUMERIC_LOSS,
                        ntl_squash_factor=9.0, **options)
    return launch_command(REPO / "launch" / "train.py", *flags, processes=processes)


def steps_of(output: Path) -> dict:
    """step -> that step's metrics (the training steps of a finished run)."""
    return {record["step"]: record for record in read_metrics(output) if "loss/total" in record}


def table_rows(logged: dict) -> list:
    reference = logged[next(iter(logged))]
    rows = []
    for name, steps in logged.items():
        difference = max(abs(steps[step]["loss/total"] - reference[step]["loss/total"]) / abs(reference[step]
                                                                                              ["loss/total"])
                         for step in reference)
        shares = [steps[step]["perf/count_seconds"] / steps[step]["perf/step_seconds"] for step in steps
                  if "perf/count_seconds" in steps[step]]
        rows.append({"layout": name, "step1_total": steps[1]["loss/total"], "step1_ce": steps[1]["loss/ce"],
                     "step1_numeric": steps[1]["loss/numeric"], "step1_positions": steps[1]["numeric/positions"],
                     f"step{STEPS}_total": steps[STEPS]["loss/total"], "max_relative_difference": difference,
                     "count_share_of_step": statistics.median(shares) if shares else None})
    return rows


@dataclass(frozen=True)
class LayoutsOptions:
    work_dir: str = option("--work_dir", default="benchmarks/runs/layouts")


def main():
    import subprocess

    args, _ = parse_options(LayoutsOptions, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    work = Path(args.work_dir)
    corpus = write_corpus(work / "corpus")
    logged = {}
    for index, (name, layout) in enumerate(LAYOUTS.items()):
        output = work / f"run{index}"
        subprocess.run(layout_command(corpus, output, *layout), check=True, capture_output=True, cwd=REPO)
        logged[name] = steps_of(output)
        print(f"{name}: done", flush=True)
    rows = table_rows(logged)
    print(markdown_table(rows, [("layout", "layout", "s"), ("step1_total", "step 1 loss/total", ".4f"),
                                ("step1_ce", "step 1 loss/ce", ".4f"), ("step1_numeric", "step 1 loss/numeric", ".4f"),
                                ("step1_positions", "step 1 numeric positions", ".0f"),
                                (f"step{STEPS}_total", f"step {STEPS} loss/total", ".4f"),
                                ("max_relative_difference", "max rel. difference", ".1e"),
                                ("count_share_of_step", "count all-reduce / step", ".2%")]))
    path = write_results("bench_layouts", rows, steps=STEPS, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                         numeric_loss=NUMERIC_LOSS)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
