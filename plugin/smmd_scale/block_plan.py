"""How the ops split their work into blocks: a pure function of the shapes, dtypes, the device's
properties and a memory budget, so that the plan a GPU would run is tested on the CPU.

* **CPU** (what is fast on a few cores): the fused head's block holds as many elements as ``hidden``,
  at least ``MIN_BLOCK_ELEMENTS`` (DeepSpeed's rule for its fused linear CE: a block that stays in
  cache); the soft-capped backward walks a block ``ROW_BLOCK_ELEMENTS`` at a time.
* **An accelerator** (each op a kernel launch with host work of its own, so fewer and larger is
  faster): the fused head's blocks are as large as the memory budget allows, the budget being
  ``budget_bytes`` when given, else a quarter of the free device memory, at most ``MAX_DEFAULT_BUDGET``;
  the head is cut into equal blocks; no row blocks. At 4,096 tokens x V 32,000 that is one block, at
  16,384 x V 128,256 in bf16 a handful.

``with plan_as(DeviceProperties("cuda", free_bytes=...))`` makes the ops plan for another device
(what the op-budget tests and ``benchmarks.gpu_heads --plan`` use on the CPU).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

# CPU: a block of logits holds at least this many elements (4 MiB in fp32): smaller GEMMs waste time.
MIN_BLOCK_ELEMENTS = 1 << 20
# CPU: the soft-capped backward forms tanh's derivative this many elements at a time (cache-sized).
ROW_BLOCK_ELEMENTS = 1 << 20
# Accelerators: the default budget is this share of the free memory, at most MAX_DEFAULT_BUDGET.
FREE_MEMORY_SHARE = 0.25
MAX_DEFAULT_BUDGET = 4 << 30


@dataclass(frozen=True)
class DeviceProperties:
    """What the plan needs to know of a device: its ``type`` (``torch.device.type``) and, for an
    accelerator, the memory free for the loss's working blocks (None: unknown)."""

    type: str
    free_bytes: Optional[int] = None

    @property
    def accelerator(self) -> bool:
        return self.type != "cpu"

    @classmethod
    def of(cls, device: torch.device) -> "DeviceProperties":
        """The properties of ``device``, or the ones :func:`plan_as` set."""
        if _PLANNED_AS is not None:
            return _PLANNED_AS
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            return cls("cuda", int(free_bytes))
        return cls(device.type)


_PLANNED_AS: Optional[DeviceProperties] = None


@contextmanager
def plan_as(properties: DeviceProperties):
    """Plan every op in the block for a device with ``properties`` (whatever the tensors' device)."""
    global _PLANNED_AS
    previous, _PLANNED_AS = _PLANNED_AS, properties
    try:
        yield properties
    finally:
        _PLANNED_AS = previous


@dataclass(frozen=True)
class HeadPlan:
    """The fused head's blocks: ``chunk_size`` head rows each, ``blocks`` of them; ``block_bytes``
    one block's working memory; ``budget_bytes`` the budget it was sized for (None on the CPU)."""

    chunk_size: int
    blocks: int
    block_bytes: int
    budget_bytes: Optional[int] = None


def block_bytes_per_element(product_dtype: torch.dtype, compute_dtype: torch.dtype) -> int:
    """Working bytes per logit of a block: the compute-dtype block, plus the product's own output where
    it is a narrower dtype (a bf16 GEMM writes bf16, then the block is upcast)."""
    extra = product_dtype.itemsize if product_dtype.itemsize < compute_dtype.itemsize else 0
    return compute_dtype.itemsize + extra


def default_budget_bytes(device: DeviceProperties) -> int:
    """An accelerator's default budget for the working blocks."""
    if device.free_bytes is None:
        return MAX_DEFAULT_BUDGET
    return max(1, min(MAX_DEFAULT_BUDGET, int(device.free_bytes * FREE_MEMORY_SHARE)))


def fused_head_plan(tokens: int, hidden_size: int, head_rows: int, product_dtype: torch.dtype,
                    compute_dtype: torch.dtype, device: DeviceProperties, budget_bytes: Optional[int] = None,
                    chunk_size: Optional[int] = None) -> HeadPlan:
    """The fused head's blocks for ``hidden [tokens, hidden_size] @ head [head_rows, hidden_size].T``.
    ``chunk_size`` given: that many rows per block, on any device."""
    per_element = block_bytes_per_element(product_dtype, compute_dtype)
    tokens, head_rows = max(tokens, 1), max(head_rows, 1)
    budget = None
    if chunk_size is None:
        if device.accelerator:
            budget = default_budget_bytes(device) if budget_bytes is None else budget_bytes
            rows = max(1, min(head_rows, budget // (tokens * per_element)))
            blocks = math.ceil(head_rows / rows)
            chunk_size = math.ceil(head_rows / blocks)  # equal blocks: no small last one
        else:
            elements = max(tokens * hidden_size, MIN_BLOCK_ELEMENTS)
            chunk_size = max(1, min(head_rows, elements // tokens))
    blocks = math.ceil(head_rows / chunk_size)
    return HeadPlan(chunk_size, blocks, tokens * min(chunk_size, head_rows) * per_element, budget)


def row_blocks(rows: int, width: int, device: DeviceProperties) -> list:
    """``[(start, end)]`` row ranges of a ``[rows, width]`` buffer that a pass walks: cache-sized
    (``ROW_BLOCK_ELEMENTS``) on the CPU, the whole buffer at once on an accelerator."""
    if device.accelerator:
        return [(0, rows)] if rows else []
    step = max(1, ROW_BLOCK_ELEMENTS // max(width, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]
