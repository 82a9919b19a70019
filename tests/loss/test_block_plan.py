"""The block plan is a pure function of shapes, dtypes, the device's properties and a budget: the
plan a GPU runs is checked here on the CPU, and an op planned for an accelerator computes what the
CPU's plan computes."""

import math

import pytest
import torch
from helpers.reference import reference_total

from smmd_scale import NumericVocab, SMMDLoss, linear_numeric_cross_entropy
from smmd_scale.block_plan import (
    MAX_DEFAULT_BUDGET,
    ROW_BLOCK_ELEMENTS,
    DeviceProperties,
    fused_head_plan,
    plan_as,
    row_blocks,
)
from smmd_scale.op_count import count_ops

H200 = DeviceProperties("cuda", free_bytes=139 << 30)
CPU = DeviceProperties("cpu")


def test_on_a_gpu_the_blocks_are_sized_by_memory_not_by_cache():
    # 4,096 tokens x H 1,024 x V 32,000, bf16 products into fp32 blocks: 6 bytes a logit, 786 MB: one block.
    small = fused_head_plan(4096, 1024, 32_000, torch.bfloat16, torch.float32, H200)
    assert (small.blocks, small.chunk_size, small.block_bytes) == (1, 32_000, 4096 * 32_000 * 6)
    assert small.budget_bytes == MAX_DEFAULT_BUDGET  # a quarter of 139 GiB, capped at 4 GiB
    # 16,384 x 4,096 x 128,256 bf16: 12.6 GB of logits, in equal blocks within the budget.
    large = fused_head_plan(16_384, 4096, 128_256, torch.bfloat16, torch.float32, H200)
    assert 2 <= large.blocks <= 8 and large.block_bytes <= MAX_DEFAULT_BUDGET
    assert large.blocks * large.chunk_size - 128_256 < large.blocks  # equal blocks: no small last one
    # The CPU keeps its cache-sized blocks: as many elements as hidden (32 blocks of 1,024 rows here).
    cpu = fused_head_plan(4096, 1024, 32_000, torch.bfloat16, torch.float32, CPU)
    assert (cpu.blocks, cpu.chunk_size, cpu.budget_bytes) == (32, 1024, None)


def test_a_budget_or_the_free_memory_bounds_the_block():
    for budget in (1 << 20, 100 << 20, 3 << 30):
        plan = fused_head_plan(8192, 4096, 128_256, torch.float32, torch.float32, H200, budget_bytes=budget)
        assert plan.block_bytes <= max(budget, 8192 * 4) and plan.budget_bytes == budget
        assert plan.blocks == math.ceil(128_256 / plan.chunk_size)
    nearly_full = fused_head_plan(8192, 4096, 128_256, torch.float32, torch.float32,
                                  DeviceProperties("cuda", free_bytes=1 << 30))
    assert nearly_full.budget_bytes == 1 << 28 and nearly_full.block_bytes <= 1 << 28
    # A chunk size given by the caller wins on any device.
    assert fused_head_plan(64, 8, 1000, torch.float32, torch.float32, H200, chunk_size=300).chunk_size == 300


def test_row_blocks_are_the_cpus_alone():
    assert row_blocks(4096, 32_000, H200) == [(0, 4096)]
    cpu = row_blocks(4096, 32_000, CPU)
    step = ROW_BLOCK_ELEMENTS // 32_000
    assert cpu[0] == (0, step) and cpu[-1][1] == 4096 and len(cpu) == math.ceil(4096 / step)
    assert row_blocks(0, 10, H200) == []


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_accelerator_plan_computes_what_the_cpu_plan_computes(generator, softcap):
    tokens, hidden_size, vocab_size = 40, 16, 3000  # the CPU plan: one block; a 1,000-row budget: three
    vocab = NumericVocab(list(range(10, 30)), [float(v) for v in range(20)], vocab_size)
    loss = SMMDLoss(vocab)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    head = torch.randn(vocab_size, hidden_size, generator=generator, dtype=torch.float64) * 0.5
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::3] = torch.randint(10, 30, (len(targets[::3]), ), generator=generator)
    results = {}
    for name, device, budget in (("cpu", CPU, None), ("accelerator", H200, tokens * 8 * 1000)):
        inputs = [tensor.clone().requires_grad_() for tensor in (hidden, head)]
        with plan_as(device), count_ops() as counted:
            output = linear_numeric_cross_entropy(*inputs, targets, loss, logit_softcap=softcap,
                                                  block_budget_bytes=budget)
        output.total.backward()
        results[name] = (output.total.detach(), *(tensor.grad for tensor in inputs), counted.gemms)
    assert results["accelerator"][3] == results["cpu"][3] + 2  # three block GEMMs in the forward, not one
    for got, expected in zip(results["accelerator"][:3], results["cpu"][:3]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # float64: only the grouping differs
    logits = hidden @ head.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = reference_total(logits, targets, list(range(10, 30)), [float(v) for v in range(20)])[0]
    torch.testing.assert_close(results["accelerator"][0], expected, rtol=1e-10, atol=1e-12)  # float64 rounding
