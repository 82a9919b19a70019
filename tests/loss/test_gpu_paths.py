"""What a GPU run would execute, checked on CPU tensors: the softmax step as a CUDA tensor takes it,
and the losses under ``torch.autocast`` (bf16, as HF Trainer's ``bf16=True`` runs them), against
float64 references at the fp32 tolerances of the other accuracy tests."""

import pytest
import torch
from helpers.reference import FP32_CE_TOLERANCE, FP32_GRAD_TOLERANCE, FP32_OFFSETS
from test_fused_linear import problem
from torch.utils._python_dispatch import TorchDispatchMode

from smmd_scale import SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy
from smmd_scale.steps import local_softmax_and_logsumexp

from conftest import random_problem


class ClaimsCuda(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` like a GPU one: code that branches on the device takes its
    CUDA branch, computed on the CPU."""

    @property
    def is_cuda(self):
        return True


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


@pytest.mark.parametrize("offset", FP32_OFFSETS)
def test_the_softmax_step_a_cuda_tensor_takes_keeps_fp32_accuracy(generator, offset):
    """Softmax (the CE gradient's only inexact part) within the fp32 gradient tolerance and the
    log-sum-exp within the CE tolerance of float64, at logits N(0, 3) + offset, over several draws;
    and bit for bit what the CPU computes (one code path on every device)."""
    for _ in range(6):
        logits = (torch.randn(96, 3000, generator=generator, dtype=torch.float64) * 3 + offset).float()
        softmax, lse = local_softmax_and_logsumexp(logits.as_subclass(ClaimsCuda), torch.float32)
        reference = logits.double()
        assert plain(softmax).dtype == torch.float32
        assert (plain(softmax).double() - torch.softmax(reference, dim=-1)).abs().max() <= FP32_GRAD_TOLERANCE
        lse_error = (plain(lse.shift).double() + plain(lse.log_sum).double() - torch.logsumexp(reference, dim=-1))
        assert lse_error.abs().max() <= FP32_CE_TOLERANCE
        cpu_softmax, cpu_lse = local_softmax_and_logsumexp(logits, torch.float32)
        assert torch.equal(plain(softmax), cpu_softmax) and torch.equal(plain(lse.log_sum), cpu_lse.log_sum)


class LogitSizedAllocations(TorchDispatchMode):
    """The distinct storages of every ``[tokens, vocab]`` tensor that an operation returns."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.storages = shape, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result, ):
            if isinstance(value, torch.Tensor) and tuple(value.shape) == self.shape:
                self.storages[value.untyped_storage().data_ptr()] = value.dtype
        return result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_shard_gets_one_fp32_buffer_and_no_fp32_copy(generator, dtype):
    logits = (torch.randn(64, 500, generator=generator) * 3).to(dtype)
    with LogitSizedAllocations((64, 500)) as watch:
        softmax, _ = local_softmax_and_logsumexp(logits.as_subclass(ClaimsCuda), torch.float32)
    assert list(watch.storages.values()) == [torch.float32]  # the softmax buffer, written from the half values
    expected = torch.softmax(logits.double(), dim=-1)
    assert (plain(softmax).double() - expected).abs().max() <= FP32_GRAD_TOLERANCE


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_materialized_loss_under_autocast_is_the_loss_without_it(generator):
    """SMMD's [P, N] x [N, N] product stays in fp32 (autocast would run it in bf16: 0.3% off)."""
    vocab, logits, targets = random_problem(generator, vocab_size=300, shape=(3, 40), dtype=torch.float32)
    results = []
    for autocast in (False, True):
        leaf = logits.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = numeric_cross_entropy(leaf, targets, SMMDLoss(vocab), weight=0.5)
            out.total.backward()
        results.append((out.numeric.item(), out.total.item(), leaf.grad))
    (numeric, total, grad), (autocast_numeric, autocast_total, autocast_grad) = results
    assert (autocast_numeric, autocast_total) == (numeric, total) and torch.equal(autocast_grad, grad)


@pytest.mark.parametrize("backward_under_autocast", [True, False], ids=["backward-inside", "backward-outside"])
def test_the_fused_head_under_autocast_has_the_exact_gradient_of_its_forward(generator, backward_under_autocast):
    """fp32 inputs under bf16 autocast: the block GEMMs run in fp32 (the inputs' dtype) in the forward
    and in the backward's recomputation alike, so the loss and its gradient are the float64 op's to
    fp32 accuracy (autocast in the forward alone left the gradient 2.5% off its own forward)."""
    for trial in range(3):
        vocab, hidden, head, bias, targets = problem(generator, vocab_size=400, shape=(2, 24))
        smmd = SMMDLoss(vocab)
        exact = [tensor.clone().requires_grad_(True) for tensor in (hidden, head, bias)]
        reference = linear_numeric_cross_entropy(exact[0], exact[1], targets, smmd, 0.5, bias=exact[2], chunk_size=64)
        reference.total.backward()
        leaves = [tensor.float().requires_grad_(True) for tensor in (hidden, head, bias)]
        with bf16_autocast():
            out = linear_numeric_cross_entropy(leaves[0], leaves[1], targets, smmd, 0.5, bias=leaves[2],
                                               chunk_size=64)
            if backward_under_autocast:
                out.total.backward()
        if not backward_under_autocast:
            out.total.backward()
        assert out.total.dtype == torch.float32
        assert out.total.item() == pytest.approx(reference.total.item(), rel=1e-6)
        for leaf, exact_leaf in zip(leaves, exact):
            assert leaf.grad.dtype == torch.float32
            error = (leaf.grad.double() - exact_leaf.grad).abs().max() / exact_leaf.grad.abs().max()
            assert error <= 1e-5, (trial, error.item())


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make a CUDA device wait for the host to read a result: outputs whose shape
    depends on the data (nonzero, boolean-mask indexing, masked_select, unique) and reads of a value
    (item, tolist, bool), seen on CPU tensors as the ops a GPU run would dispatch."""

    SYNCING = ("aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique", "aten._local_scalar_dense")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        boolean_index = name == "aten.index" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] or []))
        self.count += name.startswith(self.SYNCING) or boolean_index
        return func(*args, **(kwargs or {}))


def test_the_fused_backward_syncs_with_the_host_a_fixed_number_of_times_not_per_block(generator):
    """The fused head's backward: the same number of host syncs for 1 block as for 64 (the block's
    target rows are found once, before the loop; a GPU would otherwise wait twice per block)."""
    vocab, hidden, head, bias, targets = problem(generator, vocab_size=512, shape=(4, 12))
    smmd = SMMDLoss(vocab)
    counts = {}
    for chunk_size in (512, 8):
        h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
        out = linear_numeric_cross_entropy(h, w, targets, smmd, bias=bias, chunk_size=chunk_size)
        with HostSyncs() as syncs:
            out.total.backward()
        counts[chunk_size] = syncs.count
    assert counts[8] == counts[512] <= 4, counts
