"""Numeric evaluation of a Hugging Face causal-LM checkpoint on {"prompt", "answer"} JSONL lines.

    python launch/evaluate.py MODEL_DIR --data qa.jsonl [--limit 200] [--output report.json]

Prints a table (all items, then each "task") and writes the JSON report (default
MODEL_DIR/numeric_eval.json); the options are in ``smmd_numeracy/evaluate_cli.py``.
"""

from smmd_numeracy.evaluate_cli import cli

if __name__ == "__main__":
    cli()
