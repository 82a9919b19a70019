"""The loss parts in a ``transformers.Trainer``'s logs: a ``TrainerCallback`` that adds, at every
logging step, CE, the numeric term, each numeric loss by name, the total and the numeric-token
metrics, over the micro-batches since the previous log, so that they reach ``log_history``,
TensorBoard, W&B, ... through the Trainer's own reporting. ``InstalledLoss.attach_to_trainer``
adds it (first, so that the reporting callbacks see what it adds).

    installed = smmd_scale.install(model, smmd_scale.SMMDLoss(vocab))
    trainer = Trainer(model=model, args=args, train_dataset=data)
    installed.attach_to_trainer(trainer)   # the step's counts, and this callback
    trainer.train()                        # log_history: loss_ce, loss_numeric, loss_smmd, ..., loss_total

Keys (``train/<key>`` in TensorBoard and W&B): ``loss_ce`` (mean CE per target token),
``loss_numeric`` (the numeric term: mean per numeric-target position), ``loss_<name>`` for each
numeric loss's own value (``loss_smmd``, ``loss_mmd``, ``loss_smooth``, ``loss_ntl_was``, ...),
``loss_total = loss_ce + weight x loss_numeric``, ``numeric_accuracy``, ``numeric_mae`` (over the
numeric-target positions; left out when there were none) and ``numeric_positions`` (per optimizer
step). All are means over the window's targets, summed over the micro-batches and, on several
processes, over the processes (one small all-reduce through the Trainer's accelerator per log). With
``attach_to_trainer`` and ``logging_steps=1`` ``loss_total`` is the Trainer's ``loss``: the objective it
trains. Without the step's numeric count (no ``attach_to_trainer``) the Trainer weighs each
micro-batch's numeric mean by its tokens, so its ``loss`` differs from ``loss_total``.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

# Sums kept over a logging window, in this order (reduced over processes as one tensor).
_COUNTS = ("ce_sum", "numeric_sum", "tokens", "numeric_positions", "correct", "abs_error")


def _count(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def call_sums(losses, stats: dict, num_items_in_batch=None, num_numeric_in_batch=None) -> tuple:
    """(CE summed over the call's targets, the numeric loss summed over its numeric positions) from
    the call's reduced ``losses`` (total, ce, numeric) and ``stats``, undoing the reduction that
    :func:`smmd_scale.loss.reduce_losses` applied with the counts it was given."""
    tokens, positions = stats["tokens"], stats["numeric_tokens"]
    ce, numeric = float(losses[1]), float(losses[2])
    ce_divisor = _count(num_items_in_batch) if num_items_in_batch is not None else max(tokens, 1)
    if num_numeric_in_batch is not None:
        numeric_divisor = _count(num_numeric_in_batch)
    elif num_items_in_batch is not None:  # the numeric mean weighed by the call's share of the step's tokens
        numeric_divisor = max(positions, 1) * _count(num_items_in_batch) / tokens if tokens else 0.0
    else:
        numeric_divisor = max(positions, 1)
    return ce * ce_divisor, numeric * numeric_divisor


class NumericLossCallback(TrainerCallback):
    """Adds the loss parts of ``installed`` (what :func:`smmd_scale.install` returned) to the
    Trainer's training logs (see the module docstring). ``reduce``: sums a tensor over the
    processes (``trainer.accelerator.reduce``; None on one process)."""

    def __init__(self, installed, reduce=None):
        self.hook = installed.hook
        self.reduce = reduce
        self._reset()

    def _reset(self) -> None:
        self._sums = dict.fromkeys(_COUNTS, 0.0)
        self._steps = 0  # optimizer steps in the window (the same on every process)
        # numeric loss name -> its value summed over numeric positions (the same names on every process)
        self._parts = dict.fromkeys(self.hook.numeric_loss.stat_names, 0.0)

    def _record_micro_batch(self) -> None:
        stats, losses = self.hook.last_stats, self.hook.last_losses
        if stats is None or losses is None:
            return
        ce_sum, numeric_sum = call_sums(losses, stats, *(self.hook.last_counts or (None, None)))
        positions = stats["numeric_tokens"]
        self._sums["ce_sum"] += ce_sum
        self._sums["numeric_sum"] += numeric_sum
        self._sums["tokens"] += stats["tokens"]
        self._sums["numeric_positions"] += positions
        self._sums["correct"] += stats["numeric_accuracy"] * positions
        self._sums["abs_error"] += stats["numeric_mae"] * positions
        for name in self.hook.numeric_loss.stat_names:  # per-position means in the stats
            self._parts[name] += stats[name] * positions

    def on_substep_end(self, args, state, control, **kwargs):  # a micro-batch that did not end the step
        self._record_micro_batch()

    def on_step_end(self, args, state, control, **kwargs):  # the step's last micro-batch
        self._record_micro_batch()
        self._steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # evaluation logs (eval_loss, ...) are left as they are
            return
        names = list(self._parts)
        values = torch.tensor([self._sums[key] for key in _COUNTS] + [self._parts[name] for name in names],
                              dtype=torch.float64)
        if self.reduce is not None:
            values = self.reduce(values).cpu()
        totals = dict(zip([*_COUNTS, *names], values.tolist()))
        steps = self._steps
        self._reset()
        if not totals["tokens"]:
            return
        positions = totals["numeric_positions"]
        parts = {"loss_ce": totals["ce_sum"] / totals["tokens"],
                 "loss_numeric": totals["numeric_sum"] / positions if positions else 0.0}
        parts.update({f"loss_{name}": totals[name] / positions if positions else 0.0 for name in names})
        parts["loss_total"] = parts["loss_ce"] + self.hook.weight * parts["loss_numeric"]
        if positions:
            parts.update(numeric_accuracy=totals["correct"] / positions, numeric_mae=totals["abs_error"] / positions)
        parts["numeric_positions"] = positions / max(steps, 1)
        logs.update(parts)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(parts)  # the Trainer stored a copy of these logs before the callbacks ran
