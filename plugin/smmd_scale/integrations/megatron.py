"""Megatron-core / Megatron-DeepSpeed entry point: per-token losses on ``[s, b, V/T]`` logits.

Megatron's ``loss_func`` applies its own loss mask, so this returns unreduced per-token values::

    ce, numeric = vocab_parallel_numeric_cross_entropy(output_tensor, labels.transpose(0, 1).contiguous(),
                                                       numeric_loss, tp_group=mpu.get_tensor_model_parallel_group())
    mask = loss_mask.transpose(0, 1).float()
    numeric_mask = numeric_loss.numeric_mask(labels.transpose(0, 1)).float() * mask
    loss = (ce * mask).sum() / mask.sum() + weight * (numeric * mask).sum() / numeric_mask.sum().clamp_min(1)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..deprecation import renamed
from ..loss import per_token_losses
from ..numeric_loss import NumericLoss


def vocab_parallel_numeric_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                         numeric_loss: NumericLoss, tp_group=None,
                                         vocab_start_index: Optional[int] = None) -> tuple:
    """CE and the numeric loss per token for this rank's vocabulary shard.

    vocab_parallel_logits: ``[s, b, V/T]`` (any leading shape), this rank's contiguous shard.
    target: ``[s, b]`` token ids, replicated in the tensor-parallel group.
    vocab_start_index: first vocabulary id of this shard; ``None`` means Megatron's equal shards
        (``tp_rank * V/T``, the vocabulary padded to a multiple of the TP size).

    Returns ``(ce [s, b], numeric [s, b])``, both with grad: CE is 0 where ``target`` is
    ``numeric_loss.ignore_index``; the numeric loss is 0 where the target is not a numeric token.
    One packed all-reduce in the forward, none in the backward.
    """
    losses = per_token_losses(vocab_parallel_logits, target, numeric_loss, tp_group=tp_group,
                              vocab_start_index=vocab_start_index)
    return losses.ce.view(target.shape), losses.numeric.view(target.shape)


vocab_parallel_smmd_cross_entropy = renamed(vocab_parallel_numeric_cross_entropy, "vocab_parallel_smmd_cross_entropy",
                                            {"smmd": "numeric_loss"})
