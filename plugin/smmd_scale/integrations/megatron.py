"""Megatron-core / Megatron-DeepSpeed entry point: per-token losses on ``[s, b, V/T]`` logits.

Megatron's ``loss_func`` applies its own loss mask, so this returns unreduced per-token values::

    ce, smmd = vocab_parallel_smmd_cross_entropy(output_tensor, labels.transpose(0, 1).contiguous(),
                                                 smmd_loss, tp_group=mpu.get_tensor_model_parallel_group())
    mask = loss_mask.transpose(0, 1).float()
    numeric = smmd_loss.numeric_mask(labels.transpose(0, 1)).float() * mask
    loss = (ce * mask).sum() / mask.sum() + weight * (smmd * mask).sum() / numeric.sum().clamp_min(1)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..loss import per_token_losses
from ..numeric_loss import NumericLoss


def vocab_parallel_smmd_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, smmd: NumericLoss,
                                      tp_group=None, vocab_start_index: Optional[int] = None) -> tuple:
    """CE and SMMD per token for this rank's vocabulary shard.

    vocab_parallel_logits: ``[s, b, V/T]`` (any leading shape), this rank's contiguous shard.
    target: ``[s, b]`` token ids, replicated in the tensor-parallel group.
    vocab_start_index: first vocabulary id of this shard; ``None`` means Megatron's equal shards
        (``tp_rank * V/T``, the vocabulary padded to a multiple of the TP size).

    Returns ``(ce [s, b], smmd [s, b])``, both with grad: CE is 0 where ``target`` is
    ``smmd.ignore_index``; SMMD is 0 where the target is not a numeric token. One packed
    all-reduce in the forward, none in the backward.
    """
    ce, smmd_values, _ = per_token_losses(vocab_parallel_logits, target, smmd, tp_group=tp_group,
                                          vocab_start_index=vocab_start_index)
    return ce.view(target.shape), smmd_values.view(target.shape)
