"""DeepSpeed's ``vocab_parallel_linear_cross_entropy`` signature on ``linear_numeric_cross_entropy`` at
weight 0 (CE alone), so that DeepSpeed's own unit tests of its fused linear CE can run on this op
(tests/loss/test_deepspeed_suite.py)."""

import torch
import torch.distributed as dist

from smmd_scale import NumericVocab, SMMDLoss, linear_numeric_cross_entropy


def vocab_parallel_linear_cross_entropy(hidden, weight, target, bias=None, reduction="mean", chunk_size=None,
                                        tp_group=None, vocab_start_index=0, vocab_end_index=None, ignore_index=-100):
    """CE of ``hidden @ weight.T (+ bias)`` against ``target``; ``weight`` is this rank's rows
    ``[vocab_start_index, vocab_end_index)`` under ``tp_group``. ``chunk_size`` is passed on as ours
    (head rows per block, where DeepSpeed's counts token rows): the tests only vary it."""
    vocab_size = weight.shape[0] if weight.dim() == 2 else 1
    if tp_group is not None:  # the full vocabulary's size (the adapter's own collective, not the op's)
        width = torch.tensor([vocab_size])
        dist.all_reduce(width, group=tp_group)
        vocab_size = int(width)
    vocab = NumericVocab([0, 1], [0.0, 1.0], max(vocab_size, 2))
    out = linear_numeric_cross_entropy(hidden, weight, target, SMMDLoss(vocab, ignore_index=ignore_index), 0.0,
                                       bias=bias, tp_group=tp_group, vocab_start_index=vocab_start_index,
                                       chunk_size=chunk_size, reduction=reduction)
    return out.total
