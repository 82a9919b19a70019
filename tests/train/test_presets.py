"""Model presets (exact parameter counts against real HF models) and the memory planner (activation
counts against the tensors autograd saves, model states against DeepSpeed's own estimator)."""

import json
import time
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
from helpers.host_probe import hang_guard
from helpers.models import saved_activation_bytes
from transformers import LlamaConfig, LlamaForCausalLM

from smmd_train.model.presets import (
    PRESETS,
    largest_layer_params,
    parameter_count,
    preset_config,
    zero_partition_params,
)
from smmd_train.tools import memory as estimate_cli

ROOT = Path(__file__).resolve().parents[2]

# The brief's real-world shapes: (hidden, layers, heads, kv heads, intermediate, tied).
REAL_WORLD = {"1b": (2048, 16, 32, 8, 8192, True), "3b": (3072, 28, 24, 8, 8192, True),
              "7b": (4096, 32, 32, 32, 11008, False), "13b": (5120, 40, 40, 40, 13824, False),
              "34b": (8192, 48, 64, 8, 22016, False), "70b": (8192, 80, 64, 8, 28672, False)}


def _meta_model(config):
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_equals_the_model(name):
    config = preset_config(name, vocab_size=128256 if name != "tiny" else 2048)
    model = _meta_model(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    assert largest_layer_params(config) == model_to_params(model)[1]


def test_parameter_count_random_configs(generator):
    def draw(low, high):
        return int(torch.randint(low, high, (1, ), generator=generator))

    for _ in range(4):
        kv_heads = draw(1, 4)
        heads = kv_heads * draw(1, 4)
        # head_dim need not be hidden / heads (as in Gemma-style configs), but heads must divide hidden.
        config = LlamaConfig(vocab_size=draw(50, 3000), hidden_size=heads * 4 * draw(1, 10),
                             num_hidden_layers=draw(1, 5), num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=4 * draw(1, 10), intermediate_size=draw(8, 500),
                             tie_word_embeddings=bool(draw(0, 2)), attention_bias=bool(draw(0, 2)),
                             mlp_bias=bool(draw(0, 2)))
        model = _meta_model(config)
        assert parameter_count(config) == sum(p.numel() for p in model.parameters()), config
        assert largest_layer_params(config) == model_to_params(model)[1], config


# The config class of each decoder family train.py trains (smmd_train.model.presets.DECODER_FAMILIES).
FAMILY_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                         "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
                         "gemma3_text": "Gemma3TextConfig"}


def _family_config(family, layers, tied=True, hidden_size=96, heads=6, kv_heads=2, head_dim=8, **fields):
    import transformers

    return getattr(transformers, FAMILY_CONFIG_CLASSES[family])(
        vocab_size=300, hidden_size=hidden_size, intermediate_size=176, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied,
        max_position_embeddings=64, **fields)


def test_every_family_s_parameter_count_equals_its_model(generator):
    from transformers import AutoModelForCausalLM

    from smmd_train.model.presets import DECODER_FAMILIES

    assert set(FAMILY_CONFIG_CLASSES) == set(DECODER_FAMILIES)
    for family in FAMILY_CONFIG_CLASSES:
        kv_heads = int(torch.randint(1, 4, (1, ), generator=generator))
        heads = kv_heads * int(torch.randint(1, 4, (1, ), generator=generator))
        for tied in (True, False):
            config = _family_config(family, int(torch.randint(1, 4, (1, ), generator=generator)), tied=tied,
                                    hidden_size=8 * heads, heads=heads, kv_heads=kv_heads,
                                    head_dim=4 * int(torch.randint(1, 6, (1, ), generator=generator)))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            assert parameter_count(config) == sum(p.numel() for p in model.parameters()), (family, config)
            assert largest_layer_params(config) == model_to_params(model)[1], (family, config)


ESTIMATED = ["mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"]


def _sliding_window_fields(family, seq_len, generator):
    """A family's sliding-window fields, drawn around ``seq_len`` (a window of seq_len or less masks;
    a longer one does not), and per layer whether it slides: Mistral slides every layer when it has
    a window; Gemma-2/3 and Qwen2/3 name each layer's kind (Qwen2/3 slide the layers from
    ``max_window_layers`` on); Gemma has none."""
    window = int(torch.randint(seq_len - 4, seq_len + 5, (1, ), generator=generator))
    kinds = [bool(torch.randint(0, 2, (1, ), generator=generator)) for _ in range(2)]
    if family == "mistral":
        return ({"sliding_window": window}, [True, True]) if kinds[0] else ({}, [False, False])
    if family in ("qwen2", "qwen3"):
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}, [False, True]
    if family == "gemma":
        return {}, [False, False]
    return ({"sliding_window": window, "layer_types": ["sliding_attention" if kind else "full_attention"
                                                       for kind in kinds]}, kinds)


PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("family", ESTIMATED)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_estimated_family_s_activation_bytes_equal_what_autograd_saves(family, attention, precision, generator):
    """Gemma-2 has no SDPA in transformers (its soft-capped scores): it is built and counted eager
    either way; Gemma-3 runs SDPA and ignores attn_logit_softcapping (set here: no change). In bf16 (a
    GPU run) and fp32 (a CPU run)."""
    from transformers import AutoModelForCausalLM

    micro_batch, seq_len = int(torch.randint(1, 4, (1, ), generator=generator)), 8 * int(
        torch.randint(2, 5, (1, ), generator=generator))
    fields, sliding = _sliding_window_fields(family, seq_len, generator)
    if family in ("gemma2", "gemma3_text"):
        fields.update(attn_logit_softcapping=float(torch.randint(5, 60, (1, ), generator=generator)),
                      final_logit_softcapping=float(torch.randint(5, 40, (1, ), generator=generator)))
    implementation = "eager" if family == "gemma2" else attention
    # transformers' SDPA expands GQA's k and v past a head_dim of 256
    fields["head_dim"] = 8 if torch.randint(0, 2, (1, ), generator=generator) else 264
    configs = [_family_config(family, layers, attn_implementation=implementation,
                              **{**fields, **({"layer_types": fields["layer_types"][:layers]}
                                              if "layer_types" in fields else {})})
               for layers in (1, 2)]
    dtype = PRECISIONS[precision]
    models = [AutoModelForCausalLM.from_config(config).to(dtype) for config in configs]
    assert [model.config._attn_implementation for model in models] == [implementation] * 2
    one, two = (saved_activation_bytes(model, input_ids=torch.randint(0, 300, (micro_batch, seq_len)))
                for model in models)
    flash = attention == "sdpa"
    # Besides the estimate, the model keeps the int64 input ids and RoPE's cos and sin in its dtype
    # (Gemma-3: a pair per kind of layer, local and global); Gemma, its embedding scale in its dtype;
    # the soft-capped logits' tanh output belongs to the loss's working set (logits_and_loss_bytes).
    ropes = [len(set(config.layer_types)) if family == "gemma3_text" else 1 for config in configs]
    rope = 2 * seq_len * configs[1].head_dim * dtype.itemsize
    assert two - one - (ropes[1] - ropes[0]) * rope == estimate_cli.layer_activation_bytes(
        configs[1], seq_len, micro_batch, flash_attention=flash, sliding_window=sliding[1], precision=precision)
    extra = micro_batch * seq_len * 8 + ropes[1] * rope
    if family.startswith("gemma"):
        extra += dtype.itemsize
    if getattr(configs[1], "final_logit_softcapping", None) is not None:
        softcapped, plain = (estimate_cli.logits_and_loss_bytes(300, seq_len, micro_batch, logit_softcap=cap,
                                                                precision=precision)
                             for cap in (True, False))
        extra += softcapped - plain
    assert two == estimate_cli.activation_bytes(configs[1], seq_len, micro_batch, flash_attention=flash,
                                                precision=precision) + extra


@pytest.mark.parametrize("family", ESTIMATED)
def test_a_hugging_face_config_of_each_estimated_family_is_planned(tmp_path, capsys, family):
    from transformers import AutoModelForCausalLM

    config = _family_config(family, 2, tied=False)
    config.save_pretrained(tmp_path / family)
    with torch.device("meta"):
        params = sum(parameter.numel() for parameter in AutoModelForCausalLM.from_config(config).parameters())
    estimate_cli.main(["--model", str(tmp_path / family), "--json", "--gpus_per_node", "2", "--seq_len", "64"])
    record = json.loads(capsys.readouterr().out)
    assert record["params"] == params and type(estimate_cli.model_config(str(tmp_path / family))) is type(config)
    assert record["attention"] == ("eager" if family == "gemma2" else "SDPA")
    logits = estimate_cli.logits_and_loss_bytes(300, 64, 1, logit_softcap=family in ("gemma2", "gemma3_text")
                                                and config.final_logit_softcapping is not None)
    assert record["logits_and_loss_bytes"] == logits


def test_gemma_2_s_eager_attention_is_what_the_planner_counts(tmp_path, capsys):
    """transformers runs Gemma-2 eager only: the planner counts eager whatever --flash_attention says,
    the report says so, and Ulysses (which needs SDPA) is refused as train.py refuses it."""
    config = _family_config("gemma2", 2)
    asked_sdpa, asked_eager = (estimate_cli.estimate(config, flash_attention=flash) for flash in (True, False))
    assert asked_sdpa["attention"] == "eager" and asked_sdpa["activation_bytes"] == asked_eager["activation_bytes"]
    config.save_pretrained(tmp_path / "gemma2")
    estimate_cli.main(["--model", str(tmp_path / "gemma2"), "--gpus_per_node", "2", "--seq_len", "64"])
    assert "eager attention" in capsys.readouterr().out
    with pytest.raises(ValueError, match="sp_size > 1 needs SDPA, but transformers runs model_type 'gemma2' with "
                                         "eager attention only"):
        estimate_cli.estimate(config, gpus_per_node=2, sp_size=2, seq_len=64)


def test_tp_rank_counts_match_deepspeed_autotp():
    # Recorded from deepspeed.initialize on 2 gloo ranks (ZeRO-3, autotp_size 2,
    # vocab_parallel_lm_head): per rank, the sum of ds_numel and the largest module's ds_numel.
    # Minutes on CPU, so it is not rerun here.
    untied = preset_config("tiny", vocab_size=2048, tie_word_embeddings=False)
    tied = preset_config("tiny", vocab_size=2048)
    assert (parameter_count(untied, 2), largest_layer_params(untied, 2)) == (763008, 262144)
    assert (parameter_count(tied, 2), largest_layer_params(tied, 2)) == (500864, 131072)
    with pytest.raises(ValueError, match=r"--tp 4 is more than the model's num_key_value_heads=2: .* rank 2 would "
                                         r"hold none; use --tp 2 or less"):
        parameter_count(tied, 4)


# (heads, KV heads, head_dim, MLP width, vocabulary, tied): SmolLM2-135M (9 heads over 3 KV heads, a
# 49,152 vocabulary), GPT-2's 50,257 vocabulary, a 32,002 one, 6 KV heads over 4 ranks.
UNEVEN = [(9, 3, 64, 1536, 49152, True), (12, 12, 64, 3072, 50257, False), (32, 8, 128, 11008, 32002, False),
          (6, 6, 16, 130, 50257, True)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, intermediate, vocab, tied", UNEVEN)
@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_uneven_splits_are_deepspeeds(heads, kv_heads, head_dim, intermediate, vocab, tied, tp_size):
    """The shares of smmd_train.model.autotp, and the per-rank counts built on them, against DeepSpeed's
    own get_shard_size_list for every projection and the vocabulary-parallel head."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    from smmd_train.model.autotp import kv_head_shares, near_even_shares

    config = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=tied)
    if tp_size > kv_heads:
        with pytest.raises(ValueError, match=f"num_key_value_heads={kv_heads}"):
            parameter_count(config, tp_size)
        return
    meta = AutoTPMeta.from_model_config(config)
    q_rows = get_shard_size_list(heads * head_dim, tp_size, meta, "model.layers.0.self_attn.q_proj")
    kv_rows = get_shard_size_list(kv_heads * head_dim, tp_size, meta, "model.layers.0.self_attn.k_proj")
    mlp_rows = get_shard_size_list(intermediate, tp_size, meta, "model.layers.0.mlp.gate_proj")
    vocab_rows = get_shard_size_list(vocab, tp_size, meta, "lm_head")
    assert kv_rows == [share * head_dim for share in kv_head_shares(kv_heads, tp_size)]
    assert q_rows == [share * heads // kv_heads * head_dim for share in kv_head_shares(kv_heads, tp_size)]
    assert mlp_rows == near_even_shares(intermediate, tp_size) and vocab_rows == near_even_shares(vocab, tp_size)
    assert max(vocab_rows) == vocab_rows[0] and max(q_rows) == q_rows[0] and max(mlp_rows) == mlp_rows[0]

    # Rank 0's parameters: its projections, both norms per layer, the final norm, the head shard
    # (and the whole untied embedding, or the tied embedding sharing the head's shard).
    hidden = config.hidden_size
    layer = hidden * (2 * q_rows[0] + 2 * kv_rows[0] + 3 * mlp_rows[0]) + 2 * hidden
    head = vocab_rows[0] * hidden
    assert parameter_count(config, tp_size) == 2 * layer + hidden + head + (0 if tied else vocab * hidden)
    assert largest_layer_params(config, tp_size) == max(head if tied else vocab * hidden, hidden * mlp_rows[0])
    assert estimate_cli.logits_and_loss_bytes(vocab, 8, 1, tp_size) == 8 * vocab_rows[0] * 8


def test_what_autotp_cannot_split_is_refused_with_what_to_do():
    from smmd_train.model.autotp import check_tensor_parallel_split

    config = LlamaConfig(vocab_size=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=8)
    check_tensor_parallel_split(config, 3)  # one vocabulary row per rank is enough
    with pytest.raises(ValueError, match=r"--tp 4 is more than the model's vocab_size=3: .* use a smaller --tp"):
        check_tensor_parallel_split(config, 4)
    with pytest.raises(ValueError, match=r"--tp 9 is more than the model's num_key_value_heads=8"):
        check_tensor_parallel_split(config, 9)
    with pytest.raises(ValueError, match=r"tp_size=0 must be a positive int"):
        check_tensor_parallel_split(config, 0)


@pytest.mark.parametrize("name", list(REAL_WORLD))
def test_real_world_shapes(name):
    hidden, layers, heads, kv_heads, intermediate, tied = REAL_WORLD[name]
    config = preset_config(name, vocab_size=32000)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.tie_word_embeddings) == REAL_WORLD[name]
    assert config.head_dim * heads == hidden


def test_tiny_is_small_and_trains_on_cpu():
    config = preset_config("tiny", vocab_size=2048, max_position_embeddings=256)
    assert 500_000 <= parameter_count(config) <= 5_000_000
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 2048, (4, 128))
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # A hang guard, not a speed target: tiny's step takes a fraction of a second on a CPU.
    assert time.perf_counter() - start < hang_guard(5.0)
    assert abs(loss.item() - torch.log(torch.tensor(2048.0)).item()) < 0.5  # near-uniform at init


def test_preset_config_contract():
    assert [name for name in PRESETS] == ["tiny", "10m", "125m", "350m", "1b", "3b", "7b", "13b", "34b", "70b"]
    for name in PRESETS:
        assert "vocab_size" not in PRESETS[name]
        assert preset_config(name, 1000).tie_word_embeddings == (name in ("tiny", "10m", "125m", "350m", "1b", "3b"))
    config = preset_config("7b", 5000, max_position_embeddings=1024, num_hidden_layers=2)
    assert (config.vocab_size, config.max_position_embeddings, config.num_hidden_layers) == (5000, 1024, 2)
    with pytest.raises(ValueError, match="unknown model preset '8b'; choose one of tiny, 10m, 125m, 350m, 1b"):
        preset_config("8b", 1000)
    with pytest.raises(ValueError, match="vocab_size=0 must be a positive int"):
        preset_config("tiny", 0)


def _saved_activation_bytes(config, micro_batch, seq_len, dtype):
    """Bytes of the distinct non-parameter storages autograd saves in a forward in ``dtype``."""
    return saved_activation_bytes(LlamaForCausalLM(config).to(dtype),
                                  input_ids=torch.randint(0, config.vocab_size, (micro_batch, seq_len)))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_activation_bytes_equal_what_autograd_saves(attention, kv_heads, precision, generator):
    micro_batch, seq_len = int(torch.randint(1, 4, (1, ), generator=generator)), 8 * int(
        torch.randint(2, 6, (1, ), generator=generator))
    configs = [LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                           intermediate_size=176, num_hidden_layers=layers, attn_implementation=attention)
               for layers in (1, 2)]
    dtype = PRECISIONS[precision]
    one, two = (_saved_activation_bytes(config, micro_batch, seq_len, dtype) for config in configs)
    flash = attention == "sdpa"
    assert two - one == estimate_cli.layer_activation_bytes(configs[0], seq_len, micro_batch, flash_attention=flash,
                                                            precision=precision)
    # Besides the estimate, the model keeps the int64 input ids and RoPE's cos and sin in its dtype.
    extra = micro_batch * seq_len * 8 + 2 * seq_len * configs[1].head_dim * dtype.itemsize
    assert two == estimate_cli.activation_bytes(configs[1], seq_len, micro_batch, flash_attention=flash,
                                                precision=precision) + extra


@pytest.mark.parametrize("name", ["1b", "7b", "70b"])
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_are_deepspeeds_estimate(name, tp_size, offload):
    """DeepSpeed's estimator for the model whose even split over the data-parallel ranks is the rank's ZeRO-3
    partition: without TP the model itself."""
    config = preset_config(name, vocab_size=128256)
    result = estimate_cli.estimate(config, nodes=2, gpus_per_node=8, tp_size=tp_size, offload=offload)
    partitioned = round(zero_partition_params(config, tp_size, 16) * (16 // tp_size))
    if tp_size == 1:
        assert partitioned == parameter_count(config)
    cpu_bytes, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
        partitioned, largest_layer_params(config, tp_size), num_gpus_per_node=8 // tp_size,
        num_nodes=2, cpu_offload=offload, cpu_offload_params=offload, zero_init=True, additional_buffer_factor=1.5)
    assert result["model_states_gpu_bytes"] == gpu_bytes
    assert result["model_states_cpu_per_node_bytes"] == tp_size * cpu_bytes
    assert result["dp_size"] == 16 // tp_size
    assert result["total_gpu_bytes"] == gpu_bytes + result["activation_bytes"] + result["logits_and_loss_bytes"]
    assert result["logits_and_loss_bytes"] == 4096 * 128256 // tp_size * 8


def test_the_zero_partition_is_what_a_rank_holds(generator):
    """zero_partition_params against the partition the dry run counts from a model's parameters (which
    tests/launch/test_dry_run_launch.py holds to a real engine's rank_parameters): what AutoTP splits over
    the data-parallel ranks, what it leaves whole over the world; apart from ZeRO-3's padding."""
    from transformers import AutoModelForCausalLM

    from smmd_train.config.deepspeed import Topology
    from smmd_train.tools.dry_run import parameters, partitioned_parameters

    for family in FAMILY_CONFIG_CLASSES:
        for tied in (True, False):
            tp_size = int(2 ** torch.randint(0, 3, (1, ), generator=generator))
            world_size = tp_size * int(torch.randint(1, 4, (1, ), generator=generator))
            # Llama's optional biases: o_proj's and down_proj's stay whole under AutoTP
            fields = {key: bool(torch.randint(0, 2, (1, ), generator=generator))
                      for key in ("attention_bias", "mlp_bias")} if family == "llama" else {}
            config = _family_config(family, int(torch.randint(1, 4, (1, ), generator=generator)), tied=tied,
                                    heads=8, kv_heads=4, **fields)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            layout = partitioned_parameters(model, config, Topology(world_size, tp_size, world_size // tp_size))
            counted = parameters(model, layout)
            assert counted["tensor_parallel"] == parameter_count(config, tp_size), (family, config)
            assert 0 <= counted["zero_partition"] - zero_partition_params(config, tp_size, world_size) < len(layout), (
                family, tied, tp_size, world_size)


def test_autotp_leaves_the_embedding_whole_but_zero_3_splits_it_over_the_world():
    """7b at TP 2 on 16 GPUs: the untied embedding (128,256 x 4,096) and the norms (2 per layer and the
    final one) are on every TP rank in 1/16 shares, the rest of a TP rank's share in 1/8 shares; bf16 keeps
    18 bytes per partitioned parameter, fp32 20; the gathered largest layer is the embedding."""
    config = preset_config("7b", vocab_size=128256)
    embedding, whole = 128256 * 4096, 128256 * 4096 + (32 * 2 + 1) * 4096
    states = estimate_cli.model_states_bytes(config, nodes=2, gpus_per_node=8, tp_size=2)
    assert states["zero_partition_params"] == round((parameter_count(config, 2) - whole) / 8 + whole / 16)
    # A fractional partition: DeepSpeed's estimator and the count round it apart, < 1 parameter's 18 bytes (here 0).
    assert states["partitioned_bytes"] == pytest.approx(18 * states["zero_partition_params"], abs=18)
    assert states["gathered_bytes"] == 4 * embedding
    fp32 = estimate_cli.model_states_bytes(config, nodes=2, gpus_per_node=8, tp_size=2, precision="fp32")
    # round(20 x partition) against 20 x round(partition): < 1 parameter's 20 bytes apart (here 0).
    assert fp32["partitioned_bytes"] == pytest.approx(20 * states["zero_partition_params"], abs=20)
    assert fp32["gathered_bytes"] == 8 * embedding


@pytest.mark.parametrize("name", ["1b", "13b", "70b"])
def test_estimate_moves_the_right_way(name):
    config = preset_config(name, vocab_size=128256)
    base = estimate_cli.estimate(config, nodes=1, gpus_per_node=8)

    def changed(**setup):
        return estimate_cli.estimate(config, **{**base["setup"], **setup})

    assert changed(nodes=4)["model_states_gpu_bytes"] < base["model_states_gpu_bytes"]
    assert changed(nodes=4)["model_states_cpu_per_node_bytes"] <= base["model_states_cpu_per_node_bytes"]
    assert changed(offload=True)["total_gpu_bytes"] < base["total_gpu_bytes"]
    assert changed(tp_size=2)["activation_bytes"] < base["activation_bytes"]
    assert changed(tp_size=2)["logits_and_loss_bytes"] == base["logits_and_loss_bytes"] // 2
    assert changed(gradient_checkpointing=True)["activation_bytes"] < base["activation_bytes"]
    assert changed(micro_batch=2)["activation_bytes"] > base["activation_bytes"]
    assert changed(flash_attention=False)["activation_bytes"] > base["activation_bytes"]


@pytest.mark.parametrize("name", ["1b", "7b", "13b", "34b", "70b"])
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_next_steps_fit_and_need_every_change(name, micro_batch):
    config = preset_config(name, vocab_size=128256)
    setup = dict(nodes=1, gpus_per_node=8, micro_batch=micro_batch, gpu_memory_gib=80.0)
    steps = estimate_cli.next_steps(config, **setup)
    if steps is None:
        assert estimate_cli.estimate(config, **setup)["verdict"] == "fits"
        return
    assert steps["fits"] and steps["estimate"]["verdict"] == "fits"
    chosen = steps["estimate"]["setup"]
    # Undoing any one change gives a cheaper setup, which must not fit, or it would have been chosen.
    undo = []
    if chosen["offload"]:
        undo.append({"offload": False})
    if chosen["tp_size"] > 1:
        undo.append({"tp_size": chosen["tp_size"] // 2})
    if chosen["gradient_checkpointing"]:
        undo.append({"gradient_checkpointing": False})
    if chosen["micro_batch"] < micro_batch:
        undo.append({"micro_batch": chosen["micro_batch"] + 1})
    if chosen["fused_linear"]:
        undo.append({"fused_linear": False})
    assert len(undo) == len(steps["flags"]) >= 1
    for change in undo:
        assert estimate_cli.estimate(config, **{**chosen, **change})["verdict"] != "fits", change


def test_fused_linear_loss_memory_and_the_micro_batch_it_buys():
    config = preset_config("1b", vocab_size=128256)
    tokens, hidden = 4096, config.hidden_size
    materialized = estimate_cli.logits_and_loss_bytes(128256, 4096, 1)
    fused = estimate_cli.logits_and_loss_bytes(128256, 4096, 1, fused_linear=True, hidden_size=hidden)
    assert materialized == tokens * 128256 * 8
    assert fused == tokens * hidden * 6 + tokens * hidden * 4  # one [tokens, H]-sized block, d hidden
    assert fused < 0.05 * materialized
    setup = dict(nodes=1, gpus_per_node=8, gpu_memory_gib=80.0)
    largest = estimate_cli.largest_micro_batch(config, **setup)
    largest_fused = estimate_cli.largest_micro_batch(config, fused_linear=True, **setup)
    assert largest_fused > largest >= 1
    for micro_batch, fused_linear in ((largest, False), (largest_fused, True)):
        assert estimate_cli.estimate(config, micro_batch=micro_batch, fused_linear=fused_linear, **setup)["verdict"] \
            == "fits"
        assert estimate_cli.estimate(config, micro_batch=micro_batch + 1, fused_linear=fused_linear,
                                     **setup)["verdict"] != "fits"
    assert estimate_cli.largest_micro_batch(preset_config("70b", vocab_size=128256), **setup) == 0


def test_report_names_the_largest_micro_batch_with_and_without_fused_linear(capsys):
    estimate_cli.main(["--model", "1b", "--nodes", "1", "--gpus_per_node", "8"])
    out = capsys.readouterr().out
    # (the fused head on a GPU plans blocks of up to min(4 GiB, a quarter of the free memory): 9, not
    # the 10 a [tokens, H] block gave before the planner followed the op's GPU plan)
    assert "largest micro batch that fits: 6 sequences (24,576 tokens) with materialized logits, 9 sequences " \
           "(36,864 tokens) with --fused_linear" in out


@pytest.mark.parametrize("name", ["1b", "7b", "13b"])
@pytest.mark.parametrize("micro_batch", [3, 5, 6, 12])
def test_advice_to_lower_the_micro_batch_names_the_largest_that_fits(name, micro_batch):
    """The advised micro batch is the largest that fits with the advised flags (not a power of two
    below the requested one); advised alone, it is the report's "largest micro batch that fits"."""
    config = preset_config(name, vocab_size=128256)
    setup = dict(nodes=1, gpus_per_node=8, micro_batch=micro_batch)
    steps = estimate_cli.next_steps(config, **setup)
    largest = estimate_cli.largest_micro_batch(config, **setup)
    if steps is None:
        assert largest >= micro_batch
        return
    chosen = steps["estimate"]["setup"]
    assert chosen["micro_batch"] == estimate_cli.largest_micro_batch(config, limit=micro_batch, **chosen)
    if steps["flags"] == [f"--micro_batch {chosen['micro_batch']}"]:
        assert chosen["micro_batch"] == largest


def test_the_report_agrees_with_its_advice(capsys):
    estimate_cli.main(["--model", "7b", "--micro_batch", "3"])
    out = capsys.readouterr().out
    assert "try --micro_batch 2 (" in out and "largest micro batch that fits: 2 sequences (8,192 tokens)" in out
    estimate_cli.main(["--model", "70b"])  # nothing fits on one node without changes
    out = capsys.readouterr().out
    assert "0 sequences" not in out and "(0 tokens)" not in out
    assert "no micro batch fits as set up" in out and "try --gradient_checkpointing --offload" in out
    estimate_cli.main(["--model", "1b", "--micro_batch", "1", "--seq_len", "32768"])
    out = capsys.readouterr().out
    assert "largest micro batch that fits: none with materialized logits, 1 sequence (32,768 tokens) with " \
        "--fused_linear" in out


def _llama3_8b_config(vocab_size=128256):
    """Llama-3-8B's shapes (its config.json, as transformers' Llama pages document it)."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False)


def test_a_hugging_face_config_is_planned_as_the_model_it_describes(tmp_path, capsys):
    _llama3_8b_config().save_pretrained(tmp_path / "llama-3-8b")
    params = sum(parameter.numel() for parameter in _meta_model(_llama3_8b_config()).parameters())
    for model in (tmp_path / "llama-3-8b", tmp_path / "llama-3-8b" / "config.json"):
        estimate_cli.main(["--model", str(model), "--json"])
        record = json.loads(capsys.readouterr().out)
        assert record["model"] == str(model) and record["params"] == params
        assert record["total_gpu_bytes"] == estimate_cli.estimate(_llama3_8b_config())["total_gpu_bytes"]
    estimate_cli.main(["--model", str(tmp_path / "llama-3-8b")])
    assert "8.03 B params" in capsys.readouterr().out
    # --vocab_size overrides the config's (a padded tokenizer); a preset's default stays Llama-3's.
    padded = estimate_cli.model_config(str(tmp_path / "llama-3-8b"), vocab_size=128512)
    assert parameter_count(padded) == params + 2 * 256 * 4096
    assert estimate_cli.model_config("7b").vocab_size == 128256


def test_a_model_the_planner_cannot_read_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text("{not json")
    refusals = {"8b": "8b: not a preset \\(tiny, .*\\), and no such file or folder",
                str(tmp_path / "empty"): "the folder has no config.json",
                str(tmp_path / "broken.json"): "broken.json is not JSON",
                str(tmp_path / "gpt2"): "model_type 'gpt2': not a decoder family this planner knows; the planner "
                                        "estimates llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text"}
    for model, message in refusals.items():
        with pytest.raises(SystemExit, match=message):
            estimate_cli.main(["--model", model])


def test_layout_errors():
    config = preset_config("7b", vocab_size=128256)
    with pytest.raises(ValueError, match="tp_size=3 must divide gpus_per_node=8"):
        estimate_cli.estimate(config, gpus_per_node=8, tp_size=3)
    with pytest.raises(ValueError, match="nodes=0 must be a positive int"):
        estimate_cli.estimate(config, nodes=0)


def test_all_prints_a_markdown_row_per_preset(capsys):
    estimate_cli.main(["--all", "--nodes", "1", "--gpus_per_node", "8", "--tp", "2", "--gradient_checkpointing"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(estimate_cli.TABLE_PRESETS)
    assert "TP 2 x DP 4" in lines[0]


def test_cli_json(capsys):
    estimate_cli.main(["--model", "1b", "--nodes", "1", "--gpus_per_node", "8", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["model"] == "1b" and record["params"] == parameter_count(preset_config("1b", 128256))
    # The JSON's *_gib values are rounded to 3 places (memory.with_gib): within 5e-4.
    assert record["total_gpu_gib"] == pytest.approx(record["total_gpu_bytes"] / 2**30, abs=1e-3)


def test_sequence_parallel_divides_what_a_gpu_holds_per_token():
    config = preset_config("7b", vocab_size=128256)
    base = estimate_cli.estimate(config, seq_len=32768, gradient_checkpointing=True)
    split = estimate_cli.estimate(config, seq_len=32768, gradient_checkpointing=True, sp_size=8)
    assert split["model_states_gpu_bytes"] == base["model_states_gpu_bytes"]  # ZeRO-3 over every GPU either way
    assert split["logits_and_loss_bytes"] == base["logits_and_loss_bytes"] // 8
    assert base["activation_bytes"] // 8 < split["activation_bytes"] < base["activation_bytes"] // 6
    assert (split["dp_size"], base["dp_size"]) == (1, 8)
    with pytest.raises(ValueError, match="cannot combine Ulysses sequence parallelism with AutoTP"):
        estimate_cli.estimate(config, tp_size=2, sp_size=2)
    with pytest.raises(ValueError, match="needs SDPA"):
        estimate_cli.estimate(config, sp_size=2, flash_attention=False)


@pytest.mark.parametrize("tokens, vocab_size, free_gib", [(4096, 32_000, 60.0), (32_768, 128_256, 60.0),
                                                          (32_768, 128_256, 6.0)])
def test_the_planner_counts_the_fused_heads_blocks_as_the_op_plans_them_on_a_gpu(tokens, vocab_size, free_gib):
    """On a GPU the fused head's block is min(4 GiB, a quarter of the free memory) (block_plan), one block
    where the whole head fits: the planner counts that block, not the CPU's [tokens, H] one."""
    from smmd_scale.block_plan import DeviceProperties, fused_head_plan

    hidden = 2048
    free = int(free_gib * 2**30)
    counted = estimate_cli.logits_and_loss_bytes(vocab_size, tokens, 1, fused_linear=True, hidden_size=hidden,
                                                 gpu_free_bytes=free)
    plan = fused_head_plan(tokens, hidden, vocab_size, torch.bfloat16, torch.float32, DeviceProperties("cuda", free))
    assert counted == tokens * plan.chunk_size * 6 + tokens * hidden * 4  # fp32 block and its bf16 product
    assert tokens * plan.chunk_size * 6 <= min(4 * 2**30, free / 4)
    if tokens * vocab_size * 6 <= min(4 * 2**30, free / 4):
        assert plan.blocks == 1
    cpu = estimate_cli.logits_and_loss_bytes(vocab_size, tokens, 1, fused_linear=True, hidden_size=hidden)
    assert cpu == tokens * hidden * 6 + tokens * hidden * 4  # the CPU's plan: a [tokens, H]-sized block
