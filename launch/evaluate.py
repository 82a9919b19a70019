"""Numeric evaluation of a Hugging Face causal-LM checkpoint on JSONL lines of {"prompt", "answer"} or
{"prompt", "completion"} (train.py's fine-tuning format, so a run's --eval_data file serves here too).

    python launch/evaluate.py MODEL_DIR --data qa.jsonl [--limit 200] [--output report.json]

Prints a table (all items, then each "task") and writes the JSON report (default
MODEL_DIR/numeric_eval.json); the options are in ``smmd_numeracy/evaluate_cli.py``.
"""

from smmd_numeracy.evaluate_cli import cli

if __name__ == "__main__":
    cli()
