"""Tier B of the numeracy study (benchmarks/numeracy/study_b.py): the Number Token Loss paper's own
arithmetic task, DeepMind mathematics ``arithmetic__add_sub_multiple``, with digit-level numbers.

The problems come from the ``mathematics_dataset`` package (the registry's 1.0.1, Saxton et al. 2019),
generated offline here with a fixed seed instead of downloaded:

``train-easy`` / ``train-medium`` / ``train-hard``   ``add_sub_multiple`` at the low / middle / high third
                                                     of the training entropy range (the package's
                                                     ``generate._make_entropy_fn(level, 3)``, through
                                                     ``smmd_numeracy.compat``);
``interpolate``   ``add_sub_multiple`` at the test entropy (``modules.test()``);
``extrapolate``   ``add_sub_multiple_longer`` (``modules.test_extra()``): more terms than any training problem.

Problems look like ``Calculate -11 - -5 - 0 - -12.`` with an integer answer that may be negative
(``6``). A training problem whose question text is also a test question is dropped, so the training
and test splits are disjoint by question; the two test splits are disjoint too (a repeat is drawn again).

Text: ``"Q: <question>\\nA: <answer>"``, one problem per document (the trainer packs documents
GPT-style with EOS between them). The evaluation prompt is ``"Q: <question>\\nA:"``; the greedy
continuation's first line must be exactly the answer (``parse_answer``). Numbers are digit-level
(``train_numeric_tokenizer(max_digits=1)``): the numeric tokens are the ten digits 0..9, the setting of
the NTL paper's T5 experiments, so a numeric loss compares digits, not whole answers.
"""

from __future__ import annotations

import random
import re

from . import compat, tier_a

TRAIN_LEVELS = ("train-easy", "train-medium", "train-hard")
# Test split -> the mathematics_dataset module it draws from.
TEST_SPLITS = {"interpolate": "add_sub_multiple", "extrapolate": "add_sub_multiple_longer"}
# The study's settings: data, tokenizer, model and training (benchmarks/numeracy/README.md, Tier B).
SETTINGS = {
    "train_per_level": 10_000, "eval_per_split": 1000, "data_seed": 0, "vocab_size": 512, "max_digits": 1,
    "model": "10m", "seq_len": 128, "micro_batch_size": 8, "steps": 700, "lr": 2e-3, "warmup_steps": 70,
    "eval_every": 175, "eval_batches": 4, "deepspeed_config": "ds_configs/zero3.json", "threads": 1, "nice": 10,
}
# Every arm reads the numeric tokens as the ten digits (train.py's --numeric_policy digits; on this
# tokenizer its default "integers" finds the same ten tokens).
_DIGITS = {"numeric_policy": "digits"}
# The pre-registered arms: name -> train.py options. NTL-WAS at the paper's weight 0.3 with its default raw
# distances: for the digits 0..9 squashing onto [1, 9] (--ntl_squash_factor 9, Tier A's choice) is the
# identity, so it is left out. SMMD at its defaults (its [1, 9] squash is the identity here too).
ARMS = {
    "ce": {"numeric_loss": ["smmd:0"], **_DIGITS},
    "ntl_was": {"numeric_loss": ["ntl-was:0.3"], **_DIGITS},
    "smmd": {"numeric_loss": ["smmd:1"], **_DIGITS},
}
ANSWER_PATTERN = re.compile(r"-?(?:0|[1-9][0-9]*)")


def _sampler(split: str):
    arithmetic, _ = compat.arithmetic_modules()
    if split in TRAIN_LEVELS:
        entropy = compat.training_entropy(TRAIN_LEVELS.index(split), len(TRAIN_LEVELS))
        return arithmetic.train(entropy)["add_sub_multiple"]
    if split == "interpolate":
        return arithmetic.test()[TEST_SPLITS[split]]
    if split == "extrapolate":
        return arithmetic.test_extra()[TEST_SPLITS[split]]
    raise ValueError(f"unknown split {split!r}; choose one of {TRAIN_LEVELS + tuple(TEST_SPLITS)}")


def generate_problems(split: str, count: int, seed: int, exclude=frozenset(), unique: bool = False) -> list:
    """``count`` problems ``(question, answer)`` of ``split``, deterministic for (split, seed).

    The package draws from the global ``random`` and ``numpy.random`` generators; they are seeded for
    the call (from the split's name and ``seed``) and restored after it. Questions or answers over the
    package's length limits are drawn again (as its ``generate.sample_from_module`` does), and so are
    questions in ``exclude`` and, with ``unique``, repeats."""
    import numpy as np

    _, limits = compat.arithmetic_modules()
    sample = _sampler(split)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(f"tier_b/{split}/{seed}")
    np.random.seed(random.getrandbits(32))
    problems, seen = [], set()
    try:
        while len(problems) < count:
            problem = sample()
            question, answer = str(problem.question), str(problem.answer)
            if (len(question) > limits.MAX_QUESTION_LENGTH or len(answer) > limits.MAX_ANSWER_LENGTH
                    or question in exclude or (unique and question in seen)):
                continue
            seen.add(question)
            problems.append((question, int(answer)))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return problems


def text(question: str, answer: int) -> str:
    return f"{prompt(question)} {answer}"


def prompt(question: str) -> str:
    return f"Q: {question}\nA:"


def parse_answer(continuation: str):
    """The integer a greedy continuation answers with: its first line, stripped, must be a whole
    integer (``-36``, ``7``); anything else (``36 + 1``, ``--3``, ``036``, an empty line) is ``None``."""
    line = continuation.split("\n", 1)[0].strip()
    return int(line) if ANSWER_PATTERN.fullmatch(line) else None


def build_data(out_dir, *, train_per_level: int, eval_per_split: int, seed: int = 0) -> dict:
    """Write the Tier B files under ``out_dir``; returns their paths and the split sizes.

    ``train.jsonl``   {"text"}: ``train_per_level`` problems of each training level, shuffled together;
    ``eval.jsonl``    {"text"}: the interpolate problems, for train.py's periodic held-out evaluation;
    ``qa_eval.jsonl`` {"prompt", "answer", "task" = "<split>/<module>"}: ``eval_per_split`` distinct
                      problems of each test split.
    """
    if train_per_level < 1 or eval_per_split < 1:
        raise ValueError(f"need train_per_level >= 1 and eval_per_split >= 1; got {train_per_level}, {eval_per_split}")
    tests, taken = {}, set()
    for split in TEST_SPLITS:
        tests[split] = generate_problems(split, eval_per_split, seed, exclude=frozenset(taken), unique=True)
        taken.update(question for question, _ in tests[split])
    train = []
    for level in TRAIN_LEVELS:
        train += generate_problems(level, train_per_level, seed, exclude=frozenset(taken))
    random.Random(f"tier_b/files/{seed}").shuffle(train)
    paths = tier_a.write_files(out_dir, {
        "train": [{"text": text(*problem)} for problem in train],
        "eval": [{"text": text(*problem)} for problem in tests["interpolate"]],
        "qa_eval": [{"prompt": prompt(question), "answer": answer, "task": f"{split}/{TEST_SPLITS[split]}"}
                    for split, problems in tests.items() for question, answer in problems]})
    sizes = {"train_problems": len(train), "train_distinct_questions": len({question for question, _ in train})}
    sizes.update({f"{split}_problems": len(problems) for split, problems in tests.items()})
    sizes.update({f"{split}_max_answer_chars": max(len(str(answer)) for _, answer in problems)
                  for split, problems in tests.items()})
    return {**paths, **sizes}


def max_new_tokens(items: list) -> int:
    """Tokens a greedy answer may take: the longest answer's characters (each digit is a token, the
    sign carries the space before it, an unsigned answer has a space token) plus one for EOS."""
    return max(len(str(item["answer"])) for item in items) + 2


def evaluate_model(model_dir, qa_path, batch_size: int = 200) -> dict:
    """Greedy answers of the exported model in ``model_dir`` on ``qa_path``, scored by
    ``tier_a.score`` (exact match, MAE over parseable answers, within +-1, unparseable share) per
    split and module; and the per-item answers."""
    from .evaluation import load_qa

    return tier_a.evaluate_model(model_dir, qa_path, batch_size=batch_size,
                                 max_new_tokens=max_new_tokens(load_qa(qa_path)), parse=parse_answer)
