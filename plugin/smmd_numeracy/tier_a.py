"""Tier A of the numeracy study (benchmarks/numeracy/study_a.py) and the demo's task: one-token
arithmetic, where a tiny model can learn the task.

Every problem is ``a<op>b= c`` with ``a``, ``b`` and the answer ``c`` each one token of the
Llama-3-style tokenizer (0..999 are single tokens; ``smmd_numeracy.train_numeric_tokenizer``):

``add``  a + b                 (a, b in the operand range)
``sub``  a - b, a >= b         (result >= 0)
``dist`` |a - b|               (the bounded third operation, written ``a~b=``: the distance, so
                               half of its pairs need the operands' order, unlike ``sub``)

Splits (``build_data``), all disjoint in (op, a, b):

``train``  the training pairs: every in-range pair except the held-out ones;
``val``    a held-out share of in-range pairs, used only to choose NTL-MSE's weight;
``test``   another held-out share of in-range pairs (interpolation), never used for choices;
``oor``    out of range: at least one operand in the band above the operand range. Those tokens
           never occur as operands in training, only as answers of ``add`` and in the counting
           lines (below), so with the tied embeddings a model knows them from the output side only.

The text of one problem is ``"37+45=82"`` (6 tokens with the newline); the evaluation prompt is
``"37+45="`` and the greedy continuation's first number is the answer (``evaluate_model``; it
also scores the first generated token alone, a post-hoc check).
Documents are ``PROBLEMS_PER_DOCUMENT`` problems joined by newlines; the trainer packs them
GPT-style, so the loss (CE and the numeric loss alike) covers every token, including the operands,
which are unpredictable: only the answer carries signal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATIONS = ("add", "sub", "dist")
# The study's and the demo's settings: data, tokenizer, model and training (benchmarks/numeracy/README.md).
SETTINGS = {
    "operand_range": 100, "held_out_share": 0.2, "oor_band": 50, "eval_per_split": 600, "data_seed": 0,
    "counting_share": 0.25, "vocab_size": 1400, "model": "tiny", "seq_len": 64, "micro_batch_size": 8,
    "steps": 2000, "lr": 3e-3, "warmup_steps": 200, "eval_every": 500, "eval_batches": 4,
    "deepspeed_config": "ds_configs/zero3.json", "threads": 1, "nice": 5,
}
# The study's pre-registered arms: name -> train.py options. ``ntl_mse``'s weight is chosen on the
# validation split (``None`` here); ``random_kernel`` is SMMD with a value-agnostic kernel.
ARMS = {
    "ce": {"numeric_loss": ["smmd:0"]},
    "smmd": {"numeric_loss": ["smmd:1"]},
    "ntl_was": {"numeric_loss": ["ntl-was:0.3"], "ntl_squash_factor": 9.0},
    "ntl_mse": None,
    "smmd_ntl_was": {"numeric_loss": ["smmd:1", "ntl-was:0.3"], "ntl_squash_factor": 9.0},
    "random_kernel": {"numeric_loss": ["smmd:1"], "smmd_kernel": "random"},
}

# Tier A' (benchmarks/numeracy/study_aprime.py): SMMD on raw value distances (no squashing), its bandwidth
# sigma (value units) and weight chosen on validation; the control is the same kernel on values shuffled
# across the tokens (a gaussian Gram matrix of permuted points: positive semi-definite, value-agnostic).
# Every validation and test pair is scored; out of range, 200 per operation as in Tier A.
PRIME_SETTINGS = dict(SETTINGS, eval_per_split=None, oor_per_split=600)
PRIME_ARMS = ("ce", "smmd_raw", "shuffled_kernel")
PRIME_SIGMAS = (3.0, 10.0, 30.0)
PRIME_WEIGHTS = (0.1, 0.3, 1.0)


def raw_smmd_flags(sigma: float, weight: float, shuffled: bool = False) -> dict:
    """train.py options of SMMD on raw value distances with bandwidth ``sigma`` (value units) at
    ``weight``; ``shuffled``: the same kernel on values permuted across the tokens (the control)."""
    flags = {"numeric_loss": [f"smmd:{weight:g}"], "smmd_squash_factor": 0.0, "smmd_sigmas": [sigma]}
    return {**flags, "smmd_kernel": "shuffled"} if shuffled else flags


def arm_flags(arm: str, ntl_mse_weight=None) -> dict:
    """train.py's loss options of study arm ``arm``; ``ntl_mse`` needs the weight chosen on validation."""
    if arm not in ARMS:
        raise ValueError(f"unknown Tier A arm {arm!r}; choose one of {', '.join(ARMS)}")
    if arm != "ntl_mse":
        return ARMS[arm]
    if ntl_mse_weight is None:
        raise ValueError("arm ntl_mse needs the NTL-MSE weight the study chose on validation (results/tier_a.json "
                         "has it once the study has run)")
    return {"numeric_loss": [f"ntl-mse:{ntl_mse_weight:g}"]}


SYMBOL = {"add": "+", "sub": "-", "dist": "~"}
PROBLEMS_PER_DOCUMENT = 8
COUNTING_LENGTH = 24
SPLITS = ("train", "val", "test", "oor")


def answer(op: str, a: int, b: int) -> int:
    return a + b if op == "add" else a - b if op == "sub" else abs(a - b)


def pairs(op: str, low: int, high: int) -> list:
    """(a, b) with both operands in [low, high) whose answer is a single 0..999 token."""
    return [(a, b) for a in range(low, high) for b in range(low, high)
            if (op != "sub" or a >= b) and 0 <= answer(op, a, b) <= 999]


def oor_pairs(op: str, operand_range: int, band: int) -> list:
    """Pairs with at least one operand in [operand_range, operand_range + band) and the other in
    [0, operand_range + band), answer still one token."""
    return [(a, b) for a, b in pairs(op, 0, operand_range + band) if max(a, b) >= operand_range]


def text(op: str, a: int, b: int) -> str:
    return f"{prompt(op, a, b)}{answer(op, a, b)}"


def prompt(op: str, a: int, b: int) -> str:
    return f"{a}{SYMBOL[op]}{b}="


def split_pairs(operand_range: int, held_out_share: float, oor_band: int, seed: int) -> dict:
    """{split: [(op, a, b)]}: per operation, a ``held_out_share`` of the in-range pairs whose operands
    are both >= 2 is held out and halved into val and test; the rest is train (pairs with an operand 0
    or 1 always train: the counting lines state every n + 1 = n + 1 fact anyway); ``oor`` is every
    out-of-range pair."""
    rng = random.Random(f"tier_a/{seed}")
    splits = {split: [] for split in SPLITS}
    for op in OPERATIONS:
        in_range = pairs(op, 0, operand_range)
        eligible = [(a, b) for a, b in in_range if min(a, b) >= 2]
        rng.shuffle(eligible)
        held = round(len(in_range) * held_out_share)
        splits["val"] += [(op, a, b) for a, b in eligible[:held // 2]]
        splits["test"] += [(op, a, b) for a, b in eligible[held // 2:held]]
        held_out = set(eligible[:held])
        splits["train"] += [(op, a, b) for a, b in in_range if (a, b) not in held_out]
        splits["oor"] += [(op, a, b) for a, b in oor_pairs(op, operand_range, oor_band)]
    return splits


def counting_lines(count: int, length: int, seed: int) -> list:
    """``count`` runs of ``length`` consecutive numbers from a random start in 0..999, comma-separated
    ("37,38,39,..."): every number token in order, the number line the arithmetic is built on."""
    rng = random.Random(f"tier_a/counting/{seed}")
    lines = []
    for _ in range(count):
        start = rng.randrange(0, 1000 - length + 1)
        lines.append(",".join(str(number) for number in range(start, start + length)))
    return lines


def _documents(problems: list) -> list:
    return ["\n".join(text(*problem) for problem in problems[start:start + PROBLEMS_PER_DOCUMENT])
            for start in range(0, len(problems), PROBLEMS_PER_DOCUMENT)]


def write_files(out_dir, tables: dict) -> dict:
    """Each of ``tables`` ({name: rows}) as JSON lines in ``out_dir``/<name>.jsonl, the folder made if
    missing; returns {name: its path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        with open(out_dir / f"{name}.jsonl", "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    return {name: str(out_dir / f"{name}.jsonl") for name in tables}


def data_and_tokenizer(work_dir, settings: dict = SETTINGS) -> dict:
    """``build_data`` of ``settings`` into ``work_dir``/data and a Llama-3-style tokenizer of
    ``settings["vocab_size"]`` tokens trained on its training text, saved in ``work_dir``/tokenizer (the
    demo's data, and the training benchmarks' numeric corpus); ``build_data``'s dict with ``tokenizer``."""
    from .tokenizer import train_numeric_tokenizer

    work_dir = Path(work_dir)
    data = build_data(work_dir / "data", operand_range=settings["operand_range"],
                      held_out_share=settings["held_out_share"], oor_band=settings["oor_band"],
                      eval_per_split=settings["eval_per_split"], counting_share=settings["counting_share"],
                      seed=settings["data_seed"])
    with open(data["train"]) as handle:
        texts = [json.loads(line)["text"] for line in handle]
    train_numeric_tokenizer(texts, vocab_size=settings["vocab_size"]).save_pretrained(work_dir / "tokenizer")
    return {**data, "tokenizer": str(work_dir / "tokenizer")}


def build_data(out_dir, *, operand_range: int, held_out_share: float, oor_band: int, eval_per_split,
               counting_share: float = 0.0, seed: int = 0, oor_per_split="eval_per_split") -> dict:
    """Write the Tier A files under ``out_dir``; returns their paths and the split sizes.

    ``train.jsonl``  {"text"}: every training pair once, shuffled, in documents (one epoch = all pairs),
                     with counting lines (``counting_lines``) making up ``counting_share`` of the documents;
    ``eval.jsonl``   {"text"}: test pairs in documents, for train.py's periodic held-out CE/accuracy;
    ``qa_eval.jsonl`` {"prompt", "answer", "task"}: up to ``eval_per_split`` problems of each of val and
                     test (None: every pair of the split) and up to ``oor_per_split`` of oor (by default
                     ``eval_per_split``), task = "<split>/<op>", sampled evenly over the operations;
    """
    if not 0 <= counting_share < 1:
        raise ValueError(f"counting_share must be in [0, 1); got {counting_share!r}")
    if not 0 < held_out_share < 1:
        raise ValueError(f"held_out_share must be in (0, 1); got {held_out_share!r}")
    oor_per_split = eval_per_split if oor_per_split == "eval_per_split" else oor_per_split
    if operand_range < 2 or oor_band < 1 or any(count is not None and count < len(OPERATIONS)
                                                 for count in (eval_per_split, oor_per_split)):
        raise ValueError(f"need operand_range >= 2, oor_band >= 1, eval_per_split and oor_per_split None or >= "
                         f"{len(OPERATIONS)}; got {operand_range}, {oor_band}, {eval_per_split}, {oor_per_split}")
    splits = split_pairs(operand_range, held_out_share, oor_band, seed)
    rng = random.Random(f"tier_a/files/{seed}")
    train = list(splits["train"])
    rng.shuffle(train)
    documents = _documents(train)
    counting = round(len(documents) * counting_share / (1 - counting_share))
    documents += counting_lines(counting, COUNTING_LENGTH, seed)
    rng.shuffle(documents)
    qa, eval_problems = [], []
    for split in ("val", "test", "oor"):
        for op in OPERATIONS:
            chosen = [problem for problem in splits[split] if problem[0] == op]
            rng.shuffle(chosen)
            count = oor_per_split if split == "oor" else eval_per_split
            chosen = chosen if count is None else chosen[:count // len(OPERATIONS)]
            qa += [{"prompt": prompt(*problem), "answer": answer(*problem), "task": f"{split}/{op}"}
                   for problem in chosen]
            if split == "test":
                eval_problems += chosen
    rng.shuffle(eval_problems)
    paths = write_files(out_dir, {"train": [{"text": document} for document in documents],
                                  "eval": [{"text": document} for document in _documents(eval_problems)],
                                  "qa_eval": qa})
    sizes = {f"{split}_pairs": len(problems) for split, problems in splits.items()}
    sizes.update({f"{split}_{op}_pairs": sum(problem[0] == op for problem in problems)
                  for split, problems in splits.items() for op in OPERATIONS})
    return {**paths, **sizes, "counting_documents": counting, "qa_items": len(qa)}


# ----------------------------------------------------------------------------------------------
# Evaluation: greedy answers per item (exact match, MAE, within +-1 need the per-item answers)
# ----------------------------------------------------------------------------------------------

def score(items: list, parsed: list) -> dict:
    """Exact match, MAE and the share within +-1 of the answer, per task and over each split.

    ``items`` are qa_eval rows ({"prompt", "answer", "task" = "<split>/<op>"}), ``parsed`` the number
    each greedy answer starts with (None when there is none). An unparseable answer counts as wrong
    for exact match and within +-1 and is left out of ``mae`` (its share is reported); ``mae_capped``
    counts every item, each error at most the split's cap (``mae_cap``: the span of the split's answers,
    largest - smallest, at least 1) and an unparseable answer as the cap."""
    if len(items) != len(parsed):
        raise ValueError(f"one parsed answer per item needed; got {len(parsed)} for {len(items)} items")
    caps = answer_spans(items)
    groups: dict = {}
    for item, value in zip(items, parsed):
        split = item["task"].split("/")[0]
        for key in (item["task"], split):
            groups.setdefault(key, []).append((item["answer"], value))
    report = {}
    for key, rows in sorted(groups.items()):
        errors = [abs(value - truth) for truth, value in rows if value is not None]
        report[key] = {"count": len(rows),
                       "exact_match": sum(value == truth for truth, value in rows) / len(rows),
                       "within_1": sum(value is not None and abs(value - truth) <= 1 for truth, value in rows)
                       / len(rows),
                       "mae": sum(errors) / len(errors) if errors else None,
                       "mae_capped": capped_mae(rows, caps[key.split("/")[0]]), "mae_cap": caps[key.split("/")[0]],
                       "unparseable": sum(value is None for _, value in rows) / len(rows)}
    return report


def answer_spans(items: list) -> dict:
    """{split: largest answer - smallest answer over the split's items, at least 1}: the cap of
    ``capped_mae``, the largest error an answer inside the split's own range can have."""
    answers: dict = {}
    for item in items:
        answers.setdefault(item["task"].split("/")[0], []).append(item["answer"])
    return {split: max(1, max(values) - min(values)) for split, values in answers.items()}


def capped_mae(rows: list, cap) -> float:
    """Mean over all ``rows`` ((truth, parsed or None)) of min(|parsed - truth|, cap), an unparseable
    answer counting as ``cap``: no answer is dropped."""
    return sum(cap if value is None else min(abs(value - truth), cap) for truth, value in rows) / len(rows)


def evaluate_model(model_dir, qa_path, batch_size: int = 200, max_new_tokens: int = 3, parse=None,
                   first_token: bool = False) -> dict:
    """Greedy answers of the exported model in ``model_dir`` on ``qa_path``: ``score``'s report and
    the per-item answers. Deterministic on one thread (the model runs in eval mode, no sampling).

    ``max_new_tokens`` bounds each continuation; ``parse`` reads the answer from it (default
    ``parse_number``, the first number; Tier B passes its whole-answer parser).

    Tier A's pre-registered scoring is the first number in a greedy continuation of 3 tokens. A
    continuation can run two number tokens together ("179" "196" reads as 179196), which no
    one-token answer can be, so with ``first_token=True`` ``metrics_first_token`` /
    ``answers_first_token`` also score the first generated token alone (greedy: the same first
    token). That second scoring was added after the first results were seen (benchmarks/numeracy/
    README.md, Tier A) and is reported as post hoc beside the pre-registered one, never instead of it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import generate_continuations, load_qa, parse_number

    parse = parse or parse_number
    items = load_qa(qa_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = tokenizer([item["prompt"] for item in items])["input_ids"]
    with torch.no_grad():
        texts = generate_continuations(model, tokenizer, prompt_ids, tokenizer.pad_token_id, batch_size,
                                       max_new_tokens=max_new_tokens)
        first_tokens = (generate_continuations(model, tokenizer, prompt_ids, tokenizer.pad_token_id, batch_size,
                                               max_new_tokens=1) if first_token else None)
    parsed = [parse(text) for text in texts]
    result = {"metrics": score(items, parsed), "answers": parsed}
    if first_token:
        first = [parse(text) for text in first_tokens]
        result.update(metrics_first_token=score(items, first), answers_first_token=first)
    return result
