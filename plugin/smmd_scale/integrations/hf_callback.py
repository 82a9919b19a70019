"""The loss parts in a ``transformers.Trainer``'s logs: a ``TrainerCallback`` that adds, at every
logging step, CE, the numeric term, each numeric loss by name, the total and the numeric-token
metrics, over the micro-batches since the previous log, and at every evaluation the same parts over
the evaluation set, so that they reach ``log_history``, TensorBoard, W&B, ... through the Trainer's own
reporting. ``InstalledLoss.attach_to_trainer`` adds it (first, so that the reporting callbacks see
what it adds).

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

Evaluation: the Trainer's ``eval_loss`` is the trained objective, CE + weight x numeric, each
evaluation batch's own means averaged over the batches' sequences. The callback adds the same keys
with the evaluation's prefix (``eval_loss_ce``, ``eval_loss_numeric``, ``eval_loss_smmd``, ...,
``eval_loss_total``, ``eval_numeric_accuracy``, ``eval_numeric_mae``; ``eval_numeric_positions``: the
set's total), pooled over the whole evaluation set, to the evaluation's log and to the metrics
``evaluate()`` returns: ``metric_for_best_model="loss_ce"`` (the Trainer reads ``eval_loss_ce``) selects
the best model and stops early on CE alone, the objective a CE-trained run reports as ``eval_loss``.

If the first training step never calls the hook (a trainer or model that computes its own loss), the
callback raises before the optimizer applies that step.
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


class _Window:
    """The sums of the hook calls recorded since the window was last read (a logging window, an evaluation)."""

    def __init__(self, names: list):
        self.names = names  # numeric loss names (the same on every process)
        self.clear()

    def clear(self) -> None:
        self.sums = dict.fromkeys(_COUNTS, 0.0)
        self.parts = dict.fromkeys(self.names, 0.0)  # name -> its value summed over numeric positions
        self.calls = 0  # calls recorded on this process

    def add(self, hook) -> None:
        """Add ``hook``'s last call."""
        stats = hook.last_stats
        ce_sum, numeric_sum = call_sums(hook.last_losses, stats, *(hook.last_counts or (None, None)))
        positions = stats["numeric_tokens"]
        self.sums["ce_sum"] += ce_sum
        self.sums["numeric_sum"] += numeric_sum
        self.sums["tokens"] += stats["tokens"]
        self.sums["numeric_positions"] += positions
        self.sums["correct"] += stats["numeric_accuracy"] * positions
        self.sums["abs_error"] += stats["numeric_mae"] * positions
        for name in self.names:  # per-position means in the stats
            self.parts[name] += stats[name] * positions
        self.calls += 1

    def read(self, weight: float, reduce=None) -> dict:
        """The window's parts (keys as in the module docstring, ``numeric_positions`` the window's total),
        pooled over the processes by ``reduce``; clears the window. Empty when it saw no target."""
        values = torch.tensor([self.sums[key] for key in _COUNTS] + [self.parts[name] for name in self.names],
                              dtype=torch.float64)
        if reduce is not None:
            values = reduce(values).cpu()
        totals = dict(zip([*_COUNTS, *self.names], values.tolist()))
        self.clear()
        if not totals["tokens"]:
            return {}
        positions = totals["numeric_positions"]
        parts = {"loss_ce": totals["ce_sum"] / totals["tokens"],
                 "loss_numeric": totals["numeric_sum"] / positions if positions else 0.0}
        parts.update({f"loss_{name}": totals[name] / positions if positions else 0.0 for name in self.names})
        parts["loss_total"] = parts["loss_ce"] + weight * parts["loss_numeric"]
        if positions:
            parts.update(numeric_accuracy=totals["correct"] / positions, numeric_mae=totals["abs_error"] / positions)
        parts["numeric_positions"] = positions
        return parts


class NumericLossCallback(TrainerCallback):
    """Adds the loss parts of ``installed`` (what :func:`smmd_scale.install` returned) to the
    Trainer's training and evaluation logs (see the module docstring), and raises if the first
    training step never calls the hook. ``reduce``: sums a tensor over the processes
    (``trainer.accelerator.reduce``; None on one process). ``trainer_name``: the trainer's class, for
    that error."""

    def __init__(self, installed, reduce=None, trainer_name: str = "The trainer"):
        self.hook = installed.hook
        self.reduce = reduce
        self.trainer_name = trainer_name
        names = list(self.hook.numeric_loss.stat_names)
        self._training, self._evaluation = _Window(names), _Window(names)
        self._steps = 0  # optimizer steps in the training window (the same on every process)
        # A call is told from the last one by its losses' record (a new object per call: hook.last_losses),
        # not by a counter: an int the hook increments would make torch.compile(model) compile again per call.
        self._recorded = self.hook.last_losses
        self._before_first_step = None  # hook.last_losses when the first step began, until that step is checked
        self._first_step_began = False
        self._first_step_checked = False

    def _record(self, window: _Window) -> None:
        """Add the hook's last call to ``window`` if it is one no window holds yet."""
        if self.hook.last_losses is not None and self.hook.last_losses is not self._recorded:
            window.add(self.hook)
        self._recorded = self.hook.last_losses

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._first_step_checked:
            self._before_first_step, self._first_step_began = self.hook.last_losses, True

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Before the optimizer applies the first step: a trainer that never calls the hook trains
        # another loss in silence (e.g. TRL's own, a compute_loss_func that does not call the hook).
        if self._first_step_checked or not self._first_step_began:
            return
        self._first_step_checked = True
        if self.hook.last_losses is self._before_first_step:
            model_name = type(model).__name__ if model is not None else "the model"
            raise RuntimeError(f"{self.trainer_name} ran its first training step on {model_name} without calling the "
                               "smmd_scale loss hook, so it trained another loss than CE + weight x numeric (the step "
                               "is not applied); the loss must come from the model called with its labels (a model "
                               "whose forward calls self.loss_function, a compute_loss that calls the model with "
                               "labels) or from installed.hook(outputs.logits, labels, num_items_in_batch=...) in a "
                               "compute_loss_func")

    def on_substep_end(self, args, state, control, **kwargs):  # a micro-batch that did not end the step
        self._record(self._training)

    def on_step_end(self, args, state, control, **kwargs):  # the step's last micro-batch
        self._record(self._training)
        self._steps += 1

    def on_prediction_step(self, args, state, control, **kwargs):  # an evaluation (or prediction) batch
        self._record(self._evaluation)

    def on_evaluate(self, args, state, control, **kwargs):
        self._evaluation.clear()  # already logged; cleared here too for an evaluation without logging

    def on_predict(self, args, state, control, **kwargs):
        self._evaluation.clear()  # predict() logs nothing: its batches belong to no evaluation

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if "loss" in logs:
            parts = self._training.read(self.hook.weight, self.reduce)
            if parts:
                parts["numeric_positions"] /= max(self._steps, 1)  # per optimizer step
            self._steps = 0
        else:
            # An evaluation's log (evaluate() logs its metrics, then hands the same dict to
            # on_evaluate and returns it: what metric_for_best_model reads) holds "<prefix>_runtime".
            prefix = next((key[:-len("_runtime")] for key in logs if key.endswith("_runtime")), None)
            if prefix is None or not self._evaluation.calls:
                return
            parts = {f"{prefix}_{key}": value
                     for key, value in self._evaluation.read(self.hook.weight, self.reduce).items()}
        logs.update(parts)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(parts)  # the Trainer stored a copy of these logs before the callbacks ran
