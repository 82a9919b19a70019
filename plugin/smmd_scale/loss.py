"""CE + a numeric loss on materialized logits: the op, its autograd and its reductions
(docs/objective.md).

No ``torch.distributed`` here: under tensor parallelism the forward hands this rank's contribution
to the exchange (``call_plan.run_exchange``, one all-reduce) and gets back what every rank needs;
the single-device path skips that step. The steps are ``steps.py``'s, shared with the fused
linear head (``fused_linear.py``).

Memory: the op keeps **one** ``[tokens, V_local]`` working buffer in the compute dtype (float32, or
float64 for float64 logits; ``accum_dtype`` chooses another): the local softmax — under soft-capping
the capped logits, whose softmax and tanh derivative backward forms a row block at a time —, kept
for backward and turned into the gradient in place. The numeric part reads only ``[P, N]`` numeric
logits at the P numeric-target positions (never a ``[P, V]`` block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .call_plan import (
    DEFAULT_OPTIONS,
    CallPlan,
    CrossEntropyOptions,
    LogitsSpec,
    NumericLossLike,
    check_numeric_loss,
    check_weight,
    plan_call,
)
from .checks import REDUCTIONS, check_reduction  # noqa: F401  (loss.check_reduction)
from .removed import module_attribute, removed_error
from .sequence_shard import SequenceShard
from .steps import (
    ShiftedLogSumExp,
    StatSums,
    call_statistics,
    call_stats,
    claim_single_backward,
    cross_entropy_per_token,
    dense_gradient_,
    exchange_or_keep_local,
    gather_numeric_logits,
    gather_target_logits,
    live_rows,
    local_softmax_and_logsumexp,
    numeric_loss_and_gradient,
    numeric_per_token,
    numeric_upstream,
    row_blocks,
    row_multipliers,
    smoothing_offsets,
    softmax_rescale,
    target_coefficients,
    transform_logits_,
    transform_slope,
    transformed_logits_and_logsumexp,
    upstream_gradients,
    z_loss_per_token,
    zero,
)


@dataclass
class NumericOutput:
    """Result of :func:`numeric_cross_entropy` (and :func:`smmd_scale.linear_numeric_cross_entropy`).

    total, ce, numeric, z: tensors with grad; ``total = ce + z + weight * numeric``, ``numeric`` being
        the call's numeric loss (SMMD, NTL, or a weighted sum of them) and ``z`` the z-loss (0 when
        off). Scalars under ``reduction="mean"`` or ``"sum"``; under ``"none"`` each has the targets'
        shape (CE and z 0 at ignored positions, the numeric loss 0 where the target is not numeric).
    stats: detached Python floats (a dict; on an accelerator a mapping made on the device and read from
        it when a value is first asked for, so that the op syncs nothing to the host and a call whose
        statistics nobody reads launches 9 ops fewer; until then it holds a few vectors of the call's
        positions, ``steps.StatInputs``; ``dict(out.stats)`` to keep them) —
        the numeric loss's parts as means over numeric positions
        (SMMD: ``smmd``, ``mmd`` and ``smooth``; NTL: ``ntl_was`` or ``ntl_mse``), ``numeric_tokens``
        (P), ``numeric_accuracy`` (argmax over the numeric tokens is the target token),
        ``numeric_mae`` (|E_q[value] - target value|), ``comm_calls`` and ``comm_bytes`` (this
        call's collectives and their payload bytes), ``tokens`` (non-ignored targets).
    """

    total: torch.Tensor
    ce: torch.Tensor
    numeric: torch.Tensor
    stats: dict
    z: Optional[torch.Tensor] = None

    @property
    def smmd(self):
        """Removed in 0.3.0: :attr:`numeric` (refused by name)."""
        raise removed_error("NumericOutput.smmd")


@dataclass(frozen=True)
class PerTokenLosses:
    """CE, the numeric loss and the z-loss per position, unreduced: ``ce`` and ``z`` ``[T]`` (T =
    targets.numel(), 0 at ignored positions); ``numeric_rows`` ``[P]``, the numeric loss at the plan's
    numeric positions (``plan.positions``; 0 on a fixed-capacity plan's spare rows), and
    :attr:`numeric`, the same scattered to ``[T]`` (0 where the target is not numeric; made when asked
    for: the mean and the sum read the rows). ``plan``: the call's plan; ``stat_sums``: its statistics
    (``steps.stat_sums``), detached, or on an accelerator's plan the function that makes them when they
    are first read (``steps.call_statistics``). Not a tuple (until 0.3.0 it was, with the ``[T]`` numeric
    loss second): unpacking it fails instead of handing out the rows."""

    ce: torch.Tensor
    numeric_rows: torch.Tensor
    plan: CallPlan
    stat_sums: StatSums
    z: Optional[torch.Tensor] = None

    @property
    def numeric(self) -> torch.Tensor:
        """``[T]`` the numeric loss per position (differentiable)."""
        return numeric_per_token(self.plan, self.numeric_rows, self.ce)

    def stats(self) -> dict:
        return call_stats(self.plan.loss.stat_names, self.stat_sums, self.plan.spec.device)


def _lse_rows(lse: ShiftedLogSumExp, start: int, end: int) -> ShiftedLogSumExp:
    return ShiftedLogSumExp(lse.shift[start:end], lse.log_sum[start:end])


class _CrossEntropyAndNumeric(torch.autograd.Function):
    """``logits [T, V_local]`` -> (CE ``[T]``, numeric loss ``[T]``, z-loss ``[T]``, statistics), one
    working buffer: the local softmax, or under soft-capping the capped logits (tanh's derivative is
    formed from them in backward)."""

    @staticmethod
    def forward(ctx, logits, plan: CallPlan):
        options, compute_dtype = plan.options, plan.compute_dtype
        softcapped = options.logit_softcap is not None
        if softcapped:
            buffer, local_lse = transformed_logits_and_logsumexp(logits, options, compute_dtype)
            local_sum = buffer.sum(dim=-1) if options.label_smoothing else None
        else:
            buffer, local_lse = local_softmax_and_logsumexp(logits, compute_dtype, options.scale)
            local_sum = logits.sum(dim=-1, dtype=compute_dtype) * options.scale if options.label_smoothing else None
        pieces = exchange_or_keep_local(plan, gather_numeric_logits(logits, plan.positions,
                                                                    plan.local_numeric_columns),
                                        local_lse, gather_target_logits(logits, plan.local_targets, plan.owned),
                                        local_sum)
        target_logits = transform_logits_(pieces.target_logits.to(compute_dtype, copy=True), options)
        ce = cross_entropy_per_token(pieces.lse, target_logits, plan.valid, options.label_smoothing, pieces.logit_sum,
                                     plan.loss.vocab.vocab_size)
        z = z_loss_per_token(pieces.lse, plan.valid, options.z_loss)
        numeric = numeric_loss_and_gradient(plan, pieces.numeric_logits, pieces.lse)
        sums = call_statistics(plan, numeric, pieces.comm)
        if isinstance(sums, torch.Tensor):  # (on an accelerator's plan a function: call_statistics)
            ctx.mark_non_differentiable(sums)

        ctx.set_materialize_grads(False)  # (no zeros made for the outputs nothing used: upstream_gradients)
        ctx.consumed = False
        ctx.logits_dtype = logits.dtype
        ctx.plan = plan
        if ctx.needs_input_grad[0]:
            # Every tensor backward reads is saved through save_for_backward (none kept on ctx), which
            # is also what lets torch.compile trace the op into one graph. Under tensor parallelism the
            # global softmax is softmax_local * exp(lse_local - lse); the soft-capped path has no row scale.
            row_scale = None
            if not softcapped and plan.tensor_parallel:
                row_scale = softmax_rescale(local_lse, pieces.lse)
            # (Inside torch.compile the buffer is saved as a copy: Dynamo refuses to save a tensor the
            # forward wrote in place; the compiled graph is functional, and the compiler plans its memory.)
            saved = (buffer, row_scale, pieces.lse.shift, pieces.lse.log_sum, numeric.grad, numeric.row_coefficient,
                     transform_slope(target_logits, options))
            if torch.compiler.is_compiling():
                saved = tuple(None if tensor is None else tensor.clone() for tensor in saved)
            ctx.save_for_backward(*saved)
        return ce, numeric.value.to(ce.dtype), z, sums

    @staticmethod
    def backward(ctx, grad_ce, grad_numeric, grad_z, _grad_stats):
        claim_single_backward(ctx)
        plan = ctx.plan
        options = plan.options
        # the working buffer becomes the gradient
        grad, row_scale, shift, log_sum, numeric_grad, row_coefficient, target_slope = ctx.saved_tensors
        lse = ShiftedLogSumExp(shift, log_sum)
        grad_ce, grad_numeric = upstream_gradients(grad_ce, grad_numeric, shift, numeric_grad.shape[0])
        upstream = numeric_upstream(grad_numeric, grad.dtype)
        multiplier = row_multipliers(plan, row_coefficient, grad_ce, upstream, grad.dtype, lse, grad_z)
        offsets = smoothing_offsets(plan, grad_ce, grad.dtype)
        if options.logit_softcap is not None:
            for start, end in row_blocks(*grad.shape, grad.device):
                dense_gradient_(grad[start:end], _lse_rows(lse, start, end), multiplier[start:end],
                                None if offsets is None else offsets[start:end], options)
        else:
            grad.mul_((multiplier * options.scale if row_scale is None else row_scale * multiplier * options.scale)
                      [:, None])
            if offsets is not None:
                grad.sub_((offsets * options.scale)[:, None])
        # Every row adds its coefficient at its (clamped) target column, 0 where another shard owns the
        # target: no data-dependent row list, so no host sync.
        coefficients = target_coefficients(plan, grad_ce, target_slope, grad.dtype)
        grad.scatter_add_(1, plan.local_targets[:, None],
                          torch.where(plan.owned, coefficients, zero(coefficients))[:, None])
        lo, hi = plan.numeric_columns
        if hi > lo and plan.positions.numel():
            numeric_rows = live_rows(plan, numeric_grad[:, lo:hi] * upstream[:, None])
            grad.index_put_((plan.positions[:, None], plan.local_numeric_columns[None, :]), numeric_rows,
                            accumulate=True)
        return grad.to(ctx.logits_dtype), None


def logits_spec(logits, targets) -> LogitsSpec:
    """The :class:`LogitsSpec` of ``logits`` after the type checks every op runs first."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"logits and targets must be torch.Tensors, got {type(logits).__name__} and "
                        f"{type(targets).__name__}")
    if logits.dim() < 1:
        raise ValueError(f"logits must have a last (vocabulary) dim, got shape {tuple(logits.shape)}")
    return LogitsSpec.of(logits)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor, numeric_loss: NumericLossLike, tp_group=None,
                     vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                     weight: Optional[float] = None, num_numeric_in_batch=None,
                     options: CrossEntropyOptions = DEFAULT_OPTIONS,
                     sequence_shard: Optional[SequenceShard] = None, numeric_capacity=None) -> PerTokenLosses:
    """CE, the numeric loss and the z-loss per position of ``logits [..., V_local]``, unreduced (the
    building block of :func:`numeric_cross_entropy` and of the Megatron entry point, which applies its
    own mask)."""
    check_numeric_loss(numeric_loss)
    spec = logits_spec(logits, targets)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=True,
                     num_items_in_batch=num_items_in_batch, weight=weight, num_numeric_in_batch=num_numeric_in_batch,
                     options=options, sequence_shard=sequence_shard, may_pad_positions=True,
                     numeric_capacity=numeric_capacity)
    ce, numeric_rows, z, sums = _CrossEntropyAndNumeric.apply(logits.reshape(-1, spec.width), plan)
    return PerTokenLosses(ce, numeric_rows, plan, sums, z)


def _count(count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, device=like.device, dtype=like.dtype).clamp_min(1)


def reduce_losses(losses: PerTokenLosses, weight: float, num_items_in_batch=None,
                  num_numeric_in_batch=None, reduction: str = "mean") -> NumericOutput:
    """Per-token CE, numeric loss and z-loss -> :class:`NumericOutput`.

    ``reduction="none"``: the per-token values in the targets' shape, ``total = ce + z + weight *
    numeric`` per position. ``"sum"``: their sums. ``"mean"`` (the default) as follows; the z-loss is
    reduced as CE is.

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
    if reduction in ("none", "sum"):
        z_per_token = torch.zeros_like(losses.ce) if losses.z is None else losses.z
    if reduction == "none":
        shape = plan.spec.shape[:-1]
        ce, numeric, z = (value.view(shape) for value in (losses.ce, losses.numeric, z_per_token))
        return NumericOutput(total=ce + z + weight * numeric, ce=ce, numeric=numeric, stats=losses.stats(), z=z)
    if reduction == "sum":
        ce, numeric, z = losses.ce.sum(), losses.numeric_rows.sum(), z_per_token.sum()
        return NumericOutput(total=ce + z + weight * numeric, ce=ce, numeric=numeric, stats=losses.stats(), z=z)
    valid_tokens = plan.valid_count
    numeric_sum = losses.numeric_rows.sum()
    items = valid_tokens.clamp_min(1) if num_items_in_batch is None else _count(num_items_in_batch, losses.ce)
    ce = losses.ce.sum() / items
    z = losses.z.sum() / items if losses.z is not None else None
    if num_numeric_in_batch is not None:
        numeric_term = numeric_sum / _count(num_numeric_in_batch, numeric_sum)
    else:
        count = plan.numeric_count
        numeric_term = numeric_sum / (max(count, 1) if isinstance(count, int) else count.clamp_min(1))
        if num_items_in_batch is not None:
            numeric_term = numeric_term * valid_tokens / _count(num_items_in_batch, losses.ce)
    total = torch.add(ce, numeric_term, alpha=weight) if z is None else ce + z + weight * numeric_term
    return NumericOutput(total=total, ce=ce, numeric=numeric_term, stats=losses.stats(),
                         z=torch.zeros_like(ce) if z is None else z)


def numeric_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, numeric_loss: NumericLossLike,
                          weight: float = 1.0, tp_group=None, vocab_start_index: Optional[int] = 0,
                          num_items_in_batch=None, num_numeric_in_batch=None, *, reduction: str = "mean",
                          logit_scale: Optional[float] = None, logit_softcap: Optional[float] = None,
                          z_loss: float = 0.0, label_smoothing: float = 0.0,
                          accum_dtype: Optional[torch.dtype] = None,
                          sequence_shard: Optional[SequenceShard] = None, numeric_capacity=None) -> NumericOutput:
    """CE + weight * a numeric loss (SMMD, NTL or a weighted sum) in one pass over ``logits [..., V]``
    or a vocab-parallel shard (``tp_group``, ``vocab_start_index``). ``targets [...]`` are aligned
    with the logits (no shift). The reductions are :func:`reduce_losses`': given the optimizer
    step's ``num_items_in_batch`` and ``num_numeric_in_batch``, the call's share of the step's
    objective, the same for any micro-batch, accumulation or parallel layout.

    logit_scale, logit_softcap: the logits scored are ``cap * tanh(scale * logits / cap)`` (Cohere's
        scale, Gemma-2/3's final soft-capping); CE, the z-loss and the numeric loss all read them
    z_loss: adds ``z_loss * lse^2`` per token (PaLM), reported as ``out.z``
    label_smoothing: as ``F.cross_entropy``'s; vocab-parallel, each rank's slot of the one exchange
        carries one more per-token number (its shard's logit sum)
    reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (per-token values in the targets' shape)
    accum_dtype: the softmax statistics, CE and the gradient buffer's dtype; None = float32
        (float64 for float64 logits), e.g. ``torch.bfloat16`` to follow bf16 logits
    sequence_shard: under sequence parallelism, the whole sequence's targets and this call's slice
        (:class:`smmd_scale.sequence_shard.SequenceShard`), so that the losses that read whole
        numbers (DEL, DIST2's place weights, number-level NTL) see the numbers that cross the slice's
        ends; the others ignore it
    numeric_capacity: vocabulary-parallel on an accelerator, the numeric rows the one exchange carries:
        None (one host read per call, the capacity grown from the counts read), ``"tokens"`` or a bound on
        the call's numeric positions (no host read; :func:`smmd_scale.call_plan.exchange_capacity`)
    """
    weight = check_weight(weight)
    reduction = check_reduction(reduction, num_items_in_batch, num_numeric_in_batch)
    options = CrossEntropyOptions.checked(logit_scale, logit_softcap, z_loss, label_smoothing, accum_dtype)
    losses = per_token_losses(logits, targets, numeric_loss, tp_group, vocab_start_index, num_items_in_batch, weight,
                              num_numeric_in_batch, options, sequence_shard, numeric_capacity)
    return reduce_losses(losses, weight, num_items_in_batch, num_numeric_in_batch, reduction)


def __getattr__(name: str):
    return module_attribute(__name__, name)  # smmd_cross_entropy, SMMDOutput: removed in 0.3.0
