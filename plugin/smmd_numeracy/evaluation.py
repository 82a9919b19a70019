"""Numeric evaluation of a Hugging Face causal LM on question/answer lines.

    qa = load_qa("arithmetic.jsonl")     # {"prompt": "Q: What is 237 + 418? A:", "answer": 655, "task": "add"}
    report = evaluate_qa(model, tokenizer, qa)
    report["exact_match"], report["mae"], report["numeric_token_accuracy"]

Two measurements per item, each batched:

* **generation**: greedy continuation of the prompt (left-padded batches); the first number in the
  decoded continuation is the model's answer. ``exact_match``, ``mae``, ``relative_error`` and
  ``unparseable`` come from it.
* **teacher forcing**: one forward pass over ``prompt + " " + str(answer)``, the training text
  format. At every answer-span position whose target is a numeric token (``NumericVocab``, policy
  "integers"), ``numeric_token_accuracy`` checks the argmax over the *full* vocabulary and
  ``numeric_token_mae`` is ``|E_p[value] - target value|`` with ``p`` the softmax over the numeric
  tokens only, as the SMMD loss's ``numeric_mae`` statistic.

Prompts are tokenized with the tokenizer's default special tokens (a BOS where the tokenizer adds one).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from smmd_scale import NumericVocab

# The number the model answered with: optional sign, ASCII digits, optional decimal part.
# [0-9], not \d, which also matches non-ASCII digits ("٣").
NUMBER_PATTERN = re.compile(r"[-+]?[0-9]+(?:\.[0-9]+)?")
_EXAMPLES = 5


def parse_number(text: str) -> Optional[int | float]:
    """The first number in ``text`` (an int unless it has a decimal part), or ``None`` if there is none."""
    match = NUMBER_PATTERN.search(text)
    if match is None:
        return None
    return _number_from_string(match.group())


def _number_from_string(text: str) -> int | float:
    return float(text) if "." in text else int(text)


# ----------------------------------------------------------------------------------------------
# Loading and checking items
# ----------------------------------------------------------------------------------------------

def load_qa(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file of ``{"prompt": str, "answer": int | float | numeric str, "task": str (optional)}``.

    Blank lines are skipped. Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming
    ``path:line`` for a line that is not a JSON object or whose fields are missing or malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"QA file {path} does not exist (expected JSONL lines of "
                                f'{{"prompt": ..., "answer": ...}})')
    items = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg} at column {error.colno})"
                                 ) from None
            check_item(record, f"{path}:{line_number}")
            items.append(record)
    if not items:
        raise ValueError(f"{path} holds no QA items; expected JSONL lines of {{\"prompt\": ..., \"answer\": ...}}")
    return items


def check_item(item, where: str) -> str:
    """The answer text of ``item`` (see :func:`answer_text`); ``ValueError`` prefixed by ``where`` unless
    ``item`` is a valid QA dict."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object with \"prompt\" and \"answer\"; got {type(item).__name__}")
    missing = [field for field in ("prompt", "answer") if field not in item]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; every item needs \"prompt\" and \"answer\" "
                         f"(and optionally \"task\"); got fields {sorted(item)}")
    if not isinstance(item["prompt"], str) or not item["prompt"]:
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string; got {item['prompt']!r}")
    if "task" in item and not isinstance(item["task"], str):
        raise ValueError(f"{where}: \"task\" must be a string; got {item['task']!r}")
    return answer_text(item["answer"], where)


def answer_text(answer, where: str = "answer") -> str:
    """The answer as it appears in the training text: ``655``, ``-12``, ``2.5``.

    Accepts an int, a finite float, or a string of that form; rejects bools, exponents, separators
    and surrounding spaces, which the generated-answer parser would not read back as the same number.
    """
    if isinstance(answer, bool) or not isinstance(answer, (numbers.Real, str)):
        raise ValueError(f"{where}: \"answer\" must be a number or a numeric string; got {answer!r}")
    if isinstance(answer, numbers.Real) and not math.isfinite(answer):
        raise ValueError(f"{where}: \"answer\" must be finite; got {answer!r}")
    text = answer if isinstance(answer, str) else str(answer)
    if NUMBER_PATTERN.fullmatch(text) is None:
        raise ValueError(f"{where}: \"answer\" {answer!r} is not a plain decimal number (like 655, -12 or 2.5; "
                         f"no exponent, separators or spaces)")
    return text


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

def evaluate_qa(model, tokenizer, qa: list[dict], batch_size: int = 32, max_new_tokens: int = 8) -> dict:
    """Generation and teacher-forced numeric metrics of ``model`` on ``qa`` (see the module docstring).

    Returns ``{"count", "exact_match", "mae", "relative_error", "unparseable", "numeric_token_accuracy",
    "numeric_token_mae", "numeric_tokens", "per_task": {task: {same metric keys}}, "examples": [first 5
    {"prompt", "answer", "generated", "parsed"}]}``. Means over an empty set (no parseable answer, no
    numeric answer token) are ``None``. ``per_task`` covers the items that have a "task". The model
    runs in eval mode under ``torch.no_grad`` and is put back in its previous mode; the tokenizer is
    not modified. Deterministic for a given model, data and ``batch_size``.
    """
    if not qa:
        raise ValueError("qa is empty; pass at least one {\"prompt\", \"answer\"} item")
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    answers = [check_item(item, f"qa[{index}]") for index, item in enumerate(qa)]
    pad_token_id = _pad_token_id(tokenizer)
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)

    prompts = [item["prompt"] for item in qa]
    prompt_ids = tokenizer(prompts)["input_ids"]
    text_ids = tokenizer([prompt + " " + answer for prompt, answer in zip(prompts, answers)])["input_ids"]
    answer_starts = [_answer_start(prompt, text) for prompt, text in zip(prompt_ids, text_ids)]

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            generated = generate_continuations(model, tokenizer, prompt_ids, pad_token_id, batch_size, max_new_tokens)
            numeric = teacher_forced_numeric(model, vocab, text_ids, answer_starts, pad_token_id, batch_size)
    finally:
        model.train(was_training)

    records = []
    for answer, continuation, (correct, abs_error_sum, count) in zip(answers, generated, numeric):
        records.append({"answer": _number_from_string(answer), "parsed": parse_number(continuation),
                        "numeric_correct": correct, "numeric_abs_error_sum": abs_error_sum, "numeric_tokens": count})
    report = summarize(records)
    tasks = defaultdict(list)
    for item, record in zip(qa, records):
        if "task" in item:
            tasks[item["task"]].append(record)
    report["per_task"] = {task: summarize(tasks[task]) for task in sorted(tasks)}
    report["examples"] = [{"prompt": item["prompt"], "answer": item["answer"], "generated": continuation,
                           "parsed": record["parsed"]}
                          for item, continuation, record in zip(qa[:_EXAMPLES], generated, records)]
    return report


def summarize(records: list[dict]) -> dict:
    """The metric keys of the report from per-item records (answer, parsed, numeric_* sums)."""
    parsed = [record for record in records if record["parsed"] is not None]
    errors = [abs(record["parsed"] - record["answer"]) for record in parsed]
    relative = [error / max(abs(record["answer"]), 1) for error, record in zip(errors, parsed)]
    numeric_tokens = sum(record["numeric_tokens"] for record in records)
    return {
        "count": len(records),
        "exact_match": sum(record["parsed"] == record["answer"] for record in parsed) / len(records),
        "mae": _mean(errors),
        "relative_error": _mean(relative),
        "unparseable": (len(records) - len(parsed)) / len(records),
        "numeric_token_accuracy": (sum(record["numeric_correct"] for record in records) / numeric_tokens
                                   if numeric_tokens else None),
        "numeric_token_mae": (sum(record["numeric_abs_error_sum"] for record in records) / numeric_tokens
                              if numeric_tokens else None),
        "numeric_tokens": numeric_tokens,
    }


def _mean(values: list) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _pad_token_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            return token_id
    raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an eos token to pad batches with; set "
                     f"tokenizer.pad_token first")


def _answer_start(prompt_ids: list, text_ids: list) -> int:
    """First position of the answer span in ``text_ids``: where it stops agreeing with the prompt's tokens.

    A tokenizer may merge the prompt's last piece with the space after it (sentencepiece ``▁``), so
    the span starts at the common prefix, not at ``len(prompt_ids)``. At least 1: position 0 has no
    prediction.
    """
    common = 0
    for prompt_token, text_token in zip(prompt_ids, text_ids):
        if prompt_token != text_token:
            break
        common += 1
    return max(common, 1)


def _batches(lengths: list, batch_size: int):
    """Index batches, longest sequences first so each batch holds similar lengths (less padding)."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def _left_pad(sequences: list, pad_token_id: int, device) -> tuple:
    """``input_ids`` and ``attention_mask``, both ``[batch, longest]``, padded on the left."""
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, longest - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, longest - len(sequence):] = 1
    return input_ids.to(device), attention_mask.to(device)


def generate_continuations(model, tokenizer, prompt_ids: list, pad_token_id: int, batch_size: int,
                           max_new_tokens: int) -> list[str]:
    """Greedy continuations of each prompt (token id lists), decoded without special tokens, in input order.

    ``generate`` derives position ids from the attention mask, so left padding does not shift them.
    ``use_cache=True`` is explicit: training scripts save ``config.use_cache=False``.
    """
    continuations = [None] * len(prompt_ids)
    for batch in _batches([len(ids) for ids in prompt_ids], batch_size):
        input_ids, attention_mask = _left_pad([prompt_ids[index] for index in batch], pad_token_id, model.device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                                max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, use_cache=True)
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1]:], skip_special_tokens=True)
        for index, text in zip(batch, texts):
            continuations[index] = text
    return continuations


def teacher_forced_numeric(model, vocab: NumericVocab, text_ids: list, answer_starts: list, pad_token_id: int,
                           batch_size: int) -> list[tuple]:
    """Per item ``(correct, abs_error_sum, numeric_tokens)`` over its answer-span numeric targets.

    Left padding puts every answer at the end of its row, so one ``logits_to_keep`` = longest answer
    + 1 serves the batch: logits ``[batch, keep, V]`` instead of ``[batch, T, V]``. Position ids are
    passed explicitly because a plain forward, unlike ``generate``, does not derive them from the mask.
    """
    token_ids = vocab.token_ids.to(model.device)
    values = vocab.values.to(model.device)
    results = [None] * len(text_ids)
    for batch in _batches([len(ids) for ids in text_ids], batch_size):
        input_ids, attention_mask = _left_pad([text_ids[index] for index in batch], pad_token_id, model.device)
        answer_lengths = torch.tensor([len(text_ids[index]) - answer_starts[index] for index in batch],
                                      device=model.device)
        keep = int(answer_lengths.max()) + 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=keep, use_cache=False).logits
        # A model that ignores logits_to_keep returns every position; the last `keep` are the same ones.
        logits = logits[:, -keep:-1].float()                                   # [batch, keep - 1, V]
        targets = input_ids[:, -(keep - 1):]                                   # [batch, keep - 1]
        offsets = torch.arange(keep - 1, 0, -1, device=model.device)          # distance from the row's end
        in_answer = offsets[None, :] <= answer_lengths[:, None]
        numeric = in_answer & torch.isin(targets, token_ids)
        rows, columns = numeric.nonzero(as_tuple=True)
        numeric_logits = logits[rows, columns]                                 # [P, V]
        numeric_targets = targets[rows, columns]                               # [P]
        correct = numeric_logits.argmax(dim=-1) == numeric_targets
        probabilities = torch.softmax(numeric_logits[:, token_ids].double(), dim=-1)   # [P, N]
        target_values = values[torch.searchsorted(token_ids, numeric_targets)]
        abs_error = (probabilities @ values - target_values).abs()
        zeros = torch.zeros(len(batch), dtype=torch.float64, device=model.device)
        correct_per_row = zeros.index_add(0, rows, correct.double()).tolist()
        abs_error_per_row = zeros.index_add(0, rows, abs_error).tolist()
        numeric_per_row = numeric.sum(dim=-1).tolist()
        for row, index in enumerate(batch):
            results[index] = (int(correct_per_row[row]), abs_error_per_row[row], numeric_per_row[row])
    return results
