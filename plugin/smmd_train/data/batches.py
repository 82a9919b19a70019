"""Serving micro-batches: each data-parallel rank's deterministic, resumable micro-batches of the
packed blocks (:class:`PackedBatches`) and the held-out set's (:func:`eval_batches`)."""

from __future__ import annotations

from typing import Iterator

import datasets
import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# Serving micro-batches
# ----------------------------------------------------------------------------------------------

class PackedBatches:
    """Deterministic, resumable micro-batches of packed blocks for one data-parallel rank.

    Epoch ``e`` visits the blocks in the permutation drawn from ``(seed, e)``. Optimizer step ``k``
    of an epoch takes the next ``global_batch_size = micro_batch_size * dp_size * accumulation``
    positions of it, whatever the layout: the same set of blocks for every (micro-batch, DP,
    accumulation) with that global batch, as Megatron's sampler does, so a run's data and objective
    do not depend on how the step is split. Inside the step, micro-step ``m`` of DP rank ``r`` takes
    positions ``m * micro_batch_size * dp_size + r * micro_batch_size`` onwards (``micro_batch_size``
    of them): ranks with the same ``dp_rank`` (the tensor-parallel ranks of one DP group) get the same
    batch, different DP ranks disjoint blocks. When fewer than ``global_batch_size`` positions are
    left, those blocks are skipped for this epoch and the next epoch starts (they are seen in other
    epochs' permutations).

    The permutation comes from numpy's legacy ``RandomState`` seeded with ``[seed, epoch]``: its
    stream is frozen across numpy versions and platforms, so every rank and a resumed run on other
    machines draw the same order.

    Yields ``{"input_ids": LongTensor [micro_batch_size, seq_len]}`` forever, ``accumulation`` per step,
    with ``"labels"`` of the same shape where the dataset has that column (prompt/completion rows).
    """

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 accumulation: int = 1):
        check_positive_int("micro_batch_size", micro_batch_size)
        check_positive_int("dp_size", dp_size)
        check_positive_int("accumulation", accumulation)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an int in [0, dp_size={dp_size}), got {dp_rank!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if "input_ids" not in dataset.column_names:
            raise ValueError(f"the dataset has no 'input_ids' column (columns: {dataset.column_names}); "
                             f"pass the output of tokenize_and_pack")
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.accumulation = accumulation
        self.seed = seed
        self.num_blocks = len(dataset)
        self.micro_step_size = micro_batch_size * dp_size
        self.global_batch_size = self.micro_step_size * accumulation
        if self.num_blocks < self.global_batch_size:
            raise ValueError(f"the dataset has {self.num_blocks} blocks, fewer than one optimizer step of "
                             f"micro_batch_size={micro_batch_size} x dp_size={dp_size} x accumulation={accumulation} "
                             f"= {self.global_batch_size}; use more data, a smaller seq_len or a smaller batch")
        self.steps_per_epoch = self.num_blocks // self.global_batch_size
        self._blocks = dataset.with_format("numpy", columns=_row_columns(dataset))
        self._set_position(epoch=0, position=0)

    def _set_position(self, epoch: int, position: int) -> None:
        self._epoch = epoch
        self._position = position
        self._micro_step = 0
        self._order = np.random.RandomState([self.seed, epoch]).permutation(self.num_blocks)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def samples_consumed(self) -> int:
        """Blocks consumed so far by all DP ranks together (skipped epoch tails not counted)."""
        return (self._epoch * self.steps_per_epoch * self.global_batch_size + self._position
                + self._micro_step * self.micro_step_size)

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> dict:
        start = self._position + self._micro_step * self.micro_step_size + self.dp_rank * self.micro_batch_size
        batch = _stack_blocks(self._blocks, self._order[start:start + self.micro_batch_size])
        self._micro_step += 1
        if self._micro_step == self.accumulation:
            if self._position + 2 * self.global_batch_size > self.num_blocks:
                self._set_position(self._epoch + 1, 0)
            else:
                self._position += self.global_batch_size
                self._micro_step = 0
        return batch

    def state_dict(self) -> dict:
        """JSON-serialisable position at an optimizer-step boundary. On resume ``seed``,
        ``num_blocks`` and ``global_batch_size`` must match; the layout (micro-batch, DP degree,
        accumulation) may differ."""
        if self._micro_step:
            raise RuntimeError(f"the data position is saved between optimizer steps, not after micro-step "
                               f"{self._micro_step} of {self.accumulation}")
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "num_blocks": self.num_blocks,
                "global_batch_size": self.global_batch_size, "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size, "accumulation": self.accumulation}

    def load_state_dict(self, state: dict) -> None:
        """Continue with the optimizer step where the iterator that produced ``state`` stood.

        Raises ValueError if ``seed``, ``num_blocks`` or ``global_batch_size`` differ from this
        iterator's: the data order would silently change. Another split of the same global batch
        continues the same blocks in the same steps.
        """
        expected = self.state_dict()
        missing = sorted({"epoch", "position", "seed", "num_blocks"} - state.keys())
        if missing:
            raise ValueError(f"data state is missing {missing}; got keys {sorted(state)}")
        # Checkpoints written before the step-based order recorded the micro-step instead.
        saved_global_batch = state.get("global_batch_size", state.get("micro_batch_size", 0) * state.get("dp_size", 0))
        state = {**state, "global_batch_size": saved_global_batch}
        mismatches = [f"{key}: checkpoint {state[key]!r}, now {expected[key]!r}"
                      for key in ("seed", "global_batch_size", "num_blocks") if state[key] != expected[key]]
        if mismatches:
            raise ValueError(f"cannot resume the data order: {'; '.join(mismatches)}. Resume with the checkpoint's "
                             f"seed, global batch (micro-batch x DP x accumulation) and data (same files, tokenizer, "
                             f"seq_len), or start a new run")
        epoch, position = state["epoch"], state["position"]
        if (not isinstance(epoch, int) or epoch < 0 or not isinstance(position, int) or position < 0
                or position % self.global_batch_size or position + self.global_batch_size > self.num_blocks):
            raise ValueError(f"data state epoch={epoch!r} position={position!r} is not an optimizer-step start for "
                             f"{self.num_blocks} blocks in steps of {self.global_batch_size}")
        self._set_position(epoch, position)


def eval_batches(dataset: datasets.Dataset, micro_batch_size: int, max_batches: int | None = None) -> Iterator[dict]:
    """Blocks in dataset order as ``{"input_ids": LongTensor [micro_batch_size, seq_len]}`` (and
    ``"labels"`` where the dataset has them, as :class:`PackedBatches`).

    Full micro-batches only (a tail shorter than ``micro_batch_size`` is dropped), at most
    ``max_batches``. Not sharded: every rank that calls it gets the same batches.
    """
    check_positive_int("micro_batch_size", micro_batch_size)
    if max_batches is not None:
        check_positive_int("max_batches", max_batches)
    num_batches = len(dataset) // micro_batch_size
    if num_batches == 0:
        raise ValueError(f"the eval dataset has {len(dataset)} blocks, fewer than micro_batch_size={micro_batch_size}")
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    blocks = dataset.with_format("numpy", columns=_row_columns(dataset))
    return (_stack_blocks(blocks, range(index * micro_batch_size, (index + 1) * micro_batch_size))
            for index in range(num_batches))


def _row_columns(dataset: datasets.Dataset) -> list:
    return [name for name in ("input_ids", "labels") if name in dataset.column_names]


def _stack_blocks(blocks: datasets.Dataset, indices) -> dict:
    """Rows ``indices`` of a numpy-formatted block dataset: each column as LongTensor ``[len(indices), seq_len]``."""
    rows = blocks[[int(index) for index in indices]]
    return {name: torch.from_numpy(np.stack(values).astype(np.int64)) for name, values in rows.items()}


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
