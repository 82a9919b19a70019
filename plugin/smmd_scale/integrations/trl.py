"""TRL's ``SFTTrainer``: CE + weight x the numeric loss, in one forward per micro-batch.

TRL 1.16's ``SFTTrainer.compute_loss`` never calls the model's ``loss_function``. It puts a fused LM
head on the model (``trl.trainer.utils.add_fused_lm_head``) and calls ``model(**inputs,
fused_lm_head=True)``, which scores the labels in tiles from the head's input (per-token
log-probabilities, entropies, top-1 flags; no logits) and trains their NLL. A ``compute_loss_func``
gets the logits of a forward without labels, and the fused head then runs the model a second time,
under ``no_grad``, for TRL's metrics.

:func:`attach_to_sft_trainer` gives the trainer ``transformers.Trainer.compute_loss`` back: the model is
called with its labels, the installed hook computes the loss from its logits (exactly what the
Trainer trains), and TRL's metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``, ``aux_loss``)
are computed from the same logits. The logits are materialised, as under the Trainer.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from .. import compat
from ..numeric_loss import IGNORE_INDEX

# Rows of logits per chunk of the entropy and top-1 metrics: bounds their float32 copy.
METRIC_ROWS = 1024


def is_sft_trainer(trainer) -> bool:
    """Whether ``trainer`` is TRL's ``SFTTrainer`` or a subclass (without importing TRL)."""
    module = sys.modules.get("trl.trainer.sft_trainer")
    return module is not None and isinstance(trainer, module.SFTTrainer)


def attach_to_sft_trainer(trainer) -> None:
    """Make ``trainer`` (an ``SFTTrainer``) compute its loss through the model's ``loss_function``
    (see the module docstring). A subclass that overrides ``compute_loss`` keeps its own; the first
    training step then tells whether it calls the hook (``NumericLossCallback``)."""
    from trl import SFTTrainer

    if trainer.args.loss_type != "nll":
        raise ValueError(f"SFTConfig(loss_type={trainer.args.loss_type!r}) computes TRL's own loss without the "
                         "smmd_scale hook; use loss_type='nll' (the hook's CE + weight x numeric loss replaces it)")
    if type(trainer).compute_loss is SFTTrainer.compute_loss:
        trainer.compute_loss = types.MethodType(compute_loss, trainer)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """``SFTTrainer.compute_loss`` with the model's own loss: ``transformers.Trainer.compute_loss``
    (the model called with its labels; or a ``compute_loss_func`` given the logits), then TRL's
    metrics from the same logits. Bound to the trainer by :func:`attach_to_sft_trainer`."""
    from trl import SFTTrainer

    mode = "train" if self.model.training else "eval"
    inputs["use_cache"] = False  # as SFTTrainer: no KV cache in a training forward
    if self.aux_loss_enabled:  # as SFTTrainer: VLM wrappers return the router logits only when asked per call
        inputs["output_router_logits"] = True
    # Read before the Trainer takes the labels out of `inputs` (it does for a compute_loss_func).
    targets = inputs.get("shift_labels")
    if targets is None:
        targets = F.pad(inputs["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss, outputs = super(SFTTrainer, self).compute_loss(model, inputs, return_outputs=True,
                                                         num_items_in_batch=num_items_in_batch)
    record_metrics(self, mode, outputs, targets, inputs)
    return (loss, outputs) if return_outputs else loss


def token_metrics(logits: torch.Tensor, targets: torch.Tensor) -> tuple:
    """(entropy summed over the target positions, top-1 hits, target positions) of ``logits [..., V]``
    against ``targets [...]`` (-100: no target), in float32 chunks of :data:`METRIC_ROWS` rows: what
    TRL's fused head returns as ``entropy``, ``is_top1`` and ``label_mask``."""
    rows = logits.detach().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1).to(rows.device)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    entropy_sum = rows.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.long, device=rows.device)
    for chunk in positions.split(METRIC_ROWS):
        chunk_logits = rows[chunk].float()
        log_probs = chunk_logits.log_softmax(-1)
        entropy_sum += -(log_probs.exp() * log_probs).sum()
        hits += (chunk_logits.argmax(-1) == targets[chunk]).sum()
    return entropy_sum, hits, torch.tensor(positions.numel(), device=rows.device)


def record_metrics(trainer, mode: str, outputs, targets: torch.Tensor, inputs: dict) -> None:
    """Record a micro-batch's metrics where ``SFTTrainer.compute_loss`` records them, over all processes
    as it does. Without logits (``install(..., fused_linear=True)`` trains without them) ``entropy`` and
    ``mean_token_accuracy`` are left out."""
    gather = trainer.accelerator.gather_for_metrics
    metrics = compat.sft_metrics(trainer)[mode]
    logits = getattr(outputs, "logits", None)
    if logits is not None:
        entropy_sum, hits, positions = (gather(value).sum() for value in token_metrics(logits, targets))
        metrics["entropy"].append((entropy_sum / positions).item() if positions > 0 else 0.0)
        metrics["mean_token_accuracy"].append((hits / positions).item() if positions > 0 else 0.0)
    tokens = 0
    if mode == "train":
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        else:  # padding-free rows: no attention mask, one row of position ids
            local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        tokens = int(gather(local).sum().item())
    metrics["num_tokens"] = [compat.sft_train_tokens(trainer, tokens)]
    aux_loss = getattr(outputs, "aux_loss", None)
    if trainer.aux_loss_enabled and aux_loss is not None:
        metrics["aux_loss"].append(gather(aux_loss.detach()).mean().item())
