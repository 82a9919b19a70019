"""The accelerator's plan computes what the CPU's plan computes, for every registered loss, both ops,
with the call options and the reductions: the numeric positions at a fixed capacity (padded rows,
masked), the fused head's sweeps with the log-sum-exp folded into the recomputing GEMM, the
per-block merge done once. Run on the CPU under ``plan_as`` (the plan is a function of the device's
properties), in float64 so that only the grouping of sums differs."""

import pytest
import torch

from smmd_scale import NumericVocab, linear_numeric_cross_entropy, numeric_cross_entropy
from smmd_scale.block_plan import DeviceProperties, plan_as
from smmd_scale.digit_entropy import DigitEntropyLoss
from smmd_scale.dist2 import DIST2Loss
from smmd_scale.number_level import NumberLevelNTLoss
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss, options_from

H200 = DeviceProperties("cuda", free_bytes=139 << 30)
CPU = DeviceProperties("cpu")
TOKENS, HIDDEN, VOCAB = 48, 8, 300
DIGITS = list(range(10, 20))
OPTION_SETS = {
    "plain": {},
    "scale, z-loss, smoothing": dict(logit_scale=0.7, z_loss=1e-3, label_smoothing=0.1),
    "soft-cap": dict(logit_softcap=5.0),
}
# float64 on both plans: only the order of additions differs (row blocks, the blocks' merge, the
# folded log-sum-exp), each a few ulp of values of order 10 (the logits and CE here).
TOLERANCE = dict(rtol=1e-9, atol=1e-11)


def problem(generator):
    vocab = NumericVocab(DIGITS, [float(value) for value in range(10)], VOCAB)
    targets = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=generator)
    flat = targets.view(-1)
    flat[::2] = torch.randint(10, 20, (TOKENS // 2, ), generator=generator)
    flat[1::5] = torch.randint(10, 20, (len(flat[1::5]), ), generator=generator)
    flat[::9] = -100
    return vocab, targets


def run(plan, op: str, loss, inputs, targets, options: dict, reduction: str = "mean", tensor_count: bool = False,
        budget=None):
    inputs = [tensor.clone().requires_grad_() for tensor in inputs]
    count = torch.tensor(TOKENS - 3) if tensor_count else None
    with plan_as(plan):
        if op == "materialized":
            output = numeric_cross_entropy(*inputs, targets, loss, reduction=reduction, num_items_in_batch=count,
                                           **options)
        else:
            output = linear_numeric_cross_entropy(*inputs, targets, loss, reduction=reduction,
                                                  num_items_in_batch=count, block_budget_bytes=budget, **options)
        (output.total if reduction != "none" else output.total.sum()).backward()
        stats = dict(output.stats)
    return output, [tensor.grad for tensor in inputs], stats


def inputs_for(op: str, generator, bias: bool = False) -> list:
    if op == "materialized":
        return [torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64) * 3]
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=generator, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    return [hidden, head]


def check_same(accelerator, cpu) -> None:
    (out_a, grads_a, stats_a), (out_c, grads_c, stats_c) = accelerator, cpu
    for name in ("total", "ce", "numeric", "z"):
        torch.testing.assert_close(getattr(out_a, name), getattr(out_c, name), **TOLERANCE, msg=name)
    for got, expected in zip(grads_a, grads_c):
        torch.testing.assert_close(got, expected, **TOLERANCE)
    assert stats_a.keys() == stats_c.keys()
    for key, value in stats_c.items():
        assert stats_a[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("op", ["materialized", "fused"])
@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_every_loss_computes_the_same_on_both_plans(generator, op, option_set):
    vocab, targets = problem(generator)
    defaults = options_from(lambda option: option.default)
    inputs = inputs_for(op, generator)
    for name in NUMERIC_LOSSES:
        loss = build_numeric_loss(vocab, [(name, 1.0)], defaults, dot_token_ids=[5])
        options = OPTION_SETS[option_set]
        check_same(run(H200, op, loss, inputs, targets, options), run(CPU, op, loss, inputs, targets, options))


@pytest.mark.parametrize("op", ["materialized", "fused"])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_the_reductions_and_a_tensor_count_agree(generator, op, reduction):
    vocab, targets = problem(generator)
    inputs = inputs_for(op, generator)
    loss = build_numeric_loss(vocab, [("smmd", 1.0), ("ntl-was", 0.5)])
    check_same(run(H200, op, loss, inputs, targets, {}, reduction), run(CPU, op, loss, inputs, targets, {}, reduction))
    check_same(run(H200, op, loss, inputs, targets, {}, tensor_count=True),
               run(CPU, op, loss, inputs, targets, {}, tensor_count=True))


@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_the_fused_head_in_several_blocks_with_a_bias(generator, option_set):
    """Several blocks on the accelerator's plan (a budget of 70 head rows: 5 blocks) against the CPU's
    one block, with a bias: the blocks' merge, the target column's block and the numeric columns' block."""
    vocab, targets = problem(generator)
    hidden, head = inputs_for("fused", generator)
    bias = torch.randn(VOCAB, generator=generator, dtype=torch.float64)
    loss = build_numeric_loss(vocab, [("smmd", 1.0), ("ntl-was", 0.5)])
    options = dict(OPTION_SETS[option_set], bias=bias)
    budget = TOKENS * 8 * 70
    check_same(run(H200, "fused", loss, [hidden, head], targets, options, budget=budget),
               run(CPU, "fused", loss, [hidden, head], targets, options))


def test_a_call_without_numbers_and_one_with_only_numbers(generator):
    vocab, _ = problem(generator)
    loss = build_numeric_loss(vocab, [("smmd", 1.0)])
    logits = torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64)
    for targets in (torch.full((TOKENS, ), 50), torch.randint(10, 20, (TOKENS, ), generator=generator)):
        accelerator = run(H200, "materialized", loss, [logits], targets, {})
        check_same(accelerator, run(CPU, "materialized", loss, [logits], targets, {}))
        assert accelerator[2]["numeric_tokens"] == int(((targets >= 10) & (targets < 20)).sum())


def test_the_padded_rows_never_reach_position_zero(generator):
    """The spare rows of a fixed-capacity plan repeat position 0: its loss, gradient and statistics stay
    its own whether its target is numeric or not."""
    vocab, targets = problem(generator)
    loss = build_numeric_loss(vocab, [("ntl-was", 1.0)])
    logits = torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64)
    for first in (50, 13, -100):
        targets.view(-1)[0] = first
        accelerator = run(H200, "materialized", loss, [logits], targets, {}, reduction="none")
        check_same(accelerator, run(CPU, "materialized", loss, [logits], targets, {}, reduction="none"))


@pytest.mark.parametrize("name", ["dist2", "gauss-ls", "del", "smmd", "ntl-was"])
def test_spare_rows_on_a_masked_position_zero_stay_out_of_the_loss(generator, name):
    """A spare row scores position 0's numeric logits against a made-up target: with a -inf there (a
    masked token) its value is inf or NaN while position 0's own losses are finite (ignored, or a word).
    The loss, per-token values, statistics and gradients stay the CPU plan's, also compiled (the
    accelerator's plan inside ``torch.compile`` on the CPU). Until the spare rows were masked with
    ``where`` again, ``value * live`` turned these totals into NaN."""
    vocab, targets = problem(generator)
    loss = build_numeric_loss(vocab, [(name, 1.0)], options_from(lambda option: option.default))
    logits = torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64) * 3
    # one digit masked suffices for the losses that read log q; SMMD and NTL need all of them masked
    logits[0, 0, DIGITS[:3] if name in ("dist2", "gauss-ls", "del") else DIGITS] = float("-inf")
    for first in (50, -100):
        targets.view(-1)[0] = first
        for reduction in ("none", "mean"):
            accelerator = run(H200, "materialized", loss, [logits], targets, {}, reduction)
            assert torch.isfinite(accelerator[0].total).all(), (first, reduction)
            check_same(accelerator, run(CPU, "materialized", loss, [logits], targets, {}, reduction))
        compiled = torch.compile(lambda x, y: numeric_cross_entropy(x, y, loss).total, fullgraph=True,
                                 backend="eager")(logits, targets)
        # (within TOLERANCE, not equal: compiled, the numeric loss is summed over the fixed capacity's rows,
        # spare zeros included; the CPU's plan sums its exact positions: the same terms, another order)
        assert torch.isfinite(compiled)
        torch.testing.assert_close(compiled, numeric_cross_entropy(logits, targets, loss).total, **TOLERANCE)


def test_digit_runs_at_a_fixed_capacity(generator):
    """The losses that join digits into numbers find their runs at the fixed capacity (spare rows in a
    bin, numbers at P + 1 slots): the same numbers, values and gradients as from the exact positions,
    with dots inside and between runs, runs across the sequence dim of Megatron's ``[s, b]``, and position
    0 a digit, a plain token, an ignored one or a dot."""
    vocab, _ = problem(generator)
    dot = 5
    losses = [NumberLevelNTLoss(vocab, float_level=True, dot_token_ids=[dot]), NumberLevelNTLoss(vocab, reweigh=False),
              DigitEntropyLoss(vocab, dot_token_ids=[dot]), DIST2Loss(vocab, place_weighted=True),
              NumberLevelNTLoss(vocab, float_level=True, dot_token_ids=[dot], sequence_dim=0),
              DigitEntropyLoss(vocab, dot_token_ids=[dot], sequence_dim=0)]
    for first in (13, 50, -100, dot):
        _, targets = problem(generator)
        flat = targets.view(-1)
        flat[3::7] = dot  # dots between digits (some), after one, before one
        flat[0] = first
        logits = torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64) * 3
        for loss in losses:
            shaped = targets.T.contiguous() if loss.sequence_dim == 0 else targets
            inputs = [logits.transpose(0, 1).contiguous() if loss.sequence_dim == 0 else logits]
            for reduction in ("none", "mean"):
                check_same(run(H200, "materialized", loss, inputs, shaped, {}, reduction),
                           run(CPU, "materialized", loss, inputs, shaped, {}, reduction))


# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel on the accelerator's plan: real gloo groups
# ------------------------------------------------------------------------------------------------


def _vocab_parallel_on_the_accelerators_plan(rank, world_size, seed, numeric_capacity=None):
    """Each op, vocabulary-parallel on the accelerator's plan (the fused head in several blocks, some
    rows' targets on other shards), against the whole vocabulary on one device on the CPU's plan;
    returns the host-sync sites of each call."""
    import torch.distributed as dist

    from smmd_scale.op_count import count_ops

    generator = torch.Generator().manual_seed(seed)
    vocab, targets = problem(generator)
    per_position = build_numeric_loss(vocab, [("smmd", 1.0), ("ntl-was", 0.5)])
    # the digit-run losses too: their runs found at the capacity the exchange's rows come back in
    digit_runs = build_numeric_loss(vocab, [("ntl-number", 1.0), ("del", 0.5)], dot_token_ids=[5])
    cuts = sorted(torch.randperm(VOCAB - 1, generator=generator)[:world_size - 1].add(1).tolist())
    bounds = [0] + cuts + [VOCAB]
    start, end = bounds[rank], bounds[rank + 1]
    sites = {}
    for op, loss in (("materialized", per_position), ("fused", per_position), ("materialized", digit_runs),
                     ("fused", digit_runs)):
        inputs = inputs_for(op, generator)
        (whole, grads_whole, stats_whole) = run(CPU, op, loss, inputs, targets, {})
        shard = [tensor.clone().requires_grad_() for tensor in inputs]
        local = shard[0][..., start:end] if op == "materialized" else shard[1][start:end]
        with plan_as(H200):
            with count_ops() as forward:
                if op == "materialized":
                    output = numeric_cross_entropy(local, targets, loss, tp_group=dist.group.WORLD,
                                                   vocab_start_index=start, numeric_capacity=numeric_capacity)
                else:
                    output = linear_numeric_cross_entropy(shard[0], local, targets, loss, tp_group=dist.group.WORLD,
                                                          vocab_start_index=start, block_budget_bytes=TOKENS * 8 * 23,
                                                          numeric_capacity=numeric_capacity)
            with count_ops() as backward:
                output.total.backward()
            stats = dict(output.stats)
        for name in ("total", "ce", "numeric"):
            torch.testing.assert_close(getattr(output, name), getattr(whole, name), **TOLERANCE, msg=name)
        if op == "materialized":  # this shard's columns of the logits' gradient
            pairs = [(shard[0].grad[..., start:end], grads_whole[0][..., start:end])]
        else:  # the hidden states' whole gradient (reduced over the shards), this shard's head rows'
            pairs = [(shard[0].grad, grads_whole[0]), (shard[1].grad[start:end], grads_whole[1][start:end])]
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, **TOLERANCE)
        assert stats.keys() == stats_whole.keys()
        for key in [key for key in stats_whole if "comm" not in key]:  # (the exchange is the shards' alone)
            assert stats[key] == pytest.approx(stats_whole[key], rel=1e-9, abs=1e-12), key
        sites[f"{op}, {loss!r}"[:60]] = (forward.sync_sites, backward.sync_sites)
    return sites


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_on_the_accelerators_plan_equals_one_device(world_size):
    from helpers.distributed import run_ranks, values_or_raise

    reports = values_or_raise(run_ranks(_vocab_parallel_on_the_accelerators_plan, world_size,
                                        int(torch.randint(0, 2**31, (1, )))))
    # Host syncs: none in either backward. The forward reads one thing on the host under tensor
    # parallelism: the exchange's header (every rank's verdict and counts, so that a bad input on one rank
    # raises the same error on all, and the numeric rows' count, written there on the device: the numeric
    # positions are held at the fixed capacity; until 2026-11-29 their nonzero was a second read). A new
    # site anywhere fails here.
    known = ["parallel.py: Tensor.tolist"]
    for sites in reports:
        for op, (forward, backward) in sites.items():
            assert backward == [], (op, backward)
            assert [f"{site.split(':')[0]}: {site.split(': ')[-1]}" for site in forward] == known, (op, forward)


def numeric_count(targets) -> int:
    flat = targets.reshape(-1)
    return int(((flat >= DIGITS[0]) & (flat <= DIGITS[-1])).sum())


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_at_a_fixed_numeric_capacity_reads_nothing_back(world_size):
    """``numeric_capacity="tokens"`` or a bound the caller knows: the exchange carries that many numeric rows
    whatever the count, and its checks are device-side asserts, so the forward and backward of both ops
    read nothing back to the host; the values, gradients and statistics are one device's as before."""
    from helpers.distributed import run_ranks, values_or_raise

    seed = int(torch.randint(0, 2**31, (1, )))
    bound = numeric_count(problem(torch.Generator().manual_seed(seed))[1])  # the exact count: tight
    for capacity in ("tokens", bound):
        for sites in values_or_raise(run_ranks(_vocab_parallel_on_the_accelerators_plan, world_size, seed,
                                               capacity)):
            for op, (forward, backward) in sites.items():
                assert forward == [] and backward == [], (capacity, op, forward, backward)


def _too_small_or_failed(rank, world_size, seed, case):
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(seed)
    vocab, targets = problem(generator)
    loss = build_numeric_loss(vocab, [("smmd", 1.0)])
    logits = torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64)
    bounds = [VOCAB * part // world_size for part in range(world_size + 1)]
    local = logits[:, bounds[rank]:bounds[rank + 1]]
    flat = targets.reshape(-1)
    capacity = numeric_count(targets) - 1 if case == "too small" else "tokens"
    # a check on the host that fails on this rank alone (a bad count: the others do not see it)
    count = -1 if case == "one rank's input fails" and rank == world_size - 1 else None
    with plan_as(H200):
        try:
            numeric_cross_entropy(local, flat, loss, tp_group=dist.group.WORLD, vocab_start_index=bounds[rank],
                                  num_items_in_batch=count, numeric_capacity=capacity)
        except (RuntimeError, ValueError) as error:
            return str(error)
    return "no error"


@pytest.mark.gloo
@pytest.mark.parametrize("case", ["too small", "one rank's input fails"])
def test_a_fixed_numeric_capacity_fails_on_every_rank_when_it_cannot_hold(case):
    """A bound below the count, or one rank's bad input, fails on every rank (checked on the device: no
    rank waits in a collective that others left)."""
    from helpers.distributed import run_ranks, values_or_raise

    messages = values_or_raise(run_ranks(_too_small_or_failed, 2, int(torch.randint(0, 2**31, (1, ))), case))
    assert "no error" not in messages, messages
    if case == "too small":
        assert all("more numeric-target positions than its numeric_capacity" in message for message in messages)
    else:  # the failing rank names its input; the other says a rank of the group failed
        assert "tensor-parallel rank 1 of the group: num_items_in_batch=-1 must be >= 0" in messages[1], messages
        assert "a tensor-parallel rank of the group failed an input check" in messages[0], messages


def test_numeric_capacity_is_checked_before_any_collective():
    vocab, targets = problem(torch.Generator().manual_seed(0))
    loss = build_numeric_loss(vocab, [("smmd", 1.0)])
    from smmd_scale.call_plan import exchange_capacity

    assert exchange_capacity(None, 48) is None and exchange_capacity("tokens", 48) == 48
    assert exchange_capacity(10, 48) == 10 and exchange_capacity(100, 48) == 48  # at most the tokens
    for bad in (0, -3, 2.5, True, "all"):
        with pytest.raises(ValueError, match=r"numeric_capacity=.* must be None, 'tokens' or an int >= 1"):
            exchange_capacity(bad, 48)
    # one device: the option has nothing to carry and changes nothing, but a bad value is still named
    logits = torch.randn(TOKENS, VOCAB, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"numeric_capacity=0 must be None, 'tokens' or an int >= 1"):
        numeric_cross_entropy(logits, targets.reshape(-1), loss, numeric_capacity=0)
    with plan_as(H200):
        torch.testing.assert_close(numeric_cross_entropy(logits, targets.reshape(-1), loss, numeric_capacity=5).total,
                                   numeric_cross_entropy(logits, targets.reshape(-1), loss).total, rtol=0, atol=0)


@pytest.mark.parametrize("dtypes", ["bf16", "fp32", "fp32 head, bf16 autocast", "bf16 with a bias"])
def test_one_blocks_hidden_gradient_is_the_accumulated_one_bit_for_bit(generator, monkeypatch, dtypes):
    """One block on one device: d hidden is the block's product in hidden's dtype, not added into fp32
    zeros and converted back; both give the same bits (adding to 0 and widening are exact), in each
    dtype the head runs in."""
    vocab, targets = problem(generator)
    hidden, head = (tensor.float() for tensor in inputs_for("fused", generator))
    bias = torch.randn(VOCAB, generator=generator) if "bias" in dtypes else None
    if dtypes.startswith("bf16"):
        hidden, head = hidden.bfloat16(), head.bfloat16()
        bias = None if bias is None else bias.bfloat16()
    loss = build_numeric_loss(vocab, [("smmd", 1.0), ("ntl-was", 0.5)])
    from smmd_scale import fused_linear

    def gradients():
        inputs = [hidden.clone().requires_grad_(), head.clone().requires_grad_()]
        with plan_as(H200), torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in dtypes):
            output = linear_numeric_cross_entropy(*inputs, targets, loss, bias=bias)
        output.total.backward()
        return [tensor.grad for tensor in inputs]

    direct = gradients()
    monkeypatch.setattr(fused_linear, "one_block_on_one_device", lambda *args: False)
    accumulated = gradients()
    assert direct[0].dtype == hidden.dtype
    for got, expected in zip(direct, accumulated):
        assert torch.equal(got, expected)


def _hook_at_a_fixed_capacity(rank, world_size, seed, capacity="tokens"):
    """The installed loss's hook (what train.py's --tp_exchange_capacity tokens or counted reaches: its
    ce_options; counted, the bound the trainer counts for the micro-batch, ``LossReporter.exchange_bounds``)
    on this rank's vocabulary shard of a model's logits, under the accelerator's plan: its host syncs, and
    its loss against the whole vocabulary's on one device."""
    import torch.distributed as dist

    from smmd_scale.integrations import NumericCausalLMLoss
    from smmd_scale.op_count import count_ops
    from smmd_train.distributed.sequence_parallel import local_target_counts, step_targets

    generator = torch.Generator().manual_seed(seed)
    vocab, targets = problem(generator)
    loss = build_numeric_loss(vocab, [("smmd", 1.0), ("ntl-was", 0.5)])
    logits = torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64)
    labels = targets.clone()
    bounds = [VOCAB * part // world_size for part in range(world_size + 1)]
    shard = logits[..., bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    if capacity == "counted":
        capacity = int(local_target_counts(step_targets({"labels": labels}), vocab.token_ids)[1])
        assert 0 < capacity < TOKENS  # (a bound that is neither the tokens nor vacuous)
    hook = NumericCausalLMLoss(loss, 0.5, tp_group=dist.group.WORLD, vocab_start_index=bounds[rank],
                               ce_options={"numeric_capacity": capacity})
    whole = NumericCausalLMLoss(loss, 0.5)(logits, labels)
    with plan_as(H200):
        with count_ops() as forward:
            total = hook(shard, labels)
        with count_ops() as backward:
            total.backward()
    torch.testing.assert_close(total, whole, **TOLERANCE)
    return forward.sync_sites + backward.sync_sites


@pytest.mark.gloo
@pytest.mark.parametrize("capacity", ["tokens", "counted"])
def test_the_installed_hook_at_a_fixed_capacity_reads_nothing_back(capacity):
    from helpers.distributed import run_ranks, values_or_raise

    sites = values_or_raise(run_ranks(_hook_at_a_fixed_capacity, 2, int(torch.randint(0, 2**31, (1, ))), capacity))
    assert sites == [[], []], sites


def test_one_block_reads_the_numeric_logits_only_where_the_compute_dtype_holds_them(generator):
    """With one block the numeric logits come from the block, which is in the compute dtype: exact for
    a wider one (bf16 products in fp32), rounded for a narrower one (``accum_dtype=torch.bfloat16`` under
    fp32 logits), where they keep their own product. The statistics (float64 sums of the numeric logits'
    softmax) then do not depend on how many blocks the head is in (they differed at 1e-4 when the rounded
    block was read), and agree with the CPU's plan to bf16's rounding."""
    vocab, targets = problem(generator)
    loss = build_numeric_loss(vocab, [("smmd", 1.0)])
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator) * 3
    head = torch.randn(VOCAB, HIDDEN, generator=generator)

    def stats(plan, **options):
        with plan_as(plan):
            return dict(linear_numeric_cross_entropy(hidden, head, targets.view(-1), loss, accum_dtype=torch.bfloat16,
                                                     **options).stats)

    one, several, cpu = stats(H200), stats(H200, block_budget_bytes=TOKENS * 4 * 70), stats(CPU)
    for key in ("smmd", "mmd", "numeric_mae"):
        # (one and several blocks: the same numeric logits and the same fixed-capacity rows, so the same
        # bf16 products; the CPU's plan has its exact rows, and a bf16 product of another shape may round
        # differently: within a few of bf16's 2^-8 relative steps, summed over the positions)
        assert one[key] == pytest.approx(several[key], rel=1e-12), key
        assert one[key] == pytest.approx(cpu[key], rel=2e-2), key


def test_the_cached_zero_is_never_a_fake_tensor(generator):
    """``steps.zero`` caches one 0-dim zero per device and dtype; a trace under FakeTensorMode (what
    non-strict ``torch.export``, ``make_fx`` and memory estimators run) must not leave a fake one there
    for the real calls after it (one did, and every later call in the process returned fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from smmd_scale import steps

    vocab, targets = problem(generator)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    head = torch.randn(VOCAB, HIDDEN, generator=generator)
    traced = build_numeric_loss(vocab, [("smmd", 1.0)])
    with plan_as(H200):  # (a real call first fills the loss's own per-device caches with real tensors)
        linear_numeric_cross_entropy(hidden, head, targets.view(-1), traced)
    steps._ZEROS.clear()  # (the shared cache empty when the fake trace runs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, plan_as(H200):
        linear_numeric_cross_entropy(mode.from_tensor(hidden).requires_grad_(), mode.from_tensor(head),
                                     mode.from_tensor(targets.view(-1)), traced)
    assert all(type(zero) is torch.Tensor for zero in steps._ZEROS.values()), steps._ZEROS
    with plan_as(H200):
        output = linear_numeric_cross_entropy(hidden.clone().requires_grad_(), head, targets.view(-1),
                                              build_numeric_loss(vocab, [("smmd", 1.0)]))
        output.total.backward()
    assert type(output.total) is torch.Tensor and torch.isfinite(output.total) and output.stats["numeric_tokens"] > 0
