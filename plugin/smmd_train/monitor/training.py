"""Per-step training metrics to the run's TensorBoard directory, to DeepSpeed's monitor (so the
config's csv, wandb or comet monitors get them too) and to ``metrics.jsonl``, on rank 0; HParams,
the Custom Scalars layout of the tags the run writes (smmd_train.monitor.dashboards) and an end-of-run
summary (``summary/*``) for comparing runs.

Names are a contract (what dashboards key on):

    loss/total  loss/ce  loss/numeric  loss/z (with --z_loss)
    loss/<statistic>   (each numeric loss of the run: smmd_scale.registry, e.g. loss/smmd, loss/ntl_was)
    numeric/accuracy  numeric/mae  numeric/positions
    perf/tokens_per_second  perf/tokens_per_second_per_rank  perf/tflops_per_rank
    perf/step_seconds  perf/count_seconds  memory/peak_gib  comm/loss_bytes  comm/loss_backward_bytes  train/lr
    comm/exchange_rows (with --tp_exchange_capacity counted)
    train/grad_norm  train/skipped_steps  run/world_size  run/tp_size  run/dp_size  run/sp_size

TensorBoard alone also gets ``memory/zero_gib`` (0 at every step that has ``memory/peak_gib``): the
lower edge of the memory chart's band, which keeps 0 on its axis (smmd_train.monitor.dashboards.FROM_ZERO).

The losses are the optimizer step's objective (the trainer passes the step's counts to the loss,
:meth:`TrainingMonitor.record_step_counts`): ``loss/ce`` the mean CE over the step's valid targets,
``loss/numeric`` the numeric term, the mean over the step's numeric-target positions, and
``loss/total = loss/ce + loss/z + weight x loss/numeric`` (``loss/z``: the z-loss, reduced as CE),
whatever the micro-batch, accumulation, DP or SP layout; each numeric loss's own value
(``loss/smmd``, ``loss/ntl_was``, ...; for a weighted sum
``loss/numeric = sum_i w_i loss/<term_i>``) and the numeric statistics are means over the step's
numeric-target positions. A step without numeric targets logs the numeric losses as 0 with
``numeric/positions`` 0 (accuracy and MAE are left out: they are undefined). Without counts (the
model's own loss, ``--framework_loss``) the losses are means over the step's micro-batches.
Everything is summed over the micro-batches and the data- and sequence-parallel ranks (one small
all-reduce per step); with sequence parallelism each rank's losses are its shard's share.
``comm/loss_bytes`` is what this rank's loss exchanged in the step's forwards,
``comm/loss_backward_bytes`` what the fused linear head's backward all-reduced (``d hidden``,
the all-reduce the head's own backward runs otherwise), ``comm/exchange_rows`` the numeric rows the
step's exchanges were bounded to (``--tp_exchange_capacity counted``: each micro-batch's numeric
targets; the step's largest). The x axis is the optimizer step.
``perf/*`` and ``memory/*`` start after the process's first step (its warm-up: lazy
initialisation, allocator growth). At the end, ``summary/*`` hold one value per run (medians over
the steps after warm-up, the final losses), which the HParams dashboard compares across runs.
"""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from smmd_scale.registry import note_reader, statistic_names

from . import dashboards
from .metrics_file import keep_records_through

# The per-position statistics the registered numeric losses report (their output's stats), logged as loss/<name>.
NUMERIC_PARTS = statistic_names()
note_reader(__name__)
# Sums kept per step, in this order, reduced over the data-parallel group.
_SUMS = ("total", "ce", "z", "numeric", *NUMERIC_PARTS, "numeric_tokens", "correct", "abs_error", "tokens",
         "micro_batches")


def peak_memory_gib() -> float:
    """Peak accelerator memory of this process, or its peak resident memory on a CPU run."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class TrainingMonitor:
    """Accumulate a step's loss statistics and write the contract scalars once per step.

    ``flops_per_token``: model FLOPs per trained token for forward + backward (6 x parameters
    plus attention), used for ``perf/tflops_per_rank``. ``tensorboard_dir``: where rank 0 writes
    the run's events (None: no TensorBoard); ``hparams``: the run's settings for the HParams view.
    ``start_step``: the step the run continues from (a resumed checkpoint's; 0 from scratch): rank 0
    drops the records of later steps from ``metrics_path``, which this run logs again.
    """

    def __init__(self, engine, *, world_size: int, tp_size: int, dp_size: int, dp_group, flops_per_token: float,
                 metrics_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 hparams: Optional[dict] = None, sp_size: int = 1, start_step: int = 0):
        self.engine = engine
        self.world_size, self.tp_size, self.dp_size, self.dp_group = world_size, tp_size, dp_size, dp_group
        # With sequence parallelism (dp_group then holds the SP ranks too) a rank computes 1/sp of a micro-batch.
        self.sp_size = sp_size
        self.flops_per_token = flops_per_token
        rank_zero = dist.get_rank() == 0
        self.metrics_path = Path(metrics_path) if metrics_path and rank_zero else None
        if self.metrics_path is not None:
            keep_records_through(self.metrics_path, start_step)
        self.writer = None
        self._charted = set()  # the tags the run's Custom Scalars layout holds
        if tensorboard_dir and rank_zero:
            self.writer = dashboards.open_writer(tensorboard_dir)
            if hparams:
                dashboards.write_hparams(self.writer, hparams, dashboards.trial_id(tensorboard_dir),
                                         experiment=not dashboards.has_experiment(Path(tensorboard_dir).parent))
                self.writer.add_text("run/settings", "\n".join(f"* {key}: {value}" for key, value in hparams.items()))
        self._steps_seen = 0
        self._after_warmup = []  # per step after warm-up: (tokens/s, peak GiB, loss bytes)
        self._last = {}
        self._reset()

    def _reset(self) -> None:
        self._sums = dict.fromkeys(_SUMS, 0.0)
        self._has_z = False
        self._loss_bytes = self._loss_backward_bytes = 0
        self._parts = set()
        self._step_counts = None
        self._exchange_rows = None

    def record_step_counts(self, valid_targets: int, numeric_positions: int, seconds: float = 0.0) -> None:
        """The step's global counts, passed to the loss: its micro-batches' losses are then shares
        of the step's objective and add up to it (they are summed, not averaged). ``seconds``: what
        counting took, its all-reduce included (``perf/count_seconds``)."""
        self._step_counts = (valid_targets, numeric_positions)
        self._count_seconds = seconds

    def record_exchange_bounds(self, bounds: list) -> None:
        """``--tp_exchange_capacity counted``: the numeric rows each micro-batch's exchange is bounded to
        (``comm/exchange_rows``: the step's largest); None entries (not bounded) are not recorded."""
        bounded = [bound for bound in bounds if bound is not None]
        if bounded:
            self._exchange_rows = max(bounded)

    def log_run_shape(self) -> None:
        """The run's layout as the first record of metrics.jsonl (in TensorBoard it is in the HParams)."""
        self._write([("run/world_size", self.world_size), ("run/tp_size", self.tp_size),
                     ("run/dp_size", self.dp_size), ("run/sp_size", self.sp_size)], step=0, tensorboard=False)

    def record_micro_batch(self, losses: tuple, stats: Optional[dict], z=None) -> None:
        """``losses``: detached (total, ce, numeric term) of one micro-batch; ``stats``: its
        NumericOutput.stats (None when the run trains with the model's own loss: no numeric statistics);
        ``z``: its z-loss term when the run has one (``--z_loss``; logged as ``loss/z``)."""
        total, ce, numeric_term = (float(value) for value in losses)
        self._sums["total"] += total
        self._sums["ce"] += ce
        if z is not None:
            self._sums["z"] += float(z)
            self._has_z = True
        self._sums["micro_batches"] += 1 / self.sp_size
        if stats is None:
            return
        numeric = stats["numeric_tokens"]
        self._sums["numeric"] += numeric_term
        for name in NUMERIC_PARTS:
            if name in stats:
                self._parts.add(name)
                self._sums[name] += stats[name] * numeric
        for key, value in (("numeric_tokens", numeric), ("correct", stats["numeric_accuracy"] * numeric),
                           ("abs_error", stats["numeric_mae"] * numeric), ("tokens", stats["tokens"])):
            self._sums[key] += value
        self._loss_bytes += stats["comm_bytes"]
        self._loss_backward_bytes += stats.get("backward_comm_bytes", 0)

    def end_step(self, step: int, step_seconds: float, tokens_in_step: int, learning_rate: float,
                 skipped_steps: int = 0) -> dict:
        """Reduce, write and return the step's metrics (the same dict on every rank).

        ``learning_rate``: the rate this step's update used (read before the optimizer step);
        ``skipped_steps``: steps skipped so far for a non-finite loss (the run's total).
        """
        device = self.engine.device
        sums = torch.tensor([self._sums[key] for key in _SUMS], dtype=torch.float64, device=device)
        if self.dp_size * self.sp_size > 1:
            dist.all_reduce(sums, group=self.dp_group)
        peak = torch.tensor([peak_memory_gib()], dtype=torch.float64, device=device)
        if self.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        totals = dict(zip(_SUMS, sums.tolist()))
        # Shares of the step's objective add up to it; per-micro-batch means are averaged.
        divisor = 1.0 if self._step_counts is not None else max(totals["micro_batches"], 1)
        grad_norm = self.engine.get_global_grad_norm()
        tokens_per_second = tokens_in_step / step_seconds if step_seconds > 0 else 0.0
        metrics = {"loss/total": totals["total"] / divisor, "loss/ce": totals["ce"] / divisor}
        if self._has_z:
            metrics["loss/z"] = totals["z"] / divisor
        if self._parts:  # a run on the model's own loss has no numeric statistics: none are written
            positions = totals["numeric_tokens"]
            metrics["loss/numeric"] = totals["numeric"] / divisor
            # A step without numeric targets has numeric loss 0 (nothing to score), not NaN.
            metrics.update({f"loss/{name}": totals[name] / positions if positions else 0.0
                            for name in NUMERIC_PARTS if name in self._parts})
            metrics["numeric/positions"] = positions
            if positions:
                metrics.update({"numeric/accuracy": totals["correct"] / positions,
                                "numeric/mae": totals["abs_error"] / positions})
        metrics.update({
            "perf/tokens_per_second": tokens_per_second,
            "perf/tokens_per_second_per_rank": tokens_per_second / self.world_size,
            "perf/tflops_per_rank": tokens_per_second * self.flops_per_token / self.world_size / 1e12,
            "perf/step_seconds": step_seconds,
            **({"perf/count_seconds": self._count_seconds} if self._step_counts is not None else {}),
            "memory/peak_gib": peak.item(),
            "comm/loss_bytes": float(self._loss_bytes),
            "comm/loss_backward_bytes": float(self._loss_backward_bytes),
            **({"comm/exchange_rows": float(self._exchange_rows)} if self._exchange_rows is not None else {}),
            "train/lr": float(learning_rate),
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/skipped_steps": float(skipped_steps),
        })
        self._steps_seen += 1
        written = metrics
        if self._steps_seen == 1:  # the process's warm-up step: its time and memory are not the run's
            written = {key: value for key, value in metrics.items() if not key.startswith(("perf/", "memory/"))}
        else:
            self._after_warmup.append((tokens_per_second, metrics["memory/peak_gib"], metrics["comm/loss_bytes"]))
        self._write(list(written.items()), step)
        self._last = dict(metrics)
        self._reset()
        return metrics

    def write_eval(self, step: int, metrics: dict) -> None:
        self._write(list(metrics.items()), step)
        self._last.update(metrics)

    def finish(self, step: int) -> dict:
        """Write the end-of-run ``summary/*`` scalars at ``step`` (medians over the steps after warm-up,
        the last losses and evaluation) and close the TensorBoard writer; returns the summary."""
        summary = {}
        if self._after_warmup:
            rates, peaks, loss_bytes = zip(*self._after_warmup)
            tokens_per_second = statistics.median(rates)
            summary.update({"summary/tokens_per_second": tokens_per_second,
                            "summary/tokens_per_second_per_rank": tokens_per_second / self.world_size,
                            "summary/tflops_per_rank": tokens_per_second * self.flops_per_token / self.world_size
                            / 1e12,
                            "summary/peak_memory_gib": max(peaks),
                            "summary/loss_bytes_per_step": statistics.median(loss_bytes)})
        for key, tag in (("loss/total", "final_loss_total"), ("loss/ce", "final_loss_ce"),
                         ("loss/numeric", "final_loss_numeric"), ("eval/ce", "final_eval_ce")):
            if key in self._last:
                summary[f"summary/{tag}"] = self._last[key]
        self._write(list(summary.items()), step)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return summary

    def _write(self, items: list, step: int, tensorboard: bool = True) -> None:
        self.engine.monitor.write_events([(name, float(value), step) for name, value in items])
        if self.writer is not None and tensorboard:
            for name, value in items:
                self.writer.add_scalar(name, float(value), step)
                if name in dashboards.FROM_ZERO:  # the lower edge of the chart's band: its axis starts at 0
                    self.writer.add_scalar(dashboards.FROM_ZERO[name], 0.0, step)
            # The layout charts what the run writes: rewritten when a tag appears (the first step, the
            # first evaluation); the fused head's backward bytes once they are not 0.
            charted = self._charted | {name for name, value in items
                                       if name != "comm/loss_backward_bytes" or value}
            if dashboards.step_layout(charted) != dashboards.step_layout(self._charted):
                dashboards.write_layout(self.writer, dashboards.step_layout(charted), step)
            self._charted = charted
            self.writer.flush()
        if self.metrics_path is not None:
            with open(self.metrics_path, "a") as handle:
                handle.write(json.dumps({"step": step, **{name: value for name, value in items}}) + "\n")
