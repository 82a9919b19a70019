"""Fused cross-entropy + a numeric loss on logits: the math and its autograd (docs/objective.md).

No ``torch.distributed`` here: under tensor parallelism the forward hands this rank's contribution
to :func:`smmd_scale.parallel.exchange` (one all-reduce) and gets back what every rank needs; the
single-device path skips that step. The single-device, vocab-parallel and fused-linear
(``fused_linear.py``) paths share the named steps below.

Memory: the fused op keeps **one** ``[tokens, V_local]`` working buffer in the compute dtype
(float32, or float64 for float64 logits): the local softmax, written straight from the logits'
own dtype (a bf16 shard is never first copied to fp32), kept for backward and turned into the
gradient in place. The numeric part reads only ``[P, N]`` numeric logits at the P numeric-target
positions (never a ``[P, V]`` block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .numeric_loss import ForwardPlan, LogitsSpec, NumericLoss, NumericTerms
from .parallel import exchange


@dataclass
class SMMDOutput:
    """Result of :func:`smmd_cross_entropy` (and :func:`smmd_scale.linear_smmd_cross_entropy`).

    total, ce, smmd: scalar tensors with grad; ``total = ce + weight * smmd``, ``smmd`` being the
        numeric loss of the call (SMMD, or whichever numeric loss was passed).
    stats: detached Python floats — the numeric loss's parts as means over numeric positions
        (SMMD: ``mmd`` and ``smooth``, r^T K r and alpha r^T L r), ``numeric_tokens`` (P),
        ``numeric_accuracy`` (argmax over the numeric tokens is the target token),
        ``numeric_mae`` (|E_q[value] - target value|), ``comm_calls`` and ``comm_bytes`` (this
        call's collectives and their payload bytes), ``tokens`` (non-ignored targets).
    """

    total: torch.Tensor
    ce: torch.Tensor
    smmd: torch.Tensor
    stats: dict


@dataclass
class StatSums:
    """One call's detached statistics, summed on the device and read once on the host (:func:`stats_dict`)."""

    parts: dict  # name -> sum over numeric positions
    correct: torch.Tensor
    abs_error: torch.Tensor
    valid_tokens: torch.Tensor  # non-ignored targets
    comm_calls: int  # collectives this call ran (forward and, known in advance, backward) and their bytes
    comm_bytes: int


@dataclass
class NumericStep:
    """The numeric loss at the P numeric positions, differentiated w.r.t. the numeric logits.

    grad:            ``[P, N]`` d value / d numeric logits (through q = softmax over the numeric tokens)
    row_coefficient: ``[P]`` or None: d value / d full-vocabulary logits also has
                     ``row_coefficient * softmax(full row)`` on every column (losses that weigh by
                     the numeric tokens' probability mass)
    """

    terms: NumericTerms
    grad: torch.Tensor
    row_coefficient: Optional[torch.Tensor]
    correct: torch.Tensor  # [P] bool
    abs_error: torch.Tensor  # [P]


# ---------------------------------------------------------------------------------------------
# Named steps shared by the single-device, vocab-parallel and fused-linear paths
# ---------------------------------------------------------------------------------------------


class ShiftedLogSumExp(NamedTuple):
    """A log-sum-exp per row kept as two numbers, ``shift + log_sum``: a shift (the row's max) and
    ``log sum exp(x - shift)``. The sum itself is never formed in the compute dtype: in fp32 at
    logits around 300 its rounding alone would cost 3e-5 of CE, while ``shift - logit`` is exact
    and ``log_sum`` is small (at most log V), so CE and the softmax keep fp32's accuracy at any
    logit magnitude, as Megatron-core's vocab-parallel CE does by subtracting the global max."""

    shift: torch.Tensor  # [T]
    log_sum: torch.Tensor  # [T]


def local_softmax_and_logsumexp(logits: torch.Tensor, compute_dtype: torch.dtype) -> tuple:
    """``logits [T, V_local]`` -> (softmax over the shard ``[T, V_local]``, its :class:`ShiftedLogSumExp`).

    The softmax is the working buffer, written in ``compute_dtype`` straight from the logits' own
    dtype. On CUDA that is torch's fused softmax (it converts half to float inside the kernel and
    accumulates accurately). On other devices the steps are spelled out: ``logits - max`` computed
    in the compute dtype straight into the buffer (never a float32 copy of half logits), then exp,
    sum and normalise in place; torch's CPU softmax kernel accumulates its row sums with about 4x
    the error of ``sum``, which the fp32 accuracy target cannot afford.
    """
    max_logits = logits.amax(dim=-1).to(compute_dtype)
    if logits.is_cuda:
        softmax = torch.softmax(logits, dim=-1, dtype=compute_dtype)
        log_sum = -softmax.amax(dim=-1).log()  # the max's probability is 1 / sum, at least 1 / V_local
    else:
        softmax = torch.sub(logits, max_logits[:, None])  # promotes to compute_dtype
        softmax.exp_()
        row_sums = softmax.sum(dim=-1)
        softmax.div_(row_sums[:, None])
        log_sum = row_sums.log()
    return softmax, ShiftedLogSumExp(max_logits, log_sum)


def combine_logsumexp(shifts: torch.Tensor, log_sums: torch.Tensor) -> ShiftedLogSumExp:
    """Per-rank pieces ``[T, TP]`` -> the global :class:`ShiftedLogSumExp` (shifted by the global max)."""
    shift = shifts.amax(dim=-1)
    return ShiftedLogSumExp(shift, torch.logsumexp(shifts - shift[:, None] + log_sums, dim=-1))


def softmax_rescale(local: ShiftedLogSumExp, overall: ShiftedLogSumExp) -> torch.Tensor:
    """``[T]`` factors that turn a shard's softmax into its slice of the full-vocabulary softmax:
    ``exp(local lse - global lse)``, formed from differences only."""
    return torch.exp((local.shift - overall.shift) + (local.log_sum - overall.log_sum))


def gather_target_logits(logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """``logits[t, y_t]`` where this shard owns y_t, else 0: ``[T]`` in the logits' dtype."""
    picked = logits.gather(1, local_targets[:, None]).squeeze(1)
    return torch.where(owned, picked, torch.zeros_like(picked))


def gather_numeric_logits(logits: torch.Tensor, positions: torch.Tensor, local_columns: torch.Tensor) -> torch.Tensor:
    """The ``[P, n_local]`` numeric logits at the numeric positions (only those elements are read)."""
    return logits[positions[:, None], local_columns[None, :]]


def exchange_or_keep_local(plan: ForwardPlan, numeric_logits: torch.Tensor, local_lse=None,
                           target_logits=None) -> tuple:
    """Single device: the local pieces are the global ones. Vocab-parallel: the one all-reduce.

    Returns (:class:`ShiftedLogSumExp` or None, target logits ``[T]`` or None, numeric logits
    ``[P, N]``, collectives run, bytes they carried).
    """
    if plan.tp_state is None:
        return local_lse, target_logits, numeric_logits, 0, 0
    contribution = plan.loss.rank_contribution(plan.spec, plan.targets, plan.vocab_start_index,
                                               with_ce=local_lse is not None)
    contribution.numeric_positions = int(plan.positions.numel())
    contribution.numeric_columns = plan.numeric_columns
    contribution.numeric_logits, contribution.local_lse = numeric_logits, local_lse
    contribution.target_logits = target_logits
    received = exchange(contribution, plan.tp_group, plan.tp_state)
    lse = None if received.lse_slots is None else combine_logsumexp(received.lse_slots[..., 0],
                                                                   received.lse_slots[..., 1])
    return lse, received.target_logits, received.numeric_logits, received.comm_calls, received.comm_bytes


def cross_entropy_per_token(lse: ShiftedLogSumExp, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``lse - logits[t, y_t]``, as ``(shift - target logit) + log_sum``, at valid positions; 0 at
    ignored ones unless their logits are not finite (``x - x`` is NaN there), so a NaN anywhere in
    the logits never becomes a finite loss."""
    return torch.where(valid, (lse.shift - target_logits) + lse.log_sum,
                       (lse.shift - lse.shift) + (lse.log_sum - lse.log_sum))


def numeric_step(plan: ForwardPlan, numeric_logits: torch.Tensor,
                 lse: Optional[ShiftedLogSumExp] = None) -> NumericStep:
    """The plan's numeric loss on the full numeric slice ``[P, N]`` and its gradient.

    ``q = softmax(numeric logits)``; the loss gives d/dq (and d/dmass), chained here through the
    softmax over the numeric tokens. ``mass``, the full softmax's probability on the numeric tokens,
    is ``exp(logsumexp(numeric logits) - lse)`` at the numeric positions (needs ``lse``), and its
    gradient reaches every column: ``d mass / d z_k = p_k [k numeric] - mass p_k``.

    Everything here is O(P N), so it runs in float64 whatever the logits' dtype (the chain through
    the softmax subtracts nearly equal numbers); a loss's own heavier work (SMMD's ``[P, N] x [N, N]``
    product) runs in the compute dtype. The gradient comes back in the compute dtype.
    """
    logits = numeric_logits.double()
    q = torch.softmax(logits, dim=-1)
    mass = None
    if plan.loss.needs_mass:
        positions = plan.positions
        mass = torch.exp((torch.logsumexp(logits, dim=-1) - lse.shift[positions].double())
                         - lse.log_sum[positions].double())
    terms = plan.loss.numeric_terms(q, plan.numeric_targets, mass, plan.compute_dtype)
    grad_q = terms.grad_q.double()
    grad = q * (grad_q - (q * grad_q).sum(dim=-1, keepdim=True))
    row_coefficient = None
    if terms.grad_mass is not None:
        grad = grad + (terms.grad_mass * mass)[:, None] * q
        row_coefficient = (-terms.grad_mass * mass).to(plan.compute_dtype)
    values = plan.loss.vocab_tensors(q.device, torch.float64).values
    return NumericStep(terms=terms, grad=grad.to(plan.compute_dtype), row_coefficient=row_coefficient,
                       correct=q.argmax(dim=-1) == plan.numeric_targets,
                       abs_error=(q @ values - values[plan.numeric_targets]).abs())


def record_stats(plan: ForwardPlan, step: NumericStep, comm_calls: int, comm_bytes: int) -> None:
    plan.stats = StatSums(parts={name: part.detach().sum() for name, part in step.terms.parts.items()},
                          correct=step.correct.sum(), abs_error=step.abs_error.detach().sum(),
                          valid_tokens=plan.valid.sum(), comm_calls=comm_calls, comm_bytes=comm_bytes)


def row_multipliers(plan: ForwardPlan, row_coefficient: Optional[torch.Tensor], grad_ce: torch.Tensor,
                    grad_numeric: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T]``: what each full softmax row is multiplied by in the gradient: d loss / d CE (0 at
    ignored positions), plus the numeric loss's row coefficient at the numeric positions."""
    multiplier = grad_ce.to(dtype) * plan.valid
    if row_coefficient is not None and plan.positions.numel():
        multiplier = multiplier.index_add(0, plan.positions,
                                          row_coefficient.to(dtype) * grad_numeric[plan.positions].to(dtype))
    return multiplier


def _guard_single_backward(ctx) -> None:
    # The saved softmax becomes the gradient in place, so a second backward through the same
    # forward (retain_graph=True) would read a gradient as if it were a softmax.
    if ctx.consumed:
        raise RuntimeError("smmd_scale's fused loss supports one backward per forward (its working buffer "
                           "becomes the gradient in place); run the forward again instead of retain_graph=True")
    ctx.consumed = True


class _FusedCrossEntropyNumeric(torch.autograd.Function):
    """``logits [T, V_local]`` -> (CE per token ``[T]``, numeric loss per token ``[T]``, 0 where not numeric)."""

    @staticmethod
    def forward(ctx, logits, plan: ForwardPlan):
        compute_dtype = plan.compute_dtype
        softmax, local_lse = local_softmax_and_logsumexp(logits, compute_dtype)
        target_logits = gather_target_logits(logits, plan.local_targets, plan.owned)
        numeric_logits = gather_numeric_logits(logits, plan.positions, plan.local_numeric_columns)
        lse, target_logits, numeric_logits, comm_calls, comm_bytes = exchange_or_keep_local(
            plan, numeric_logits, local_lse, target_logits)
        ce = cross_entropy_per_token(lse, target_logits.to(compute_dtype), plan.valid)
        step = numeric_step(plan, numeric_logits, lse)
        numeric = torch.zeros_like(ce).index_put_((plan.positions, ), step.terms.value.to(ce.dtype))
        record_stats(plan, step, comm_calls, comm_bytes)

        ctx.consumed = False
        ctx.logits_dtype = logits.dtype
        ctx.plan, ctx.numeric_grad, ctx.row_coefficient = plan, step.grad, step.row_coefficient
        if ctx.needs_input_grad[0]:
            # Under tensor parallelism the global softmax is softmax_local * exp(lse_local - lse).
            row_scale = torch.ones_like(ce) if plan.tp_state is None else softmax_rescale(local_lse, lse)
            ctx.save_for_backward(softmax, row_scale)
        return ce, numeric

    @staticmethod
    def backward(ctx, grad_ce, grad_numeric):
        _guard_single_backward(ctx)
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


class _NumericLossOnly(torch.autograd.Function):
    """``logits [T, V_local]`` -> the numeric loss per numeric position ``[P]``; reads only ``[P, N]``
    logits (for losses that do not need the full softmax's mass on the numeric tokens)."""

    @staticmethod
    def forward(ctx, logits, plan: ForwardPlan):
        numeric_logits = gather_numeric_logits(logits, plan.positions, plan.local_numeric_columns)
        _, _, numeric_logits, comm_calls, comm_bytes = exchange_or_keep_local(plan, numeric_logits)
        step = numeric_step(plan, numeric_logits)
        record_stats(plan, step, comm_calls, comm_bytes)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        ctx.plan, ctx.numeric_grad = plan, step.grad
        return step.terms.value.to(plan.compute_dtype)

    @staticmethod
    def backward(ctx, grad_value):
        plan = ctx.plan
        grad = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_value.device)
        lo, hi = plan.numeric_columns
        if hi > lo and plan.positions.numel():
            rows = ctx.numeric_grad[:, lo:hi] * grad_value.to(ctx.numeric_grad.dtype)[:, None]
            grad[plan.positions[:, None], plan.local_numeric_columns[None, :]] = rows.to(ctx.logits_dtype)
        return grad, None


def _check_logits(logits, targets) -> LogitsSpec:
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"logits and targets must be torch.Tensors, got {type(logits).__name__} and "
                        f"{type(targets).__name__}")
    if logits.dim() < 1:
        raise ValueError(f"logits must have a last (vocabulary) dim, got shape {tuple(logits.shape)}")
    return LogitsSpec.of(logits)


def _check_numeric_loss(numeric_loss) -> None:
    if not isinstance(numeric_loss, NumericLoss):
        raise TypeError(f"smmd must be a smmd_scale.SMMDLoss (or another smmd_scale.NumericLoss), got "
                        f"{type(numeric_loss).__name__}")


def numeric_loss_alone(numeric_loss: NumericLoss, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                       vocab_start_index: Optional[int] = 0) -> torch.Tensor:
    """The mean of ``numeric_loss`` over numeric-target positions (what ``numeric_loss(logits, targets)`` returns)."""
    spec = _check_logits(logits, targets)
    if numeric_loss.needs_mass:  # the mass needs the full softmax: the fused op, with CE left unused
        _, numeric_per_token, plan = per_token_losses(logits, targets, numeric_loss, tp_group, vocab_start_index)
        return numeric_per_token.sum() / max(plan.positions.numel(), 1)
    plan = numeric_loss.prepare(spec, targets, tp_group, vocab_start_index, with_ce=False)
    values = _NumericLossOnly.apply(logits.reshape(-1, spec.width), plan)
    return values.sum() / max(values.numel(), 1)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor, numeric_loss: NumericLoss, tp_group=None,
                     vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                     weight: Optional[float] = None) -> tuple:
    """CE and the numeric loss per position, unreduced: ``([T], [T], forward plan)``, T = targets.numel().

    CE is 0 at ignored positions; the numeric loss is 0 where the target is not numeric. The
    building block of :func:`smmd_cross_entropy` and of the Megatron entry point (which applies its
    own mask).
    """
    _check_numeric_loss(numeric_loss)
    spec = _check_logits(logits, targets)
    plan = numeric_loss.prepare(spec, targets, tp_group, vocab_start_index, with_ce=True,
                                num_items_in_batch=num_items_in_batch, weight=weight)
    ce, numeric = _FusedCrossEntropyNumeric.apply(logits.reshape(-1, spec.width), plan)
    return ce, numeric, plan


def check_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight={weight!r} must be a number (0 = CE only)")
    # The value itself is checked with the tensors, so a bad weight on one rank raises on all of them.
    return float(weight)


def reduce_losses(ce_per_token: torch.Tensor, numeric_per_token: torch.Tensor, plan: ForwardPlan, weight: float,
                  num_items_in_batch=None) -> SMMDOutput:
    """Per-token CE and numeric loss -> :class:`SMMDOutput`.

    CE is the mean over non-ignored targets (0 if there are none), or their sum /
    ``num_items_in_batch`` when given, as Hugging Face does under gradient accumulation. The numeric
    loss is the mean over numeric-target positions; with ``num_items_in_batch`` it is weighted by
    this call's share of the batch's tokens (``tokens / num_items_in_batch``), so that summing
    micro-batches — which is what the HF Trainer does with that argument — keeps it at its mean
    scale instead of multiplying it by the number of micro-batches.
    """
    valid_tokens = plan.valid.sum()
    numeric_mean = numeric_per_token.sum() / max(int(plan.positions.numel()), 1)
    if num_items_in_batch is None:
        ce = ce_per_token.sum() / valid_tokens.clamp_min(1)
        numeric_term = numeric_mean
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=ce_per_token.device,
                                      dtype=ce_per_token.dtype).clamp_min(1)
        ce = ce_per_token.sum() / denominator
        numeric_term = numeric_mean * valid_tokens / denominator
    return SMMDOutput(total=ce + weight * numeric_term, ce=ce, smmd=numeric_term, stats=stats_dict(plan))


def smmd_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smmd: NumericLoss, weight: float = 1.0,
                       tp_group=None, vocab_start_index: Optional[int] = 0, num_items_in_batch=None) -> SMMDOutput:
    """CE + weight * SMMD (or another numeric loss) in one pass over ``logits [..., V]`` (or a
    vocab-parallel shard). ``targets [...]`` are aligned with the logits (no shift); the reductions
    are :func:`reduce_losses`'."""
    weight = check_weight(weight)
    ce_per_token, numeric_per_token, plan = per_token_losses(logits, targets, smmd, tp_group, vocab_start_index,
                                                             num_items_in_batch, weight)
    return reduce_losses(ce_per_token, numeric_per_token, plan, weight, num_items_in_batch)


def stats_dict(plan: ForwardPlan) -> dict:
    """A call's :class:`StatSums` as the floats of ``SMMDOutput.stats`` (one host sync)."""
    sums = plan.stats
    names = list(sums.parts)
    values = torch.stack([part.double() for part in sums.parts.values()]
                         + [sums.correct.double(), sums.abs_error.double(), sums.valid_tokens.double()]).tolist()
    *part_sums, correct, abs_error_sum, valid_tokens = values
    numeric_tokens = int(plan.positions.numel())
    per_numeric = 1.0 / max(numeric_tokens, 1)
    return {**{name: total * per_numeric for name, total in zip(names, part_sums)},
            "numeric_tokens": numeric_tokens, "numeric_accuracy": correct * per_numeric,
            "numeric_mae": abs_error_sum * per_numeric, "comm_calls": sums.comm_calls,
            "comm_bytes": sums.comm_bytes, "tokens": int(valid_tokens)}
