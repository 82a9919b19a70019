"""The named steps of CE + a numeric loss, shared by the materialized op (``loss.py``) and the fused
linear head (``fused_linear.py``), on one device or on a vocabulary-parallel shard.

    transform_logits_ / transform_slope             -> scale and soft-cap the logits, and their derivative
    local_softmax_and_logsumexp / merge of blocks   -> this rank's ShiftedLogSumExp
    gather_target_logits, gather_numeric_logits     -> what the exchange carries (the raw logits)
    exchange_or_keep_local                          -> GlobalPieces (one all-reduce under TP)
    cross_entropy_per_token, z_loss_per_token       -> CE [T] (label smoothing included), z-loss [T]
    numeric_loss_and_gradient                       -> NumericGradient (the loss at P positions, d/d logits)
    numeric_terms_and_gradient                      -> its softmax chain (also the loss alone's, standalone.py)
    row_multipliers, smoothing_offsets              -> how backward scales and shifts each softmax row
    dense_gradient_                                 -> a block of transformed logits -> its gradient, in place
    call_statistics / stat_sums / stats_dict        -> the call's statistics: an output of the op, made
                                                       when first read on an accelerator's plan

The exchange carries the raw logits (bit-exact, in the logits' dtype); every rank applies the
call's transform (``CrossEntropyOptions``: scale, then soft-cap) to what it receives, so CE, the
z-loss and the numeric loss all read the same transformed logits.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch

from . import block_plan
from .call_plan import CallPlan, CrossEntropyOptions, NumericSlice, run_exchange


class ShiftedLogSumExp(NamedTuple):
    """A log-sum-exp per row kept as two numbers, ``shift + log_sum``: a shift (the row's max) and
    ``log sum exp(x - shift)``. The sum itself is never formed in the compute dtype: in fp32 at
    logits around 300 its rounding alone would cost 3e-5 of CE, while ``shift - logit`` is exact
    and ``log_sum`` is small (at most log V), so CE and the softmax keep fp32's accuracy at any
    logit magnitude, as Megatron-core's vocab-parallel CE does by subtracting the global max."""

    shift: torch.Tensor  # [T]
    log_sum: torch.Tensor  # [T]


class CommCount(NamedTuple):
    """Collectives one call ran and the payload bytes they carried."""

    calls: int
    bytes: int


class GlobalPieces(NamedTuple):
    """What every rank holds after the exchange (on one device: the local pieces).

    lse: the full-vocabulary :class:`ShiftedLogSumExp` ``[T]`` of the transformed logits (None for a
        numeric-only call)
    target_logits: ``[T]`` raw logits[t, y_t] (None for a numeric-only call)
    numeric_logits: ``[P, N]`` the whole raw numeric slice at the numeric positions
    logit_sum: ``[T]`` the sum of the transformed logits over the vocabulary (label smoothing only)
    """

    lse: Optional[ShiftedLogSumExp]
    target_logits: Optional[torch.Tensor]
    numeric_logits: torch.Tensor
    comm: CommCount
    logit_sum: Optional[torch.Tensor] = None


@dataclass
class NumericGradient:
    """The numeric loss at the P numeric positions, differentiated w.r.t. the numeric logits.

    value:           ``[P]`` the loss per position
    parts:           named ``[P]`` statistics of the loss (e.g. SMMD's ``mmd`` and ``smooth``)
    grad:            ``[P, N]`` d value / d raw numeric logits (through q = softmax over the numeric
                     tokens and the call's logit transform)
    row_coefficient: ``[P]`` or None: d value / d full-vocabulary logits also has
                     ``row_coefficient * softmax(full row)`` on every column (losses that weigh by
                     the numeric tokens' probability mass)
    predicted:       ``[P]`` int64, each position's most probable numeric token (argmax of q; the numeric
                     accuracy's)
    expected:        ``[P]`` float64, each position's expected value ``q @ values`` (the numeric MAE's)
    comm:            the collectives the loss ran itself (a number-level loss on a sequence shard)
    """

    value: torch.Tensor
    parts: dict
    grad: torch.Tensor
    row_coefficient: Optional[torch.Tensor]
    predicted: torch.Tensor
    expected: torch.Tensor
    comm: CommCount = CommCount(0, 0)


class StatInputs(NamedTuple):
    """What a call's statistics are made from, O(P): the loss's statistics ``parts`` (``[P]`` each),
    :class:`NumericGradient`'s ``predicted`` and ``expected``, and the loss's own collectives ``comm``."""

    parts: dict
    predicted: torch.Tensor
    expected: torch.Tensor
    comm: CommCount


# An op's statistics: :func:`stat_sums`' tensor, or the function of :func:`call_statistics` that makes it.
StatSums = Union[torch.Tensor, Callable[[], torch.Tensor]]


_ZEROS: dict = {}


def zero(like: torch.Tensor):
    """A 0-dim zero in ``like``'s device and dtype, made once per (device, dtype): ``torch.where(mask,
    x, zero(x))`` dispatches one op, where ``torch.where(mask, x, 0.0)`` makes a scalar tensor for the
    0.0 first. Inside ``torch.compile`` the number 0.0 (a constant of the graph; a cache filled from a
    compiled graph would be a guard that fails on the next call)."""
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor or _capturing(like):
        return 0.0  # (a traced, fake or subclassed tensor, or a CUDA graph's capture: nothing cached from it)
    key = (like.device, like.dtype)
    if key not in _ZEROS:
        made = torch.zeros((), dtype=like.dtype, device=like.device)
        if type(made) is not torch.Tensor:  # (made under a mode that fakes tensors: not kept)
            return made
        _ZEROS[key] = made
    return _ZEROS[key]


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``tensor``'s device (a tensor made then lives in the
    graph's pool, its fill only recorded)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def transform_logits_(logits: torch.Tensor, options: CrossEntropyOptions) -> torch.Tensor:
    """Scale, then soft-cap ``logits`` in place (``cap * tanh(scale * x / cap)``); returns them."""
    if options.logit_softcap is not None:
        return tanh_of_capped_(logits, options).mul_(options.logit_softcap)
    return logits.mul_(options.scale) if options.logit_scale is not None else logits


def transform_slope(transformed: torch.Tensor, options: CrossEntropyOptions) -> Optional[torch.Tensor]:
    """d transformed / d raw logit, from the transformed values: ``scale * (1 - (z / cap)^2)``;
    None when the transform is the identity."""
    if options.logit_softcap is not None:  # |z| <= cap, so this is >= 0 up to rounding
        return torch.mul(transformed, transformed).mul_(-options.scale / options.logit_softcap**2).add_(options.scale)
    if options.logit_scale is not None:
        return torch.full_like(transformed, options.scale)
    return None


def row_blocks(rows: int, width: int, device: torch.device) -> list:
    """``[(start, end)]`` row ranges of a ``[rows, width]`` buffer on ``device`` that a step needing a
    temporary of their size walks (:func:`smmd_scale.block_plan.row_blocks`: cache-sized on the CPU,
    the whole buffer on an accelerator)."""
    return block_plan.row_blocks(rows, width, block_plan.DeviceProperties.of(device))


def transformed_logits_and_logsumexp(logits: torch.Tensor, options: CrossEntropyOptions,
                                     compute_dtype: torch.dtype) -> tuple:
    """``logits [T, V_local]`` -> (the soft-capped logits ``[T, V_local]`` in ``compute_dtype``, the
    working buffer, and their :class:`ShiftedLogSumExp`). Soft-capping keeps the transformed logits,
    not the softmax, so that backward can form tanh's derivative from them; the log-sum-exp takes
    one row block's temporary at a time."""
    transformed = transform_logits_(logits.to(compute_dtype, copy=True), options)
    shift = transformed.amax(dim=-1)
    sums = torch.empty_like(shift)
    for start, end in row_blocks(*transformed.shape, transformed.device):
        sums[start:end] = torch.sub(transformed[start:end], shift[start:end, None]).exp_().sum(dim=-1)
    return transformed, ShiftedLogSumExp(shift, sums.log())


def dense_gradient_(transformed: torch.Tensor, lse: ShiftedLogSumExp, multiplier: torch.Tensor,
                    offsets: Optional[torch.Tensor], options: CrossEntropyOptions) -> torch.Tensor:
    """A block of transformed logits ``[R, B]`` (compute dtype) -> in place, the dense part of the
    gradient with respect to the raw logits: ``(softmax * multiplier - offset) * slope`` per row, the
    slope being the transform's derivative (``lse``, ``multiplier``, ``offsets``: ``[R]``)."""
    slope = transform_slope(transformed, options) if options.logit_softcap is not None else None
    transformed.sub_(lse.shift[:, None]).sub_(lse.log_sum[:, None]).exp_().mul_(multiplier[:, None])
    if offsets is not None:
        transformed.sub_(offsets[:, None])
    if slope is not None:
        return transformed.mul_(slope)
    return transformed.mul_(options.scale) if options.logit_scale is not None else transformed


# 2 x beyond which tanh(x) is 1 in float64 (and float32): 1 - tanh(x) < 2 exp(-2x) = 8.5e-18 at 2x = 40,
# and expm1(40) = 2.4e17 is finite in every float dtype the head computes in.
TANH_SATURATED_DOUBLE_ARGUMENT = 40.0


def tanh_of_capped_(logits: torch.Tensor, options: CrossEntropyOptions) -> torch.Tensor:
    """In place, ``tanh(scale * x / cap)``: the soft-capped logits divided by the cap, to a few ulp
    (the materialized op's logits and every exchanged target logit; the fused head's blocks use
    :func:`capped_sigmoid_`).

    On the CPU tanh is formed as ``u / (u + 2)``, ``u = expm1(2 y)`` with ``2 y`` capped at
    :data:`TANH_SATURATED_DOUBLE_ARGUMENT` (where tanh is 1): torch's CPU tanh costs about twice its
    expm1 (1.4x the time of this whole formula on a [4096, 1024] fp32 block, one thread), and the
    fused head evaluates it on every logit in both passes. Each step is accurate to an ulp relative
    to its value (``u > -1``, so ``u + 2 > 1`` cancels nothing): the result stays within a few ulp
    of tanh, exactly +-1 where tanh saturates, NaN for NaN. Elsewhere torch's tanh (one memory-bound
    pass, cheaper there than the formula's four). ``u + 2`` is one row block's temporary."""
    if not logits.is_cpu:
        return logits.mul_(options.scale / options.logit_softcap).tanh_()
    expm1 = logits.mul_(2 * options.scale / options.logit_softcap).clamp_max_(TANH_SATURATED_DOUBLE_ARGUMENT).expm1_()
    if expm1.dim() < 2 or not expm1.is_contiguous():  # a vector (the target logits), or a strided buffer
        return expm1.div_(torch.add(expm1, 2.0))
    flat = expm1.view(-1, expm1.shape[-1])
    for start, end in row_blocks(*flat.shape, flat.device):
        rows = flat[start:end]
        rows.div_(torch.add(rows, 2.0))
    return expm1


def capped_sigmoid_(logits: torch.Tensor, options: CrossEntropyOptions) -> torch.Tensor:
    """In place, ``sigmoid(-2 scale x / cap)``: the fused head's soft-capped block. With ``σ`` this,
    the capped logit ``cap tanh(scale x / cap)`` is ``cap (1 - 2σ)`` and its derivative ``scale (1 -
    tanh^2)`` is ``4 scale σ (1 - σ)``, so the forward's log-sum-exp and the backward's gradient read
    both from ``σ`` (two passes per logit: a scale and torch's sigmoid, against five for the accurate
    tanh of :func:`tanh_of_capped_` on the CPU). ``1 - 2σ`` carries ``σ``'s absolute rounding: the
    capped logit is within ``8 cap`` units of roundoff of 1 of ``cap tanh`` (tested; 3 measured, 5e-6 at
    cap 30 in fp32, the order of a [T, H] x [H, B] product's own rounding at H ~ 1,000), not within its
    relative ulp near ``x = 0``; where tanh saturates the capped logit is exactly ``±cap``."""
    return logits.mul_(-2.0 * options.scale / options.logit_softcap).sigmoid_()


def softcap_dense_gradient_(sigma: torch.Tensor, lse: ShiftedLogSumExp, multiplier: torch.Tensor,
                            offsets: Optional[torch.Tensor], options: CrossEntropyOptions) -> torch.Tensor:
    """:func:`dense_gradient_` of a soft-capped block given as ``σ`` (:func:`capped_sigmoid_`, ``[R,
    B]``), in place: ``(softmax * multiplier - offset) * 4 scale σ (1 - σ)`` per row, with the softmax
    ``exp(cap (1 - 2σ) - lse)``. The softmax's ``1 / sum`` and ``4 scale`` are folded into the per-row
    multiplier; one row block's temporary at a time, so the block is the only ``[R, B]`` buffer (and
    a row block's passes run while it is in cache)."""
    cap = options.logit_softcap
    row_scale = lse.log_sum.neg().exp_().mul_(multiplier).mul_(4.0 * options.scale)
    base = torch.sub(cap, lse.shift)
    offsets = None if offsets is None else offsets * (4.0 * options.scale)
    for start, end in row_blocks(*sigma.shape, sigma.device):
        rows = sigma[start:end]
        softmax = torch.add(base[start:end, None], rows, alpha=-2.0 * cap).exp_()
        softmax.mul_(row_scale[start:end, None])
        if offsets is not None:
            softmax.sub_(offsets[start:end, None])
        torch.addcmul(rows, rows, rows, value=-1.0, out=rows).mul_(softmax)  # σ (1 - σ) (softmax m - offset)
    return sigma


def local_softmax_and_logsumexp(logits: torch.Tensor, compute_dtype: torch.dtype, scale: float = 1.0) -> tuple:
    """``logits [T, V_local]`` -> (softmax over the shard ``[T, V_local]``, its :class:`ShiftedLogSumExp`).

    The softmax is the working buffer, written in ``compute_dtype``. The same steps on every device:
    ``logits - max`` computed in the compute dtype straight into the buffer (a bf16 or fp16 shard is
    read as it is, never first copied to fp32: the buffer is the only ``[T, V_local]`` allocation),
    then exp, sum and normalise in place. Not torch's softmax: with ``dtype=float32`` it converts a
    half shard to an fp32 copy first (about 10 bytes per logit at peak, not 6); its CPU kernel
    accumulates row sums with about 4x the error of ``sum``, and reading log-sum-exp back from the
    largest probability misses the fp32 gradient target at some inputs. ``scale`` > 0: the softmax of
    ``scale * logits`` (Cohere's logit scale; the shift is the scaled max).
    """
    max_logits = logits.amax(dim=-1).to(compute_dtype)
    softmax = torch.sub(logits, max_logits[:, None]).to(compute_dtype)  # promotes to compute_dtype
    if scale != 1.0:
        softmax.mul_(scale)
        max_logits = max_logits * scale
    softmax.exp_()
    row_sums = softmax.sum(dim=-1)
    softmax.div_(row_sums[:, None])
    return softmax, ShiftedLogSumExp(max_logits, row_sums.log())


def merge_block_logsumexp(running: ShiftedLogSumExp, block_logits: torch.Tensor,
                          factor: Optional[float] = None, offset: float = 0.0) -> ShiftedLogSumExp:
    """Fold one block of logits ``[T, B]`` (compute dtype; overwritten) into a running
    :class:`ShiftedLogSumExp` whose ``log_sum`` holds the running *sum* of ``exp(x - shift)``
    (the fused linear head's online merge; take the log once at the end). ``factor`` (non-zero): the
    block holds ``y`` with the logits ``offset + factor * y`` (the soft-capped head's
    :func:`capped_sigmoid_`), formed in the same pass that subtracts the shift."""
    shift, total = running
    if factor is None:
        block_max = block_logits.amax(dim=-1)
    else:  # the largest logit of a row is at its largest y for factor > 0, at its smallest otherwise
        extreme = block_logits.amax(dim=-1) if factor > 0 else block_logits.amin(dim=-1)
        block_max = extreme.mul_(factor).add_(offset)
    new_shift = torch.maximum(shift, block_max)
    # A row whose shift is still -inf has nothing to rescale (and -inf - -inf would be NaN).
    carried = torch.where(torch.isneginf(new_shift), torch.zeros_like(total), total * (shift - new_shift).exp())
    if factor is None:
        shifted = block_logits.sub_(new_shift[:, None])
    else:  # offset + factor * y - shift in one pass (y finite: capped)
        shifted = torch.add((offset - new_shift)[:, None], block_logits, alpha=factor, out=block_logits)
    return ShiftedLogSumExp(new_shift, carried + shifted.exp_().sum(dim=-1))


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


def exchange_or_keep_local(plan: CallPlan, numeric_logits: torch.Tensor, local_lse: Optional[ShiftedLogSumExp] = None,
                           target_logits: Optional[torch.Tensor] = None,
                           local_logit_sum: Optional[torch.Tensor] = None) -> GlobalPieces:
    """One device: the local pieces are the global ones. Vocab-parallel: the one all-reduce."""
    if not plan.tensor_parallel:
        return GlobalPieces(local_lse, target_logits, numeric_logits, CommCount(0, 0), local_logit_sum)
    received = run_exchange(plan, numeric_logits, local_lse, target_logits, local_logit_sum)
    slots = received.lse_slots
    lse = None if slots is None else combine_logsumexp(slots[..., 0], slots[..., 1])
    logit_sum = slots[..., 2].sum(dim=-1) if slots is not None and local_logit_sum is not None else None
    return GlobalPieces(lse, received.target_logits, received.numeric_logits,
                        CommCount(received.comm_calls, received.comm_bytes), logit_sum)


def cross_entropy_per_token(lse: ShiftedLogSumExp, target_logits: torch.Tensor, valid: torch.Tensor,
                            label_smoothing: float = 0.0, logit_sum: Optional[torch.Tensor] = None,
                            vocab_size: int = 1) -> torch.Tensor:
    """``lse - logits[t, y_t]``, as ``(shift - target logit) + log_sum``, at valid positions; 0 at
    ignored ones unless their logits are not finite (times ``valid``, one op: ``x * 0`` is NaN there;
    both ops hand in a target logit of 0 where the target is not theirs, so only the row's shift and
    sum can make it so), so a NaN anywhere in the logits never becomes a finite loss. With label
    smoothing eps (``F.cross_entropy``'s definition): ``(1 - eps) * (lse - z_y) + eps * (lse - logit_sum / V)``."""
    if label_smoothing:
        mean_logit = logit_sum / vocab_size
        loss = ((1 - label_smoothing) * (lse.shift - target_logits) + label_smoothing * (lse.shift - mean_logit)
                + lse.log_sum)
    else:
        loss = (lse.shift - target_logits) + lse.log_sum
    return loss * valid


def z_loss_per_token(lse: ShiftedLogSumExp, valid: torch.Tensor, coefficient: float) -> torch.Tensor:
    """PaLM's z-loss ``coefficient * lse^2`` ``[T]`` at valid positions, 0 elsewhere; None when off
    (the ops then return no z-loss tensor, and the reductions report a 0)."""
    if not coefficient:
        return None
    log_z = lse.shift + lse.log_sum
    return torch.where(valid, coefficient * log_z * log_z, torch.zeros_like(log_z))


def numeric_loss_and_gradient(plan: CallPlan, numeric_logits: torch.Tensor,
                              lse: Optional[ShiftedLogSumExp] = None) -> NumericGradient:
    """The plan's numeric loss on the full numeric slice ``[P, N]`` and its gradient.

    ``q = softmax(numeric logits)``; the loss gives d/d numeric logits (a loss of q chains its d/dq
    through the softmax over the numeric tokens itself, ``numeric_loss.terms_from_q``) and, if it
    reads the mass, d/dlog(mass). ``mass``, the full
    softmax's probability on the numeric tokens, is ``exp(logsumexp(numeric logits) - lse)`` at the
    numeric positions (needs ``lse``), and its gradient reaches every column: ``d mass / d z_k = p_k
    [k numeric] - mass p_k``.

    Everything here is O(P N), so it runs in float64 whatever the logits' dtype (the chain through
    the softmax subtracts nearly equal numbers); a loss's own heavier work (SMMD's ``[P, N] x [N, N]``
    product) runs in the compute dtype. The gradient comes back in the compute dtype.
    """
    logits = transform_logits_(numeric_logits.double(), plan.options)
    mass = log_mass = None
    if plan.loss.needs_mass:
        positions = plan.positions
        log_mass = (torch.logsumexp(logits, dim=-1) - lse.shift[positions].double()) - lse.log_sum[positions].double()
        mass = torch.exp(log_mass)
    terms, q, grad, grad_log_mass = numeric_terms_and_gradient(plan, logits, mass, log_mass)
    row_coefficient = None
    if grad_log_mass is not None:
        grad = grad + grad_log_mass[:, None] * q
        row_coefficient = (-grad_log_mass).to(plan.compute_dtype)
    slope = transform_slope(logits, plan.options)
    if slope is not None:
        grad = grad * slope
    values = plan.loss.vocab.on(logits.device, torch.float64)[1]  # (cached per device: no copy per call)
    value = terms.value
    if plan.live is not None:  # a fixed-capacity plan: its spare rows' values are 0 (the gradient's and
        # the statistics' are dropped where they are used). ``where``, not times live: a spare row scores
        # position 0's numeric logits against a made-up target, so it can be inf or NaN (a -inf logit there)
        # while position 0's own losses are finite, and NaN * 0 would carry it into the loss.
        value = torch.where(plan.live, value, zero(value))
    return NumericGradient(value=value, parts=terms.parts, grad=grad.to(plan.compute_dtype),
                           row_coefficient=row_coefficient, predicted=q.argmax(dim=-1), expected=q @ values,
                           comm=CommCount(terms.comm_calls, terms.comm_bytes))


def numeric_terms_and_gradient(plan: CallPlan, logits: torch.Tensor, mass: Optional[torch.Tensor],
                               log_mass: Optional[torch.Tensor]) -> tuple:
    """The plan's loss on the numeric slice, shared by the ops and the loss alone: ``logits [P, N]``
    (float64, transformed), with ``mass`` / ``log_mass`` ``[P]`` where the loss reads them (else None).
    Returns (its :class:`~smmd_scale.numeric_loss.NumericTerms`, ``q [P, N]``, d value / d numeric
    logits with the mass held fixed ``[P, N]``, d value / d log(mass) ``[P]`` or None): every loss
    gives its gradient in the numeric logits' coordinates; how the mass's part reaches the logits is
    the caller's (it differs with how the mass was formed)."""
    q = torch.softmax(logits, dim=-1)
    terms = plan.loss.terms_for_call(plan, NumericSlice(logits, q, None, mass, log_mass))
    grad = torch.zeros_like(q) if terms.grad_logits is None else terms.grad_logits.double()
    return terms, q, grad, None if terms.grad_log_mass is None else terms.grad_log_mass.double()


def numeric_per_token(plan: CallPlan, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The numeric loss per numeric position ``rows [P]`` scattered to ``[T]`` (0 where the target is not
    numeric), ``like``'s dtype; differentiable (a fixed-capacity plan's spare rows all point at position
    0 and add their 0 there). Made only where a caller asks for the per-token loss: the ops and their
    mean and sum read the rows."""
    return torch.zeros_like(like).index_put((plan.positions, ), rows.to(like.dtype), accumulate=plan.live is not None)


# The statistics every call reports after the numeric loss's own parts, in stat_sums' order.
STAT_FIELDS = ("correct", "abs_error", "tokens", "numeric_tokens", "comm_calls", "comm_bytes")


def call_statistics(plan: CallPlan, numeric: NumericGradient, comm: CommCount) -> StatSums:
    """What an op returns for its statistics: :func:`stat_sums` made now on the CPU's plan (where
    ``NumericOutput.stats`` is a dict, read at once) and inside ``torch.compile`` (part of the graph);
    on an accelerator's plan, a function that makes them when they are first read
    (:class:`CallStats`), so that a call whose statistics nobody reads launches 9 ops fewer. Until
    then it holds :class:`StatInputs`: a few ``[P]`` vectors (P: the plan's rows, on a fixed-capacity
    plan the call's tokens), nothing ``[P, N]`` and nothing of the gradient."""
    if torch.compiler.is_compiling() or not block_plan.DeviceProperties.of(plan.spec.device).accelerator:
        return stat_sums(plan, numeric, comm)
    pieces = StatInputs({name: numeric.parts[name] for name in plan.loss.stat_names}, numeric.predicted,
                        numeric.expected, numeric.comm)
    return lambda: stat_sums(plan, pieces, comm)


def stat_sums(plan: CallPlan, numeric, comm: CommCount) -> torch.Tensor:
    """The call's statistics as one detached float64 tensor: the sum over the numeric positions of
    each of the loss's ``stat_names``, then :data:`STAT_FIELDS` (read on the host once, by
    :func:`stats_dict`). ``numeric``: a :class:`NumericGradient` or :class:`StatInputs`; ``comm``: the
    call's exchange; the loss's own collectives (``numeric.comm``) are added to it."""
    double = torch.float64
    values = plan.loss.vocab.on(numeric.expected.device, double)[1]  # (cached per device: no copy per call)
    correct = numeric.predicted == plan.numeric_targets
    abs_error = (numeric.expected.detach() - values[plan.numeric_targets]).abs()
    # (stack and cat promote to the widest dtype in one op each: no conversion op per statistic)
    per_position = torch.stack([*(numeric.parts[name].detach() for name in plan.loss.stat_names), correct, abs_error])
    if plan.live is not None:  # a fixed-capacity plan's spare rows count for nothing (``where``: they may be
        per_position = torch.where(plan.live, per_position, zero(per_position))  # NaN, as in numeric_loss_and_gradient)
    sums = per_position.sum(dim=1, dtype=double)
    count = plan.numeric_count
    device_counts = [plan.valid.sum() if plan.valid_count is None else plan.valid_count]
    host_counts = [comm.calls + numeric.comm.calls, comm.bytes + numeric.comm.bytes]
    if isinstance(count, int):
        host_counts.insert(0, count)
    else:
        device_counts.append(count)
    return torch.cat([sums, torch.stack(device_counts),
                      torch.tensor(host_counts, dtype=double, device=plan.valid.device)])


class CallStats(MutableMapping):
    """A call's statistics (``NumericOutput.stats``): a mapping of the floats :func:`stats_dict` gives,
    kept as :func:`stat_sums`' one device tensor (or the function of :func:`call_statistics` that
    makes it) until a value is first read, then made and read on the host once. The op itself never
    reads them (no host sync in its forward or backward); a trainer reads them where it syncs anyway
    (at its logging interval). Values set on it need no read."""

    def __init__(self, stat_names: tuple, sums: StatSums):
        self._pending = (stat_names, sums)
        self._values: Optional[dict] = None
        self._set: dict = {}

    @property
    def read(self) -> bool:
        """Whether the values were made and read (then nothing they were made from is kept)."""
        return self._values is not None

    def _read(self) -> dict:
        if self._values is None:
            stat_names, sums = self._pending
            self._values = {**stats_dict(stat_names, sums() if callable(sums) else sums), **self._set}
            self._pending = None  # (what they were made from is not kept)
        return self._values

    def __getitem__(self, key):
        return self._read()[key]

    def __setitem__(self, key, value):
        self._set[key] = value
        if self._values is not None:
            self._values[key] = value

    def __delitem__(self, key):
        self._set.pop(key, None)
        del self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self):
        return len(self._read())

    def __repr__(self):
        return repr(self._read()) if self._values is not None else "CallStats(<not read yet>)"


def call_stats(stat_names: tuple, sums: torch.Tensor, device: torch.device):
    """``NumericOutput.stats``: a dict of floats (:func:`stats_dict`) on the CPU's plan, where reading
    them costs nothing; on an accelerator's plan (or inside ``torch.compile``) a :class:`CallStats`,
    read when first asked for."""
    if block_plan.DeviceProperties.of(device).accelerator or torch.compiler.is_compiling():
        return CallStats(stat_names, sums)
    return stats_dict(stat_names, sums() if callable(sums) else sums)


def stats_dict(stat_names: tuple, sums: torch.Tensor) -> dict:
    """:func:`stat_sums` as the floats of ``NumericOutput.stats`` (one host sync): the loss's parts
    and the numeric accuracy and MAE as means over the numeric positions, counts as ints."""
    *part_sums, correct, abs_error, tokens, numeric_tokens, comm_calls, comm_bytes = sums.tolist()
    numeric_tokens = int(numeric_tokens)
    per_numeric = 1.0 / max(numeric_tokens, 1)
    return {**{name: total * per_numeric for name, total in zip(stat_names, part_sums)},
            "numeric_tokens": numeric_tokens, "numeric_accuracy": correct * per_numeric,
            "numeric_mae": abs_error * per_numeric, "comm_calls": int(comm_calls), "comm_bytes": int(comm_bytes),
            "tokens": int(tokens)}


def numeric_upstream(grad_numeric: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[P]`` d loss / d (numeric loss at each of the plan's numeric positions), in ``dtype`` (the ops
    return the numeric loss per numeric position, :class:`~smmd_scale.loss.PerTokenLosses`' ``numeric_rows``,
    so the gradient arrives in those rows: no gather from ``[T]``)."""
    return grad_numeric.to(dtype)


def live_rows(plan: CallPlan, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[P, ...]``, one per numeric position of the plan) with a fixed-capacity plan's spare
    rows set to 0 (``torch.where``: also where a spare row, a copy of position 0's, is not finite)."""
    if plan.live is None:
        return rows
    return torch.where(plan.live.view(-1, *([1] * (rows.dim() - 1))), rows, zero(rows))


def row_multipliers(plan: CallPlan, row_coefficient: Optional[torch.Tensor], grad_ce: torch.Tensor,
                    upstream: torch.Tensor, dtype: torch.dtype, lse: Optional[ShiftedLogSumExp] = None,
                    grad_z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T]``: what each full softmax row is multiplied by in the gradient: d loss / d CE (0 at
    ignored positions), plus the z-loss's ``2 * coefficient * lse * d loss / d z``, plus the numeric
    loss's row coefficient at the numeric positions (``upstream``: :func:`numeric_upstream`)."""
    multiplier = grad_ce.to(dtype) * plan.valid
    if plan.options.z_loss and grad_z is not None:
        log_z = (lse.shift + lse.log_sum).to(dtype)
        multiplier = multiplier + (2 * plan.options.z_loss) * log_z * grad_z.to(dtype) * plan.valid
    if row_coefficient is not None and plan.positions.numel():
        multiplier = multiplier.index_add(0, plan.positions, live_rows(plan, row_coefficient.to(dtype) * upstream))
    return multiplier


def smoothing_offsets(plan: CallPlan, grad_ce: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``[T]``: label smoothing's share of d CE / d logit on every column, ``eps / V`` times d loss /
    d CE at valid positions (subtracted from each row); None without label smoothing."""
    if not plan.options.label_smoothing:
        return None
    return grad_ce.to(dtype) * plan.valid * (plan.options.label_smoothing / plan.loss.vocab.vocab_size)


def target_coefficients(plan: CallPlan, grad_ce: torch.Tensor, target_slope: Optional[torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    """``[T]``: what backward adds at each target column: ``-(1 - eps) * d loss / d CE``, times the
    transform's slope at the target logit."""
    coefficient = -grad_ce.to(dtype)
    if plan.options.label_smoothing:
        coefficient = coefficient * (1 - plan.options.label_smoothing)
    return coefficient if target_slope is None else coefficient * target_slope.to(dtype)


def upstream_gradients(grad_ce, grad_numeric, like: torch.Tensor, numeric_rows: int) -> tuple:
    """The ops' backward gets no gradient for an output nothing used (``ctx.set_materialize_grads(False)``
    in their forward: autograd then fills no zeros for the z-loss or the statistics): (d loss / d CE
    ``[T]``, d loss / d numeric loss ``[P]``), zeros (``like``'s dtype and device) where one of them was
    not used."""
    return (torch.zeros_like(like) if grad_ce is None else grad_ce,
            like.new_zeros(numeric_rows) if grad_numeric is None else grad_numeric)


def claim_single_backward(ctx) -> None:
    """Mark ``ctx``'s one backward as used; a second one raises. The materialized op's saved working
    buffer (the softmax, or the soft-capped logits) becomes the gradient in place, so a second
    backward through the same forward (``retain_graph=True``) would read a gradient as if it were a
    softmax. (The fused linear head saves only its inputs and recomputes, so it has no such limit.)"""
    if ctx.consumed:
        raise RuntimeError("numeric_cross_entropy supports one backward per forward: its [tokens, V] working buffer "
                           "(the softmax) becomes the gradient in place, which saves a second [tokens, V] buffer; "
                           "run the forward again instead of retain_graph=True, or use "
                           "linear_numeric_cross_entropy, which allows it")
    ctx.consumed = True
