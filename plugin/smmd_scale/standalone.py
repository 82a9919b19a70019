"""A numeric loss called on its own, ``loss(logits, targets)``: no CE, and no pass over the whole
logits.

The numeric part of the loss reads only the ``[P, N]`` numeric logits at the P numeric-target
positions. A loss that weighs by the probability mass of the numeric tokens (NTL's ``reweigh``)
also needs each such position's full-vocabulary log-sum-exp; it is computed from the P full rows
alone, in blocks of rows (never a ``[tokens, V]`` buffer), as the log-sum-exp of the *non-numeric*
columns, so that ``1 - mass = S_other / (S_numeric + S_other)`` keeps its relative accuracy when
the mass is close to 1 (a fp32 full-row log-sum-exp rounds ``1 - mass`` to about 1e-7, which
the reweighed NTL-MSE multiplies by ``1.01 * (max v - min v)^2``). Vocab-parallel: each rank's
non-numeric log-sum-exp travels in the exchange's log-sum-exp slots, the numeric logits as
usual: still the one collective, none in backward.

Reductions are ntloss's: ``"mean"`` (weighted by ``loss_weights`` at the positions that carry a
value, divided by their sum), ``"sum"`` and ``"none"`` (the targets' shape, 0 where no value lives).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import checks
from .call_plan import CallPlan, LogitsSpec, NumericLossLike, check_numeric_loss, plan_call
from .steps import (
    ShiftedLogSumExp,
    exchange_or_keep_local,
    gather_numeric_logits,
    numeric_terms_and_gradient,
    row_blocks,
)


def other_logsumexp(logits: torch.Tensor, plan: CallPlan, positions: torch.Tensor) -> ShiftedLogSumExp:
    """``[T]`` log-sum-exp of this shard's non-numeric columns at ``positions`` (shift 0 and
    ``log_sum = -inf`` elsewhere and where every such logit is -inf), in the compute dtype."""
    tokens = plan.targets.numel()
    shift = torch.zeros(tokens, dtype=plan.compute_dtype, device=logits.device)
    log_sum = torch.full((tokens, ), float("-inf"), dtype=plan.compute_dtype, device=logits.device)
    for start, end in row_blocks(int(positions.numel()), logits.shape[1], logits.device):
        rows = positions[start:end]
        block = logits[rows].to(plan.compute_dtype)
        block[:, plan.local_numeric_columns] = float("-inf")
        row_max = block.amax(dim=-1) if block.shape[1] else torch.full_like(block[:, 0], float("-inf"))
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        shift[rows] = row_max
        log_sum[rows] = block.sub_(row_max[:, None]).exp_().sum(dim=-1).log()
    return ShiftedLogSumExp(shift, log_sum)


class AloneGradient(NamedTuple):
    """The loss at the P numeric positions and its gradient, float64.

    value:           ``[P]``
    numeric_grad:    ``[P, N]`` d value / d numeric logits, all of it (the mass's part included)
    row_coefficient: ``[P]`` or None: d value / d a non-numeric logit is ``row_coefficient * p_k``
    lse:             ``[P]`` the full-vocabulary log-sum-exp (None without the mass)
    mass_rows:       which of the P rows the mass was read at (None: all); the others' is not formed
    """

    value: torch.Tensor
    numeric_grad: torch.Tensor
    row_coefficient: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    mass_rows: Optional[torch.Tensor]


def loss_and_gradient(plan: CallPlan, numeric_logits: torch.Tensor, other: Optional[ShiftedLogSumExp],
                      mass_rows: Optional[torch.Tensor] = None) -> AloneGradient:
    """The plan's loss from the numeric logits ``[P, N]`` and (for a loss that needs the mass) the
    non-numeric log-sum-exp ``other`` (``[T]``), in float64. With ``d = lse_other - lse_numeric``,
    ``mass = sigmoid(-d)`` and ``1 - mass = sigmoid(d)``: both keep their relative accuracy. A numeric
    column's whole gradient is formed here, where the mass's part ``g * (1 - mass) * q`` (``g``: d value
    / d log(mass))
    is small when the mass is close to 1 (as two fp32 terms it would cancel)."""
    logits = numeric_logits.double()
    mass = log_mass = rest = lse = None
    if plan.loss.needs_mass:
        numeric_part = torch.logsumexp(logits, dim=-1)
        positions = plan.positions
        other_part = other.shift[positions].double() + other.log_sum[positions].double()
        gap = other_part - numeric_part
        mass, rest, log_mass = torch.sigmoid(-gap), torch.sigmoid(gap), -torch.nn.functional.softplus(gap)
        lse = torch.logaddexp(numeric_part, other_part)
    terms, q, grad, grad_log_mass = numeric_terms_and_gradient(plan, logits, mass, log_mass)
    row_coefficient = None
    if grad_log_mass is not None:
        grad = grad + (grad_log_mass * rest)[:, None] * q
        row_coefficient = -grad_log_mass
    return AloneGradient(terms.value.double(), grad, row_coefficient, lse, mass_rows)


class _NumericAlone(torch.autograd.Function):
    """``logits [T, V_local]`` -> the numeric loss at the P numeric positions ``[P]`` (compute dtype)."""

    @staticmethod
    def forward(ctx, logits, plan: CallPlan):
        numeric_logits = gather_numeric_logits(logits, plan.positions, plan.local_numeric_columns)
        mass_rows = plan.loss.mass_rows(plan) if plan.loss.needs_mass else None
        if plan.loss.needs_mass:
            other = other_logsumexp(logits, plan, plan.positions if mass_rows is None else plan.positions[mass_rows])
            target_logits = torch.zeros(plan.targets.numel(), dtype=logits.dtype, device=logits.device)
            pieces = exchange_or_keep_local(plan, numeric_logits, other, target_logits)
        else:
            pieces = exchange_or_keep_local(plan, numeric_logits)
        numeric = loss_and_gradient(plan, pieces.numeric_logits, pieces.lse, mass_rows)
        ctx.logits_dtype, ctx.logits_shape = logits.dtype, logits.shape
        ctx.plan, ctx.numeric = plan, numeric
        if numeric.row_coefficient is not None:
            ctx.save_for_backward(logits)
        return numeric.value.to(plan.compute_dtype)

    @staticmethod
    def backward(ctx, grad_value):
        plan, numeric = ctx.plan, ctx.numeric
        compute_dtype = plan.compute_dtype
        grad = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_value.device)
        if not plan.positions.numel():
            return grad, None
        lo, hi = plan.numeric_columns
        grad_value = grad_value.double()
        numeric_rows = (numeric.numeric_grad[:, lo:hi] * grad_value[:, None]).to(compute_dtype)
        columns = plan.local_numeric_columns
        grad[plan.positions[:, None], columns[None, :]] = numeric_rows.to(ctx.logits_dtype)
        if numeric.row_coefficient is None:
            return grad, None
        (logits, ) = ctx.saved_tensors
        rows_of = torch.arange(plan.positions.numel(), device=grad.device) if numeric.mass_rows is None \
            else numeric.mass_rows
        coefficient = (numeric.row_coefficient[rows_of] * grad_value[rows_of]).to(compute_dtype)
        lse = numeric.lse[rows_of].to(compute_dtype)
        for start, end in row_blocks(int(rows_of.numel()), logits.shape[1], logits.device):
            rows = plan.positions[rows_of[start:end]]
            # a non-numeric column: its softmax times the row's coefficient; a numeric one: its whole gradient
            block = logits[rows].to(compute_dtype).sub_(lse[start:end, None]).exp_().mul_(coefficient[start:end, None])
            block[:, columns] = numeric_rows[rows_of[start:end]]
            grad[rows] = block.to(ctx.logits_dtype)
        return grad, None


class _FromOwner(torch.autograd.Function):
    """Identity forward; backward hands each row the gradient of the row that owns its value (a
    number-level loss's digits share their number's value, kept at its first digit)."""

    @staticmethod
    def forward(ctx, values, owners):
        ctx.owners = owners
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.owners], None


def numeric_loss_alone(numeric_loss: NumericLossLike, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                       vocab_start_index: Optional[int] = 0, reduction: str = "mean",
                       loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``numeric_loss`` alone on ``logits [..., V_local]`` (what ``numeric_loss(logits, targets)`` returns).

    reduction: ``"mean"`` over the positions that carry a value (numeric targets; a number-level
        loss: each number's first digit), weighted by ``loss_weights`` there, divided by their sum;
        ``"sum"``; ``"none"``: ``targets``' shape. With no such position: an exact 0 that still
        back-propagates.
    loss_weights: ``[...]`` like targets, finite and >= 0 (identical on every tensor-parallel rank).
    """
    check_numeric_loss(numeric_loss)
    checks.check_reduction(reduction)
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"logits and targets must be torch.Tensors, got {type(logits).__name__} and "
                        f"{type(targets).__name__}")
    if logits.dim() < 1:
        raise ValueError(f"logits must have a last (vocabulary) dim, got shape {tuple(logits.shape)}")
    if loss_weights is not None and (not isinstance(loss_weights, torch.Tensor) or loss_weights.is_complex()):
        raise TypeError(f"loss_weights must be a real torch.Tensor of targets' shape or None, got "
                        f"{type(loss_weights).__name__}")
    # a bad weight joins the exchange as this rank's verdict (plan_call then skips its own checks)
    failed_check = None if loss_weights is None else checks.check_loss_weights(loss_weights, targets)
    spec = LogitsSpec.of(logits)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=numeric_loss.needs_mass,
                     failed_check=failed_check)
    values = _NumericAlone.apply(logits.reshape(-1, spec.width), plan)
    owners = numeric_loss.value_owners(plan)
    carries = torch.ones_like(plan.positions, dtype=torch.bool) if owners is None else \
        owners == torch.arange(owners.numel(), device=owners.device)
    if owners is not None:
        values = _FromOwner.apply(values, owners)
    weights = carries.to(values.dtype)
    if loss_weights is not None:
        weights = weights * loss_weights.reshape(-1)[plan.positions].to(values.dtype)
    weighted = values * weights
    if reduction == "none":
        return torch.zeros(plan.targets.numel(), dtype=values.dtype, device=values.device).index_put(
            (plan.positions, ), weighted).view(targets.shape)
    total = weighted.sum()
    if reduction == "sum":
        return total
    if loss_weights is None:
        return total / max(int(carries.sum()), 1)
    return total / weights.sum().clamp_min(torch.finfo(values.dtype).eps)

