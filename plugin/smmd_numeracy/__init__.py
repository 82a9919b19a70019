"""Numeracy data and scoring: the study's tiers (``tier_a``, ``tier_b``, ``tier_c``; Tier A's arithmetic is
also the demo's data and the training benchmarks' corpus), a Llama-3-style tokenizer trained locally, and
the numeric evaluation of a trained model.

    from smmd_numeracy import evaluate_qa, load_qa, tier_a
    data = tier_a.data_and_tokenizer("work/")      # work/data/*.jsonl and work/tokenizer
    report = evaluate_qa(model, tokenizer, load_qa(data["qa_eval"]))
"""

from .evaluation import evaluate_qa, load_qa, parse_number
from .tokenizer import train_numeric_tokenizer

__all__ = ["evaluate_qa", "load_qa", "parse_number", "train_numeric_tokenizer"]
