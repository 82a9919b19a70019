"""Per-step training metrics to TensorBoard through DeepSpeed's monitor (so the config's csv,
wandb or comet monitors get them too) and to ``metrics.jsonl`` on rank 0.

Names are a contract (what dashboards key on):

    loss/total  loss/ce  loss/numeric
    loss/smmd  loss/mmd  loss/smooth  loss/ntl_was  loss/ntl_mse   (the numeric losses of the run)
    numeric/accuracy  numeric/mae  numeric/tokens
    perf/tokens_per_second  perf/tokens_per_second_per_device  perf/tflops_per_device
    perf/step_seconds  memory/peak_gib  comm/loss_bytes  comm/loss_backward_bytes  train/lr
    train/grad_norm  train/skipped_steps  run/world_size  run/tp_size  run/dp_size

``loss/total = loss/ce + weight x loss/numeric``: means over the step's micro-batches. The numeric
losses' own values (SMMD and its two terms, NTL-WAS, NTL-MSE) and the numeric statistics are
means over the step's numeric-target positions. Everything is summed over the micro-batches and
the data-parallel replicas (one small all-reduce per step) before it is averaged.
``comm/loss_bytes`` is what this rank's loss exchanged in the step's forwards,
``comm/loss_backward_bytes`` what the fused linear head's backward all-reduced (``d hidden``,
the all-reduce the head's own backward runs otherwise). The x axis is the optimizer step.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# The per-position statistics the numeric losses report (SMMDOutput.stats), logged as loss/<name>.
NUMERIC_PARTS = ("smmd", "mmd", "smooth", "ntl_was", "ntl_mse")
# Sums kept per step, in this order, reduced over the data-parallel group.
_SUMS = ("total", "ce", "numeric", *NUMERIC_PARTS, "numeric_tokens", "correct", "abs_error", "tokens",
         "micro_batches")


def peak_memory_gib() -> float:
    """Peak accelerator memory of this process, or its peak resident memory on a CPU run."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class TrainingMonitor:
    """Accumulate a step's loss statistics and write the contract scalars once per step.

    ``flops_per_token``: model FLOPs per trained token for forward + backward (6 x parameters
    plus attention), used for ``perf/tflops_per_device``.
    """

    def __init__(self, engine, *, world_size: int, tp_size: int, dp_size: int, dp_group, flops_per_token: float,
                 metrics_path: Optional[str] = None):
        self.engine = engine
        self.world_size, self.tp_size, self.dp_size, self.dp_group = world_size, tp_size, dp_size, dp_group
        self.flops_per_token = flops_per_token
        self.metrics_path = Path(metrics_path) if metrics_path and dist.get_rank() == 0 else None
        self._reset()

    def _reset(self) -> None:
        self._sums = dict.fromkeys(_SUMS, 0.0)
        self._loss_bytes = self._loss_backward_bytes = 0
        self._parts = set()

    def record_micro_batch(self, losses: tuple, stats: Optional[dict]) -> None:
        """``losses``: detached (total, ce, numeric term) of one micro-batch; ``stats``: its
        SMMDOutput.stats (None when the run trains with the model's own loss: no numeric statistics)."""
        total, ce, numeric_term = (float(value) for value in losses)
        self._sums["total"] += total
        self._sums["ce"] += ce
        self._sums["micro_batches"] += 1
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

    def log_run_shape(self) -> None:
        self._write([("run/world_size", self.world_size), ("run/tp_size", self.tp_size),
                     ("run/dp_size", self.dp_size)], step=0)

    def end_step(self, step: int, step_seconds: float, tokens_in_step: int, learning_rate: float,
                 skipped_steps: int = 0) -> dict:
        """Reduce, write and return the step's metrics (the same dict on every rank).

        ``learning_rate``: the rate this step's update used (read before the optimizer step);
        ``skipped_steps``: steps skipped so far for a non-finite loss (the run's total).
        """
        device = self.engine.device
        sums = torch.tensor([self._sums[key] for key in _SUMS], dtype=torch.float64, device=device)
        if self.dp_size > 1:
            dist.all_reduce(sums, group=self.dp_group)
        peak = torch.tensor([peak_memory_gib()], dtype=torch.float64, device=device)
        if self.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        totals = dict(zip(_SUMS, sums.tolist()))
        micro_batches = max(totals["micro_batches"], 1)
        grad_norm = self.engine.get_global_grad_norm()
        tokens_per_second = tokens_in_step / step_seconds if step_seconds > 0 else 0.0
        metrics = {"loss/total": totals["total"] / micro_batches, "loss/ce": totals["ce"] / micro_batches}
        if self._parts:  # a run on the model's own loss has no numeric statistics: none are written
            # Averages over no numeric position are undefined (NaN): a step without numeric targets.
            numeric = totals["numeric_tokens"] or float("nan")
            metrics["loss/numeric"] = totals["numeric"] / micro_batches
            metrics.update({f"loss/{name}": totals[name] / numeric for name in NUMERIC_PARTS if name in self._parts})
            metrics.update({"numeric/accuracy": totals["correct"] / numeric,
                            "numeric/mae": totals["abs_error"] / numeric, "numeric/tokens": totals["numeric_tokens"]})
        metrics.update({
            "perf/tokens_per_second": tokens_per_second,
            "perf/tokens_per_second_per_device": tokens_per_second / self.world_size,
            "perf/tflops_per_device": tokens_per_second * self.flops_per_token / self.world_size / 1e12,
            "perf/step_seconds": step_seconds,
            "memory/peak_gib": peak.item(),
            "comm/loss_bytes": float(self._loss_bytes),
            "comm/loss_backward_bytes": float(self._loss_backward_bytes),
            "train/lr": float(learning_rate),
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/skipped_steps": float(skipped_steps),
        })
        self._write(list(metrics.items()), step)
        self._reset()
        return metrics

    def write_eval(self, step: int, metrics: dict) -> None:
        self._write(list(metrics.items()), step)

    def _write(self, items: list, step: int) -> None:
        self.engine.monitor.write_events([(name, float(value), step) for name, value in items])
        if self.metrics_path is not None:
            with open(self.metrics_path, "a") as handle:
                handle.write(json.dumps({"step": step, **{name: value for name, value in items}}) + "\n")
