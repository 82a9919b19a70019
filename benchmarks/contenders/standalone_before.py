"""A numeric loss called on its own the way smmd_scale ran it before its standalone path
(``smmd_scale.standalone``): the "before" row of bench_ntl_standalone.

A loss that needs the softmax's mass on the numeric tokens (NTL's reweighing) ran the whole CE op
(a full softmax of every row) and left CE unused; any other read only the ``[P, N]`` numeric
logits at the P numeric-target positions, through its own autograd function below.

    loss = numeric_loss_mean(NTLoss(vocab), logits, targets)
"""

from typing import Optional

import torch

from smmd_scale.call_plan import CallPlan, NumericLossLike, plan_call
from smmd_scale.loss import logits_spec, per_token_losses
from smmd_scale.steps import exchange_or_keep_local, gather_numeric_logits, numeric_loss_and_gradient, stat_sums


class NumericOnly(torch.autograd.Function):
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


def numeric_loss_mean(numeric_loss: NumericLossLike, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                      vocab_start_index: Optional[int] = 0) -> torch.Tensor:
    """The mean of ``numeric_loss`` over numeric-target positions (what ``numeric_loss(logits, targets)``
    returns); an exact 0 that still back-propagates when there are none."""
    spec = logits_spec(logits, targets)
    if numeric_loss.needs_mass:  # the mass needs the full softmax: the CE op, with CE left unused
        losses = per_token_losses(logits, targets, numeric_loss, tp_group, vocab_start_index)
        return losses.numeric.sum() / max(losses.plan.positions.numel(), 1)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=False)
    values, _ = NumericOnly.apply(logits.reshape(-1, spec.width), plan)
    return values.sum() / max(values.numel(), 1)
