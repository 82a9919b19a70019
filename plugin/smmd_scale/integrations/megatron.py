"""Megatron-core / Megatron-DeepSpeed entry point: per-token losses on ``[s, b, V/T]`` logits.

Megatron's ``loss_func`` applies its own loss mask, so this returns unreduced per-token values::

    ce, numeric = vocab_parallel_numeric_cross_entropy(output_tensor, labels.transpose(0, 1).contiguous(),
                                                       numeric_loss, tp_group=mpu.get_tensor_model_parallel_group())

and :func:`loss_func_outputs` turns them into what Megatron-LM's ``loss_func`` returns under
``--calculate-per-token-loss``: ``(loss sum, token count, {"lm loss": [sum, count], "numeric loss":
[sum, count]})``. Megatron sums those over micro-batches, pipeline stages and the DP x CP ranks and
divides, so pipeline and context parallelism and its per-token normalization work unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..loss import per_token_losses
from ..numeric_loss import NumericLoss
from ..removed import module_attribute


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


def loss_func_outputs(ce: torch.Tensor, numeric: torch.Tensor, loss_mask: torch.Tensor, target: torch.Tensor,
                      numeric_loss: NumericLoss, weight: float = 1.0) -> tuple:
    """Megatron-LM's ``loss_func`` return under ``--calculate-per-token-loss`` for CE + weight x the
    numeric loss, from the per-token ``ce`` and ``numeric`` ``[s, b]`` (``target`` and ``loss_mask``
    in the same layout).

    Returns ``(loss_sum, num_tokens, report)``: ``loss_sum = sum(ce * mask) + weight * sum(numeric *
    mask)``, ``num_tokens = sum(mask)`` (int), and ``report`` with ``"lm loss"`` = ``[sum CE, tokens]``
    and ``"numeric loss"`` = ``[sum numeric, numeric-target positions]``, which Megatron reduces into the
    step's mean CE and mean numeric loss. Megatron divides the step's gradient by its token count,
    so the numeric term trains as ``weight * sum(numeric) / n_tokens(step)``, weighted per token: the
    same for any micro-batch, pipeline, DP or CP layout of the step. (Per numeric position instead, as
    smmd-scale's own trainer normalizes, is ``weight * n_tokens / n_numeric`` of it for the step.)
    """
    mask = loss_mask.to(ce.dtype)
    ce_sum, numeric_sum = (ce * mask).sum(), (numeric * mask).sum()
    tokens = mask.sum()
    numeric_positions = (numeric_loss.numeric_mask(target).to(ce.dtype) * mask).sum()
    report = {"lm loss": torch.stack([ce_sum.detach(), tokens]),
              "numeric loss": torch.stack([numeric_sum.detach(), numeric_positions])}
    return ce_sum + weight * numeric_sum, tokens.long(), report


def __getattr__(name: str):
    return module_attribute(__name__, name)  # vocab_parallel_smmd_cross_entropy: removed in 0.3.0
