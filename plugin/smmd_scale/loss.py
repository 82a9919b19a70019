"""CE + a numeric loss on materialized logits: the op, its autograd and its reductions
(docs/objective.md).

No ``torch.distributed`` here: under tensor parallelism the forward hands this rank's contribution
to the exchange (``call_plan.run_exchange``, one all-reduce) and gets back what every rank needs;
the single-device path skips that step. The steps are ``steps.py``'s, shared with the fused
linear head (``fused_linear.py``).

Memory: the op keeps **one** ``[tokens, V_local]`` working buffer in the compute dtype (float32, or
float64 for float64 logits): the local softmax, kept for backward and turned into the gradient in
place. The numeric part reads only ``[P, N]`` numeric logits at the P numeric-target positions
(never a ``[P, V]`` block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .call_plan import CallPlan, LogitsSpec, NumericLossLike, check_numeric_loss, check_weight, plan_call
from .deprecation import renamed, renamed_class, warn_renamed
from .steps import (
    claim_single_backward,
    cross_entropy_per_token,
    exchange_or_keep_local,
    gather_numeric_logits,
    gather_target_logits,
    local_softmax_and_logsumexp,
    numeric_loss_and_gradient,
    numeric_per_token,
    row_multipliers,
    softmax_rescale,
    stat_sums,
    stats_dict,
)


@dataclass
class NumericOutput:
    """Result of :func:`numeric_cross_entropy` (and :func:`smmd_scale.linear_numeric_cross_entropy`).

    total, ce, numeric: scalar tensors with grad; ``total = ce + weight * numeric``, ``numeric`` being
        the call's numeric loss (SMMD, NTL, or a weighted sum of them).
    stats: detached Python floats — the numeric loss's parts as means over numeric positions
        (SMMD: ``smmd``, ``mmd`` and ``smooth``; NTL: ``ntl_was`` or ``ntl_mse``), ``numeric_tokens``
        (P), ``numeric_accuracy`` (argmax over the numeric tokens is the target token),
        ``numeric_mae`` (|E_q[value] - target value|), ``comm_calls`` and ``comm_bytes`` (this
        call's collectives and their payload bytes), ``tokens`` (non-ignored targets).
    """

    total: torch.Tensor
    ce: torch.Tensor
    numeric: torch.Tensor
    stats: dict

    @property
    def smmd(self) -> torch.Tensor:
        """Deprecated name of :attr:`numeric` (kept for one release)."""
        warn_renamed("NumericOutput.smmd", "NumericOutput.numeric")
        return self.numeric


class PerTokenLosses(NamedTuple):
    """CE and the numeric loss per position, unreduced, ``[T]`` each (T = targets.numel()); CE is 0 at
    ignored positions, the numeric loss 0 where the target is not numeric. ``plan``: the call's
    plan; ``stat_sums``: its statistics (``steps.stat_sums``), detached."""

    ce: torch.Tensor
    numeric: torch.Tensor
    plan: CallPlan
    stat_sums: torch.Tensor

    def stats(self) -> dict:
        return stats_dict(self.plan.loss.stat_names, self.stat_sums, int(self.plan.positions.numel()))


class _CrossEntropyAndNumeric(torch.autograd.Function):
    """``logits [T, V_local]`` -> (CE ``[T]``, numeric loss ``[T]``, statistics), one working buffer."""

    @staticmethod
    def forward(ctx, logits, plan: CallPlan):
        compute_dtype = plan.compute_dtype
        softmax, local_lse = local_softmax_and_logsumexp(logits, compute_dtype)
        pieces = exchange_or_keep_local(plan, gather_numeric_logits(logits, plan.positions,
                                                                    plan.local_numeric_columns),
                                        local_lse, gather_target_logits(logits, plan.local_targets, plan.owned))
        ce = cross_entropy_per_token(pieces.lse, pieces.target_logits.to(compute_dtype), plan.valid)
        numeric = numeric_loss_and_gradient(plan, pieces.numeric_logits, pieces.lse)
        sums = stat_sums(plan, numeric, pieces.comm)
        ctx.mark_non_differentiable(sums)

        ctx.consumed = False
        ctx.logits_dtype = logits.dtype
        ctx.plan, ctx.numeric_grad, ctx.row_coefficient = plan, numeric.grad, numeric.row_coefficient
        if ctx.needs_input_grad[0]:
            # Under tensor parallelism the global softmax is softmax_local * exp(lse_local - lse).
            row_scale = softmax_rescale(local_lse, pieces.lse) if plan.tensor_parallel else torch.ones_like(ce)
            ctx.save_for_backward(softmax, row_scale)
        return ce, numeric_per_token(plan, numeric, ce), sums

    @staticmethod
    def backward(ctx, grad_ce, grad_numeric, _grad_stats):
        claim_single_backward(ctx)
        softmax, row_scale = ctx.saved_tensors
        plan = ctx.plan
        grad = softmax  # the working buffer becomes the gradient
        grad.mul_((row_scale * row_multipliers(plan, ctx.row_coefficient, grad_ce, grad_numeric, grad.dtype))[:, None])
        rows = plan.owned.nonzero().squeeze(1)
        grad_ce = grad_ce.to(grad.dtype)
        grad.index_put_((rows, plan.local_targets[rows]), -grad_ce[rows], accumulate=True)
        lo, hi = plan.numeric_columns
        if hi > lo and plan.positions.numel():
            numeric_rows = ctx.numeric_grad[:, lo:hi] * grad_numeric[plan.positions].to(grad.dtype)[:, None]
            grad.index_put_((plan.positions[:, None], plan.local_numeric_columns[None, :]), numeric_rows,
                            accumulate=True)
        return grad.to(ctx.logits_dtype), None


class _NumericOnly(torch.autograd.Function):
    """``logits [T, V_local]`` -> (the numeric loss per numeric position ``[P]``, statistics); reads
    only ``[P, N]`` logits (for losses that do not need the full softmax's mass on the numeric tokens)."""

    @staticmethod
    def forward(ctx, logits, plan: CallPlan):
        pieces = exchange_or_keep_local(plan, gather_numeric_logits(logits, plan.positions,
                                                                    plan.local_numeric_columns))
        numeric = numeric_loss_and_gradient(plan, pieces.numeric_logits)
        sums = stat_sums(plan, numeric, pieces.comm)
        ctx.mark_non_differentiable(sums)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        ctx.plan, ctx.numeric_grad = plan, numeric.grad
        return numeric.value.to(plan.compute_dtype), sums

    @staticmethod
    def backward(ctx, grad_value, _grad_stats):
        plan = ctx.plan
        grad = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_value.device)
        lo, hi = plan.numeric_columns
        if hi > lo and plan.positions.numel():
            rows = ctx.numeric_grad[:, lo:hi] * grad_value.to(ctx.numeric_grad.dtype)[:, None]
            grad[plan.positions[:, None], plan.local_numeric_columns[None, :]] = rows.to(ctx.logits_dtype)
        return grad, None


def logits_spec(logits, targets) -> LogitsSpec:
    """The :class:`LogitsSpec` of ``logits`` after the type checks every op runs first."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"logits and targets must be torch.Tensors, got {type(logits).__name__} and "
                        f"{type(targets).__name__}")
    if logits.dim() < 1:
        raise ValueError(f"logits must have a last (vocabulary) dim, got shape {tuple(logits.shape)}")
    return LogitsSpec.of(logits)


def numeric_loss_mean(numeric_loss: NumericLossLike, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                      vocab_start_index: Optional[int] = 0) -> torch.Tensor:
    """The mean of ``numeric_loss`` over numeric-target positions (what ``numeric_loss(logits, targets)``
    returns); an exact 0 that still back-propagates when there are none."""
    spec = logits_spec(logits, targets)
    if numeric_loss.needs_mass:  # the mass needs the full softmax: the CE op, with CE left unused
        losses = per_token_losses(logits, targets, numeric_loss, tp_group, vocab_start_index)
        return losses.numeric.sum() / max(losses.plan.positions.numel(), 1)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=False)
    values, _ = _NumericOnly.apply(logits.reshape(-1, spec.width), plan)
    return values.sum() / max(values.numel(), 1)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor, numeric_loss: NumericLossLike, tp_group=None,
                     vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                     weight: Optional[float] = None, num_numeric_in_batch=None) -> PerTokenLosses:
    """CE and the numeric loss per position of ``logits [..., V_local]``, unreduced (the building
    block of :func:`numeric_cross_entropy` and of the Megatron entry point, which applies its own mask)."""
    check_numeric_loss(numeric_loss)
    spec = logits_spec(logits, targets)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=True,
                     num_items_in_batch=num_items_in_batch, weight=weight, num_numeric_in_batch=num_numeric_in_batch)
    ce, numeric, sums = _CrossEntropyAndNumeric.apply(logits.reshape(-1, spec.width), plan)
    return PerTokenLosses(ce, numeric, plan, sums)


def _count(count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, device=like.device, dtype=like.dtype).clamp_min(1)


def reduce_losses(losses: PerTokenLosses, weight: float, num_items_in_batch=None,
                  num_numeric_in_batch=None) -> NumericOutput:
    """Per-token CE and numeric loss -> :class:`NumericOutput`.

    With the optimizer step's counts — ``num_items_in_batch`` (its valid targets) and
    ``num_numeric_in_batch`` (its numeric-target positions), over all its micro-batches and data-
    and sequence-parallel ranks — the call returns its *share* of the step's objective: ``ce =
    sum(CE) / num_items_in_batch`` and ``numeric = sum(numeric loss) / num_numeric_in_batch``.
    Summed over the step's calls, the shares are the step's objective, whatever the layout (a call
    without numbers adds 0 to the numeric term).

    Without counts a call keeps its own means: CE over its non-ignored targets (0 if none), the
    numeric loss over its numeric-target positions. With ``num_items_in_batch`` alone (what the
    HF Trainer passes) CE is its share, and the numeric mean is weighted by the call's share of
    the tokens (``tokens / num_items_in_batch``), which keeps it at its mean scale but weighs each
    micro-batch by its tokens, not by its numbers.
    """
    plan = losses.plan
    valid_tokens = plan.valid.sum()
    numeric_sum = losses.numeric.sum()
    ce = losses.ce.sum() / (valid_tokens.clamp_min(1) if num_items_in_batch is None
                            else _count(num_items_in_batch, losses.ce))
    if num_numeric_in_batch is not None:
        numeric_term = numeric_sum / _count(num_numeric_in_batch, losses.numeric)
    else:
        numeric_term = numeric_sum / max(int(plan.positions.numel()), 1)
        if num_items_in_batch is not None:
            numeric_term = numeric_term * valid_tokens / _count(num_items_in_batch, losses.ce)
    return NumericOutput(total=ce + weight * numeric_term, ce=ce, numeric=numeric_term, stats=losses.stats())


def numeric_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, numeric_loss: NumericLossLike,
                          weight: float = 1.0, tp_group=None, vocab_start_index: Optional[int] = 0,
                          num_items_in_batch=None, num_numeric_in_batch=None) -> NumericOutput:
    """CE + weight * a numeric loss (SMMD, NTL or a weighted sum) in one pass over ``logits [..., V]``
    or a vocab-parallel shard (``tp_group``, ``vocab_start_index``). ``targets [...]`` are aligned
    with the logits (no shift). The reductions are :func:`reduce_losses`': given the optimizer
    step's ``num_items_in_batch`` and ``num_numeric_in_batch``, the call's share of the step's
    objective, the same for any micro-batch, accumulation or parallel layout."""
    weight = check_weight(weight)
    losses = per_token_losses(logits, targets, numeric_loss, tp_group, vocab_start_index, num_items_in_batch, weight,
                              num_numeric_in_batch)
    return reduce_losses(losses, weight, num_items_in_batch, num_numeric_in_batch)


smmd_cross_entropy = renamed(numeric_cross_entropy, "smmd_cross_entropy", {"smmd": "numeric_loss"})
SMMDOutput = renamed_class(NumericOutput, "SMMDOutput")
