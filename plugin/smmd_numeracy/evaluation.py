"""Numeric evaluation of a Hugging Face causal LM on question/answer or prompt/completion lines.

    qa = load_qa("arithmetic.jsonl")     # {"prompt": "Q: What is 237 + 418? A:", "answer": 655, "task": "add"}
                                         # or {"prompt": "What is 17 + 25? Answer:", "completion": " 42"}
    report = evaluate_qa(model, tokenizer, qa)
    report["exact_match"], report["mae"], report["numeric_accuracy"]

Two record formats, mixed freely in one file:

* **question/answer** ``{"prompt", "answer", "task"?}``: ``answer`` is a number or a numeric string;
  the teacher-forced text is ``prompt + " " + answer``, tokenized as one text.
* **prompt/completion** ``{"prompt", "completion", "task"?}``: the fine-tuning format of train.py's
  ``--data`` and ``--eval_data`` (``smmd_train.data``), so one validation file serves both. The
  completion is the expected answer alone: a plain decimal number, whitespace around it allowed
  (``" 42"`` is 42; train.py appends the EOS itself). The teacher-forced tokens are train.py's row
  without its padding: ``tokenizer(prompt) + tokenizer(completion)``, each text on its own (the EOS
  after them is never a numeric target).

Every text is tokenized without special tokens (no BOS), as train.py tokenizes its data: the model
sees what it saw in training.

Two measurements per item, each batched:

* **generation**: greedy continuation of the prompt (left-padded batches); the first number in the
  decoded continuation is the model's answer. ``exact_match``, ``mae``, ``relative_error`` and
  ``unparseable`` come from it.
* **teacher forcing**: one forward pass over the item's teacher-forced tokens. At every answer-span
  position whose target is a numeric token (``NumericVocab``, policy "integers"):

  - ``numeric_accuracy``: the argmax over the *numeric tokens* is the target, as the numeric loss's
    ``numeric_accuracy`` statistic and train.py's ``eval/numeric_accuracy`` count it;
  - ``numeric_accuracy_full_vocab``: the argmax over the *full vocabulary* is the target (a
    non-numeric token may win it); ``numeric_token_accuracy`` is its earlier name, still in reports;
  - ``numeric_token_mae``: ``|E_p[value] - target value|`` with ``p`` the softmax over the numeric
    tokens only, as the loss's ``numeric_mae`` statistic (train.py's ``eval/numeric_mae``).
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
_FORMATS = '{"prompt": ..., "answer": ...} or {"prompt": ..., "completion": ...}'


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
    """Read a JSONL file of question/answer records ``{"prompt": str, "answer": int | float | numeric str}``
    or prompt/completion records ``{"prompt": str, "completion": numeric str}`` (train.py's fine-tuning
    format), each with an optional ``"task": str``; the records come back as they are.

    Blank lines are skipped. Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming
    ``path:line`` for a line that is not a JSON object or whose fields are missing or malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"QA file {path} does not exist (expected JSONL lines of {_FORMATS})")
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
        raise ValueError(f"{path} holds no QA items; expected JSONL lines of {_FORMATS}")
    return items


def check_item(item, where: str) -> str:
    """The answer text of ``item``: :func:`answer_text` of a question/answer record's "answer",
    :func:`completion_answer` of a prompt/completion record's "completion"; ``ValueError`` prefixed by
    ``where`` unless ``item`` is a valid record of one of the two formats."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object, one of {_FORMATS}; got {type(item).__name__}")
    if "answer" in item and "completion" in item:
        raise ValueError(f"{where}: both \"answer\" and \"completion\"; a record is question/answer or "
                         f"prompt/completion, keep one of the two")
    expected = "completion" if "completion" in item else "answer"
    missing = [field for field in ("prompt", expected) if field not in item]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; every item needs \"prompt\" and \"answer\" "
                         f"(question/answer) or \"prompt\" and \"completion\" (prompt/completion, as train.py's "
                         f"--eval_data), and optionally \"task\"; got fields {sorted(item)}")
    if not isinstance(item["prompt"], str) or not item["prompt"]:
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string; got {item['prompt']!r}")
    if "task" in item and not isinstance(item["task"], str):
        raise ValueError(f"{where}: \"task\" must be a string; got {item['task']!r}")
    if expected == "completion":
        return completion_answer(item["completion"], where)
    return answer_text(item["answer"], where)


def completion_answer(completion, where: str = "completion") -> str:
    """The answer a prompt/completion record's completion holds: the completion without the whitespace
    around it, which must be a plain decimal number as :func:`answer_text` takes one (``" 42"`` ->
    ``"42"``). train.py appends the EOS to every completion itself, so the completion is the number alone."""
    if not isinstance(completion, str) or not completion.strip():
        raise ValueError(f"{where}: \"completion\" must be a non-empty string, the answer (like \" 42\"); got "
                         f"{completion!r}")
    text = completion.strip()
    if NUMBER_PATTERN.fullmatch(text) is None:
        raise ValueError(f"{where}: \"completion\" {completion!r} is not a number; evaluate.py scores a "
                         f"prompt/completion record whose completion is the answer alone: a plain decimal number "
                         f"(like \" 42\", \"-12\" or \"2.5\"; whitespace around it, but no other text, exponent or "
                         f"separators)")
    return text


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

    Returns ``{"count", "exact_match", "mae", "relative_error", "unparseable", "numeric_accuracy",
    "numeric_accuracy_full_vocab", "numeric_token_accuracy" (the same as the full-vocabulary one),
    "numeric_token_mae", "numeric_tokens", "per_task": {task: {same metric keys}}, "examples": [first 5
    {"prompt", "answer" or "completion", "generated", "parsed"}]}``. Means over an empty set (no
    parseable answer, no numeric answer token) are ``None``. ``per_task`` covers the items that have a
    "task". The model runs in eval mode under ``torch.no_grad`` and is put back in its previous mode;
    the tokenizer is not modified. Deterministic for a given model, data and ``batch_size``.
    """
    if not qa:
        raise ValueError("qa is empty; pass at least one {\"prompt\", \"answer\"} or {\"prompt\", \"completion\"} "
                         "item")
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    answers = [check_item(item, f"qa[{index}]") for index, item in enumerate(qa)]
    pad_token_id = _pad_token_id(tokenizer)
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    prompt_ids, text_ids, answer_starts = tokenize_items(tokenizer, qa, answers)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            generated = generate_continuations(model, tokenizer, prompt_ids, pad_token_id, batch_size, max_new_tokens)
            numeric = teacher_forced_numeric(model, vocab, text_ids, answer_starts, pad_token_id, batch_size)
    finally:
        model.train(was_training)

    records = [{"answer": _number_from_string(answer), "parsed": parse_number(continuation), **counts}
               for answer, continuation, counts in zip(answers, generated, numeric)]
    report = summarize(records)
    tasks = defaultdict(list)
    for item, record in zip(qa, records):
        if "task" in item:
            tasks[item["task"]].append(record)
    report["per_task"] = {task: summarize(tasks[task]) for task in sorted(tasks)}
    report["examples"] = [_example(item, continuation, record["parsed"])
                          for item, continuation, record in zip(qa[:_EXAMPLES], generated, records)]
    return report


def _example(item: dict, generated: str, parsed) -> dict:
    expected = "completion" if "completion" in item else "answer"
    return {"prompt": item["prompt"], expected: item[expected], "generated": generated, "parsed": parsed}


def summarize(records: list[dict]) -> dict:
    """The metric keys of the report from per-item records (answer, parsed, and the
    :func:`teacher_forced_numeric` sums)."""
    parsed = [record for record in records if record["parsed"] is not None]
    errors = [abs(record["parsed"] - record["answer"]) for record in parsed]
    relative = [error / max(abs(record["answer"]), 1) for error, record in zip(errors, parsed)]
    numeric_tokens = sum(record["numeric_tokens"] for record in records)

    def per_numeric_token(name: str) -> Optional[float]:
        return sum(record[name] for record in records) / numeric_tokens if numeric_tokens else None

    full_vocab_accuracy = per_numeric_token("full_vocab_correct")
    return {
        "count": len(records),
        "exact_match": sum(record["parsed"] == record["answer"] for record in parsed) / len(records),
        "mae": _mean(errors),
        "relative_error": _mean(relative),
        "unparseable": (len(records) - len(parsed)) / len(records),
        "numeric_accuracy": per_numeric_token("numeric_correct"),
        "numeric_accuracy_full_vocab": full_vocab_accuracy,
        "numeric_token_accuracy": full_vocab_accuracy,  # its earlier name: readers of earlier reports still work
        "numeric_token_mae": per_numeric_token("abs_error_sum"),
        "numeric_tokens": numeric_tokens,
    }


def tokenize_items(tokenizer, qa: list[dict], answers: list[str]) -> tuple[list, list, list]:
    """(prompt token ids, teacher-forced token ids, answer-span start), one of each per item, every text
    tokenized without special tokens, as train.py tokenizes its data (``smmd_train.data``): no BOS.

    A question/answer item's teacher-forced text is ``prompt + " " + answer`` (``answers``: the items'
    :func:`check_item` texts) tokenized as one text; its span starts where those tokens stop agreeing
    with the prompt's (:func:`_answer_start`). A prompt/completion item's tokens are the prompt's then
    the completion's, each text tokenized on its own, as train.py's row of that record (less the EOS,
    never a numeric target); its span starts right after the prompt.
    """
    def encode(texts: list) -> list:
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    prompt_ids = encode([item["prompt"] for item in qa])
    completions = iter(encode([item["completion"] for item in qa if "completion" in item]))
    joined = iter(encode([item["prompt"] + " " + answer for item, answer in zip(qa, answers)
                          if "completion" not in item]))
    text_ids, answer_starts = [], []
    for item, prompt in zip(qa, prompt_ids):
        if "completion" in item:
            text_ids.append(prompt + next(completions))
            answer_starts.append(max(len(prompt), 1))
        else:
            text_ids.append(next(joined))
            answer_starts.append(_answer_start(prompt, text_ids[-1]))
    return prompt_ids, text_ids, answer_starts


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
                           batch_size: int) -> list[dict]:
    """Per item, sums over its answer-span numeric targets: ``{"numeric_correct"`` (argmax over the
    numeric tokens is the target), ``"full_vocab_correct"`` (argmax over the full vocabulary is),
    ``"abs_error_sum"``, ``"numeric_tokens"}``.

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
        full_logits = logits[rows, columns]                                    # [P, V]
        numeric_logits = full_logits[:, token_ids]                             # [P, N]
        numeric_targets = targets[rows, columns]                               # [P]
        full_vocab_correct = full_logits.argmax(dim=-1) == numeric_targets
        numeric_correct = token_ids[numeric_logits.argmax(dim=-1)] == numeric_targets
        probabilities = torch.softmax(numeric_logits.double(), dim=-1)         # [P, N]
        target_values = values[torch.searchsorted(token_ids, numeric_targets)]
        abs_error = (probabilities @ values - target_values).abs()
        sums = torch.zeros(3, len(batch), dtype=torch.float64, device=model.device)  # [3, batch]
        sums.index_add_(1, rows, torch.stack([numeric_correct.double(), full_vocab_correct.double(), abs_error]))
        numeric_correct_per_row, full_vocab_correct_per_row, abs_error_per_row = sums.tolist()
        numeric_per_row = numeric.sum(dim=-1).tolist()
        for row, index in enumerate(batch):
            results[index] = {"numeric_correct": int(numeric_correct_per_row[row]),
                              "full_vocab_correct": int(full_vocab_correct_per_row[row]),
                              "abs_error_sum": abs_error_per_row[row], "numeric_tokens": numeric_per_row[row]}
    return results
