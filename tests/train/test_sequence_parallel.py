"""Ulysses sequence parallelism (smmd_train.distributed.sequence_parallel): the shards and their labels against
the whole sequence and against DeepSpeed's own data-loader adapter, the refusals, and on 2 gloo
ranks a tiny Llama whose two shards' loss shares and gradients add up to the whole sequence's
(float64), with and without the fused linear head: with the numbers all in one shard, and with
DEL + number-level NTL on digit numbers that cross the shard boundary."""

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_ranks, values_or_raise
from helpers.models import saved_activation_bytes, tiny_llama

from smmd_scale import DigitEntropyLoss, NumberLevelNTLoss, NumericVocab, SMMDLoss
from smmd_train.distributed.sequence_parallel import IGNORE_INDEX, check_sequence_parallel, forward_inputs
from smmd_train.model.presets import preset_config

VOCAB_SIZE, NUMERIC_IDS = 64, list(range(40, 56))


def shifted_reference(input_ids: torch.Tensor) -> torch.Tensor:
    """The next token of each position, -100 after the last: HF's shift over the whole sequence."""
    return torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], IGNORE_INDEX)], dim=1)


def random_ids(seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """Ids without numbers in the first half of each sequence and with numbers in the second."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (batch, seq_len), generator=generator)
    numeric = torch.rand(batch, seq_len, generator=generator) < 0.4
    numeric[:, :seq_len // 2] = False
    return torch.where(numeric, torch.randint(40, 56, (batch, seq_len), generator=generator), ids)


@pytest.mark.parametrize("sp_size", [1, 2, 4])
def test_shards_hold_every_target_of_the_whole_sequence(sp_size):
    input_ids = random_ids(sp_size, batch=3, seq_len=16)
    shards = [forward_inputs(input_ids, rank, sp_size) for rank in range(sp_size)]
    if sp_size == 1:
        assert shards[0].keys() == {"input_ids", "labels"} and shards[0]["labels"] is input_ids
        return
    for name, whole in (("input_ids", input_ids), ("shift_labels", shifted_reference(input_ids)),
                        ("position_ids", torch.arange(16).expand(3, 16))):
        assert torch.equal(torch.cat([shard[name] for shard in shards], dim=1), whole), name
    for rank, shard in enumerate(shards[:-1]):  # a shard's last target is the next shard's first token
        assert torch.equal(shard["shift_labels"][:, -1], shards[rank + 1]["input_ids"][:, 0])
    assert all(shard["labels"] is shard["shift_labels"] for shard in shards)


def test_refusals_name_the_values():
    config = preset_config("tiny", vocab_size=256)  # 4 heads, 2 KV heads
    check_sequence_parallel(config, 2, seq_len=48, tp_size=1, world_size=4)
    check_sequence_parallel(config, 4, seq_len=48, tp_size=1, world_size=4)  # KV heads replicated
    for sp_size, seq_len, tp_size, world_size, message in (
            (2, 48, 2, 4, "cannot combine Ulysses sequence parallelism with AutoTP"),
            (2, 47, 1, 2, "--seq_len 47 must be a multiple of --sp 2"),
            (3, 48, 1, 3, "does not divide the model's num_attention_heads=4"),
            (2, 48, 1, 3, "--sp 2 must divide the world size 3"),
            (0, 48, 1, 2, "must be a positive int")):
        with pytest.raises(ValueError, match=message):
            check_sequence_parallel(config, sp_size, seq_len, tp_size, world_size)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text"])
def test_a_sliding_window_longer_than_the_sequence_is_refused_under_sp(family):
    """DeepSpeed's Ulysses attention drops the 4D mask (it masks by position ids, causally), so a
    sliding-window layer would attend over the whole sequence: refused when the window is shorter than
    the sequence, accepted when it covers it (the window then masks nothing)."""
    import transformers

    classes = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma3_text": "Gemma3TextConfig"}
    extra = {"qwen2": {"use_sliding_window": True, "max_window_layers": 1}}.get(family, {})
    config = getattr(transformers, classes[family])(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, **extra)
    with pytest.raises(ValueError, match=r"--sp 2 with a sliding-window model: 1 of its 2 layers|"
                                         r"--sp 2 with a sliding-window model: 2 of its 2 layers"):
        check_sequence_parallel(config, 2, seq_len=48, tp_size=1, world_size=2)
    check_sequence_parallel(config, 2, seq_len=16, tp_size=1, world_size=2)  # the window covers the sequence


def _deepspeed_comm():
    """deepspeed.comm over the process group the worker already has (as train.py starts it)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _against_deepspeed_adapter(rank, world_size, seed):
    """Our shard of a batch vs the shard UlyssesSPDataLoaderAdapter makes of the same batch (every
    rank loads the same sample, so the adapter's first micro-batch is it), and the counts."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    _deepspeed_comm()

    from smmd_train.distributed.sequence_parallel import target_counts

    input_ids = random_ids(seed, batch=2, seq_len=12)
    batch = {"input_ids": input_ids.clone(), "labels": input_ids.clone(),
             "position_ids": torch.arange(12).expand(2, 12).clone()}
    adapter = UlyssesSPDataLoaderAdapter([batch], sp_rank=rank, sp_group=None, sp_world_size=world_size,
                                         device="cpu")
    theirs, ours = next(adapter), forward_inputs(input_ids, rank, world_size)
    same = {name: torch.equal(theirs[name], ours[name]) for name in ("input_ids", "position_ids", "shift_labels")}
    counts = target_counts(ours["shift_labels"], torch.tensor(NUMERIC_IDS), group=None)
    whole = shifted_reference(input_ids)
    expected = [int((whole != IGNORE_INDEX).sum()), int(torch.isin(whole, torch.tensor(NUMERIC_IDS)).sum())]
    return same, [int(counts["num_items_in_batch"]), int(counts["num_numeric_in_batch"])], expected


@pytest.mark.gloo
def test_shards_equal_deepspeeds_adapter_and_counts_cover_the_group():
    for same, counts, expected in values_or_raise(run_ranks(_against_deepspeed_adapter, 2, 7, fresh=True)):
        assert all(same.values()), same
        assert counts == expected and expected[1] > 0


DIGIT_IDS, DOT_ID = list(range(40, 50)), 50


def crossing_digits(seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """Ids with digit numbers across the middle of each sequence (where 2 shards meet): an integer in
    the first row, a decimal whose dot is the first target of the second shard in the second."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (batch, seq_len), generator=generator)
    middle = seq_len // 2
    ids[:, middle - 2:middle + 3] = torch.randint(40, 50, (batch, 5), generator=generator)
    ids[1, middle + 1] = DOT_ID  # the target of position middle (the second shard's first) is the dot
    return ids


def _shares_add_up(rank, world_size, fused_linear, seed, digits=False):
    """Loss and gradients of the whole micro-batch on this process (reference), then the rank's shard
    through Ulysses with the micro-batch's counts: the shares, summed over the ranks, must match.
    ``digits``: DEL + number-level NTL on numbers that cross the shard boundary, else SMMD."""
    torch.set_default_dtype(torch.float64)
    import torch.distributed as dist

    import smmd_scale
    from smmd_train.distributed.sequence_parallel import UlyssesAttention, target_counts

    if digits:
        vocab = NumericVocab(DIGIT_IDS, list(range(10)), VOCAB_SIZE)
        numeric_loss = (DigitEntropyLoss(vocab, dot_token_ids=[DOT_ID])
                        + 0.5 * NumberLevelNTLoss(vocab, float_level=True, dot_token_ids=[DOT_ID]))
        input_ids = crossing_digits(seed, batch=2, seq_len=16)
    else:
        vocab = NumericVocab(NUMERIC_IDS, list(range(len(NUMERIC_IDS))), VOCAB_SIZE)
        numeric_loss, input_ids = SMMDLoss(vocab), random_ids(seed, batch=2, seq_len=16)

    def model_and_loss():
        model = tiny_llama(VOCAB_SIZE, hidden_size=32, heads=4, kv_heads=2, seed=seed, attn_implementation="sdpa")
        return model.train(), smmd_scale.install(model, numeric_loss, fused_linear=fused_linear)

    reference, _ = model_and_loss()
    whole = reference(input_ids=input_ids, labels=input_ids).loss
    whole.backward()
    model, installed = model_and_loss()
    ulysses = UlyssesAttention(model, world_size, micro_batch_size=2, seq_len=16)
    try:
        inputs = forward_inputs(input_ids, rank, world_size, group=ulysses.group)
        inputs.update(target_counts(inputs["shift_labels"], vocab.token_ids, ulysses.group))
        share = model(**inputs).loss
        share.backward()
        path, comm_calls = installed.last_path, installed.last_stats["comm_calls"]
    finally:
        ulysses.destroy()
    total = share.detach().clone()
    dist.all_reduce(total)
    errors = []
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        gradient = parameter.grad.clone()
        dist.all_reduce(gradient)
        errors.append(float((gradient - expected.grad).abs().max() / expected.grad.abs().max().clamp_min(1e-30)))
    return float(abs(total - whole) / whole), max(errors), path, comm_calls


def _shares_add_up_with_and_without_the_fused_head(rank, world_size, seed):
    _deepspeed_comm()
    return [_shares_add_up(rank, world_size, fused_linear, seed, digits)
            for digits in (False, True) for fused_linear in (False, True)]


@pytest.mark.gloo
def test_two_shards_add_up_to_the_whole_sequence():
    for outcomes in values_or_raise(run_ranks(_shares_add_up_with_and_without_the_fused_head, 2, 3, fresh=True)):
        cases = [(digits, fused_linear) for digits in (False, True) for fused_linear in (False, True)]
        for case, (loss_error, gradient_error, path, comm_calls) in zip(cases, outcomes):
            # float64 model and loss; the shares regroup the whole sequence's sums (rounding ~1e-15)
            assert loss_error < 1e-10 and gradient_error < 1e-10, (case, loss_error, gradient_error)
            assert (path == "fused_linear") == case[1]
            assert comm_calls == int(case[0])  # number-level NTL's sum of the crossing numbers


def test_shift_reference_is_hfs():
    input_ids = random_ids(0, batch=1, seq_len=8)
    logits = torch.randn(1, 8, VOCAB_SIZE, dtype=torch.float64)
    hf = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), input_ids[:, 1:].reshape(-1))
    ours = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), shifted_reference(input_ids).reshape(-1))
    # float64, the same 7 per-token CEs (the -100 position adds none), means of order 5 (measured equal).
    assert torch.allclose(hf, ours, rtol=0, atol=1e-12)


def _saved_activation_bytes_per_rank(rank, world_size, kv_heads, micro_batch, seq_len):
    """What autograd saves on this rank (distinct non-parameter storages) in a bf16 forward of a
    1-layer and a 2-layer Llama through Ulysses, and the planner's count for the same layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from smmd_train.distributed.sequence_parallel import UlyssesAttention
    from smmd_train.tools import memory

    configs = [LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                           intermediate_size=176, num_hidden_layers=layers, attn_implementation="sdpa")
               for layers in (1, 2)]
    models = [LlamaForCausalLM(config).to(torch.bfloat16) for config in configs]
    ulysses = UlyssesAttention(models[0], world_size, micro_batch, seq_len)
    input_ids = torch.randint(0, 128, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    inputs = forward_inputs(input_ids, rank, world_size)
    try:
        saved_bytes = [saved_activation_bytes(model, input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
                       for model in models]
    finally:
        ulysses.destroy()
    return (saved_bytes[1] - saved_bytes[0],
            memory.layer_activation_bytes(configs[0], seq_len, micro_batch, sp_size=world_size))


def _saved_activation_bytes_per_rank_for_kv_heads(rank, world_size, micro_batch, seq_len):
    """KV heads 4 and 2 split over the 2 ranks, 1 replicated (each registration undone before the next)."""
    _deepspeed_comm()
    return [_saved_activation_bytes_per_rank(rank, world_size, kv_heads, micro_batch, seq_len)
            for kv_heads in (4, 2, 1)]


@pytest.mark.slow  # starts processes: the fast loop keeps one test of this kind
@pytest.mark.gloo
def test_planner_counts_what_a_ulysses_layer_saves_per_rank():
    for outcomes in values_or_raise(run_ranks(_saved_activation_bytes_per_rank_for_kv_heads, 2, 2, 24, fresh=True)):
        for kv_heads, (saved, planned) in zip((4, 2, 1), outcomes):
            assert saved == planned, kv_heads
