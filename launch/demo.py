"""The self-contained CPU demo: continued pretraining with SMMD vs CE, end to end, nothing downloaded.

    bash launch/demo.sh                 # sets up .venv, then runs this with the defaults (~4.5 min, 2 cores)
    python launch/demo.py --help        # knobs to scale it up on a GPU box

1. a numeric corpus generated with `datasets` (arithmetic with results up to 999, clock reading,
   unit conversions, counting, word problems, mixed with plain text) and held-out problems whose
   operands never occur in training;
2. a Llama-3-style BPE tokenizer trained on it (numbers split into groups of up to 3 digits, so
   0..999 are single tokens);
3. a tiny Llama pretrained briefly with CE;
4. two continued-pretraining runs from that same checkpoint, same data order: CE only, and
   CE + SMMD (the paper's defaults) — each ZeRO-3 + AutoTP (TP=2, vocabulary-parallel head)
   through the deepspeed launcher, logging to TensorBoard;
5. numeric evaluation of both on the held-out problems and a side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from smmd_train.arguments import REPO, train_command
from smmd_train.dashboards import write_experiment
from smmd_train.metrics_file import METRICS_FILE, read_metrics
from smmd_train.tables import markdown_table

TABLE_COLUMNS = [("run", "run", ""), ("exact match", "exact match", ".1%"), ("MAE", "MAE", ".1f"),
                 ("unparseable", "unparseable", ".1%"), ("numeric-token acc.", "numeric-token acc.", ".1%"),
                 ("numeric-token MAE", "numeric-token MAE", ".1f"), ("eval CE", "eval CE", ".3f"),
                 ("tokens/s", "tokens/s", ".0f")]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", default=str(REPO / "demo_runs"), help="everything the demo writes")
    parser.add_argument("--model", default="tiny", help="preset to pretrain (tiny on CPU; e.g. 125m on a GPU)")
    parser.add_argument("--train_per_task", type=int, default=4000, help="training problems per task")
    parser.add_argument("--test_per_task", type=int, default=60, help="held-out problems per task")
    parser.add_argument("--pretrain_steps", type=int, default=300)
    parser.add_argument("--continue_steps", type=int, default=200)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--continue_lr", type=float, default=1e-3)
    parser.add_argument("--smmd_weight", type=float, default=1.0)
    parser.add_argument("--gpus", type=int, default=2, help="processes for the deepspeed launcher")
    parser.add_argument("--tp", type=int, default=2, help="AutoTP degree of every training run")
    parser.add_argument("--deepspeed_config", default=str(REPO / "ds_configs" / "zero3.json"))
    parser.add_argument("--fused_linear", action="store_true", help="train every run with train.py --fused_linear "
                        "(CE + SMMD from the LM head's input, no logits)")
    parser.add_argument("--vocab_size", type=int, default=2048, help="tokenizer size")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def stage(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.monotonic()


def launch_train(args, name: str, model: str, steps: int, lr: float, smmd_weight: float, data: dict,
                 tokenizer_dir: Path, export_dir: Path) -> Path:
    """One train.py run under the deepspeed launcher; returns its output dir."""
    output_dir = Path(args.work_dir) / name
    shutil.rmtree(output_dir, ignore_errors=True)
    command = train_command(processes=args.gpus, deepspeed_config=args.deepspeed_config, tp=args.tp, model=model,
                            tokenizer=tokenizer_dir if model == args.model else None, data=[data["train"]],
                            eval_data=[data["eval"]], eval_batches=8, seq_len=args.seq_len,
                            micro_batch_size=args.micro_batch_size, max_steps=steps, lr=lr,
                            warmup_steps=max(steps // 10, 1), seed=args.seed, output_dir=output_dir,
                            tensorboard_dir=Path(args.work_dir) / "tensorboard" / name,
                            numeric_loss=[f"smmd:{smmd_weight:g}"], export_hf=export_dir,
                            fused_linear=args.fused_linear)
    log = output_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
        returncode = follow_progress(process, output_dir / METRICS_FILE, steps, name)
    if returncode != 0:
        raise SystemExit(f"{name} failed (exit {returncode}); see {log}:\n" +
                         "".join(log.read_text().splitlines(keepends=True)[-30:]))
    return output_dir


def follow_progress(process: subprocess.Popen, metrics_path: Path, steps: int, name: str) -> int:
    """A progress bar on the terminal for a run whose own output goes to its log file: the steps
    rank 0 has written to metrics.jsonl, with the last loss and tokens/s. Returns the exit code."""
    from tqdm import tqdm

    done, position = 0, 0
    with tqdm(total=steps, desc=f"    {name}", unit="step", dynamic_ncols=True, leave=False) as bar:
        while True:
            finished = process.poll() is not None
            if metrics_path.is_file():
                with open(metrics_path) as handle:
                    handle.seek(position)
                    for line in handle.readlines():
                        if not line.endswith("\n"):  # a record still being written: read it next time
                            break
                        position += len(line)
                        record = json.loads(line)
                        if "loss/total" in record and record["step"] > done:
                            bar.update(record["step"] - done)
                            done = record["step"]
                            postfix = {"loss": f"{record['loss/total']:.3f}"}
                            if "perf/tokens_per_second" in record:
                                postfix["tok/s"] = f"{record['perf/tokens_per_second']:.0f}"
                            bar.set_postfix(postfix)
            if finished:
                return process.returncode
            time.sleep(0.5)


def training_summary(output_dir: Path) -> dict:
    records = read_metrics(output_dir)
    steps = [r for r in records if "loss/total" in r]
    evals = [r for r in records if "eval/ce" in r]
    return {"tokens_per_second": statistics.median(r["perf/tokens_per_second"] for r in steps
                                                   if "perf/tokens_per_second" in r),
            "final_ce": steps[-1]["loss/ce"], "eval_ce": evals[-1]["eval/ce"] if evals else float("nan"),
            "eval_numeric_accuracy": evals[-1]["eval/numeric_accuracy"] if evals else float("nan")}


def score_answers(model_dir: Path, qa_path: str) -> dict:
    """Greedy answers and teacher-forced numeric-token metrics of an exported model on held-out problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smmd_numeracy import evaluate_qa, load_qa

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    report = evaluate_qa(model, AutoTokenizer.from_pretrained(model_dir), load_qa(qa_path))
    (model_dir / "numeric_eval.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import smmd_numeracy as numeracy

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "tensorboard", ignore_errors=True)
    began = time.monotonic()

    started = stage("1/5 numeric corpus (datasets)")
    corpus = numeracy.build_corpus(work / "data", train_per_task=args.train_per_task,
                                   test_per_task=args.test_per_task, seed=args.seed)
    data = {key: str(corpus[key]) for key in ("train", "eval", "qa_test")}
    print(f"    {corpus['train_problems']} training problems in {corpus['train_documents']} documents "
          f"({corpus['plain_text_documents']} plain text), {corpus['test_problems']} held-out problems "
          f"({time.monotonic() - started:.0f} s)")

    started = stage("2/5 Llama-3-style tokenizer (numbers 0..999 are single tokens)")
    with open(data["train"]) as handle:
        texts = [json.loads(line)["text"] for line in handle]
    tokenizer = numeracy.train_numeric_tokenizer(texts, vocab_size=args.vocab_size)
    tokenizer_dir = work / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    print(f"    {len(tokenizer)} tokens ({time.monotonic() - started:.0f} s)")

    started = stage(f"3/5 pretrain a {args.model} Llama with CE ({args.pretrain_steps} steps)")
    pretrained = work / "pretrained"
    launch_train(args, "pretrain", args.model, args.pretrain_steps, args.lr, 0.0, data, tokenizer_dir, pretrained)
    print(f"    -> {pretrained} ({time.monotonic() - started:.0f} s)")

    runs = {}
    for index, (name, weight) in enumerate((("ce", 0.0), ("smmd", args.smmd_weight))):
        label = "CE only" if weight == 0 else f"CE + {weight:g} x SMMD (paper defaults)"
        started = stage(f"4/5 ({index + 1}/2) continue pretraining: {label}, {args.continue_steps} steps, "
                        f"ZeRO-3 + AutoTP on {args.gpus} processes")
        output = launch_train(args, name, str(pretrained), args.continue_steps, args.continue_lr, weight, data,
                              tokenizer_dir, work / name / "hf")
        runs[name] = (label, output)
        print(f"    -> {output} ({time.monotonic() - started:.0f} s)")

    started = stage("5/5 numeric evaluation on held-out problems (greedy generation + teacher forcing)")
    rows = []
    for label, output in runs.values():
        report, summary = score_answers(output / "hf", data["qa_test"]), training_summary(output)
        rows.append({"run": label, "exact match": report["exact_match"], "MAE": report["mae"],
                     "unparseable": report["unparseable"],
                     "numeric-token acc.": report["numeric_token_accuracy"],
                     "numeric-token MAE": report["numeric_token_mae"], "eval CE": summary["eval_ce"],
                     "tokens/s": summary["tokens_per_second"], "report": report})
    print(f"    ({time.monotonic() - started:.0f} s)")

    print(f"\n{report['count']} held-out problems, operands never seen in training; "
          f"tokens/s = training throughput on {args.gpus} processes\n")
    print(markdown_table(rows, TABLE_COLUMNS))  # a metric over nothing (MAE when no answer parses) prints -
    (work / "demo_results.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                        "seconds": time.monotonic() - began}, indent=1))
    print(f"\nper-task reports: {work}/*/hf/numeric_eval.json; everything: {work}/demo_results.json")
    # The HParams dashboard's columns for the three runs: what differs between them first.
    write_experiment(str(work / "tensorboard"), differs=("numeric_weight", "model", "max_steps", "lr"))
    print(f"TensorBoard:  tensorboard --logdir {work / 'tensorboard'}")
    print(f"total {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
