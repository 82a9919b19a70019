"""The command line of ``launch/evaluate.py``: numeric evaluation of a Hugging Face causal-LM
checkpoint on JSONL lines of {"prompt", "answer"} or {"prompt", "completion"} (train.py's
fine-tuning format: the --eval_data file of a fine-tuning run evaluates as it is).

    python launch/evaluate.py MODEL_DIR --data qa.jsonl [--limit 200] [--output report.json]

Greedy generation and teacher-forced numeric-token metrics (``smmd_numeracy.evaluation``, which
defines them): prints a table (all items, then each "task") and writes the JSON report returned by
``evaluate_qa``, by default to MODEL_DIR/numeric_eval.json. Runs on CUDA when available (float32, or
--dtype bfloat16), else on CPU in float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from smmd_train.distributed.process_end import skip_final_collections

from .evaluation import evaluate_qa, load_qa

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_COLUMNS = (("task", "task", ""), ("count", "count", ""), ("exact_match", "exact_match", ".4f"), ("mae", "mae", ".4f"),
            ("relative_error", "rel_error", ".4f"), ("unparseable", "unparseable", ".4f"),
            ("numeric_accuracy", "num_acc", ".4f"), ("numeric_accuracy_full_vocab", "num_acc_full_vocab", ".4f"),
            ("numeric_token_mae", "num_tok_mae", ".4f"), ("numeric_tokens", "num_tokens", ""))


@dataclass(frozen=True, kw_only=True)
class EvaluateOptions:
    model_dir: str = option(help="a local HF model dir (config.json and weights, e.g. from export_hf.py)")
    data: str = option("--data", required=True, help='JSONL of {"prompt", "answer"} or {"prompt", "completion"} '
                       '(train.py\'s fine-tuning format; the completion is the answer, like " 42"), each with an '
                       'optional "task"')
    tokenizer: Optional[str] = option("--tokenizer", help="tokenizer dir (default: the model dir)")
    batch_size: int = option("--batch_size", type=int, default=32)
    max_new_tokens: int = option("--max_new_tokens", type=int, default=8)
    limit: Optional[int] = option("--limit", type=int, help="evaluate only the first N items")
    output: Optional[str] = option("--output", help="report path (default MODEL_DIR/numeric_eval.json)")
    dtype: str = option("--dtype", choices=list(_DTYPES), default="float32", help="bfloat16 needs CUDA")
    trust_remote_code: bool = option("--trust_remote_code", action="store_true",
                                     help="allow model/tokenizer code shipped inside the model dir to run (off by "
                                     "default)")


def parse_args(argv=None) -> EvaluateOptions:
    args, parser = parse_options(EvaluateOptions, argv, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"{args.model_dir} is not a Hugging Face model dir (no config.json there)")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer {args.tokenizer} is not a directory")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data} does not exist")
    for name in ("batch_size", "max_new_tokens", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1; got {value}")
    if args.dtype != "float32" and not torch.cuda.is_available():
        parser.error(f"--dtype {args.dtype} needs a CUDA device; on CPU the evaluation runs in float32")
    return args


def load_model_and_tokenizer(args: EvaluateOptions) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=_DTYPES[args.dtype],
                                                 trust_remote_code=args.trust_remote_code).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model_dir,
                                              trust_remote_code=args.trust_remote_code)
    return model, tokenizer


def format_table(report: dict) -> str:
    """One row for all items, then one per task; ``-`` where a mean is undefined."""
    rows = [{**report, "task": "all"}] + [{**metrics, "task": task} for task, metrics in report["per_task"].items()]
    return markdown_table(rows, _COLUMNS)


def main(argv=None) -> dict:
    """evaluate.py: writes the report's JSON, prints the table and returns the report."""
    args = parse_args(argv)
    try:
        qa = load_qa(args.data)
    except ValueError as error:
        sys.exit(f"evaluate.py: {error}")
    if args.limit is not None:
        qa = qa[:args.limit]
    model, tokenizer = load_model_and_tokenizer(args)
    report = evaluate_qa(model, tokenizer, qa, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)

    output = Path(args.output) if args.output else Path(args.model_dir) / "numeric_eval.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join((f"{args.model_dir} on {args.data} ({report['count']} items, {model.device}, {args.dtype})",
                     format_table(report), f"report: {output}")))
    return report


def cli(argv=None) -> None:
    """The ``smmd-evaluate`` console command: :func:`main` without its return value (the report,
    which a console script would otherwise turn into the exit status), and no collection at exit
    (``smmd_train.distributed.process_end``)."""
    main(argv)
    skip_final_collections()
