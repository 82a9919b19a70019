"""Held-out evaluation during training: CE, perplexity and the numeric metrics on ``--eval_data``,
split across the data-parallel replicas, every ``--eval_steps`` optimizer steps and at the end."""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.distributed as dist

from ..data.batches import eval_batches
from ..distributed.sequence_parallel import micro_batch_inputs


@torch.no_grad()
def held_out_metrics(engine, installed, dataset, micro_batch_size: int, max_batches: int, dp_rank: int,
                     dp_size: int, dp_group, sp_rank: int = 0, sp_size: int = 1, sp_group=None) -> dict:
    """CE and numeric metrics on held-out blocks, split across the data-parallel replicas; with
    sequence parallelism each rank of an SP group evaluates its shard of the same blocks, and
    ``dp_group`` (then the dp x sp ranks) sums the shards.

    The numeric metrics are the installed loss's statistics, over the numeric-target positions (with
    prompt/completion data, the completions' only): ``eval/numeric_accuracy``, the share where the
    argmax over the numeric tokens is the target, and ``eval/numeric_mae``. launch/evaluate.py
    reports the same quantities on the same tokens (no BOS, as the data has none) as
    ``numeric_accuracy`` and ``numeric_token_mae``; docs/training.md ("Evaluating a trained model")
    defines them all."""
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)  # ce*tokens, tokens, correct, abs err, numeric
    for batch in itertools.islice(eval_batches(dataset, micro_batch_size, max_batches), dp_rank, None, dp_size):
        engine(**micro_batch_inputs(batch, engine.device, sp_rank, sp_size, sp_group))
        stats, (_, ce, _) = installed.last_stats, installed.hook.last_losses
        numeric = stats["numeric_tokens"]
        sums += torch.tensor([float(ce) * stats["tokens"], stats["tokens"], stats["numeric_accuracy"] * numeric,
                              stats["numeric_mae"] * numeric, numeric], dtype=torch.float64, device=engine.device)
    engine.train()
    if dp_size * sp_size > 1:
        dist.all_reduce(sums, group=dp_group)
    ce_sum, tokens, correct, abs_error, numeric = sums.tolist()
    return {"eval/ce": ce_sum / max(tokens, 1), "eval/perplexity": math.exp(min(ce_sum / max(tokens, 1), 50)),
            "eval/numeric_accuracy": correct / max(numeric, 1), "eval/numeric_mae": abs_error / max(numeric, 1),
            "eval/numeric_tokens": numeric}


def describe(metrics: dict) -> str:
    """One console line of held-out metrics."""
    return (f"eval ce {metrics['eval/ce']:.4f} (perplexity {metrics['eval/perplexity']:.4g}), numeric accuracy "
            f"{metrics['eval/numeric_accuracy']:.3f}, numeric MAE {metrics['eval/numeric_mae']:.4g} over "
            f"{metrics['eval/numeric_tokens']:.0f} numeric positions")


class Evaluator:
    """The evaluation cadence of a run (``smmd_train.run.PreparedRun``): every ``every_steps`` steps
    (0: only at the end) and once at the end unless the last step just evaluated; the metrics go to
    ``monitor``. Off without held-out data or with a loss that has no numeric statistics
    (``LossReporter.evaluates``: the model's own)."""

    def __init__(self, run, monitor, every_steps: int, max_batches: int):
        self.run, self.monitor, self.every_steps, self.max_batches = run, monitor, every_steps, max_batches
        self.enabled = run.eval_blocks is not None and run.plan.loss.evaluates
        self.last: Optional[tuple] = None  # (step, metrics) of the latest evaluation

    def evaluate(self, step: int) -> dict:
        run = self.run
        metrics = held_out_metrics(run.engine, run.plan.loss.installed, run.eval_blocks, run.micro_batch_size,
                                   self.max_batches, run.dp_rank, run.plan.topology.dp_size, run.dp_group,
                                   run.sp_rank, run.sp_size, run.sp_group)
        self.monitor.write_eval(step, metrics)
        self.last = (step, metrics)
        return metrics

    def maybe_evaluate(self, step: int) -> Optional[dict]:
        """Evaluate if ``step`` is due; returns the metrics, or None."""
        if self.enabled and self.every_steps and step % self.every_steps == 0:
            return self.evaluate(step)
        return None

    def finish(self, step: int) -> Optional[dict]:
        """The final evaluation at ``step`` (reused if that step just ran one); None when off."""
        if not self.enabled:
            return None
        if self.last is None or self.last[0] != step:
            self.evaluate(step)
        return self.last[1]
