"""Numeracy data and scoring: the study's tiers (``tier_a``, ``tier_b``, ``tier_c``); the retired task
suite's generators, which the training benchmarks use as data (numeric word problems with held-out
operands and the corpus built from them); a Llama-3-style tokenizer trained locally; and the numeric
evaluation of a trained model.

    from smmd_numeracy import build_corpus, evaluate_qa, load_qa, train_numeric_tokenizer
    paths = build_corpus("data/", train_per_task=4000, test_per_task=60)
    tokenizer = train_numeric_tokenizer(texts)
    report = evaluate_qa(model, tokenizer, load_qa(paths["qa_test"]))
"""

from .corpus import build_corpus, plain_text
from .evaluation import evaluate_qa, load_qa, parse_number
from .tasks import TASKS, TEST_MODULUS, Problem, generate_problems, split_capacity
from .tokenizer import train_numeric_tokenizer

__all__ = ["TASKS", "TEST_MODULUS", "Problem", "build_corpus", "evaluate_qa", "generate_problems", "load_qa",
           "parse_number", "plain_text", "split_capacity", "train_numeric_tokenizer"]
