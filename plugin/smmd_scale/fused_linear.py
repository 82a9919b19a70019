"""CE + a numeric loss straight from the LM head's input: the logits never exist as a whole.

    out = linear_numeric_cross_entropy(hidden [..., H], head_weight [V_local, H], targets [...], numeric_loss)

The same contract as :func:`smmd_scale.numeric_cross_entropy` on ``hidden @ head_weight.T (+ bias)``,
with the logits produced one block of head rows at a time (``[tokens, chunk_size]``):

* forward: one pass over the blocks keeps a running (max, sum of exp) per token (merged online, so
  the log-sum-exp is the same :class:`ShiftedLogSumExp` as on materialized logits) and picks the
  target logits; the numeric logits ``[P, n_local]`` are one small product of the numeric-target
  rows of ``hidden`` and the numeric rows of the head. Then the same single exchange as the
  materialized path (vocab-parallel: one packed SUM all-reduce), CE and the numeric loss.
* backward: a second pass recomputes each block's logits, turns them into the gradient in place
  (softmax times the row multipliers, minus the one-hot, plus the numeric loss's columns; with
  soft-capping the block is ``σ = sigmoid(-2 x / cap)``, the capped logits ``cap (1 - 2σ)``, one
  sigmoid per logit and pass, and the cap's derivative ``4 σ (1 - σ)`` is read from it) and
  writes ``d head_weight`` for the block and accumulates ``d hidden`` in the compute dtype. Under
  tensor parallelism ``d hidden`` is summed over the group: the one all-reduce a column-parallel
  head runs in its own backward anyway; nothing else.

Extra memory beyond the inputs and the gradients: one block of logits in the compute dtype (plus its
copy in the input dtype for half inputs), ``d hidden`` in the compute dtype and O(tokens + P * N).
The blocks are :func:`smmd_scale.block_plan.fused_head_plan`'s: on the CPU a block holds as many
elements as ``hidden`` but at least ``MIN_BLOCK_ELEMENTS`` (DeepSpeed's rule for its fused linear CE);
on an accelerator as many as a memory budget allows (``block_budget_bytes``, else a share of the free
memory); ``chunk_size`` sets the head rows per block on any device.
Four GEMM passes over the head against three for materialized logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks
from .block_plan import DeviceProperties, fused_head_plan
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
from .loss import NumericOutput, PerTokenLosses, check_reduction, reduce_losses
from .parallel import group_size_and_rank, reduce_input_gradient
from .removed import module_attribute
from .sequence_shard import SequenceShard
from .steps import (
    ShiftedLogSumExp,
    call_statistics,
    capped_sigmoid_,
    cross_entropy_per_token,
    dense_gradient_,
    exchange_or_keep_local,
    live_rows,
    merge_block_logsumexp,
    numeric_loss_and_gradient,
    numeric_upstream,
    row_multipliers,
    smoothing_offsets,
    softcap_dense_gradient_,
    target_coefficients,
    transform_logits_,
    transform_slope,
    upstream_gradients,
    z_loss_per_token,
    zero,
)


def default_chunk_size(tokens: int, hidden_size: int, head_rows: int) -> int:
    """Head rows per block on the CPU when none is given (:func:`smmd_scale.block_plan.fused_head_plan`)."""
    return fused_head_plan(tokens, hidden_size, head_rows, torch.float32, torch.float32,
                           DeviceProperties("cpu")).chunk_size


def block_logits(hidden: torch.Tensor, head_rows: torch.Tensor, bias_rows: Optional[torch.Tensor],
                 compute_dtype: torch.dtype) -> torch.Tensor:
    """``hidden [T, H] @ head_rows[B, H].T (+ bias)`` -> ``[T, B]`` in the compute dtype. The product
    runs in hidden's dtype (the product dtype: head rows and bias are cast to it, a block at a time,
    where they differ), as the model's own head computes its logits."""
    head_rows = head_rows.to(hidden.dtype)
    if bias_rows is None:
        return (hidden @ head_rows.T).to(compute_dtype)
    return torch.addmm(bias_rows.to(hidden.dtype), hidden, head_rows.T).to(compute_dtype)


def product_dtype(hidden: torch.Tensor, head_weight: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    """The dtype of the head's product: the inputs' one dtype; for mixed dtypes (bf16 hidden with an
    fp32 head, what torch.autocast and HF Trainer's bf16 AMP hand the head) autocast's dtype, as
    autocast would run the head's linear; None for mixed dtypes without autocast (refused)."""
    dtypes = {hidden.dtype, head_weight.dtype, hidden.dtype if bias is None else bias.dtype}
    if len(dtypes) == 1:
        return hidden.dtype
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def one_block_on_one_device(accelerator: bool, plan: CallPlan, chunk_size: int, head_weight: torch.Tensor) -> bool:
    """Whether the backward makes d hidden as the one block's product in hidden's dtype, instead of
    adding each block's product into zeros in the compute dtype and converting back (the same bits
    with one block: adding to 0 and a widening round trip are exact): one block, one device, the
    accelerator's plan."""
    return accelerator and not plan.tensor_parallel and _one_block(head_weight.shape[0], chunk_size)


def _rows(tensor: Optional[torch.Tensor], start: int, end: int) -> Optional[torch.Tensor]:
    """``tensor[start:end]``, or the tensor itself when the block is all of it (one block: no slice
    op to dispatch)."""
    if tensor is None or (start == 0 and end == tensor.shape[0]):
        return tensor
    return tensor[start:end]


def _blocks(rows: int, chunk_size: int):
    return [(start, min(start + chunk_size, rows)) for start in range(0, rows, chunk_size)]


def _one_block(rows: int, chunk_size: int) -> bool:
    """Whether one block covers the head's ``rows`` (the one test of the one-block paths)."""
    return len(_blocks(rows, chunk_size)) == 1


class _FusedLinearCrossEntropyNumeric(torch.autograd.Function):
    """``hidden [T, H]``, ``head_weight [V_local, H]``, ``bias [V_local]`` -> (CE ``[T]``, numeric loss ``[T]``,
    z-loss ``[T]``, statistics)."""

    @staticmethod
    def forward(ctx, hidden, head_weight, bias, plan: CallPlan, chunk_size: int, accelerator: bool):
        with torch.autocast(hidden.device.type, enabled=False):  # the block GEMMs in the product dtype
            ctx.save_for_backward(hidden, head_weight, bias)
            hidden = hidden.to(plan.spec.dtype)  # the product dtype (a copy only for mixed dtypes)
            compute_dtype = plan.compute_dtype
            options = plan.options
            if accelerator:  # (each row's target block and column, found once for both passes)
                ctx.where = _TargetBlocks(plan, chunk_size, len(_blocks(head_weight.shape[0], chunk_size)))
                local_lse, target_logits, logit_sum, numeric_logits = _forward_sweep_accelerator(
                    hidden, head_weight, bias, plan, chunk_size, ctx.where)
            else:
                local_lse, target_logits, logit_sum = _forward_sweep_cpu(hidden, head_weight, bias, plan, chunk_size)
                numeric_logits = None

            # The numeric and target logits as the materialized op reads them: in the logits' (product)
            # dtype. One device: the target logits stay in the compute dtype they were picked in (a
            # product-dtype value, so converting there and back would change nothing) and are this
            # call's own tensor; under tensor parallelism the exchange carries them in the logits' dtype.
            # (One block on the accelerator's plan: the numeric logits were read from it, product-dtype
            # values held in the compute dtype, so converting them for the exchange is exact.)
            if numeric_logits is None:
                numeric_bias = None if bias is None else bias[plan.local_numeric_columns]
                numeric_logits = block_logits(hidden[plan.positions], head_weight[plan.local_numeric_columns],
                                              numeric_bias, plan.spec.dtype)
            if plan.tensor_parallel:
                target_logits = target_logits.to(plan.spec.dtype)
                numeric_logits = numeric_logits.to(plan.spec.dtype)
            pieces = exchange_or_keep_local(plan, numeric_logits, local_lse, target_logits, logit_sum)
            target_logits = pieces.target_logits
            if plan.tensor_parallel:
                target_logits = target_logits.to(compute_dtype, copy=True)
            target_logits = transform_logits_(target_logits, options)
            ce = cross_entropy_per_token(pieces.lse, target_logits, plan.valid, options.label_smoothing,
                                         pieces.logit_sum, plan.loss.vocab.vocab_size)
            z = z_loss_per_token(pieces.lse, plan.valid, options.z_loss)
            numeric = numeric_loss_and_gradient(plan, pieces.numeric_logits, pieces.lse)
            sums = call_statistics(plan, numeric, pieces.comm)
            if isinstance(sums, torch.Tensor):  # (on an accelerator's plan a function: call_statistics)
                ctx.mark_non_differentiable(sums)

            ctx.set_materialize_grads(False)  # (no zeros made for the outputs nothing used: upstream_gradients)
            ctx.plan, ctx.chunk_size, ctx.accelerator = plan, chunk_size, accelerator
            ctx.lse, ctx.numeric_grad, ctx.row_coefficient = pieces.lse, numeric.grad, numeric.row_coefficient
            ctx.target_slope = transform_slope(target_logits, options)
            return ce, numeric.value.to(ce.dtype), z, sums

    @staticmethod
    def backward(ctx, grad_ce, grad_numeric, grad_z, _grad_stats):
        # Nothing saved is changed here (each block is recomputed), so retain_graph=True may run it again.
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # as in the forward
            hidden, head_weight, bias = ctx.saved_tensors
            hidden_dtype = hidden.dtype
            hidden = hidden.to(ctx.plan.spec.dtype)
            plan, lse = ctx.plan, ctx.lse
            compute_dtype = plan.compute_dtype
            needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
            grad_ce, grad_numeric = upstream_gradients(grad_ce, grad_numeric, lse.shift, ctx.numeric_grad.shape[0])
            upstream = numeric_upstream(grad_numeric, compute_dtype)
            multiplier = row_multipliers(plan, ctx.row_coefficient, grad_ce, upstream, compute_dtype, lse, grad_z)
            offsets = smoothing_offsets(plan, grad_ce, compute_dtype)
            target_coefficient = target_coefficients(plan, grad_ce, ctx.target_slope, compute_dtype)
            direct = needs_hidden and one_block_on_one_device(ctx.accelerator, plan, ctx.chunk_size, head_weight)
            grad_hidden = (torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device)
                           if needs_hidden and not direct else None)
            whole = _one_block(head_weight.shape[0], ctx.chunk_size)  # (its products are the gradients)
            grad_weight = (_Whole() if whole else torch.empty_like(head_weight)) if needs_weight else None
            grad_bias = (_Whole() if whole else torch.empty_like(bias)) if needs_bias else None  # (compute dtype)
            lo, hi = plan.numeric_columns
            shard_grad = ctx.numeric_grad if (lo, hi) == (0, ctx.numeric_grad.shape[1]) else ctx.numeric_grad[:, lo:hi]
            numeric_grad = live_rows(plan, shard_grad * upstream[:, None])
            if ctx.accelerator:
                block_hidden = _backward_sweep_accelerator(hidden, head_weight, bias, plan, ctx.chunk_size, lse,
                                                           multiplier, offsets, target_coefficient, numeric_grad,
                                                           grad_hidden, grad_weight, grad_bias, ctx.where, direct)
                if direct:
                    return (block_hidden.to(hidden_dtype), _Whole.tensor_of(grad_weight, head_weight),
                            _Whole.tensor_of(grad_bias, bias), None, None, None)
            else:
                _backward_sweep_cpu(hidden, head_weight, bias, plan, ctx.chunk_size, lse, multiplier, offsets,
                                    target_coefficient, numeric_grad, grad_hidden, grad_weight, grad_bias)
            if needs_hidden:
                if plan.tensor_parallel:
                    reduce_input_gradient(grad_hidden, plan.tp_group)
                grad_hidden = grad_hidden.to(hidden_dtype)
            return (grad_hidden, _Whole.tensor_of(grad_weight, head_weight), _Whole.tensor_of(grad_bias, bias), None,
                    None, None)


def _forward_sweep_cpu(hidden, head_weight, bias, plan: CallPlan, chunk_size: int) -> tuple:
    """The forward's pass over the head's blocks on the CPU's plan: (this shard's
    :class:`ShiftedLogSumExp`, the raw target logits ``[T]``, the transformed logits' row sums or None).
    A running (max, sum) merged block by block, the target logit picked from its block."""
    compute_dtype, options = plan.compute_dtype, plan.options
    tokens = hidden.shape[0]
    running = ShiftedLogSumExp(torch.full((tokens, ), float("-inf"), dtype=compute_dtype, device=hidden.device),
                               torch.zeros(tokens, dtype=compute_dtype, device=hidden.device))
    target_logits = torch.zeros(tokens, dtype=compute_dtype, device=hidden.device)
    logit_sum = torch.zeros_like(target_logits) if options.label_smoothing else None
    for start, end in _blocks(head_weight.shape[0], chunk_size):
        logits = block_logits(hidden, _rows(head_weight, start, end), _rows(bias, start, end), compute_dtype)
        in_block = plan.owned & (plan.local_targets >= start) & (plan.local_targets < end)
        picked = logits.gather(1, (plan.local_targets - start).clamp(0, end - start - 1)[:, None]).squeeze(1)
        target_logits = torch.where(in_block, picked, target_logits)  # the raw logit, as exchanged
        if options.logit_softcap is not None:  # the block holds σ, the capped logits cap (1 - 2σ)
            capped_sigmoid_(logits, options)
            factor, offset = -2.0 * options.logit_softcap, options.logit_softcap
        else:
            transform_logits_(logits, options)
            factor, offset = None, 0.0
        if logit_sum is not None:
            logit_sum += logits.sum(dim=-1) if factor is None else \
                logits.sum(dim=-1).mul_(factor).add_(offset * (end - start))
        running = merge_block_logsumexp(running, logits, factor, offset)
    return ShiftedLogSumExp(running.shift, running.log_sum.log()), target_logits, logit_sum


class _TargetBlocks:
    """Where each row's target column lies among the head's blocks, found once for a pass (the
    accelerator's sweeps), so that a block adds no op of its own for it but the pick or the add at
    the column: with one block the target's own column; with several, each row's column within its
    block (``[T, 1]``, clamped into a shorter last block once), and its block (-1 where this shard
    does not own the target)."""

    def __init__(self, plan: CallPlan, chunk_size: int, blocks: int):
        self.plan, self.single, self.count, self.chunk_size = plan, blocks == 1, blocks, chunk_size
        if self.single:
            self.column = plan.local_targets[:, None]
        else:
            self.block = torch.where(plan.owned, plan.local_targets // chunk_size, -1)
            self.column = (plan.local_targets % chunk_size)[:, None]
        self._last_column = None
        self._numeric_index = None

    @property
    def numeric_index(self) -> tuple:
        """(rows ``[P, 1]``, columns ``[1, N]``): the numeric positions' numeric columns, indices into
        the one block (the whole shard), shaped once for both passes."""
        if self._numeric_index is None:
            self._numeric_index = (self.plan.positions[:, None], self.plan.local_numeric_columns[None, :])
        return self._numeric_index

    def columns(self, start: int, end: int) -> torch.Tensor:
        """``[T, 1]`` each row's target column in the block ``[start, end)`` (clamped into it)."""
        if self.single or end - start == self.chunk_size:
            return self.column
        if self._last_column is None:  # the one shorter block, at the end
            self._last_column = self.column.clamp(max=end - start - 1)
        return self._last_column

    def picked(self, picks: list) -> torch.Tensor:
        """``[T]`` the target logit from each block's ``[T, 1]`` pick at :meth:`columns`: the owning
        block's, 0 where this shard does not own the target."""
        if self.single:  # (where, not times owned: a negative logit times False is -0.0, whose bits the
            # exchange's integer sum would add)
            return torch.where(self.plan.owned, picks[0].squeeze(1), zero(picks[0]))
        chosen = torch.cat(picks, dim=1).gather(1, self.block.clamp(min=0)[:, None]).squeeze(1)
        return torch.where(self.plan.owned, chosen, zero(chosen))

    def per_block(self, coefficient: torch.Tensor) -> torch.Tensor:
        """``[T, blocks]``: ``coefficient [T]`` in each row's target block's column, 0 elsewhere (and
        in every column where this shard does not own the target); block ``i`` reads column ``i``."""
        if self.single:
            return (coefficient * self.plan.owned)[:, None]
        blocks = torch.arange(self.count, device=coefficient.device)
        return torch.where(self.block[:, None] == blocks, coefficient[:, None], zero(coefficient))


def _holds_exactly(compute_dtype: torch.dtype, product_dtype: torch.dtype) -> bool:
    """Whether the compute dtype holds every product-dtype value exactly (the same dtype, or a wider
    float: bf16 or fp16 in fp32, fp32 in fp64): then the numeric logits can be read from the block in
    the compute dtype, as the separate product would give them (``accum_dtype=torch.bfloat16`` under
    fp32 logits rounds the block, so they keep their own product there)."""
    return compute_dtype == product_dtype or torch.finfo(compute_dtype).bits > torch.finfo(product_dtype).bits


def _forward_sweep_accelerator(hidden, head_weight, bias, plan: CallPlan, chunk_size: int,
                               where: _TargetBlocks) -> tuple:
    """:func:`_forward_sweep_cpu` on an accelerator's plan, in fewer and larger ops: each block's own
    (max, sum of exp) kept, merged once after the pass (with one block: nothing to merge); the target
    logit picked from every block at the row's column and chosen once after the pass
    (:class:`_TargetBlocks`). Also returns, with one block, the numeric logits ``[P, N]`` read from it
    (no product of their own) where the compute dtype holds them exactly (:func:`_holds_exactly`), else
    None."""
    compute_dtype, options = plan.compute_dtype, plan.options
    blocks = _blocks(head_weight.shape[0], chunk_size)
    logit_sum = numeric_logits = None
    several = len(blocks) > 1
    picks, shifts, sums = [], [], []
    for start, end in blocks:
        logits = block_logits(hidden, _rows(head_weight, start, end), _rows(bias, start, end), compute_dtype)
        picks.append(logits.gather(1, where.columns(start, end)))  # the raw logit, as exchanged
        if where.single and _holds_exactly(compute_dtype, plan.spec.dtype):  # (raw: before the block is
            numeric_logits = logits[where.numeric_index]  # transformed and exponentiated in place)
        if options.logit_softcap is not None:  # the block holds σ, the capped logits cap (1 - 2σ)
            cap = options.logit_softcap
            capped_sigmoid_(logits, options)
            # the largest logit is at the smallest σ
            shift = logits.amin(dim=-1, keepdim=True).mul_(-2.0 * cap).add_(cap)
            if options.label_smoothing:
                block_sum = logits.sum(dim=-1).mul_(-2.0 * cap).add_(cap * (end - start))
            total = torch.add(cap - shift, logits, alpha=-2.0 * cap, out=logits).exp_().sum(dim=-1, keepdim=several)
        else:
            transform_logits_(logits, options)
            if options.label_smoothing:
                block_sum = logits.sum(dim=-1)
            shift = logits.amax(dim=-1, keepdim=True)
            total = logits.sub_(shift).exp_().sum(dim=-1, keepdim=several)  # ([T, 1] to be merged, else [T])
        if options.label_smoothing:
            logit_sum = block_sum if logit_sum is None else logit_sum + block_sum
        shifts.append(shift)
        sums.append(total)
    target_logits = where.picked(picks)
    if len(blocks) == 1:
        return ShiftedLogSumExp(shifts[0].squeeze(1), sums[0].log()), target_logits, logit_sum, numeric_logits
    shifts, sums = torch.cat(shifts, dim=1), torch.cat(sums, dim=1)
    shift = shifts.amax(dim=1, keepdim=True)
    return (ShiftedLogSumExp(shift.squeeze(1), (sums * (shifts - shift).exp()).sum(dim=1).log()), target_logits,
            logit_sum, None)


def _backward_sweep_cpu(hidden, head_weight, bias, plan: CallPlan, chunk_size: int, lse: ShiftedLogSumExp,
                        multiplier, offsets, target_coefficient, numeric_grad, grad_hidden, grad_weight,
                        grad_bias) -> None:
    """The backward's pass over the head's blocks on the CPU's plan: each block recomputed and turned
    into its gradient in place, ``d head_weight`` written and ``d hidden`` accumulated."""
    compute_dtype = plan.compute_dtype
    blocks = _blocks(head_weight.shape[0], chunk_size)
    # No data-dependent row lists (no host sync): each block adds every row's target coefficient at its
    # target column, 0 where the target is outside the block (inside the block, so that the one-hot part
    # is rounded with the rest of the block into the product dtype).
    for start, end in blocks:
        grad_logits, head_rows = _block_gradient(hidden, head_weight, bias, plan, start, end, lse, multiplier, offsets)
        in_block = plan.owned & (plan.local_targets >= start) & (plan.local_targets < end)
        grad_logits.scatter_add_(1, (plan.local_targets - start).clamp(0, end - start - 1)[:, None],
                                 torch.where(in_block, target_coefficient, zero(target_coefficient))[:, None])
        _add_numeric_columns_(grad_logits, plan, start, end, numeric_grad)
        _write_block_gradients(grad_logits, hidden, head_rows, start, end, compute_dtype, grad_hidden, grad_weight,
                               grad_bias)


def _backward_sweep_accelerator(hidden, head_weight, bias, plan: CallPlan, chunk_size: int, lse: ShiftedLogSumExp,
                                multiplier, offsets, target_coefficient, numeric_grad, grad_hidden, grad_weight,
                                grad_bias, where: _TargetBlocks, direct: bool = False) -> Optional[torch.Tensor]:
    """:func:`_backward_sweep_cpu` on an accelerator's plan: the target column found once
    (:class:`_TargetBlocks`), the log-sum-exp subtracted as one number (``shift + log_sum``, formed
    once), and where the product runs in the compute dtype without a logit transform, inside the
    recomputing GEMM (``addmm`` with ``-lse`` as its bias). The softmax then carries the rounding of
    ``shift + log_sum`` in the compute dtype: a relative 6e-8 of it in fp32, ~2e-5 of a probability at
    logits ~300, below a bf16 product's own rounding of the logits."""
    blocks = _blocks(head_weight.shape[0], chunk_size)
    coefficients = where.per_block(target_coefficient)  # [T, blocks]
    options, compute_dtype = plan.options, plan.compute_dtype
    softcapped = options.logit_softcap is not None
    folded = hidden.dtype == compute_dtype and not options.transforms_logits
    # The row vectors every block reads, shaped once: lse, the multipliers, the smoothing offsets.
    lse_column = (lse.shift + lse.log_sum)[:, None]
    multiplier_column = multiplier[:, None]
    offsets_column = None if offsets is None else offsets[:, None]
    for index, (start, end) in enumerate(blocks):
        if softcapped:
            grad_logits, head_rows = _block_gradient(hidden, head_weight, bias, plan, start, end, lse, multiplier,
                                                     offsets)
        else:
            head_rows = _rows(head_weight, start, end).to(hidden.dtype)
            bias_rows = _rows(bias, start, end)
            if folded:  # logits - lse straight out of the GEMM (beta = -1: -(lse - bias) + hidden @ rows.T)
                offset = lse_column if bias_rows is None else lse_column - bias_rows.to(hidden.dtype)
                grad_logits = torch.addmm(offset, hidden, head_rows.T, beta=-1)
            else:  # a half product, or scaled logits: the block in the compute dtype first
                grad_logits = transform_logits_(block_logits(hidden, head_rows, bias_rows, compute_dtype), options)
                grad_logits.sub_(lse_column)
            grad_logits.exp_().mul_(multiplier_column)
            if offsets_column is not None:
                grad_logits.sub_(offsets_column)
            if options.logit_scale is not None:
                grad_logits.mul_(options.scale)
        grad_logits.scatter_add_(1, where.columns(start, end),
                                 coefficients if where.single else coefficients[:, index:index + 1])
        _add_numeric_columns_(grad_logits, plan, start, end, numeric_grad,
                              where.numeric_index if where.single else None)
        product_grad = _write_block_gradients(grad_logits, hidden, head_rows, start, end, compute_dtype, grad_hidden,
                                              grad_weight, grad_bias)
    # ``direct`` (one block, one device): d hidden is returned, made in hidden's dtype, not accumulated.
    return product_grad @ head_rows if direct else None


def _block_gradient(hidden, head_weight, bias, plan: CallPlan, start: int, end: int, lse: ShiftedLogSumExp,
                    multiplier, offsets) -> tuple:
    """The block ``[start, end)`` of head rows recomputed and turned in place into the dense part of its
    gradient (softmax times the row multipliers, minus the smoothing offsets, through the transform):
    (that ``[T, B]`` block in the compute dtype, the head rows in the product dtype)."""
    options = plan.options
    head_rows = _rows(head_weight, start, end).to(hidden.dtype)
    logits = block_logits(hidden, head_rows, _rows(bias, start, end), plan.compute_dtype)
    if options.logit_softcap is not None:
        return softcap_dense_gradient_(capped_sigmoid_(logits, options), lse, multiplier, offsets, options), head_rows
    return dense_gradient_(transform_logits_(logits, options), lse, multiplier, offsets, options), head_rows


def _add_numeric_columns_(grad_logits, plan: CallPlan, start: int, end: int, numeric_grad,
                          whole_index: Optional[tuple] = None) -> None:
    """Add the numeric loss's ``[P, hi - lo]`` gradient at its columns that fall in the block (the
    numeric columns come from the vocabulary's host list, so the block's share needs no device read).
    ``whole_index``: with one block, :attr:`_TargetBlocks.numeric_index` (the forward's, reused)."""
    if whole_index is not None:
        grad_logits.index_put_(whole_index, numeric_grad, accumulate=True)
        return
    lo, hi = plan.numeric_columns
    first, last = plan.loss.vocab.count_below(plan.vocab_start_index + start) - lo, \
        plan.loss.vocab.count_below(plan.vocab_start_index + end) - lo
    first, last = max(first, 0), min(last, hi - lo)
    if last > first and plan.positions.numel():
        columns = _rows(plan.local_numeric_columns, first, last)
        columns = columns - start if start else columns
        block_grad = numeric_grad if (first, last) == (0, numeric_grad.shape[1]) else numeric_grad[:, first:last]
        grad_logits.index_put_((plan.positions[:, None], columns[None, :]), block_grad, accumulate=True)


class _Whole:
    """A parameter's gradient when one block covers the whole head: that block's product itself
    (``tensor``), instead of a buffer allocated and written into (one op less, no copy)."""

    tensor: Optional[torch.Tensor] = None

    @staticmethod
    def tensor_of(gradient, parameter: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The gradient to return for ``parameter``: a buffer as it is; a product in its dtype."""
        return gradient.tensor.to(parameter.dtype) if isinstance(gradient, _Whole) else gradient


def _write_block_gradients(grad_logits, hidden, head_rows, start: int, end: int, compute_dtype, grad_hidden,
                           grad_weight, grad_bias) -> torch.Tensor:
    """From a block's gradient ``[T, B]`` (compute dtype): write ``d bias`` and ``d head_weight`` for its
    rows, and add its share of ``d hidden`` (products in hidden's dtype, as the forward's); returns the
    block's gradient in hidden's dtype."""
    if isinstance(grad_bias, _Whole):
        grad_bias.tensor = grad_logits.sum(dim=0)
    elif grad_bias is not None:
        grad_bias[start:end] = grad_logits.sum(dim=0)
    grad_logits = grad_logits.to(hidden.dtype)
    if isinstance(grad_weight, _Whole):
        grad_weight.tensor = grad_logits.T @ hidden
    elif grad_weight is not None:
        if grad_weight.dtype == hidden.dtype:
            torch.mm(grad_logits.T, hidden, out=_rows(grad_weight, start, end))
        else:
            grad_weight[start:end] = grad_logits.T @ hidden
    if grad_hidden is not None:
        if hidden.dtype == compute_dtype:
            grad_hidden.addmm_(grad_logits, head_rows)
        else:
            grad_hidden += (grad_logits @ head_rows).to(compute_dtype)
    return grad_logits


def linear_per_token_losses(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                            numeric_loss: NumericLossLike, *, bias: Optional[torch.Tensor] = None, tp_group=None,
                            vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                            weight: Optional[float] = None, chunk_size: Optional[int] = None,
                            num_numeric_in_batch=None,
                            options: CrossEntropyOptions = DEFAULT_OPTIONS,
                            sequence_shard: Optional[SequenceShard] = None,
                            block_budget_bytes: Optional[int] = None, numeric_capacity=None) -> PerTokenLosses:
    """CE and the numeric loss per position of ``hidden @ head_weight.T (+ bias)``, unreduced; see
    :func:`linear_numeric_cross_entropy`."""
    check_numeric_loss(numeric_loss)
    for name, value in (("hidden", hidden), ("head_weight", head_weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size={chunk_size!r} must be an int (head rows per block) or None")
    tp_size, _ = group_size_and_rank(tp_group)
    logits_dtype = product_dtype(hidden, head_weight, bias)
    failed_check = checks.check_linear_inputs(hidden, head_weight, bias, chunk_size, numeric_loss.vocab.vocab_size,
                                              tensor_parallel=tp_size > 1, dtypes_agree=logits_dtype is not None)
    width = head_weight.shape[0] if head_weight.dim() == 2 else 0
    spec = LogitsSpec(tuple(hidden.shape[:-1]) + (width, ) if hidden.dim() else (width, ),
                      logits_dtype or hidden.dtype, hidden.device)
    plan = plan_call(numeric_loss, spec, targets, tp_group, vocab_start_index, with_ce=True,
                     num_items_in_batch=num_items_in_batch, weight=weight, num_numeric_in_batch=num_numeric_in_batch,
                     failed_check=failed_check, options=options, sequence_shard=sequence_shard,
                     may_pad_positions=True, numeric_capacity=numeric_capacity)
    hidden_2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    chunk_size = fused_head_plan(hidden_2d.shape[0], hidden_2d.shape[1], width, spec.dtype, plan.compute_dtype,
                                 DeviceProperties.of(hidden.device), block_budget_bytes, chunk_size).chunk_size
    device = DeviceProperties.of(hidden.device)
    ce, numeric_rows, z, sums = _FusedLinearCrossEntropyNumeric.apply(hidden_2d, head_weight, bias, plan, chunk_size,
                                                                device.accelerator)
    return PerTokenLosses(ce, numeric_rows, plan, sums, z)


def linear_numeric_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                                 numeric_loss: NumericLossLike, weight: float = 1.0, *,
                                 bias: Optional[torch.Tensor] = None, tp_group=None,
                                 vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                                 chunk_size: Optional[int] = None, num_numeric_in_batch=None, reduction: str = "mean",
                                 logit_scale: Optional[float] = None, logit_softcap: Optional[float] = None,
                                 z_loss: float = 0.0, label_smoothing: float = 0.0,
                                 accum_dtype: Optional[torch.dtype] = None,
                                 sequence_shard: Optional[SequenceShard] = None,
                                 block_budget_bytes: Optional[int] = None, numeric_capacity=None) -> NumericOutput:
    """CE + weight * a numeric loss of the logits ``hidden @ head_weight.T (+ bias)``, without ever
    making them: the same :class:`NumericOutput` as ``numeric_cross_entropy`` on those logits.

    hidden:      ``[..., H]``, identical on every rank of ``tp_group``
    head_weight: ``[V_local, H]`` this rank's rows of the head (vocabulary ids from
                 ``vocab_start_index``; all V rows without tensor parallelism)
    targets:     ``[...]`` aligned with hidden (already shifted)
    chunk_size:  head rows per block of logits (default: :func:`smmd_scale.block_plan.fused_head_plan`'s)
    block_budget_bytes: on an accelerator, the working memory the blocks may take (default: a quarter
                 of the free memory, at most 4 GiB); the CPU's plan ignores it
    num_items_in_batch, num_numeric_in_batch: the optimizer step's counts (see
                 :func:`smmd_scale.loss.reduce_losses`)
    reduction, logit_scale, logit_softcap, z_loss, label_smoothing, accum_dtype, sequence_shard,
    numeric_capacity: as in
                 :func:`smmd_scale.numeric_cross_entropy`, applied to each block of logits (soft-capping
                 and scaling in both passes; their derivative from the recomputed block)

    Gradients flow to hidden, head_weight and bias. Vocab-parallel: one packed all-reduce in the
    forward and the ``d hidden`` all-reduce in the backward (``stats["backward_comm_calls"]``,
    ``["backward_comm_bytes"]``); none at all on one device.
    """
    weight = check_weight(weight)
    reduction = check_reduction(reduction, num_items_in_batch, num_numeric_in_batch)
    options = CrossEntropyOptions.checked(logit_scale, logit_softcap, z_loss, label_smoothing, accum_dtype)
    losses = linear_per_token_losses(hidden, head_weight, targets, numeric_loss, bias=bias, tp_group=tp_group,
                                     vocab_start_index=vocab_start_index, num_items_in_batch=num_items_in_batch,
                                     weight=weight, chunk_size=chunk_size, num_numeric_in_batch=num_numeric_in_batch,
                                     options=options, sequence_shard=sequence_shard,
                                     block_budget_bytes=block_budget_bytes, numeric_capacity=numeric_capacity)
    output = reduce_losses(losses, weight, num_items_in_batch, num_numeric_in_batch, reduction)
    reduces_gradient = losses.plan.tensor_parallel and hidden.requires_grad
    output.stats["backward_comm_calls"] = int(reduces_gradient)
    output.stats["backward_comm_bytes"] = (
        losses.ce.shape[0] * hidden.shape[-1] * losses.plan.compute_dtype.itemsize
        if reduces_gradient else 0)
    return output


def __getattr__(name: str):
    return module_attribute(__name__, name)  # linear_smmd_cross_entropy: removed in 0.3.0
