"""One call of the loss, planned before any collective: which positions are numeric, which columns
this shard owns, the complete contribution this rank hands to the exchange, and the exchange state
of each tensor-parallel group.

A numeric loss reaches this module only through :class:`NumericLossLike`: its vocabulary,
``ignore_index``, ``fingerprint`` and its math (``numeric_terms``). Nothing here keeps state on the
loss object; the exchange state lives in one registry keyed by (group, loss fingerprint), so that
every rank derives the same capacity from the same sequence of all-reduced headers.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from . import checks
from .block_plan import DeviceProperties
from .parallel import ExchangeResult, ExchangeState, RankContribution, exchange, group_size_and_rank
from .sequence_shard import SequenceShard, numeric_positions
from .vocab import NumericVocab


class NumericSlice:
    """What the one exchange gives a numeric loss at a call's P numeric-target positions (float64).

    logits:   ``[P, N]`` the numeric logits (after the call's logit scale and soft-cap)
    q, log_q: ``[P, N]`` the softmax over the numeric tokens and its log (``log_q`` formed when a loss
              first reads it, if not given: the losses that read only ``q`` launch no op for it)
    mass:     ``[P]`` the full softmax's probability on the numeric tokens, None unless the loss
              ``needs_mass``; ``log_mass`` its log, formed without cancellation
    """

    def __init__(self, logits: torch.Tensor, q: torch.Tensor, log_q: Optional[torch.Tensor] = None,
                 mass: Optional[torch.Tensor] = None, log_mass: Optional[torch.Tensor] = None):
        self.logits, self.q, self._log_q, self.mass, self.log_mass = logits, q, log_q, mass, log_mass

    @property
    def log_q(self) -> torch.Tensor:
        if self._log_q is None:
            self._log_q = torch.log_softmax(self.logits, dim=-1)
        return self._log_q


@runtime_checkable
class NumericLossLike(Protocol):
    """What the loss ops need of a numeric loss (``smmd_scale.NumericLoss`` provides it)."""

    vocab: NumericVocab
    ignore_index: int
    fingerprint: int
    needs_mass: bool
    stat_names: tuple  # the [P] parts numeric_terms reports, in a fixed order

    def numeric_terms(self, q, numeric_targets, mass, compute_dtype): ...

    def terms_for_call(self, plan, numeric: NumericSlice): ...  # the loss and its gradient for one call


def check_numeric_loss(numeric_loss) -> None:
    if not isinstance(numeric_loss, NumericLossLike):
        raise TypeError(f"numeric_loss must be a smmd_scale.NumericLoss (SMMDLoss, NTLoss or a weighted sum of "
                        f"them), got {type(numeric_loss).__name__}")


def check_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight={weight!r} must be a number (0 = CE only)")
    # The value itself is checked with the tensors, so a bad weight on one rank raises on all of them.
    return float(weight)


def compute_dtype_for(logits_dtype: torch.dtype, accum_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """Losses are computed in at least float32 (float64 logits stay float64), or in ``accum_dtype``
    when the caller asks for one (e.g. the input's bfloat16)."""
    if accum_dtype is not None:
        return accum_dtype
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def _number_or_none(name: str, value, default):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number" + (" or None" if default is None else ""))
    return float(value)


@dataclass(frozen=True)
class CrossEntropyOptions:
    """How a call turns the head's output into the scored logits and what it adds to CE.

    logit_scale:     the logits are multiplied by it first (Cohere's ``logit_scale``); None = 1
    logit_softcap:   then ``cap * tanh(logits / cap)`` (Gemma-2/3's final soft-capping); None = off
    z_loss:          a per-token ``z_loss * lse^2`` term (PaLM's z-loss), reported on its own; 0 = off
    label_smoothing: CE against ``(1 - eps) * one-hot + eps / V`` as ``F.cross_entropy`` defines it
    accum_dtype:     the dtype of the softmax statistics, CE and gradient buffers; None = float32
                     (float64 for float64 inputs)

    CE, the z-loss and the numeric loss all read the transformed logits. The values are checked with
    the tensors (``checks.check_cross_entropy_options``), so a bad value on one rank raises on all.
    """

    logit_scale: Optional[float] = None
    logit_softcap: Optional[float] = None
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    accum_dtype: Optional[torch.dtype] = None

    @classmethod
    def checked(cls, logit_scale=None, logit_softcap=None, z_loss=0.0, label_smoothing=0.0,
                accum_dtype=None) -> "CrossEntropyOptions":
        """The options with their types checked (their values are checked with the tensors)."""
        if accum_dtype is not None and (not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point):
            raise TypeError(f"accum_dtype={accum_dtype!r} must be a floating torch.dtype or None (float32)")
        return cls(_number_or_none("logit_scale", logit_scale, None),
                   _number_or_none("logit_softcap", logit_softcap, None),
                   _number_or_none("z_loss", z_loss, 0.0), _number_or_none("label_smoothing", label_smoothing, 0.0),
                   accum_dtype)

    @property
    def transforms_logits(self) -> bool:
        return self.logit_scale is not None or self.logit_softcap is not None

    @property
    def scale(self) -> float:
        return 1.0 if self.logit_scale is None else self.logit_scale

    def fingerprint_parts(self) -> tuple:
        return (self.logit_scale, self.logit_softcap, self.z_loss, self.label_smoothing, str(self.accum_dtype))


DEFAULT_OPTIONS = CrossEntropyOptions()


@dataclass(frozen=True)
class LogitsSpec:
    """The logits a call scores, described without the tensor (the fused linear path never makes it):
    ``shape`` ``[..., V_local]``, ``dtype`` and ``device``."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, logits: torch.Tensor) -> "LogitsSpec":
        return cls(tuple(logits.shape), logits.dtype, logits.device)

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def tokens(self) -> int:
        count = 1
        for size in self.shape[:-1]:
            count *= size
        return count


@dataclass(frozen=True)
class CallPlan:
    """Everything one forward needs besides the logits; built before any collective.

    targets, valid, owned, local_targets: ``[T]`` the flattened targets, ``target != ignore_index``,
        "this shard owns the target id", and the target's column in the shard (clamped into it)
    positions, numeric_targets: ``[P]`` the numeric-target positions and the index of each target
        in the numeric vocabulary
    numeric_columns: (lo, hi) the numeric-vocabulary indices this shard owns;
    local_numeric_columns: ``[hi - lo]`` their columns in the shard
    token_ids, values: ``[N]`` the numeric vocabulary on the logits' device (values in the compute dtype)
    exchange_state: the group's :class:`ExchangeState`, None on one device
    options: the call's :class:`CrossEntropyOptions`
    sequence_shard: the whole sequence's targets when the call holds a slice of each sequence
        (:class:`~smmd_scale.sequence_shard.SequenceShard`), None when it holds whole sequences
    live: None when ``positions`` are exactly the numeric positions (P of them, a size read from the
        data); else ``[T]`` bool: the plan holds a fixed capacity of T rows (the call's tokens), the
        numeric positions first, and ``live`` says which rows are numeric (:func:`fixed_capacity`);
        ``live_count`` their number
    valid_count: the valid (not ignored) targets, a 0-dim tensor counted on the device once for the CE
        + numeric ops (the mean's divisor and the statistics); None for the loss alone (a caller that
        wants it counts ``valid`` itself)
    numeric_capacity: under tensor parallelism on a fixed-capacity plan, the numeric rows the exchange
        carries whatever the count (:func:`exchange_capacity`), so that it reads nothing back; else None
    """

    loss: NumericLossLike
    spec: LogitsSpec
    token_ids: torch.Tensor
    values: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    owned: torch.Tensor
    local_targets: torch.Tensor
    positions: torch.Tensor
    numeric_targets: torch.Tensor
    numeric_columns: tuple
    local_numeric_columns: torch.Tensor
    vocab_start_index: int
    tp_group: object
    exchange_state: Optional[ExchangeState]
    compute_dtype: torch.dtype
    with_ce: bool
    options: CrossEntropyOptions = DEFAULT_OPTIONS
    sequence_shard: Optional[SequenceShard] = None
    live: Optional[torch.Tensor] = None
    live_count: Optional[torch.Tensor] = None
    valid_count: Optional[torch.Tensor] = None
    numeric_capacity: Optional[int] = None

    @property
    def tensor_parallel(self) -> bool:
        return self.exchange_state is not None

    @property
    def numeric_count(self):
        """The call's numeric positions: an int, or on a fixed-capacity plan a 0-dim int64 tensor
        (counted on the device once, with the plan; reading it is the caller's host sync)."""
        return int(self.positions.numel()) if self.live is None else self.live_count


def padded_numeric_positions(vocab: NumericVocab, targets: torch.Tensor, valid: torch.Tensor) -> tuple:
    """(positions, numeric_targets, live) at a fixed capacity of ``T`` rows for ``targets [T]`` (ids in
    the vocabulary, e.g. clamped into it) and ``valid [T]``: the numeric positions first, then spare
    rows at position 0 (``live`` False, their numeric target 0). A lookup table gives each id's index
    in the numeric vocabulary; ``torch.nonzero_static`` a size that does not depend on the data (no
    host sync; one shape for a compiled graph)."""
    index = vocab.index_table(targets.device)[targets]
    found = torch.nonzero_static((index >= 0) & valid, size=targets.numel(), fill_value=-1).squeeze(1)
    live = found >= 0
    positions = found.clamp_min(0)
    return positions, index[positions].clamp_min(0), live


def exchange_capacity(numeric_capacity, tokens: int) -> Optional[int]:
    """The numeric rows a vocabulary-parallel exchange carries on a fixed-capacity plan: ``None`` (the
    default) the group's own capacity, grown from the counts it reads back (one host read per call);
    ``"tokens"`` the call's tokens (never exceeded: nothing read back, the numeric rows' bytes T x N instead
    of about 1.1 x the numeric positions x N); an int, a bound the caller knows for the call's numeric
    positions (e.g. counted when the batch was made), at most the tokens, checked on the device. It must be
    the same on every rank of the group."""
    if numeric_capacity is None:
        return None
    if numeric_capacity == "tokens":
        return max(tokens, 1)
    if isinstance(numeric_capacity, bool) or not isinstance(numeric_capacity, int) or numeric_capacity < 1:
        raise ValueError(f"numeric_capacity={numeric_capacity!r} must be None, 'tokens' or an int >= 1 (a bound on "
                         "the call's numeric-target positions)")
    return min(numeric_capacity, max(tokens, 1))


def fixed_capacity(loss: NumericLossLike, device: torch.device, tensor_parallel: bool, sequence_shard) -> bool:
    """Whether a call's numeric positions are held at a fixed capacity (the call's tokens) rather than
    at the count the targets hold: on an accelerator's plan or inside ``torch.compile``, where reading
    the count back to the host would stall the device or break the graph. Under tensor parallelism
    too: the count then travels in the exchange's header, written on the device, and only the rows
    within the exchange's own capacity are sent (:func:`smmd_scale.parallel.exchange`). Not on a sequence
    shard (its numbers are found in the whole sequence's targets, at their exact positions). A loss
    that reads digit runs finds them at the capacity too (``RunContext.live``)."""
    if sequence_shard is not None:
        return False
    return DeviceProperties.of(device).accelerator or torch.compiler.is_compiling()


# Exchange state per tensor-parallel group (weak keys: a destroyed group is not kept alive), then per loss.
_EXCHANGE_STATES = weakref.WeakKeyDictionary()


def exchange_state(tp_group, loss: NumericLossLike) -> ExchangeState:
    """The exchange state of ``loss`` on ``tp_group``: derived only from all-reduced headers, so
    equal on every rank of the group."""
    per_loss = _EXCHANGE_STATES.setdefault(tp_group, {})
    return per_loss.setdefault(loss.fingerprint, ExchangeState())


def _options_fingerprint(loss: NumericLossLike, options: CrossEntropyOptions) -> int:
    """The loss's fingerprint, mixed with the call's options when they are not the defaults (ranks
    compare it after the exchange)."""
    if options == DEFAULT_OPTIONS:
        return loss.fingerprint
    digest = hashlib.sha256(repr((loss.fingerprint, options.fingerprint_parts())).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def _header(loss: NumericLossLike, spec: LogitsSpec, targets: torch.Tensor, vocab_start_index: int, with_ce: bool,
            options: CrossEntropyOptions, failed_check=None, numeric_positions: int = 0,
            numeric_columns: tuple = (0, 0)) -> dict:
    return dict(failed_check=failed_check, tokens=spec.tokens, numeric_size=len(loss.vocab),
                vocab_start=vocab_start_index, width=spec.width, vocab_size=loss.vocab.vocab_size,
                loss_fingerprint=_options_fingerprint(loss, options), targets=targets,
                numeric_positions=numeric_positions, numeric_columns=numeric_columns,
                compute_dtype=compute_dtype_for(spec.dtype, options.accum_dtype),
                logits_dtype=spec.dtype if spec.dtype.is_floating_point else torch.float32, device=spec.device,
                with_ce=with_ce, logit_sum_slot=options.label_smoothing != 0)


def rank_contribution(plan: CallPlan, numeric_logits: torch.Tensor, local_lse=None,
                      target_logits: Optional[torch.Tensor] = None,
                      local_logit_sum: Optional[torch.Tensor] = None) -> RankContribution:
    """This rank's complete contribution to the exchange: the header of ``plan`` and its data pieces
    (``numeric_logits [P, hi - lo]``, on a fixed-capacity plan ``[T, hi - lo]`` with the count a device
    tensor; with CE the local :class:`ShiftedLogSumExp` and ``target_logits [T]``;
    with label smoothing the sum of this shard's logits ``[T]``)."""
    return RankContribution(**_header(plan.loss, plan.spec, plan.targets, plan.vocab_start_index,
                                      with_ce=local_lse is not None, options=plan.options,
                                      numeric_positions=plan.numeric_count,
                                      numeric_columns=plan.numeric_columns),
                            numeric_logits=numeric_logits, local_lse=local_lse, target_logits=target_logits,
                            local_logit_sum=local_logit_sum, numeric_capacity=plan.numeric_capacity)


def run_exchange(plan: CallPlan, numeric_logits: torch.Tensor, local_lse=None,
                 target_logits: Optional[torch.Tensor] = None,
                 local_logit_sum: Optional[torch.Tensor] = None) -> ExchangeResult:
    """The one packed all-reduce of a vocab-parallel call (see :mod:`smmd_scale.parallel`)."""
    return exchange(rank_contribution(plan, numeric_logits, local_lse, target_logits, local_logit_sum),
                    plan.tp_group, plan.exchange_state)


def plan_call(loss: NumericLossLike, spec: LogitsSpec, targets, tp_group, vocab_start_index, with_ce: bool,
              num_items_in_batch=None, weight: Optional[float] = None, num_numeric_in_batch=None,
              failed_check: Optional[checks.FailedCheck] = None,
              options: CrossEntropyOptions = DEFAULT_OPTIONS,
              sequence_shard: Optional[SequenceShard] = None, may_pad_positions: bool = False,
              numeric_capacity=None) -> CallPlan:
    """Validate (all ranks reach the same verdict) and plan one call.

    No collective runs unless the input is bad under tensor parallelism: then this rank joins the
    exchange with its verdict, so that every rank of the group raises the same error together.
    ``failed_check``: a verdict the caller already reached (the fused linear path checks its own
    inputs first). ``sequence_shard``: see :class:`CallPlan`; checked to hold ``targets`` as its
    slice (an error on the rank whose slice differs, as for the inputs on one device).
    ``may_pad_positions``: the caller handles a fixed-capacity plan (``CallPlan.live``), taken where
    :func:`fixed_capacity` says so (the CE + numeric ops; the loss alone keeps the exact positions).
    ``numeric_capacity``: see :func:`exchange_capacity`.
    """
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if len(spec.shape) < 1:
        raise ValueError(f"logits must have a last (vocabulary) dim, got shape {spec.shape}")
    tp_size, tp_rank = group_size_and_rank(tp_group)
    tensor_parallel = tp_size > 1
    if vocab_start_index is None:
        # Megatron-style equal shards.
        vocab_start_index = tp_rank * spec.width
    if isinstance(vocab_start_index, bool) or not isinstance(vocab_start_index, int):
        raise TypeError(f"vocab_start_index={vocab_start_index!r} must be an int")
    vocab = loss.vocab
    values_on_host = not (DeviceProperties.of(spec.device).accelerator or torch.compiler.is_compiling())
    padded = may_pad_positions and fixed_capacity(loss, spec.device, tensor_parallel, sequence_shard)
    capacity = exchange_capacity(numeric_capacity, spec.tokens)  # (checked on every plan, used under TP)
    capacity = capacity if tensor_parallel and padded else None
    if failed_check is None:
        failed_check = checks.check_inputs(spec, targets, vocab_size=vocab.vocab_size,
                                           vocab_start_index=vocab_start_index, tensor_parallel=tensor_parallel,
                                           ignore_index=loss.ignore_index, num_items_in_batch=num_items_in_batch,
                                           num_numeric_in_batch=num_numeric_in_batch, weight=weight,
                                           options=options, values_on_host=values_on_host)
    if failed_check is not None:
        if not tensor_parallel:
            raise failed_check.error()
        contribution = RankContribution(**_header(loss, spec, targets, vocab_start_index, with_ce, options,
                                                  failed_check), numeric_capacity=capacity)
        exchange(contribution, tp_group, exchange_state(tp_group, loss))
        raise AssertionError("unreachable: the exchange raises the shared verdict")
    if sequence_shard is not None:
        if not isinstance(sequence_shard, SequenceShard):
            raise TypeError(f"sequence_shard must be a smmd_scale.sequence_shard.SequenceShard or None, got "
                            f"{type(sequence_shard).__name__}")
        sequence_shard.check_call(targets)

    width = spec.width
    compute_dtype = compute_dtype_for(spec.dtype, options.accum_dtype)
    token_ids, values = vocab.on(spec.device, compute_dtype)
    flat_targets = (targets if targets.dim() == 1 else targets.reshape(-1)).to(torch.long)
    valid = flat_targets != loss.ignore_index
    if tensor_parallel:
        owned = valid & (flat_targets >= vocab_start_index) & (flat_targets < vocab_start_index + width)
        local_targets = (flat_targets - vocab_start_index).clamp(0, max(width - 1, 0))
        in_vocab = flat_targets.clamp(0, vocab.vocab_size - 1) if not values_on_host or may_pad_positions else None
    else:  # one device holds the whole vocabulary (checked): every valid target is its own
        owned, local_targets = valid, flat_targets.clamp(0, max(width - 1, 0))
        in_vocab = local_targets
    if not values_on_host:
        checks.assert_targets_in_range(flat_targets, in_vocab, valid, vocab.vocab_size, loss.ignore_index)
    # An ignored position contributes nothing, also when ignore_index is a numeric token's id.
    if padded:
        # (the numeric positions are the whole vocabulary's: the global target ids, clamped into it)
        positions, numeric_targets, live = padded_numeric_positions(vocab, in_vocab, valid)
    else:
        (positions, numeric_targets), live = numeric_positions(flat_targets, token_ids, loss.ignore_index), None
    lo, hi = vocab.count_below(vocab_start_index), vocab.count_below(vocab_start_index + width)
    shard_ids = token_ids if (lo, hi) == (0, token_ids.numel()) else token_ids[lo:hi]  # (all of them: no slice op)
    local_numeric_columns = shard_ids if vocab_start_index == 0 else shard_ids - vocab_start_index
    return CallPlan(loss=loss, spec=spec, token_ids=token_ids, values=values, targets=flat_targets, valid=valid,
                    owned=owned, local_targets=local_targets, positions=positions, numeric_targets=numeric_targets,
                    numeric_columns=(lo, hi), local_numeric_columns=local_numeric_columns,
                    vocab_start_index=vocab_start_index, tp_group=tp_group,
                    exchange_state=exchange_state(tp_group, loss) if tensor_parallel else None,
                    compute_dtype=compute_dtype, with_ce=with_ce, options=options, sequence_shard=sequence_shard,
                    live=live, live_count=None if live is None else live.sum(),
                    valid_count=valid.sum() if may_pad_positions else None, numeric_capacity=capacity)
