"""The training corpus and held-out sets of the numeracy suite, written as JSON lines.

    paths = build_corpus("data/", train_per_task=4000, test_per_task=60)   # train/eval/qa_test .jsonl

**Corpus.** ``build_corpus`` writes ``train.jsonl`` (training problems, ``PROBLEMS_PER_DOCUMENT`` per
document joined by newlines, shuffled with plain-text paragraphs), ``eval.jsonl`` (test problems in
the same document shape, for eval cross-entropy) and ``qa_test.jsonl`` (test prompts and answers for
generation-based evaluation, ``smmd_numeracy.evaluation.load_qa``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import datasets

from .tasks import NAMES, PROBLEMS_PER_DOCUMENT, TASKS, WORDS, Problem, check_count, generate_problems

_ADJECTIVES = ("quiet", "bright", "small", "gentle", "old", "busy", "calm", "narrow", "golden", "dark", "warm",
               "cold", "tall", "curious", "patient", "happy", "tired", "clever", "rusty", "shiny", "soft", "loud")
_PLACES = ("garden", "market", "library", "harbor", "village", "forest", "kitchen", "station", "museum", "meadow",
           "castle", "school", "valley", "bridge")
_VERBS = ("waited", "rested", "wandered", "listened", "watched", "smiled", "worked", "sang", "slept", "paused",
          "stayed", "laughed")
_ADVERBS = ("slowly", "quietly", "happily", "carefully", "suddenly", "softly", "gladly", "calmly")
_TIMES = ("in the morning", "at noon", "before dinner", "after the rain", "at dusk", "during the storm",
          "late at night", "on a windy afternoon")
_SENTENCES = (
    "The {adjective} {noun} {verb} near the {place}.",
    "{name} found a {adjective} {noun} {time}.",
    "Every {noun} in the {place} looked {adjective}.",
    "{name} and {other} walked to the {place} and talked about the {noun}.",
    "It was a {adjective} day, and the {noun} {verb} {adverb}.",
    "Nobody knew why the {noun} {verb} {time}.",
    "{name} {verb} {adverb} while the {adjective} {noun} watched.",
    "In the {place}, a {adjective} {noun} {verb} {adverb}.",
    "{name} said that the {noun} was more {adjective} than the {other_noun}.",
    "The {place} smelled of {noun} and {other_noun} {time}.",
)


def plain_text(count: int, seed: int) -> list[str]:
    """``count`` paragraphs of 3..6 template sentences with no digits: the non-numeric share of the corpus."""
    check_count("count", count)
    rng = random.Random(f"plain_text/{seed}")
    paragraphs = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(3, 6)):
            (name, _pronoun), (other, _other_pronoun) = rng.sample(NAMES, 2)
            noun, other_noun = rng.sample(WORDS, 2)
            sentence = rng.choice(_SENTENCES).format(
                name=name, other=other, noun=noun, other_noun=other_noun, adjective=rng.choice(_ADJECTIVES),
                place=rng.choice(_PLACES), verb=rng.choice(_VERBS), adverb=rng.choice(_ADVERBS),
                time=rng.choice(_TIMES))
            sentences.append(sentence[0].upper() + sentence[1:])
        paragraphs.append(" ".join(sentences))
    return paragraphs


def _documents(problems: list[Problem]) -> list[str]:
    """Problem texts, ``PROBLEMS_PER_DOCUMENT`` per document, one per line (the last document may be shorter)."""
    return ["\n".join(problem.text for problem in problems[start:start + PROBLEMS_PER_DOCUMENT])
            for start in range(0, len(problems), PROBLEMS_PER_DOCUMENT)]


def build_corpus(out_dir, *, train_per_task: int, test_per_task: int, plain_text_share: float = 0.2, seed: int = 0,
                 tasks: Sequence[str] = TASKS) -> dict:
    """Write the training corpus and the held-out sets under ``out_dir`` with ``datasets`` (JSON lines).

    ``train.jsonl``   {"text"}: ``train_per_task`` training problems per task, ``PROBLEMS_PER_DOCUMENT``
                      per document, shuffled with plain-text paragraphs that make up ``plain_text_share``
                      of the documents.
    ``eval.jsonl``    {"text"}: the ``test_per_task`` test problems per task, in documents of the same shape.
    ``qa_test.jsonl`` {"prompt", "answer", "task"}: the same test problems, one per line, shuffled.

    Returns ``{"train", "eval", "qa_test"}`` (paths) and the counts ``train_problems``,
    ``train_documents``, ``plain_text_documents``, ``eval_documents``, ``test_problems``.
    Deterministic in ``seed``; raises ``ValueError`` for bad arguments (see ``generate_problems``).
    """
    for name, count in (("train_per_task", train_per_task), ("test_per_task", test_per_task)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive int; got {count!r}")
    if not 0 <= plain_text_share < 1:
        raise ValueError(f"plain_text_share must be in [0, 1) (the share of training documents that are plain "
                         f"text); got {plain_text_share!r}")
    tasks = tuple(tasks)
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}; got {tasks!r}")

    rng = random.Random(f"corpus/{seed}")
    train = [problem for task in tasks for problem in generate_problems(task, train_per_task, "train", seed)]
    test = [problem for task in tasks for problem in generate_problems(task, test_per_task, "test", seed)]
    rng.shuffle(train)
    rng.shuffle(test)
    problem_documents = _documents(train)
    plain_count = round(len(problem_documents) * plain_text_share / (1 - plain_text_share))
    train_documents = problem_documents + plain_text(plain_count, seed)
    rng.shuffle(train_documents)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl", "qa_test": out_dir / "qa_test.jsonl"}
    tables = {"train": [{"text": text} for text in train_documents],
              "eval": [{"text": text} for text in _documents(test)],
              "qa_test": [{"prompt": problem.prompt, "answer": problem.answer, "task": problem.task}
                          for problem in test]}
    for name, path in paths.items():
        _write_jsonl(tables[name], path)
    return {**paths, "train_problems": len(train), "train_documents": len(train_documents),
            "plain_text_documents": plain_count, "eval_documents": len(tables["eval"]), "test_problems": len(test)}


def _write_jsonl(rows: list[dict], path: Path) -> None:
    """``rows`` as JSON lines through ``datasets``, without its progress bars (restored as they were)."""
    bars_were_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        datasets.Dataset.from_list(rows).to_json(str(path), lines=True)
    finally:
        if bars_were_enabled:
            datasets.enable_progress_bars()
