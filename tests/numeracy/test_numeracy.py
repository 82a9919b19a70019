"""The numeric problem generator, corpus and tokenizer (``smmd_numeracy``).

Answers are recomputed from the operands by independent references (``datetime`` for clocks, a
table of unit sizes, counting by iteration), and every split guarantee is checked by intersecting
the whole test split with a large train sample drawn with another seed.
"""

from __future__ import annotations

import datetime
import json
import operator
import random
import re
from collections import Counter

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import smmd_numeracy as numeracy
from smmd_numeracy import load_qa
from smmd_scale import NumericVocab

from conftest import SESSION_SEED

TRAIN_SAMPLE = 20_000
PROMPT_PATTERN = re.compile(r"Q: .+ A:")
INTEGER = re.compile(r"[0-9]+")


@pytest.fixture
def rng(request) -> random.Random:
    return random.Random(f"{SESSION_SEED}/{request.node.nodeid}")


# ----------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------

_DAY = datetime.datetime(2024, 1, 1)

# Each unit's size in a base unit of its dimension.
UNIT_SIZES = {
    "millimeter": ("length", 1), "centimeter": ("length", 10), "meter": ("length", 1000),
    "kilometer": ("length", 1_000_000), "inch": ("imperial length", 1), "foot": ("imperial length", 12),
    "yard": ("imperial length", 36), "gram": ("mass", 1), "kilogram": ("mass", 1000), "ounce": ("imperial mass", 1),
    "pound": ("imperial mass", 16), "milliliter": ("volume", 1), "liter": ("volume", 1000),
    "quart": ("imperial volume", 1), "gallon": ("imperial volume", 4), "second": ("time", 1), "minute": ("time", 60),
    "hour": ("time", 3600), "day": ("time", 86400), "week": ("time", 7 * 86400), "month": ("calendar", 1),
    "year": ("calendar", 12), "decade": ("calendar", 120), "century": ("calendar", 1200),
}


def clock_answer(kind: str, values: list) -> int:
    if kind == "past":
        hour, minute = values
        now = _DAY.replace(hour=hour % 12, minute=minute)
        return int((now - now.replace(minute=0)).total_seconds() // 60)
    if kind == "until":
        hour, minute = values
        now = _DAY.replace(hour=hour % 12, minute=minute)
        next_hour = now.replace(minute=0) + datetime.timedelta(hours=1)
        return int((next_hour - now).total_seconds() // 60)
    if kind == "hands":
        hour, mark = values
        minute_hand_degrees, degrees_per_minute = 30 * mark, 360 / 60
        return round(minute_hand_degrees / degrees_per_minute)
    if kind == "after_midnight":
        hour, minute = values
        return int((_DAY.replace(hour=hour, minute=minute) - _DAY).total_seconds() // 60)
    if kind == "elapsed":
        start, end = _DAY.replace(hour=values[0], minute=values[1]), _DAY.replace(hour=values[2], minute=values[3])
        return int((end - start).total_seconds() // 60)
    if kind == "hours_later":
        hour, later = values
        return int((_DAY.replace(hour=hour % 12) + datetime.timedelta(hours=later)).strftime("%I"))
    raise AssertionError(f"unknown clock kind {kind!r}")


def reference_answer(task: str, operands: tuple) -> int:
    kind, *values = operands
    if task == "arithmetic":
        return {"add": operator.add, "sub": operator.sub, "mul": operator.mul}[kind](*values)
    if task == "clock":
        return clock_answer(kind, values)
    if task == "units":
        source, target, amount = values
        (source_dimension, source_size), (target_dimension, target_size) = UNIT_SIZES[source], UNIT_SIZES[target]
        assert source_dimension == target_dimension, operands
        assert amount * source_size % target_size == 0, operands
        return amount * source_size // target_size
    if task == "counting":
        if kind == "letters":
            return len(list(values[0]))
        if kind == "letter_count":
            return sum(letter == values[1] for letter in values[0])
        if kind == "tally":
            return sum(item == values[0] for item in values[1])
        if kind == "range":
            return len(range(values[0], values[1] + 1))
        if kind == "multiples":
            return sum(number % values[0] == 0 for number in range(1, values[1] + 1))
        if kind == "list_length":
            return len(values[0])
    if task == "word_problems":
        if kind == "give_away":
            groups, each, given = values
            return sum([each] * groups) - given
        if kind == "buy_packs":
            start, packs, each = values
            return start + sum([each] * packs)
        if kind == "share":
            total, sold, boxes = values
            assert (total - sold) % boxes == 0, operands
            return (total - sold) // boxes
        if kind in ("shopping", "trip"):
            return values[0] * values[1] + values[2] * values[3]
        if kind == "age":
            age, times, years = values
            return age * times + years
    raise AssertionError(f"unknown {task} kind {kind!r}")


def held_out_unit(task: str, operands: tuple):
    """The documented split key, computed independently: what a test problem never shares with training."""
    kind, *values = operands
    if task == "arithmetic" and kind in ("add", "sub"):
        first, second = values
        total, part = (first + second, first) if kind == "add" else (first, first - second)
        return ("additive fact", total, min(part, total - part))
    if task == "arithmetic":
        return ("product fact", *sorted(values))
    if task == "clock" and kind in ("past", "until", "after_midnight", "hands"):
        minute = 5 * values[1] if kind == "hands" else values[1]
        return ("clock face", values[0] % 12, minute)
    if task == "units":
        source, target, amount = values
        larger = max((source, target), key=lambda unit: UNIT_SIZES[unit][1])
        return ("quantity", frozenset((source, target)), amount * UNIT_SIZES[source][1] // UNIT_SIZES[larger][1])
    if task == "counting" and kind in ("letters", "letter_count"):
        return ("word", values[0])
    return operands


def flat_values(operands) -> list:
    flat = []
    for value in operands:
        flat.extend(flat_values(value) if isinstance(value, tuple) else [value])
    return flat


# ----------------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", numeracy.TASKS)
def test_whole_test_split_is_disjoint_from_train_and_answers_are_right(task, rng):
    capacity = numeracy.split_capacity(task, "test")
    test = numeracy.generate_problems(task, capacity, "test", seed=rng.randrange(2**32))
    train = numeracy.generate_problems(task, min(TRAIN_SAMPLE, numeracy.split_capacity(task, "train")), "train",
                                       seed=rng.randrange(2**32))

    assert len({problem.operands for problem in test}) == capacity
    assert not {problem.operands for problem in test} & {problem.operands for problem in train}
    assert not {held_out_unit(task, problem.operands) for problem in test} & \
        {held_out_unit(task, problem.operands) for problem in train}
    # Held out: about 1 in TEST_MODULUS operand tuples.
    total = capacity + numeracy.split_capacity(task, "train")
    assert 0.6 / numeracy.TEST_MODULUS < capacity / total < 1.5 / numeracy.TEST_MODULUS

    for problem in rng.sample(test, min(len(test), 3000)) + rng.sample(train, 3000):
        assert problem.task == task
        assert isinstance(problem.answer, int) and 0 <= problem.answer <= 999, problem
        assert problem.answer == reference_answer(task, problem.operands), problem
        assert PROMPT_PATTERN.fullmatch(problem.prompt), problem
        assert problem.text == f"{problem.prompt} {problem.answer}."
        assert problem.prompt.isascii() and "\n" not in problem.prompt
        numbers_in_prompt = Counter(int(number) for number in INTEGER.findall(problem.prompt))
        operand_numbers = Counter(value for value in flat_values(problem.operands[1:]) if isinstance(value, int))
        assert not operand_numbers - numbers_in_prompt, problem
        if task == "counting":
            assert all(value in problem.prompt for value in flat_values(problem.operands[1:])
                       if isinstance(value, str)), problem


def test_every_kind_is_used_and_spread_evenly():
    kinds = {"arithmetic": {"add", "sub", "mul"},
             "clock": {"past", "until", "hands", "after_midnight", "elapsed", "hours_later"},
             "units": {"convert"},
             "counting": {"letters", "letter_count", "tally", "range", "multiples", "list_length"},
             "word_problems": {"give_away", "buy_packs", "share", "shopping", "trip", "age"}}
    for task, names in kinds.items():
        counts = Counter(problem.operands[0] for problem in numeracy.generate_problems(task, 60 * len(names),
                                                                                       "train", seed=0))
        assert counts == {name: 60 for name in names}, (task, counts)
    # 16 unit pairs both ways, less the 3 "thousand" pairs' large -> small (its answers would exceed 999).
    # Only 1..9 meters (centuries) convert to <= 999 centimeters (years): those two kinds give all they have
    # in the split, the others 11 or 12 each.
    pairs = Counter(problem.operands[1:3] for problem in numeracy.generate_problems("units", 320, "train", seed=0))
    assert len(pairs) == 29, pairs
    assert all(count <= 9 if pair in (("meter", "centimeter"), ("century", "year")) else 11 <= count <= 12
               for pair, count in pairs.items()), pairs


@pytest.mark.parametrize("task", numeracy.TASKS)
def test_same_seed_same_list_other_seed_other_sample(task, rng):
    seed = rng.randrange(2**32)
    first = numeracy.generate_problems(task, 300, "train", seed)
    assert first == numeracy.generate_problems(task, 300, "train", seed)
    other = numeracy.generate_problems(task, 300, "train", seed + 1)
    assert other != first
    assert len({problem.operands for problem in first} & {problem.operands for problem in other}) < 150
    assert len({problem.prompt for problem in first}) == 300
    questions = {INTEGER.sub("#", problem.prompt) for problem in first}
    assert len(questions) >= 10, questions  # varied phrasings, not one template


def test_small_and_exhausted_requests():
    assert numeracy.generate_problems("clock", 0, "test", seed=0) == []
    problems = numeracy.generate_problems("clock", 7, "test", seed=3)
    assert len(problems) == 7 and len({problem.operands[0] for problem in problems}) == 6
    capacity = numeracy.split_capacity("units", "test")
    everything = numeracy.generate_problems("units", capacity, "test", seed=0)
    assert len(set(everything)) == capacity


@pytest.mark.parametrize("arguments, message", [
    (("algebra", 5, "train", 0), "unknown task 'algebra'; choose one of ('arithmetic', 'clock'"),
    (("clock", 5, "validation", 0), "unknown split 'validation'; choose one of ('train', 'test')"),
    (("clock", -1, "train", 0), "count must be a non-negative int; got -1"),
    (("clock", True, "train", 0), "count must be a non-negative int; got True"),
    (("clock", 2.0, "train", 0), "count must be a non-negative int; got 2.0"),
])
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        numeracy.generate_problems(*arguments)


def test_count_above_capacity_says_the_capacity():
    capacity = numeracy.split_capacity("clock", "test")
    with pytest.raises(ValueError, match=rf"count={capacity + 1} is more than the {capacity} distinct 'clock' "
                                         rf"problems of the 'test' split.*ask for at most {capacity}"):
        numeracy.generate_problems("clock", capacity + 1, "test", seed=0)
    with pytest.raises(ValueError, match="unknown split"):
        numeracy.split_capacity("clock", "dev")


def test_plain_text_has_no_digits_and_is_deterministic(rng):
    seed = rng.randrange(2**32)
    paragraphs = numeracy.plain_text(50, seed)
    assert len(paragraphs) == 50 and paragraphs == numeracy.plain_text(50, seed)
    assert paragraphs != numeracy.plain_text(50, seed + 1)
    assert all(paragraph.isascii() and not re.search(r"[0-9]", paragraph) and "Q:" not in paragraph
               for paragraph in paragraphs)
    assert all(3 <= paragraph.count(".") <= 6 for paragraph in paragraphs)
    with pytest.raises(ValueError, match="count must be a non-negative int"):
        numeracy.plain_text(-1, 0)


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

def read_jsonl(path) -> list[dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines]


def test_build_corpus_writes_the_three_files(tmp_path, rng):
    seed = rng.randrange(2**32)
    result = numeracy.build_corpus(tmp_path / "data", train_per_task=24, test_per_task=8, seed=seed)
    problem_documents, plain_documents = 5 * 24 // 4, round(5 * 24 // 4 * 0.2 / 0.8)
    assert result == {"train": tmp_path / "data" / "train.jsonl", "eval": tmp_path / "data" / "eval.jsonl",
                      "qa_test": tmp_path / "data" / "qa_test.jsonl", "train_problems": 120,
                      "train_documents": problem_documents + plain_documents, "plain_text_documents": plain_documents,
                      "eval_documents": 10, "test_problems": 40}

    train, evaluation, qa = (read_jsonl(result[name]) for name in ("train", "eval", "qa_test"))
    assert all(set(row) == {"text"} for row in train + evaluation)
    assert len(train) == result["train_documents"] and len(evaluation) == 10 and len(qa) == 40
    train_lines = [line for row in train for line in row["text"].split("\n")]
    problem_lines = [line for line in train_lines if line.startswith("Q: ")]
    assert len(problem_lines) == 120
    assert sum(not re.search(r"[0-9]", row["text"]) for row in train) == plain_documents
    for line in problem_lines:
        prompt, answer = re.fullmatch(r"(Q: .+ A:) ([0-9]+)\.", line).groups()
        assert 0 <= int(answer) <= 999

    assert all(set(item) == {"prompt", "answer", "task"} and isinstance(item["answer"], int) for item in qa)
    assert Counter(item["task"] for item in qa) == {task: 8 for task in numeracy.TASKS}
    assert sorted(line for row in evaluation for line in row["text"].split("\n")) == \
        sorted(f"{item['prompt']} {item['answer']}." for item in qa)
    train_text = result["train"].read_text()
    assert not [item["prompt"] for item in qa if item["prompt"] in train_text]
    assert load_qa(result["qa_test"]) == qa

    again = numeracy.build_corpus(tmp_path / "again", train_per_task=24, test_per_task=8, seed=seed)
    for name in ("train", "eval", "qa_test"):
        assert again[name].read_bytes() == result[name].read_bytes()
    other = numeracy.build_corpus(tmp_path / "other", train_per_task=24, test_per_task=8, seed=seed + 1)
    assert other["train"].read_bytes() != result["train"].read_bytes()


def test_build_corpus_subset_of_tasks_and_no_plain_text(tmp_path):
    result = numeracy.build_corpus(tmp_path, train_per_task=8, test_per_task=3, plain_text_share=0.0,
                                   tasks=("clock", "units"))
    assert result["plain_text_documents"] == 0 and result["train_documents"] == 4
    assert {item["task"] for item in read_jsonl(result["qa_test"])} == {"clock", "units"}


@pytest.mark.parametrize("kwargs, message", [
    ({"train_per_task": 0}, "train_per_task must be a positive int; got 0"),
    ({"test_per_task": 1.5}, "test_per_task must be a positive int; got 1.5"),
    ({"plain_text_share": 1.0}, "plain_text_share must be in [0, 1)"),
    ({"tasks": ("clock", "poetry")}, "tasks must be a non-empty subset of ('arithmetic'"),
    ({"tasks": ()}, "tasks must be a non-empty subset"),
    ({"test_per_task": 10**6}, "is more than the"),
])
def test_build_corpus_rejects_bad_arguments(tmp_path, kwargs, message):
    arguments = {"train_per_task": 4, "test_per_task": 2, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        numeracy.build_corpus(tmp_path, **arguments)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus_texts(tmp_path_factory) -> list[str]:
    result = numeracy.build_corpus(tmp_path_factory.mktemp("corpus"), train_per_task=200, test_per_task=20)
    return [row["text"] for row in read_jsonl(result["train"])]


@pytest.fixture(scope="module")
def tokenizer(corpus_texts):
    return numeracy.train_numeric_tokenizer(corpus_texts)


def test_every_digit_group_is_one_token(tokenizer):
    digit_groups = [f"{number:0{width}d}" for width in (1, 2, 3) for number in range(10**width)]
    for group in digit_groups:
        assert tokenizer.tokenize(group) == [group]
    assert all(len(tokenizer.encode(str(number), add_special_tokens=False)) == 1 for number in range(1000))
    assert tokenizer.tokenize("1234") == ["123", "4"]
    assert tokenizer.tokenize("x12345678y") == ["x", "123", "456", "78", "y"]
    # The merges alone make every group one token too, without ignore_merges' whole-word lookup.
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(state))
    assert all(merges_only.encode(group).tokens == [group] for group in digit_groups)


def test_numeric_vocab_is_exactly_0_to_999(tokenizer):
    vocab = NumericVocab.from_tokenizer(tokenizer)
    assert len(vocab) == 1000
    assert vocab.values.tolist() == list(range(1000))
    assert sorted(vocab.tokens, key=int) == [str(number) for number in range(1000)]


def test_answers_are_a_space_token_then_one_numeric_token(tokenizer, rng):
    assert tokenizer.tokenize("A: 46.") == ["A", ":", "Ġ", "46", "."]
    for task in numeracy.TASKS:
        for problem in numeracy.generate_problems(task, 40, "test", seed=rng.randrange(2**32)):
            answer_text = f"{problem.prompt} {problem.answer}"
            assert tokenizer.tokenize(answer_text) == tokenizer.tokenize(problem.prompt) + ["Ġ", str(problem.answer)]


def test_decode_inverts_encode(tokenizer, corpus_texts, rng):
    texts = rng.sample(corpus_texts, 100) + ["naïve café – 12½ km², 😀 tabs\tand\n\nnewlines  ", "A:46 B: 007"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_tokens_padding_and_size(tokenizer, tmp_path):
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert len(set(ids)) == 3 and ids == list(range(len(tokenizer) - 3, len(tokenizer)))
    assert tokenizer.tokenize("<|end_of_text|>") == ["<|end_of_text|>"]
    assert len(tokenizer) <= 2048
    assert tokenizer("Q: What is 1 + 2? A:")["input_ids"] == tokenizer.encode("Q: What is 1 + 2? A:",
                                                                              add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["A: 1", "Q: What is 1 + 2? A:"], padding=True)
    assert batch["input_ids"][0][0] == tokenizer.pad_token_id and batch["attention_mask"][0][0] == 0

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (reloaded.padding_side, reloaded.pad_token, reloaded.bos_token, reloaded.eos_token) == \
        ("left", "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>")
    text = "Q: How many minutes are in 9 hours? A: 540."
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_training_is_deterministic_and_fills_the_requested_size(corpus_texts, tokenizer):
    again = numeracy.train_numeric_tokenizer(corpus_texts)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert len(numeracy.train_numeric_tokenizer(corpus_texts, vocab_size=1500)) == 1500
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 1359"):
        numeracy.train_numeric_tokenizer(corpus_texts, vocab_size=1000)
