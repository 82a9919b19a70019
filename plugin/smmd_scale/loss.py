"""SMMD and fused cross-entropy + SMMD: the math and its autograd (the objective: docs/objective.md).

No ``torch.distributed`` here: under tensor parallelism the forward hands this rank's contribution
to :func:`smmd_scale.parallel.exchange` (one all-reduce) and gets back what every rank needs; the
single-device path skips that step. Both paths share the named steps below.

Memory: the fused op keeps **one** ``[tokens, V_local]`` working buffer in the compute dtype
(float32, or float64 for float64 logits): the local softmax, written straight from the logits'
own dtype (a bf16 shard is never first copied to fp32), kept for backward and turned into the
gradient in place. The numeric part reads only ``[P, N]`` numeric logits at the P numeric-target
positions (never a ``[P, V]`` block).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch

from . import checks
from .kernels import build_kernel
from .parallel import ExchangeState, RankContribution, exchange, group_size_and_rank, options_fingerprint
from .vocab import NumericVocab


@dataclass
class SMMDOutput:
    """Result of :func:`smmd_cross_entropy`.

    total, ce, smmd: scalar tensors with grad; ``total = ce + weight * smmd``.
    stats: detached Python floats — ``mmd`` and ``smooth`` (means over numeric positions of
        r^T K r and alpha r^T L r), ``numeric_tokens`` (P), ``numeric_accuracy`` (argmax over the
        numeric tokens is the target token), ``numeric_mae`` (|E_p[value] - target value|),
        ``comm_calls`` and ``comm_bytes`` (this call's collectives and their payload bytes),
        ``tokens`` (non-ignored targets).
    """

    total: torch.Tensor
    ce: torch.Tensor
    smmd: torch.Tensor
    stats: dict


@dataclass
class _VocabTensors:
    """The numeric vocabulary and kernel on one device in one compute dtype."""

    token_ids: torch.Tensor  # int64 [N], sorted
    values: torch.Tensor  # [N]
    kernel: torch.Tensor  # [N, N]
    degree: torch.Tensor  # [N]


@dataclass
class _NumericTerms:
    """Per numeric position p (``[P]``) and its gradient w.r.t. the numeric logits ``[P, N]``."""

    value: torch.Tensor
    grad: torch.Tensor
    mmd: torch.Tensor
    smooth: torch.Tensor
    correct: torch.Tensor
    abs_error: torch.Tensor


@dataclass
class StatSums:
    """One call's detached statistics, summed on the device and read once on the host (:func:`stats_dict`)."""

    mmd: torch.Tensor  # sums over numeric positions
    smooth: torch.Tensor
    correct: torch.Tensor
    abs_error: torch.Tensor
    valid_tokens: torch.Tensor  # non-ignored targets
    comm_calls: int  # collectives this call ran, and the bytes they carried
    comm_bytes: int


@dataclass
class ForwardPlan:
    """Everything one forward needs besides the logits; built before any collective."""

    loss: "SMMDLoss"
    tensors: _VocabTensors
    targets: torch.Tensor  # [T] int64
    valid: torch.Tensor  # [T] bool, target != ignore_index
    owned: torch.Tensor  # [T] bool, target id inside this shard
    local_targets: torch.Tensor  # [T] target id - vocab_start_index, clamped into the shard
    positions: torch.Tensor  # [P] numeric-target positions
    numeric_targets: torch.Tensor  # [P] index of the target in the numeric vocabulary
    numeric_columns: tuple  # (lo, hi): numeric-vocabulary indices owned by this shard
    local_numeric_columns: torch.Tensor  # [hi - lo] their column in the shard
    vocab_start_index: int
    tp_group: object
    tp_state: Optional[ExchangeState]
    compute_dtype: torch.dtype
    stats: Optional[StatSums] = None


def compute_dtype_for(logits_dtype: torch.dtype) -> torch.dtype:
    """Losses are computed in at least float32; float64 logits stay float64."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Named steps shared by the single-device and vocab-parallel paths
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


def cross_entropy_per_token(lse: ShiftedLogSumExp, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``lse - logits[t, y_t]``, as ``(shift - target logit) + log_sum``, at valid positions; 0 at
    ignored ones unless their logits are not finite (``x - x`` is NaN there), so a NaN anywhere in
    the logits never becomes a finite loss."""
    return torch.where(valid, (lse.shift - target_logits) + lse.log_sum,
                       (lse.shift - lse.shift) + (lse.log_sum - lse.log_sum))


def numeric_smmd(numeric_logits: torch.Tensor, numeric_targets: torch.Tensor, tensors: _VocabTensors, mode: str,
                 alpha: float) -> _NumericTerms:
    """The paper's objective at P numeric positions, with its analytic gradient.

    ``p = softmax(numeric_logits)``, ``r = p - onehot(target)``. One ``[P, N] x [N, N]`` product
    gives everything: ``Kr``; ``r^T K r``; ``r^T L r = sum(deg * r^2) - r^T K r`` (L = D - K); and
    the gradient ``d/dp = 2 M r`` with ``M r = Kr`` (mmd), ``alpha (deg*r - Kr)`` (smooth) or their
    sum (smmd), chained through the softmax restricted to the numeric tokens.
    """
    probabilities = torch.softmax(numeric_logits.to(tensors.kernel.dtype), dim=-1)
    rows = torch.arange(probabilities.shape[0], device=probabilities.device)
    residual = probabilities.index_put((rows, numeric_targets), torch.tensor(-1.0, dtype=probabilities.dtype,
                                                                               device=probabilities.device),
                                       accumulate=True)
    kernel_residual = residual @ tensors.kernel
    mmd = (residual * kernel_residual).sum(dim=-1)
    laplacian_residual = tensors.degree * residual - kernel_residual
    smooth = alpha * (residual * laplacian_residual).sum(dim=-1)
    if mode == "mmd":
        value, metric_residual = mmd, kernel_residual
    elif mode == "smooth":
        value, metric_residual = smooth, alpha * laplacian_residual
    else:
        value, metric_residual = mmd + smooth, kernel_residual + alpha * laplacian_residual
    # relu guards float error; its derivative is 0 where the value is <= 0, as torch.relu's.
    grad_probabilities = 2.0 * metric_residual * (value > 0).to(value.dtype)[:, None]
    grad = probabilities * (grad_probabilities - (probabilities * grad_probabilities).sum(dim=-1, keepdim=True))
    target_values = tensors.values[numeric_targets]
    return _NumericTerms(value=torch.relu(value), grad=grad, mmd=mmd, smooth=smooth,
                         correct=(probabilities.argmax(dim=-1) == numeric_targets),
                         abs_error=(probabilities @ tensors.values - target_values).abs())


def _record_stats(plan: ForwardPlan, terms: _NumericTerms, comm_calls: int, comm_bytes: int) -> None:
    plan.stats = StatSums(mmd=terms.mmd.detach().sum(), smooth=terms.smooth.detach().sum(),
                          correct=terms.correct.sum(), abs_error=terms.abs_error.detach().sum(),
                          valid_tokens=plan.valid.sum(), comm_calls=comm_calls, comm_bytes=comm_bytes)


def exchange_or_keep_local(plan: ForwardPlan, logits: torch.Tensor, numeric_logits: torch.Tensor, local_lse=None,
                           target_logits=None) -> tuple:
    """Single device: the local pieces are the global ones. Vocab-parallel: the one all-reduce.

    Returns (lse ``[T]`` or None, target logits ``[T]`` or None, numeric logits ``[P, N]``,
    collectives run, bytes they carried).
    """
    if plan.tp_state is None:
        return local_lse, target_logits, numeric_logits, 0, 0
    contribution = plan.loss._rank_contribution(logits, plan.targets, plan.vocab_start_index,
                                                with_ce=local_lse is not None)
    contribution.numeric_positions = int(plan.positions.numel())
    contribution.numeric_columns = plan.numeric_columns
    contribution.numeric_logits, contribution.local_lse = numeric_logits, local_lse
    contribution.target_logits = target_logits
    received = exchange(contribution, plan.tp_group, plan.tp_state)
    lse = None if received.lse_slots is None else combine_logsumexp(received.lse_slots[..., 0],
                                                                   received.lse_slots[..., 1])
    return lse, received.target_logits, received.numeric_logits, received.comm_calls, received.comm_bytes


def _guard_single_backward(ctx) -> None:
    # The saved softmax becomes the gradient in place, so a second backward through the same
    # forward (retain_graph=True) would read a gradient as if it were a softmax.
    if ctx.consumed:
        raise RuntimeError("smmd_scale's fused loss supports one backward per forward (its working buffer "
                           "becomes the gradient in place); run the forward again instead of retain_graph=True")
    ctx.consumed = True


class _FusedCrossEntropySMMD(torch.autograd.Function):
    """``logits [T, V_local]`` -> (CE per token ``[T]``, SMMD per token ``[T]``, 0 where not numeric)."""

    @staticmethod
    def forward(ctx, logits, plan: ForwardPlan):
        compute_dtype = plan.compute_dtype
        softmax, local_lse = local_softmax_and_logsumexp(logits, compute_dtype)
        target_logits = gather_target_logits(logits, plan.local_targets, plan.owned)
        numeric_logits = gather_numeric_logits(logits, plan.positions, plan.local_numeric_columns)
        lse, target_logits, numeric_logits, comm_calls, comm_bytes = exchange_or_keep_local(
            plan, logits, numeric_logits, local_lse, target_logits)
        ce = cross_entropy_per_token(lse, target_logits.to(compute_dtype), plan.valid)
        terms = numeric_smmd(numeric_logits, plan.numeric_targets, plan.tensors, plan.loss.mode, plan.loss.alpha)
        smmd = torch.zeros_like(ce).index_put_((plan.positions, ), terms.value)
        _record_stats(plan, terms, comm_calls, comm_bytes)

        ctx.consumed = False
        ctx.logits_dtype = logits.dtype
        ctx.numeric_columns = plan.numeric_columns
        if ctx.needs_input_grad[0]:
            # Under tensor parallelism the global softmax is softmax_local * exp(lse_local - lse).
            row_scale = torch.ones_like(ce) if plan.tp_state is None else softmax_rescale(local_lse, lse)
            ctx.save_for_backward(softmax, row_scale, plan.valid, plan.owned, plan.local_targets, plan.positions,
                                  plan.local_numeric_columns, terms.grad)
        return ce, smmd

    @staticmethod
    def backward(ctx, grad_ce, grad_smmd):
        _guard_single_backward(ctx)
        softmax, row_scale, valid, owned, local_targets, positions, local_columns, numeric_grad = ctx.saved_tensors
        grad = softmax  # the working buffer becomes the gradient
        grad_ce = grad_ce.to(grad.dtype) * valid
        grad.mul_((row_scale * grad_ce)[:, None])
        rows = owned.nonzero().squeeze(1)
        grad.index_put_((rows, local_targets[rows]), -grad_ce[rows], accumulate=True)
        lo, hi = ctx.numeric_columns
        if hi > lo and positions.numel():
            smmd_rows = numeric_grad[:, lo:hi] * grad_smmd[positions].to(grad.dtype)[:, None]
            grad.index_put_((positions[:, None], local_columns[None, :]), smmd_rows, accumulate=True)
        return grad.to(ctx.logits_dtype), None


class _NumericSMMD(torch.autograd.Function):
    """``logits [T, V_local]`` -> SMMD per numeric position ``[P]``; reads only ``[P, N]`` logits."""

    @staticmethod
    def forward(ctx, logits, plan: ForwardPlan):
        numeric_logits = gather_numeric_logits(logits, plan.positions, plan.local_numeric_columns)
        _, _, numeric_logits, comm_calls, comm_bytes = exchange_or_keep_local(plan, logits, numeric_logits)
        terms = numeric_smmd(numeric_logits, plan.numeric_targets, plan.tensors, plan.loss.mode, plan.loss.alpha)
        _record_stats(plan, terms, comm_calls, comm_bytes)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        ctx.numeric_columns = plan.numeric_columns
        ctx.save_for_backward(plan.positions, plan.local_numeric_columns, terms.grad)
        return terms.value

    @staticmethod
    def backward(ctx, grad_value):
        positions, local_columns, numeric_grad = ctx.saved_tensors
        grad = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_value.device)
        lo, hi = ctx.numeric_columns
        if hi > lo and positions.numel():
            rows = numeric_grad[:, lo:hi] * grad_value.to(numeric_grad.dtype)[:, None]
            grad[positions[:, None], local_columns[None, :]] = rows.to(ctx.logits_dtype)
        return grad, None


class SMMDLoss:
    """The SMMD objective for one numeric vocabulary (docs/objective.md).

    ``loss = SMMDLoss(vocab)(logits, targets)`` with full-vocabulary logits ``[..., V]`` (any float
    dtype; computed in at least float32) and aligned (already shifted) targets ``[...]``; or, for a
    vocabulary-parallel shard ``[..., V/T]``, pass ``tp_group`` and ``vocab_start_index``. Returns
    the mean over numeric-target positions (an exact 0 that still backpropagates when there are
    none). For CE + SMMD in one pass use :func:`smmd_cross_entropy` with this object.

    Options: ``mode`` in {"smmd", "mmd", "smooth"}; ``kernel`` in {"gaussian", "laplace"} or the
    paper's ablations {"random", "shuffled"} (seeded by ``seed``); ``sigmas`` (averaged);
    ``squash_factor`` (<= 1 disables); ``alpha`` ("auto" = 1 / (2 mean degree), or a number).
    """

    def __init__(self, vocab: NumericVocab, mode: str = "smmd", kernel: str = "gaussian",
                 sigmas: Union[float, Sequence[float]] = (2.0, ), squash_factor: float = 9.0,
                 alpha: Union[str, float] = "auto", ignore_index: int = -100, seed: int = 42):
        if not isinstance(vocab, NumericVocab):
            raise TypeError(f"vocab must be a smmd_scale.NumericVocab, got {type(vocab).__name__}; build one with "
                            "NumericVocab(token_ids, values, vocab_size) or NumericVocab.from_tokenizer(tokenizer)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index={ignore_index!r} must be an int")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        distinct_values = int(torch.unique(vocab.values).numel())
        if distinct_values < 2:
            raise ValueError(f"the numeric vocabulary has {len(vocab)} token(s) but {distinct_values} distinct "
                             "value(s); SMMD compares values, so it needs at least two distinct ones (its MMD "
                             "term would be identically 0); check how the vocabulary was built")
        matrices = build_kernel(vocab.values, mode=mode, kernel=kernel, sigmas=sigmas, squash_factor=squash_factor,
                                alpha=alpha, seed=seed)
        self.vocab = vocab
        self.mode, self.kernel, self.squash_factor, self.ignore_index = mode, kernel, float(squash_factor), ignore_index
        self.sigmas = tuple(float(s) for s in (sigmas if isinstance(sigmas, (tuple, list)) else (sigmas, )))
        self.alpha = matrices.alpha
        self.kernel_matrix, self.degree = matrices.kernel, matrices.degree
        self.fingerprint = options_fingerprint(vocab.fingerprint, mode, kernel, self.sigmas, self.squash_factor,
                                               self.alpha, ignore_index, seed)
        self._cpu_token_ids = vocab.token_ids.tolist()
        self._tensors = {}
        # Exchange state per tensor-parallel group; weak keys so a destroyed group is not kept alive.
        self._tp_states = weakref.WeakKeyDictionary()

    def __repr__(self):
        return (f"SMMDLoss(mode={self.mode!r}, kernel={self.kernel!r}, sigmas={self.sigmas}, "
                f"squash_factor={self.squash_factor}, alpha={self.alpha:.6g}, ignore_index={self.ignore_index}, "
                f"vocab={self.vocab!r})")

    def _vocab_tensors(self, device: torch.device, compute_dtype: torch.dtype) -> _VocabTensors:
        key = (device, compute_dtype)
        if key not in self._tensors:
            self._tensors[key] = _VocabTensors(
                token_ids=self.vocab.token_ids.to(device),
                values=self.vocab.values.to(device=device, dtype=compute_dtype),
                kernel=self.kernel_matrix.to(device=device, dtype=compute_dtype),
                degree=self.degree.to(device=device, dtype=compute_dtype))
        return self._tensors[key]

    def _tp_state(self, tp_group) -> ExchangeState:
        if tp_group not in self._tp_states:
            self._tp_states[tp_group] = ExchangeState()
        return self._tp_states[tp_group]

    def _rank_contribution(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start_index: int, with_ce: bool,
                           failed_check=None) -> RankContribution:
        """This rank's header for the exchange; the caller adds the data pieces when healthy."""
        width = logits.shape[-1]
        return RankContribution(failed_check=failed_check, tokens=logits.numel() // max(width, 1),
                                numeric_size=len(self.vocab), vocab_start=vocab_start_index, width=width,
                                vocab_size=self.vocab.vocab_size, loss_fingerprint=self.fingerprint, targets=targets,
                                compute_dtype=compute_dtype_for(logits.dtype),
                                logits_dtype=logits.dtype if logits.is_floating_point() else torch.float32,
                                device=logits.device, with_ce=with_ce)

    def _prepare(self, logits, targets, tp_group, vocab_start_index, with_ce: bool, num_items_in_batch=None,
                 weight: Optional[float] = None) -> tuple:
        """Validate (all ranks reach the same verdict) and build the forward plan; no collective
        runs unless the input is bad under tensor parallelism, where the verdict is shared."""
        if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise TypeError(f"logits and targets must be torch.Tensors, got {type(logits).__name__} and "
                            f"{type(targets).__name__}")
        if logits.dim() < 1:
            raise ValueError(f"logits must have a last (vocabulary) dim, got shape {tuple(logits.shape)}")
        tp_size, tp_rank = group_size_and_rank(tp_group)
        tensor_parallel = tp_size > 1
        if vocab_start_index is None:
            # Megatron-style equal shards.
            vocab_start_index = tp_rank * logits.shape[-1]
        if isinstance(vocab_start_index, bool) or not isinstance(vocab_start_index, int):
            raise TypeError(f"vocab_start_index={vocab_start_index!r} must be an int")
        failed_check = checks.check_inputs(logits, targets, vocab_size=self.vocab.vocab_size,
                                      vocab_start_index=vocab_start_index, tensor_parallel=tensor_parallel,
                                      ignore_index=self.ignore_index, num_items_in_batch=num_items_in_batch,
                                      weight=weight)
        if failed_check is not None:
            if not tensor_parallel:
                raise failed_check.error()
            # Take part in the collective with the verdict so every rank raises it together.
            exchange(self._rank_contribution(logits, targets, vocab_start_index, with_ce, failed_check), tp_group,
                     self._tp_state(tp_group))
            raise AssertionError("unreachable: the exchange raises the shared verdict")

        width = logits.shape[-1]
        logits_2d = logits.reshape(-1, width)
        compute_dtype = compute_dtype_for(logits.dtype)
        tensors = self._vocab_tensors(logits.device, compute_dtype)
        flat_targets = targets.reshape(-1).to(torch.long)
        valid = flat_targets != self.ignore_index
        owned = valid & (flat_targets >= vocab_start_index) & (flat_targets < vocab_start_index + width)
        local_targets = (flat_targets - vocab_start_index).clamp(0, max(width - 1, 0))
        numeric_size = len(self.vocab)
        index = torch.searchsorted(tensors.token_ids, flat_targets).clamp(max=numeric_size - 1)
        is_numeric = tensors.token_ids[index] == flat_targets
        positions = is_numeric.nonzero().squeeze(1)
        lo = bisect.bisect_left(self._cpu_token_ids, vocab_start_index)
        hi = bisect.bisect_left(self._cpu_token_ids, vocab_start_index + width)
        plan = ForwardPlan(loss=self, tensors=tensors, targets=flat_targets, valid=valid, owned=owned,
                           local_targets=local_targets, positions=positions, numeric_targets=index[positions],
                           numeric_columns=(lo, hi), local_numeric_columns=tensors.token_ids[lo:hi] - vocab_start_index,
                           vocab_start_index=vocab_start_index, tp_group=tp_group,
                           tp_state=self._tp_state(tp_group) if tensor_parallel else None,
                           compute_dtype=compute_dtype)
        return logits_2d, plan

    def numeric_mask(self, targets: torch.Tensor) -> torch.Tensor:
        """``targets [...]`` -> bool ``[...]``: where the target is a numeric token (where SMMD applies)."""
        token_ids = self._vocab_tensors(targets.device, torch.float32).token_ids
        return torch.isin(targets, token_ids)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                 vocab_start_index: Optional[int] = 0) -> torch.Tensor:
        logits_2d, plan = self._prepare(logits, targets, tp_group, vocab_start_index, with_ce=False)
        values = _NumericSMMD.apply(logits_2d, plan)
        return values.sum() / max(values.numel(), 1)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor, smmd: SMMDLoss, tp_group=None,
                     vocab_start_index: Optional[int] = 0, num_items_in_batch=None,
                     weight: Optional[float] = None) -> tuple:
    """CE and SMMD per position, unreduced: ``([T], [T], forward plan)``, T = targets.numel().

    CE is 0 at ignored positions; SMMD is 0 where the target is not numeric. The building block
    of :func:`smmd_cross_entropy` and of the Megatron entry point (which applies its own mask).
    """
    if not isinstance(smmd, SMMDLoss):
        raise TypeError(f"smmd must be a smmd_scale.SMMDLoss, got {type(smmd).__name__}")
    logits_2d, plan = smmd._prepare(logits, targets, tp_group, vocab_start_index, with_ce=True,
                                    num_items_in_batch=num_items_in_batch, weight=weight)
    ce, smmd_values = _FusedCrossEntropySMMD.apply(logits_2d, plan)
    return ce, smmd_values, plan


def smmd_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smmd: SMMDLoss, weight: float = 1.0,
                       tp_group=None, vocab_start_index: Optional[int] = 0, num_items_in_batch=None) -> SMMDOutput:
    """CE + weight * SMMD in one pass over ``logits [..., V]`` (or a vocab-parallel shard).

    ``targets [...]`` are aligned with the logits (no shift). CE is the mean over non-ignored
    targets (0 if there are none), or their sum / ``num_items_in_batch`` when given, as Hugging
    Face does under gradient accumulation. SMMD is the mean over numeric-target positions; with
    ``num_items_in_batch`` it is weighted by this call's share of the batch's tokens
    (``tokens / num_items_in_batch``), so that summing micro-batches — which is what the HF
    Trainer does with that argument — keeps SMMD at its mean scale instead of multiplying it by
    the number of micro-batches.
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight={weight!r} must be a number (0 = CE only)")
    # The value itself is checked with the tensors, so a bad weight on one rank raises on all of them.
    ce_per_token, smmd_per_token, plan = per_token_losses(logits, targets, smmd, tp_group, vocab_start_index,
                                                          num_items_in_batch, float(weight))
    valid_tokens = plan.valid.sum()
    numeric_tokens = max(int(plan.positions.numel()), 1)
    smmd_mean = smmd_per_token.sum() / numeric_tokens
    if num_items_in_batch is None:
        ce = ce_per_token.sum() / valid_tokens.clamp_min(1)
        smmd_term = smmd_mean
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=ce_per_token.device,
                                      dtype=ce_per_token.dtype).clamp_min(1)
        ce = ce_per_token.sum() / denominator
        smmd_term = smmd_mean * valid_tokens / denominator
    total = ce + weight * smmd_term
    return SMMDOutput(total=total, ce=ce, smmd=smmd_term, stats=stats_dict(plan))


def stats_dict(plan: ForwardPlan) -> dict:
    """A call's :class:`StatSums` as the floats of ``SMMDOutput.stats`` (one host sync)."""
    sums = plan.stats
    mmd_sum, smooth_sum, correct, abs_error_sum, valid_tokens = torch.stack(
        [sums.mmd.double(), sums.smooth.double(), sums.correct.double(), sums.abs_error.double(),
         sums.valid_tokens.double()]).tolist()
    comm_calls, comm_bytes = sums.comm_calls, sums.comm_bytes
    numeric_tokens = int(plan.positions.numel())
    per_numeric = 1.0 / max(numeric_tokens, 1)
    return {"mmd": mmd_sum * per_numeric, "smooth": smooth_sum * per_numeric, "numeric_tokens": numeric_tokens,
            "numeric_accuracy": correct * per_numeric, "numeric_mae": abs_error_sum * per_numeric,
            "comm_calls": comm_calls, "comm_bytes": comm_bytes, "tokens": int(valid_tokens)}
