"""The learning-rate schedule of a training run: linear warmup, then cosine decay.

Optimizer step k (1-based) uses ``lr * k / W`` for k <= W, so the first step already trains
(``lr / W``, as Hugging Face's linear warmup), then ``lr`` decays along a cosine to
``min_ratio * lr`` at the last step. The warmup is never longer than :data:`MAX_WARMUP_FRACTION` of
the run, so a short run (a pipeline check, a 2-step smoke test) trains at full rate instead of
spending all its steps below it. (DeepSpeed's own ``WarmupCosineLR`` starts from 0, and its first
step, taken before the scheduler has stepped, always has learning rate 0.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

MAX_WARMUP_FRACTION = 0.1
DEFAULT_WARMUP_STEPS = 100


def warmup_steps_for(requested: Optional[int], max_steps: int) -> int:
    """The warmup actually used: ``requested`` (None: :data:`DEFAULT_WARMUP_STEPS`), at most
    :data:`MAX_WARMUP_FRACTION` of ``max_steps`` (rounded up), at least 1 step. (``parse_args`` has
    refused a negative ``requested``.)"""
    wanted = DEFAULT_WARMUP_STEPS if requested is None else requested
    return max(1, min(wanted, math.ceil(MAX_WARMUP_FRACTION * max_steps)))


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (1-based)."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0


def warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float):
    """A ``deepspeed.initialize(lr_scheduler=...)`` callable: a LambdaLR on the engine's optimizer. The
    scheduler has stepped s times before optimizer step s + 1, so the lambda sees ``s`` and gives the
    factor of step ``s + 1``."""
    def build(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda stepped: lr_factor(stepped + 1, warmup_steps, max_steps, min_ratio))

    return build


@dataclass(frozen=True)
class Schedule:
    """A run's learning-rate schedule: ``lr`` warmed up over ``warmup_steps``, then a cosine to
    ``min_lr_ratio * lr`` at ``max_steps`` (its horizon), and that rate after it. A checkpoint records
    it; a resumed run continues the recorded schedule (:func:`resumed_schedule`)."""

    lr: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    def scheduler(self):
        """The ``deepspeed.initialize(lr_scheduler=...)`` callable of this schedule."""
        return warmup_cosine(self.warmup_steps, self.max_steps, self.min_lr_ratio)

    def as_dict(self) -> dict:
        return asdict(self)


def resumed_schedule(recorded: dict, requested: Schedule, resumed_step: int) -> tuple:
    """(the schedule a run resumed at ``resumed_step`` trains with, notes for the log). The
    checkpoint's optimizer and scheduler states carry its rates, so the run continues the recorded
    schedule: a larger ``--max_steps`` extends the run at the schedule's final rate (the horizon is
    kept, the rate does not jump back up the cosine), a smaller one stops before the horizon; a
    changed ``--lr``, ``--warmup_steps`` or ``--min_lr_ratio`` is not applied. Each difference is said."""
    schedule = Schedule(**recorded)
    notes = []
    if requested.max_steps > schedule.max_steps:
        final = schedule.lr * schedule.min_lr_ratio
        notes.append(f"--max_steps {requested.max_steps} extends a run scheduled for {schedule.max_steps} steps: the "
                     f"learning-rate schedule keeps its {schedule.max_steps}-step horizon, and steps "
                     f"{max(schedule.max_steps, resumed_step) + 1}-{requested.max_steps} train at its final rate "
                     f"{final:.3g}")
    elif requested.max_steps < schedule.max_steps:
        notes.append(f"--max_steps {requested.max_steps} stops a run scheduled for {schedule.max_steps} steps early: "
                     "the learning rate follows the original schedule and will not have decayed to its minimum")
    changed = [f"--{name} {getattr(requested, name)} (the checkpoint's: {getattr(schedule, name)})"
               for name in ("lr", "warmup_steps", "min_lr_ratio")
               if getattr(requested, name) != getattr(schedule, name)]
    if changed:
        notes.append(f"not applied on resume: {', '.join(changed)}; the checkpoint's optimizer and scheduler states "
                     "continue its schedule (start a new run, e.g. from an HF export, for another one)")
    return schedule, notes
