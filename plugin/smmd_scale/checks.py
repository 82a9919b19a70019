"""Input validation shared by the single-device, vocab-parallel and fused-linear paths.

A check returns a :class:`FailedCheck` (a code and a few integers) instead of raising, so that under
tensor parallelism a rank can put its verdict into the one all-reduce and *every* rank raises
the same exception after it (docs/vocab_parallel.md): a rank that raised alone would leave the others
waiting in the collective. ``FailedCheck.error()`` turns the code back into the exception on any
rank, which is why messages are built only from the integers carried.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, Optional

import torch

from . import compat

# dtypes and device types are carried as indices into these tables.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "npu", "meta")

LOGITS_DTYPE = 1
TARGETS_DTYPE = 2
TARGETS_SHAPE = 3
TARGETS_DEVICE = 4
LOGITS_WIDTH = 5
SHARD_OUTSIDE_VOCAB = 6
TARGET_OUT_OF_RANGE = 7
NUM_ITEMS = 8
WEIGHT = 9
LINEAR_DTYPES = 10
LINEAR_DEVICES = 11
HEAD_WEIGHT_SHAPE = 12
BIAS_SHAPE = 13
EMPTY_INPUT = 14
CHUNK_SIZE = 15
HEAD_ROWS = 16
NUM_NUMERIC = 17
LOSS_WEIGHTS_SHAPE = 18
LOSS_WEIGHTS_VALUE = 19
LOGIT_SCALE = 20
LOGIT_SOFTCAP = 21
Z_LOSS = 22
LABEL_SMOOTHING = 23

_ERRORS = {
    LOGITS_DTYPE: (TypeError, "logits have dtype {0}; expected a floating dtype (float32, bfloat16, float16 or "
                   "float64)"),
    TARGETS_DTYPE: (TypeError, "targets have dtype {0}; expected an integer dtype (token ids)"),
    TARGETS_SHAPE: (ValueError, "targets hold {0} positions in {1} dims but logits [..., V] hold {2} positions in "
                    "{3} dims; targets must have the logits' shape without the last (vocabulary) dim "
                    "(already shifted: position t of targets is scored by logits[..., t, :])"),
    TARGETS_DEVICE: (ValueError, "targets are on {2}:{3} but logits are on {0}:{1}; move targets to the logits' "
                     "device"),
    LOGITS_WIDTH: (ValueError, "logits have {0} columns but the numeric vocabulary was built for vocab_size={1}; "
                   "build NumericVocab for the model's logits width (vocab_size=...) or pass tp_group and "
                   "vocab_start_index for a vocab-parallel shard"),
    SHARD_OUTSIDE_VOCAB: (ValueError, "the logits shard covers vocabulary ids [{0}, {1}) which is not inside "
                          "[0, {2}) (vocab_start_index={0}, shard width {3}); check vocab_start_index"),
    TARGET_OUT_OF_RANGE: (ValueError, "targets[{0}] = {1} is outside the vocabulary [0, {2}) and is not "
                          "ignore_index={3} (position counted over the flattened targets)"),
    NUM_ITEMS: (ValueError, "num_items_in_batch={0} must be >= 0"),
    NUM_NUMERIC: (ValueError, "num_numeric_in_batch={0} must be >= 0 (the numeric-target positions of the whole "
                  "optimizer step)"),
    WEIGHT: (ValueError, "weight={0} must be a finite number >= 0 (0 = CE only)"),
    LOSS_WEIGHTS_SHAPE: (ValueError, "loss_weights hold {0} positions in {1} dims but targets hold {2} in {3} dims (or "
                         "lie on another device); give one weight per target position, on the targets' device"),
    LOSS_WEIGHTS_VALUE: (ValueError, "loss_weights[{0}] = {1} must be a finite number >= 0 (position counted over the "
                         "flattened targets)"),
    LINEAR_DTYPES: (TypeError, "hidden, head_weight and bias must share one floating dtype; got {0}, {1} and {2} "
                    "(mixed floating dtypes are accepted under torch.autocast: the product runs in its dtype)"),
    LINEAR_DEVICES: (ValueError, "head_weight and bias must be on hidden's device {0}:{1}; one of them is on {2}:{3}"),
    HEAD_WEIGHT_SHAPE: (ValueError, "head_weight must be [V_local, H] with H = hidden's width {0}; got {1} dims of "
                        "sizes ({2}, {3}, ...)"),
    BIAS_SHAPE: (ValueError, "bias has {0} elements in {1} dims; expected [{2}], one per head_weight row"),
    EMPTY_INPUT: (ValueError, "hidden holds {0} tokens of width {1} and head_weight {2} rows; the fused loss needs at "
                  "least one of each"),
    CHUNK_SIZE: (ValueError, "chunk_size={0} must be a positive int (head rows per block), or None to choose it from "
                 "a memory budget"),
    LOGIT_SCALE: (ValueError, "logit_scale={0} must be a finite number > 0 (None = 1, the logits as they are)"),
    LOGIT_SOFTCAP: (ValueError, "logit_softcap={0} must be a finite number > 0 (None = no soft-capping; Gemma-2 "
                    "uses 30.0)"),
    Z_LOSS: (ValueError, "z_loss={0} must be a finite number >= 0 (the coefficient of lse^2; 0 = off, PaLM uses "
             "1e-4)"),
    LABEL_SMOOTHING: (ValueError, "label_smoothing={0} must be in [0, 1) (0 = off)"),
    HEAD_ROWS: (ValueError, "head_weight has {0} rows but the numeric vocabulary was built for vocab_size={1}; build "
                "NumericVocab for the model's vocabulary (vocab_size=...) or pass tp_group and vocab_start_index for "
                "a vocab-parallel head shard"),
}


def float_bits(value: float) -> int:
    """A float as the int64 of its bits, so it can ride in the integer verdict header exactly."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _name(table, index):
    return str(table[index]) if 0 <= index < len(table) else f"<{index}>"


class FailedCheck(NamedTuple):
    """A failed check: ``code`` (one of the constants above) and up to four integers."""

    code: int
    args: tuple

    def error(self, prefix: str = "") -> Exception:
        exception_type, template = _ERRORS[self.code]
        args = list(self.args)
        if self.code in (LOGITS_DTYPE, TARGETS_DTYPE):
            args[0] = _name(DTYPES, args[0])
        if self.code == LINEAR_DTYPES:
            args = [_name(DTYPES, code) if code >= 0 else "None (no bias)" for code in args[:3]]
        if self.code in (TARGETS_DEVICE, LINEAR_DEVICES):
            args[0] = _name(DEVICE_TYPES, args[0])
            args[2] = _name(DEVICE_TYPES, args[2])
        if self.code in (WEIGHT, LOGIT_SCALE, LOGIT_SOFTCAP, Z_LOSS, LABEL_SMOOTHING):
            args[0] = bits_float(args[0])
        if self.code == LOSS_WEIGHTS_VALUE:
            args[1] = bits_float(args[1])
        return exception_type(prefix + template.format(*args))


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def _device_code(device: torch.device) -> tuple:
    type_code = DEVICE_TYPES.index(device.type) if device.type in DEVICE_TYPES else len(DEVICE_TYPES)
    return type_code, -1 if device.index is None else device.index


def assert_targets_in_range(flat: torch.Tensor, clamped: torch.Tensor, valid: torch.Tensor, vocab_size: int,
                            ignore_index: int) -> None:
    """The targets' range on an accelerator's plan, as a device-side assert (no host read), from what
    the call's plan makes anyway: ``flat`` the targets ``[T]``, ``clamped`` them clamped into
    ``[0, vocab_size)``, ``valid`` where they are not ``ignore_index``. A valid target must be its own
    clamp (``eq >= valid``: False only where a valid target moved); the message cannot say where."""
    compat.device_assert(((clamped == flat) >= valid).all(),
                         f"targets hold an id outside the vocabulary [0, {vocab_size}) that is not "
                         f"ignore_index={ignore_index} (checked on the device, which cannot say where: run the "
                         "batch on the CPU to find the position)")


def check_inputs(logits, targets: torch.Tensor, *, vocab_size: int, vocab_start_index: int,
                 tensor_parallel: bool, ignore_index: int, num_items_in_batch=None,
                 num_numeric_in_batch=None, weight: Optional[float] = None, options=None,
                 values_on_host: bool = True) -> Optional[FailedCheck]:
    """Validate one call's tensors and per-call arguments; return the first failed check or ``None``.

    logits: a ``LogitsSpec`` of ``[..., V_local]`` (the tensor need not exist), targets: ``[...]``.
    ``options``: the call's ``CrossEntropyOptions`` (their values; their types were checked at the call).
    Only cheap checks. The data-dependent ones (targets in range; counts given as tensors) read a value
    back to the host where ``values_on_host`` (the CPU's plan); on an accelerator's plan they are
    device-side asserts instead (no host sync; the message cannot name the position, and under tensor
    parallelism every rank, holding the same targets, fails alike); the targets' range is then the
    plan's to assert (:func:`assert_targets_in_range`), from the clamped targets it makes anyway.
    """
    if not logits.dtype.is_floating_point:
        return FailedCheck(LOGITS_DTYPE, (_dtype_code(logits.dtype), ))
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return FailedCheck(TARGETS_DTYPE, (_dtype_code(targets.dtype), ))
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        return FailedCheck(TARGETS_SHAPE, (targets.numel(), targets.dim(), logits.tokens, len(logits.shape) - 1))
    if targets.device != logits.device:
        return FailedCheck(TARGETS_DEVICE, (*_device_code(logits.device), *_device_code(targets.device)))
    width = logits.width
    if not tensor_parallel and (vocab_start_index != 0 or width != vocab_size):
        return FailedCheck(LOGITS_WIDTH, (width, vocab_size))
    if vocab_start_index < 0 or vocab_start_index + width > vocab_size:
        return FailedCheck(SHARD_OUTSIDE_VOCAB, (vocab_start_index, vocab_start_index + width, vocab_size, width))
    for code, count in ((NUM_ITEMS, num_items_in_batch), (NUM_NUMERIC, num_numeric_in_batch)):
        if count is None:
            continue
        if isinstance(count, torch.Tensor) and not values_on_host:
            compat.device_assert(count >= 0, _ERRORS[code][1].format("a negative count"))
        elif float(count) < 0:
            return FailedCheck(code, (int(count), ))
    if weight is not None and not (math.isfinite(weight) and weight >= 0):
        return FailedCheck(WEIGHT, (float_bits(weight), ))
    if options is not None:
        failed = check_cross_entropy_options(options)
        if failed is not None:
            return failed
    if not values_on_host:  # the targets' range: asserted by the plan (assert_targets_in_range)
        return None
    flat = targets.reshape(-1)
    out_of_range = (flat.clamp(0, vocab_size - 1) != flat) & (flat != ignore_index)
    if out_of_range.any():
        position = int(out_of_range.nonzero()[0, 0])
        return FailedCheck(TARGET_OUT_OF_RANGE, (position, int(flat[position]), vocab_size, ignore_index))
    return None


def check_linear_inputs(hidden: torch.Tensor, head_weight: torch.Tensor, bias: Optional[torch.Tensor], chunk_size,
                        vocab_size: int, tensor_parallel: bool, dtypes_agree: bool = True) -> Optional[FailedCheck]:
    """The fused linear path's own checks (before the logits' checks): ``hidden [..., H]``,
    ``head_weight [V_local, H]``, ``bias [V_local]`` or None, ``chunk_size`` positive or None.
    ``dtypes_agree``: the inputs share a dtype, or autocast gives their product one."""
    dtypes = (hidden.dtype, head_weight.dtype, hidden.dtype if bias is None else bias.dtype)
    if not all(dtype.is_floating_point for dtype in dtypes) or not dtypes_agree:
        return FailedCheck(LINEAR_DTYPES, (_dtype_code(hidden.dtype), _dtype_code(head_weight.dtype),
                                           -1 if bias is None else _dtype_code(bias.dtype)))
    for other in (head_weight, bias):
        if other is not None and other.device != hidden.device:
            return FailedCheck(LINEAR_DEVICES, (*_device_code(hidden.device), *_device_code(other.device)))
    width = hidden.shape[-1] if hidden.dim() else 0
    if head_weight.dim() != 2 or head_weight.shape[1] != width:
        sizes = (list(head_weight.shape) + [0, 0])[:2]
        return FailedCheck(HEAD_WEIGHT_SHAPE, (width, head_weight.dim(), *sizes))
    if bias is not None and tuple(bias.shape) != (head_weight.shape[0], ):
        return FailedCheck(BIAS_SHAPE, (bias.numel(), bias.dim(), head_weight.shape[0]))
    tokens = hidden.numel() // max(width, 1) if hidden.dim() > 1 else 0
    if tokens == 0 or width == 0 or head_weight.shape[0] == 0:
        return FailedCheck(EMPTY_INPUT, (tokens, width, head_weight.shape[0]))
    if chunk_size is not None and chunk_size < 1:
        return FailedCheck(CHUNK_SIZE, (int(chunk_size), ))
    if not tensor_parallel and head_weight.shape[0] != vocab_size:
        return FailedCheck(HEAD_ROWS, (head_weight.shape[0], vocab_size))
    return None


def check_loss_weights(loss_weights: torch.Tensor, targets: torch.Tensor) -> Optional[FailedCheck]:
    """A standalone numeric loss's per-position ``loss_weights``: the targets' shape and device,
    finite and >= 0 (one reduction and a host read)."""
    if tuple(loss_weights.shape) != tuple(targets.shape) or loss_weights.device != targets.device:
        return FailedCheck(LOSS_WEIGHTS_SHAPE, (loss_weights.numel(), loss_weights.dim(), targets.numel(),
                                                targets.dim()))
    flat = loss_weights.reshape(-1).double()
    bad = ~(torch.isfinite(flat) & (flat >= 0))
    if bad.any():
        position = int(bad.nonzero()[0, 0])
        return FailedCheck(LOSS_WEIGHTS_VALUE, (position, float_bits(float(flat[position]))))
    return None


def check_cross_entropy_options(options) -> Optional[FailedCheck]:
    """The values of a call's ``CrossEntropyOptions``: scale and cap finite and > 0, z-loss finite and
    >= 0, label smoothing in [0, 1)."""
    for code, value, smallest_ok in ((LOGIT_SCALE, options.logit_scale, None),
                                     (LOGIT_SOFTCAP, options.logit_softcap, None),
                                     (Z_LOSS, options.z_loss, 0.0)):
        if value is None:
            continue
        if not math.isfinite(value) or (value <= 0 if smallest_ok is None else value < smallest_ok):
            return FailedCheck(code, (float_bits(value), ))
    smoothing = options.label_smoothing
    if not (0 <= smoothing < 1):  # also NaN
        return FailedCheck(LABEL_SMOOTHING, (float_bits(smoothing), ))
    return None


REDUCTIONS = ("mean", "sum", "none")


def check_reduction(reduction, num_items_in_batch=None, num_numeric_in_batch=None) -> str:
    """``reduction`` is one of :data:`REDUCTIONS`; the optimizer step's counts go only with ``"mean"``.
    (Arguments, not tensors: every rank passes the same ones, so the error is raised before any
    collective, as for a weight of the wrong type.)"""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {REDUCTIONS}")
    if reduction != "mean" and (num_items_in_batch is not None or num_numeric_in_batch is not None):
        raise ValueError(f"num_items_in_batch and num_numeric_in_batch divide the sums of reduction='mean'; with "
                         f"reduction={reduction!r} pass neither (got {num_items_in_batch!r} and "
                         f"{num_numeric_in_batch!r})")
    return reduction
