"""DEL, the Digit Entropy Loss (arXiv 2605.20369; the function ``DEL`` in PolyU-VCLab/DEL's
``train-qwen-deepseek.py``), on a digit vocabulary.

At a position whose target is a digit token y, with ``z`` the logits of the N digit tokens and ``q =
softmax(z)``:

    value = scale * w * mean_j( q_j * BCE(z_j, [j = y]) ),   BCE(z, 1) = softplus(-z), BCE(z, 0) = softplus(z)

``q`` is not detached (its gradient flows too); ``scale`` is the paper's 0.01. ``w`` is the place
weight of the digit in its number. A number is a run of consecutive positions along the sequence
whose targets are digits or a dot (``dot_token_ids``). Counted from the run's start, with ``k`` the
digit's place in the run, ``n`` the run's length and ``d`` the place of its first dot:

* a dot after the run's start (``d > 0``): a digit before it weighs ``2 (d - k)`` (units 2, tens 4,
  ...), one after it ``place_base^(d - 1 - k)`` (the first decimal ``base^-2``, the next ``base^-3``);
* otherwise (no dot, or the run starts with one): ``2 (n - k)``, every place of the run counted.

The value needs the digit logits themselves (not only their softmax): they are the numeric slice the
one exchange carries, so DEL runs on full logits, vocabulary-parallel shards and the fused linear
head with no further collective. Its gradient is hand-written (``terms_for_call``; ``numeric_value``
is its autograd reference): with ``e_j = BCE(z_j, [j = y])`` and ``E = sum_j q_j e_j``,

    d value / d z_k = scale * w / N * q_k * (e_k - E + sigmoid(z_k) - [k = y])

so a call runs no autograd of its own (nor does a compiled graph). On a
sequence shard (``smmd_scale.sequence_shard``) the runs are found in the whole sequence's targets,
which the call carries: exact with no collective.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .call_plan import NumericSlice
from .number_level import runs_along
from .numeric_loss import IGNORE_INDEX, NumericLoss, NumericTerms
from .refusal import Named, Refusal, digits_vocabulary, literal
from .sequence_shard import run_context
from .vocab import NumericVocab


class DigitEntropyLoss(NumericLoss):
    """DEL over a vocabulary of the ten digits.

    ``DigitEntropyLoss(NumericVocab.from_tokenizer(tokenizer, policy="digits"), dot_token_ids=[dot_id])``;
    options as the paper: ``place_base=1.02``, ``scale=0.01``. ``sequence_dim``: the targets'
    sequence dim (-1: ``[batch, seq]``; 0 for Megatron's ``[s, b]``). Without ``dot_token_ids`` every
    number is read as an integer.
    """

    name = "del"
    gradient = "hand-written"  # terms_for_call; numeric_value is its autograd reference
    reads_values = False  # a digit's place in its number and which digit it is, never its value

    def __init__(self, vocab: NumericVocab, dot_token_ids: Optional[Sequence[int]] = (), place_base: float = 1.02,
                 scale: float = 0.01, sequence_dim: int = -1, ignore_index: int = IGNORE_INDEX):
        super().__init__(vocab, ignore_index)
        values = vocab.values.tolist()
        found = sorted({int(value) for value in values if value in range(10)})
        others = sorted({value for value in values if value not in range(10)})
        if others or len(found) != 10:
            raise Refusal(literal(f"DEL weighs each digit by its place in its number, so it needs a vocabulary of "
                                  f"the ten digits 0..9; this one has the digits {found}"
                                  + (f" and the values {others[:5]}" if others else ""))
                          + "; build it with {digits} from a tokenizer that spells numbers digit by digit",
                          digits=digits_vocabulary())
        dots = sorted({int(token_id) for token_id in (dot_token_ids or ())})
        if set(dots) & set(vocab.token_id_list):
            raise ValueError(f"dot_token_ids {dots} include numeric tokens")
        for name, value, low in (("place_base", place_base, 1.0), ("scale", scale, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                     and value > low):
                raise Refusal("{option} must be a finite number > " + f"{low:g}", option=Named(name, value))
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"sequence_dim={sequence_dim!r} must be an int")
        self.dot_token_ids, self.place_base, self.scale = tuple(dots), float(place_base), float(scale)
        self.sequence_dim = sequence_dim
        self._dots = torch.tensor(self.dot_token_ids, dtype=torch.int64)

    def __repr__(self):
        return (f"DigitEntropyLoss(dot_token_ids={list(self.dot_token_ids)}, place_base={self.place_base:g}, "
                f"scale={self.scale:g}, sequence_dim={self.sequence_dim}, ignore_index={self.ignore_index}, "
                f"vocab={self.vocab!r})")

    def options(self) -> tuple:
        return self.dot_token_ids, self.place_base, self.scale, self.sequence_dim

    def place_weights(self, plan) -> torch.Tensor:
        """``[P]`` the place weight of each digit position of ``plan`` (float64)."""
        context = run_context(plan, self.sequence_dim)
        targets = context.targets.reshape(-1)
        digit = context.marked()
        dot = torch.isin(targets, self._dots.to(targets.device)) & (targets != self.ignore_index)
        runs = runs_along((digit | dot).view(context.targets.shape), self.sequence_dim)
        # the first dot's place in each run (past the run's end where it has none); a cell that is no
        # dot writes to a bin past the runs (an index, not a mask: no host sync)
        bin_cell = targets.numel()
        first_dot = torch.full((bin_cell + 1, ), bin_cell, dtype=runs.run.dtype, device=targets.device).scatter_reduce_(
            0, torch.where(dot, runs.run, bin_cell), runs.index, reduce="amin")[runs.run]
        cells = context.positions[context.of_call]
        index, length, first_dot = (tensor[cells].to(torch.float64) for tensor in (runs.index, runs.length, first_dot))
        has_dot = (first_dot > 0) & (first_dot < length)
        integer_places = torch.where(has_dot, first_dot - index, length - index)
        decimal = has_dot & (index > first_dot)
        return torch.where(decimal, self.place_base ** (first_dot - 1 - index), 2.0 * integer_places)

    def terms_for_call(self, plan, numeric: NumericSlice) -> NumericTerms:
        # O(P N), float64 (the numeric slice's dtype)
        logits, q = numeric.logits, numeric.q
        target = plan.numeric_targets[:, None]
        picked = logits.gather(1, target)
        entropy = torch.nn.functional.softplus(logits).scatter_add(1, target, -picked)  # e_j: BCE per digit token
        expected = (q * entropy).sum(dim=-1, keepdim=True)  # E
        factor = (self.scale / logits.shape[-1]) * self.place_weights(plan)[:, None]
        value = (factor * expected).squeeze(1)
        slope = torch.sigmoid(logits).scatter_add(1, target, torch.full_like(picked, -1.0))  # sigmoid(z_k) - [k = y]
        grad = factor * q * (entropy - expected + slope)
        return NumericTerms(value=value, grad_logits=grad, parts={self.name: value})

    def numeric_value(self, plan, numeric: NumericSlice) -> torch.Tensor:
        logits = numeric.logits
        one_hot = torch.zeros_like(logits).index_put_(
            (torch.arange(logits.shape[0], device=logits.device), plan.numeric_targets),
            torch.ones((), dtype=logits.dtype, device=logits.device))
        entropy = torch.nn.functional.softplus(logits) - one_hot * logits  # BCE with logits, per digit token
        return self.scale * self.place_weights(plan) * (numeric.q * entropy).mean(dim=-1)
