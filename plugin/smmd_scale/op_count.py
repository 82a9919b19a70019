"""Count what a region of code would launch on an accelerator: ATen ops, GEMMs and host syncs.

    with count_ops() as counted:
        output = numeric_cross_entropy(logits, targets, loss)
    counted.ops, counted.gemms, counted.syncs        # and counted.sync_sites: where each sync was asked for

On a GPU each ATen op is (about) one kernel launch with ~5-30 us of host work, so a loss that
dispatches 1,000 ops is launch-bound whatever its arithmetic; a host sync (a value read back to the
host: ``.item()``, ``.tolist()``, ``nonzero``, boolean indexing, ``unique``, ...) stalls the host
until the device has finished everything queued before it, and stops ``torch.compile(fullgraph=True)``.
Both are properties of the code path, not of the device, so they are counted here on the CPU under
the plan the code would use on the accelerator (tests pass the device's properties to the plan).

Counted: every op a ``TorchDispatchMode`` sees (``launches``: all but the views, which make a tensor
header and run no kernel) (the forward and, for a backward run inside the
block, the backward: autograd carries the mode to its engine), GEMMs among them (``mm``, ``addmm``,
``bmm``, ``baddbmm``, ``matmul`` and their ``.out``/``.dtype`` forms), and as syncs: the ops whose
output size or value the host must read (:data:`SYNCING_OPS`, an ``index``/``index_put`` with a
boolean index) and ``Tensor.tolist`` (which reads memory without dispatching an op, so the method is
wrapped while the block runs). Each sync records the innermost frame of ``smmd_scale`` that asked for
it (else the innermost frame outside torch).
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import compat

# ATen ops that need a value or a data-dependent size on the host.
SYNCING_OPS = frozenset({
    "aten._local_scalar_dense.default",  # .item(), int(t), float(t), bool(t), `if t:`
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor", "aten.equal.default",
    "aten.is_nonzero.default", "aten.allclose.default",
})
GEMM_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.")
# Ops that only describe a tensor (no kernel): not counted as launches.
VIEW_ONLY_OPS = frozenset({"aten.detach.default", "aten.lift_fresh.default", "prim.device.default",
                           "aten.sym_size.int", "aten.sym_numel.default", "aten.sym_stride.int"})
_PACKAGE = str(Path(__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent)  # torch's own frames (autograd, dispatch) are never the site


@dataclass
class OpCount:
    """What :func:`count_ops` saw: ``by_op`` (op name -> calls), ``syncs`` (op name -> calls) and
    ``sync_sites`` (one ``"file:line in function: op"`` per sync, in order)."""

    by_op: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    sync_sites: list = field(default_factory=list)
    view_ops: set = field(default_factory=set)

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def views(self) -> int:
        """Of :attr:`ops`, the views (``view``, ``slice``, ``permute``, ``unsqueeze``, ... : the ops whose
        schema says their output aliases an input): a new tensor header, no kernel."""
        return sum(calls for name, calls in self.by_op.items() if name in self.view_ops)

    @property
    def launches(self) -> int:
        """Of :attr:`ops`, those that run a kernel on the device: all but the views."""
        return self.ops - self.views

    @property
    def gemms(self) -> int:
        return sum(calls for name, calls in self.by_op.items() if name.startswith(GEMM_OPS))

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def record_sync(self, name: str) -> None:
        self.syncs[name] += 1
        frames = [frame for frame in traceback.extract_stack()
                  if frame.filename != __file__ and not frame.filename.startswith(_TORCH)]
        ours = [frame for frame in frames if frame.filename.startswith(_PACKAGE)]
        frame = (ours or frames)[-1]
        self.sync_sites.append(f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}: {name}")

    def summary(self) -> str:
        return (f"{self.ops} ATen ops ({self.launches} launching a kernel, {self.gemms} GEMMs), "
                f"{self.sync_count} host syncs"
                + (": " + "; ".join(self.sync_sites) if self.sync_sites else ""))


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
               for index in (indices or ()) if index is not None)


def _dispatch_counter(counted: OpCount):
    class DispatchCounter(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name not in VIEW_ONLY_OPS:
                counted.by_op[name] += 1
                if func.is_view:
                    counted.view_ops.add(name)
            if name in SYNCING_OPS or (name.startswith(("aten.index.", "aten.index_put")) and _has_boolean_index(args)):
                counted.record_sync(name)
            return func(*args, **(kwargs or {}))

    return DispatchCounter()


@contextmanager
def count_ops():
    """Count the ATen ops, GEMMs and host syncs of the block (see the module docstring)."""
    counted = OpCount()
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        counted.record_sync("Tensor.tolist")
        return tolist(tensor)

    # tolist reads memory without an op, and autograd does not carry a torch-function mode into a
    # backward: the method itself is wrapped for the block (restored after it, also on an error).
    torch.Tensor.tolist = counted_tolist
    try:
        with _dispatch_counter(counted):
            yield counted
    finally:
        torch.Tensor.tolist = tolist
