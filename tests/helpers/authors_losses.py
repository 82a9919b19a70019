"""Parity with the authors' own loss functions, through a thin adapter (nothing of theirs is vendored):

* ``SMMD_DEL_CHECKOUT``: a checkout of PolyU-VCLab/DEL. Its ``train-qwen-deepseek.py`` imports
  transformers APIs that newer releases moved, so the script is not imported: the adapter reads the
  file, takes the source of ``custom_compute_loss`` (their functions ``DEL``, ``DIST2loss`` and the
  place-weight helpers are nested in it) and executes that definition alone with the names it uses
  (torch, F, nn, math, pad_sequence), then reaches the nested functions through its code object.
* ``SMMD_NTL_CHECKOUT``: a checkout of tum-ai/number-token-loss; ``src/`` goes on PYTHONPATH and
  ``ntl.utils.label_smoother.GaussianLabelSmoother`` is used as it is, with a minimal number-token
  selector (the three attributes it reads).

Run as ``python -m helpers.authors_losses`` (tests/ on PYTHONPATH, plus the NTL checkout's src/):
it prints one JSON line ``{case: [value relative error, gradient relative error]}`` comparing ours
with theirs on fresh fp32 inputs; tests/loss/test_authors_parity.py runs it and checks the numbers.
"""

import ast
import json
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from smmd_scale import DigitEntropyLoss, DIST2Loss, GaussianLabelSmoothingLoss, NumericVocab

CASES = 6


def del_functions(checkout: Path) -> dict:
    """``{"DEL": ..., "DIST2loss": ...}``: the authors' nested functions, their own code."""
    source = (checkout / "train-qwen-deepseek.py").read_text()
    (definition, ) = [node for node in ast.parse(source).body
                      if isinstance(node, ast.FunctionDef) and node.name == "custom_compute_loss"]
    namespace = {"torch": torch, "F": F, "nn": nn, "math": math, "pad_sequence": pad_sequence}
    exec(compile(ast.Module([definition], []), str(checkout / "train-qwen-deepseek.py"), "exec"), namespace)
    outer = namespace["custom_compute_loss"]

    def nested(name, **cells):
        code = next(constant for constant in outer.__code__.co_consts
                    if isinstance(constant, types.CodeType) and constant.co_name == name)
        return types.FunctionType(code, outer.__globals__, name, None,
                                  tuple(types.CellType(cells[free]) for free in code.co_freevars))

    return {"DEL": nested("DEL", generate_place=nested("generate_place")),
            "DIST2loss": nested("DIST2loss", generate_integer_place=nested("generate_integer_place"))}


class DigitTokenizer:
    """What the authors' functions ask of a tokenizer: the ids of "0".."9" and "."."""

    def __init__(self, ids: dict):
        self.ids = ids

    def convert_tokens_to_ids(self, tokens):
        return [self.ids[token] for token in tokens]


def relative(ours, theirs) -> float:
    ours, theirs = ours.double(), theirs.double()
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def digit_stream(generator, length: int, vocab_size: int):
    """A flattened batch of valid labels (the authors' functions take ``labels[labels != -100]``):
    digits in runs, dots, other ids; and fp32 logits."""
    ids = torch.randperm(vocab_size, generator=generator)
    digits, dot = ids[:10], int(ids[10])
    choice = torch.rand(length, generator=generator)
    labels = torch.randint(0, vocab_size, (length, ), generator=generator)
    labels = torch.where(choice < 0.6, digits[torch.randint(0, 10, (length, ), generator=generator)], labels)
    labels = torch.where((choice >= 0.6) & (choice < 0.7), torch.full_like(labels, dot), labels)
    logits = 3 * torch.randn(length, vocab_size, generator=generator)
    tokenizer = DigitTokenizer({**{str(value): int(digits[value]) for value in range(10)}, ".": dot})
    vocab = NumericVocab(digits.tolist(), list(range(10)), vocab_size)
    return vocab, dot, tokenizer, labels, logits


def del_cases(checkout: Path, generator) -> dict:
    theirs = del_functions(checkout)
    results = {}
    for case in range(CASES):
        vocab, dot, tokenizer, labels, logits = digit_stream(generator, 64, 48)
        # DEL: the mean over digit positions, a scalar
        mine = logits.clone().requires_grad_(True)
        value = DigitEntropyLoss(vocab, dot_token_ids=[dot])(mine[None], labels[None])
        value.backward()
        reference = logits.clone().requires_grad_(True)
        expected = theirs["DEL"](reference, labels, tokenizer)
        expected.backward()
        results[f"del-{case}"] = [relative(value.detach(), expected.detach()), relative(mine.grad, reference.grad)]
        # DIST2loss: per digit position, weighted by its integer place, temperature 1
        mine = logits.clone().requires_grad_(True)
        values = DIST2Loss(vocab, tau=1.0, place_weighted=True)(mine[None], labels[None], reduction="none")[0]
        positions = torch.isin(labels, vocab.token_ids)
        values[positions].sum().backward()
        reference = logits.clone().requires_grad_(True)
        expected = theirs["DIST2loss"](reference, labels, tokenizer)
        expected.sum().backward()
        results[f"dist2-{case}"] = [relative(values[positions].detach(), expected.detach()),
                                    relative(mine.grad, reference.grad)]
    return results


def gaussian_cases(generator) -> dict:
    from ntl.utils.label_smoother import GaussianLabelSmoother

    results = {}
    for case in range(CASES):
        vocab_size, batch, length = 120, 3, 20  # > 100: the smoother indexes its value table by -100 too
        number_ids = torch.randperm(vocab_size, generator=generator)[:int(torch.randint(3, 30, (1, ),
                                                                                       generator=generator))]
        values = torch.randperm(200, generator=generator)[:len(number_ids)].float()
        table = torch.full((vocab_size, ), float("nan"))
        table[number_ids] = values
        selector = SimpleNamespace(number_token_indices=number_ids.tolist(), nvocab=table, number_token_values=values)
        sigma = 0.5 + 3 * torch.rand(1, generator=generator).item()
        labels = torch.randint(0, vocab_size, (batch, length), generator=generator)
        pick = torch.rand(batch, length, generator=generator)
        labels = torch.where(pick < 0.5, number_ids[torch.randint(0, len(number_ids), (batch, length),
                                                                  generator=generator)], labels)
        labels = torch.where(pick > 0.9, torch.full_like(labels, -100), labels)
        logits = 3 * torch.randn(batch, length, vocab_size, generator=generator)
        reference = logits.clone().requires_grad_(True)
        expected = GaussianLabelSmoother(sigma=sigma, selector=selector)({"logits": reference}, labels)
        expected.backward()
        # the smoother: CE at other tokens, the Gaussian-smoothed CE at number tokens, mean over valid tokens
        vocab = NumericVocab(number_ids.tolist(), values.tolist(), vocab_size)
        loss = GaussianLabelSmoothingLoss(vocab, sigma=sigma)
        mine = logits.clone().requires_grad_(True)
        per_token = F.cross_entropy(mine.reshape(-1, vocab_size), labels.reshape(-1), reduction="none")
        numeric = loss.numeric_mask(labels).reshape(-1)
        smoothed = loss(mine, labels, reduction="none").reshape(-1)
        value = torch.where(numeric, smoothed, per_token).sum() / (labels != -100).sum()
        value.backward()
        results[f"gauss-ls-{case}"] = [relative(value.detach(), expected.detach()),
                                       relative(mine.grad, reference.grad)]
    return results


def main() -> None:
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    results = {}
    if os.environ.get("SMMD_DEL_CHECKOUT"):
        results.update(del_cases(Path(os.environ["SMMD_DEL_CHECKOUT"]), generator))
    if os.environ.get("SMMD_NTL_CHECKOUT"):
        results.update(gaussian_cases(generator))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
