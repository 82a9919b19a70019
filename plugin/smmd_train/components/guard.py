"""Skip optimizer steps whose loss is NaN/inf on any rank — on every rank together — and give up,
with a clear message, after too many in a row.

How a step is skipped: ZeRO-3 checks the global gradient norm before every update and, when it
is not finite, discards the step's gradients on every rank and does not step the optimizer or
the LR scheduler (its overflow path; the norm is reduced over all ranks, so they agree). A loss
can be inf while its gradients are finite (a target logit of -inf), so a micro-batch whose loss
is not finite on *any* rank is back-propagated scaled by NaN on *every* rank: that sends the step
down ZeRO-3's overflow path deterministically. ``end_step`` then checks that DeepSpeed really
did not apply it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class NonFiniteLossError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss."""


class NonFiniteGuard:
    """Per micro-batch: ``loss = guard.checked(loss)`` before ``engine.backward``. Per optimizer
    step: ``guard.end_step(engine.was_step_applied())`` (was it skipped?), log, then
    ``guard.raise_if_exhausted(last_checkpoint)``. ``total_skips`` continues across a resume."""

    def __init__(self, max_consecutive_skips: int, total_skips: int = 0):
        if max_consecutive_skips < 1:
            raise ValueError(f"--max_skipped_steps={max_consecutive_skips} must be >= 1")
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.total_skips = total_skips
        self._poisoned = False

    def checked(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: itself, or loss * NaN if any rank's loss is not finite."""
        finite = torch.isfinite(loss.detach()).to(torch.int32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if bool(finite.item()):
            return loss
        self._poisoned = True
        return loss * float("nan")

    def end_step(self, step_applied: bool) -> bool:
        """Account for the optimizer step just taken; returns True if it was skipped."""
        poisoned, self._poisoned = self._poisoned, False
        if poisoned and step_applied:
            raise RuntimeError("DeepSpeed applied an optimizer step whose loss was not finite; train.py relies on "
                               "ZeRO stage 3 discarding such steps (check zero_optimization.stage)")
        if poisoned or not step_applied:
            self.consecutive_skips += 1
            self.total_skips += 1
            return True
        self.consecutive_skips = 0
        return False

    def raise_if_exhausted(self, last_checkpoint: Optional[str]) -> None:
        if self.consecutive_skips < self.max_consecutive_skips:
            return
        where = f"the last committed checkpoint is {last_checkpoint}" if last_checkpoint else \
            "no checkpoint was committed in this run"
        raise NonFiniteLossError(
            f"{self.consecutive_skips} consecutive optimizer steps had a NaN/inf loss (or gradients) and were skipped "
            f"on every rank; stopping (--max_skipped_steps={self.max_consecutive_skips}). Skipped steps did not "
            f"change the weights; {where}. Lower the learning rate, check the data, or resume from it.")
