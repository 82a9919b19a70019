"""train.py --dry_run in this process: the start of a job of hundreds of ranks checked on torch's fake process
groups with the model on the meta device, and what rank 0 will hold and send (``smmd_train.tools.dry_run``). No
step runs, so each takes seconds. Its numbers are checked against closed forms of the models' shapes here,
and against real 2-rank runs in tests/launch/test_dry_run_launch.py."""

import json
import math

import pytest
import torch
from helpers.corpora import write_corpus
from helpers.launching import REPO, train_flags

from smmd_train import compat
from smmd_train.config.arguments import parse_args
from smmd_train.config.run_config import RunConfig, RunRefused
from smmd_train.distributed.groups import shutdown_distributed
from smmd_train.model.presets import parameter_count, preset_config, rank_numel
from smmd_train.tools.dry_run import exchange_bytes, grown_capacity
from smmd_train.tools.memory import estimate, largest_micro_batch
from smmd_train.train import dry_run

ZERO3 = REPO / "ds_configs" / "zero3.json"
SEQ_LEN = 128
# Llama-3-8B's config.json (its shape: a dry run reads the config, not the weights)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Enough packed blocks of SEQ_LEN tokens for one step of 256 data-parallel ranks."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "train.jsonl", documents=3000)


def model_folder(root, **shape):
    """A local model folder holding only a config.json: Llama-3-8B's, with ``shape``'s changes."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**LLAMA3_8B, **shape}))
    return root


def checked(tmp_path, tokenizer_dir, corpus, **options) -> dict:
    """train.py's dry run of ``options`` in this process; its report (dry_run.json)."""
    values = dict(dry_run=True, deepspeed_config=ZERO3, tokenizer=tokenizer_dir, data=[corpus], seq_len=SEQ_LEN,
                  max_steps=10, output_dir=tmp_path / "run")
    values.update(options)
    try:
        dry_run(RunConfig.from_args(parse_args(train_flags(**values))))
    finally:
        shutdown_distributed()
    assert compat.process_groups() == []  # the fake world and DeepSpeed's groups on it are gone
    return json.loads((tmp_path / "run" / "dry_run.json").read_text())


def rank_zero_tensors(config, tp_size: int, world_size: int) -> list:
    """(elements on tensor-parallel rank 0, ranks ZeRO-3 splits them over) for each tensor of a Llama
    ``config``, in closed form: rank 0 takes the larger share of an uneven split; a projection AutoTP
    shards is split over world / TP ranks, a tensor it leaves whole (norms, an untied embedding) over
    the world."""
    dp, hidden = world_size // tp_size, config.hidden_size
    head, groups = hidden // config.num_attention_heads, config.num_attention_heads // config.num_key_value_heads
    kv = math.ceil(config.num_key_value_heads / tp_size) * head
    width, vocab = math.ceil(config.intermediate_size / tp_size), math.ceil(config.vocab_size / tp_size)
    sharded = dp if tp_size > 1 else world_size
    layer = [(groups * kv * hidden, sharded), (kv * hidden, sharded), (kv * hidden, sharded),
             (hidden * groups * kv, sharded), *[(width * hidden, sharded)] * 3, (hidden, world_size),
             (hidden, world_size)]
    tensors = layer * config.num_hidden_layers + [(hidden, world_size), (vocab * hidden, sharded)]
    if not config.tie_word_embeddings:
        tensors.append((config.vocab_size * hidden, world_size))
    return tensors


def zero_partition(tensors: list) -> int:
    return sum(-(-numel // ranks) for numel, ranks in tensors)


def all_gather_bytes(tensors: list, threshold: int, dtype_bytes: int, passes: int = 2) -> int:
    """What rank 0 receives to gather every tensor above the persistence threshold ``passes`` times."""
    return passes * dtype_bytes * sum(-(-numel // ranks) * (ranks - 1) for numel, ranks in tensors if numel > threshold)


def padded_vocab(tokenizer_dir) -> int:
    from transformers import AutoTokenizer

    return -(-len(AutoTokenizer.from_pretrained(tokenizer_dir)) // 64) * 64  # the presets' padding


def test_70b_on_512_ranks_with_tp_8(tmp_path, tokenizer_dir, corpus):
    record = checked(tmp_path, tokenizer_dir, corpus, model="70b", world_size=512, gpus_per_node=8, tp=8)
    assert (record["world_size"], record["tp_size"], record["dp_size"], record["sp_size"], record["nodes"]) == \
        (512, 8, 64, 1, 64)
    # DeepSpeed's own AutoTP groups (its device mesh), made on the fake world of 512 ranks
    assert record["groups"] == {"tensor_parallel": 8, "data_parallel": 64, "sequence_parallel": 1}
    config = preset_config("70b", vocab_size=padded_vocab(tokenizer_dir))
    tensors = rank_zero_tensors(config, 8, 512)
    assert record["parameters"] == {"model": parameter_count(config), "tensor_parallel": parameter_count(config, 8),
                                    "zero_partition": zero_partition(tensors)}
    assert record["checkpoint"]["rank_bytes"] == 12 * zero_partition(tensors)
    assert record["checkpoint"]["universal_bytes"] == 12 * parameter_count(config)
    # the planner's estimate for this layout and its verdict, and the largest micro-batches that fit
    setup = dict(nodes=64, gpus_per_node=8, tp_size=8, sp_size=1, seq_len=SEQ_LEN, offload=False, micro_batch=1,
                 gradient_checkpointing=False, flash_attention=True, gpu_memory_gib=80.0, fused_linear=False)
    assert record["memory"]["total_gpu_bytes"] == estimate(config, **setup)["total_gpu_bytes"]
    assert record["memory"]["verdict"] == "fits"
    assert record["memory"]["largest_micro_batch"] == {
        key: largest_micro_batch(config, **{**setup, "fused_linear": key == "fused_linear"})
        for key in ("materialized", "fused_linear")}
    # the loss's exchange per micro-batch: a header [8, 12] int64, log-sum-exp pairs of 8 ranks (fp32) and the
    # target logits (fp32: the CPU's plan) of its 128 positions, then the numeric rows [capacity, 1000]
    exchange, fixed = record["loss_exchange"], 8 * 12 * 8 + SEQ_LEN * 8 * 2 * 4 + SEQ_LEN * 4
    assert exchange["capacity"] > 0 and exchange["steps"] == 10
    assert all(sent > fixed and (sent - fixed) % (1000 * 4) == 0 for sent in exchange["bytes_per_step"])
    assert exchange["bytes_per_step"][-1] >= fixed + exchange["capacity"] * 1000 * 4  # the rows it grew to
    assert record["step_counts"] == {"calls_per_step": 1, "bytes_per_step": 16, "ranks": 64}
    # ZeRO-3: the projections are above the persistence threshold (10 x hidden), the norms not
    assert record["zero3"]["persistence_threshold"] == 10 * 8192
    assert record["zero3"]["all_gather_bytes"] == all_gather_bytes(tensors, 10 * 8192, dtype_bytes=4)
    assert record["zero3"]["reduce_scatter_bytes"] == all_gather_bytes(tensors, 0, dtype_bytes=4, passes=1)


def test_a_llama_3_8b_config_on_16_ranks_with_tp_2(tmp_path, tokenizer_dir, corpus):
    folder = model_folder(tmp_path / "llama-3-8b")
    record = checked(tmp_path, tokenizer_dir, corpus, model=folder, world_size=16, tp=2, fused_linear=True)
    assert (record["nodes"], record["gpus_per_node"], record["dp_size"]) == (2, 8, 8)
    assert record["groups"] == {"tensor_parallel": 2, "data_parallel": 8, "sequence_parallel": 1}
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA3_8B)
    assert record["parameters"] == {"model": 8_030_261_248, "tensor_parallel": parameter_count(config, 2),
                                    "zero_partition": zero_partition(rank_zero_tensors(config, 2, 16))}
    # the planner sees the model's own 128,256-row vocabulary, not the tokenizer's
    assert record["memory"]["logits_and_loss_bytes"] < 100 * 2**20 and record["memory"]["verdict"] == "fits"
    # with --fused_linear the head's backward all-reduces d hidden: [128 tokens, 4096] in fp32 per micro-batch
    assert record["loss_exchange"]["backward_bytes_per_step"] == [SEQ_LEN * 4096 * 4] * 10
    assert any("tokenizer only" in warning for warning in record["warnings"])  # the plan's own warning


def test_7b_on_1024_ranks_with_sequence_parallelism_4(tmp_path, tokenizer_dir, corpus):
    record = checked(tmp_path, tokenizer_dir, corpus, model="7b", world_size=1024, sp=4)
    assert (record["dp_size"], record["tp_size"], record["sp_size"], record["nodes"]) == (256, 1, 4, 128)
    # Ulysses' sequence-parallel groups, made by DeepSpeed on the fake world around the meta model's attention
    assert record["groups"] == {"tensor_parallel": 1, "data_parallel": 256, "sequence_parallel": 4}
    config = preset_config("7b", vocab_size=padded_vocab(tokenizer_dir))
    assert record["parameters"] == {"model": parameter_count(config), "tensor_parallel": parameter_count(config),
                                    "zero_partition": zero_partition(rank_zero_tensors(config, 1, 1024))}
    assert record["loss_exchange"]["bytes_per_step"] == [0] * 10  # whole logits on every rank: nothing to exchange
    assert record["step_counts"]["ranks"] == 1024  # the counts are summed over the DP x SP ranks
    assert record["memory"]["setup"]["sp_size"] == 4 and record["memory"]["verdict"] == "fits"


@pytest.mark.parametrize("shape, options, refusal", [
    ({}, dict(world_size=32, gpus_per_node=16, tp=16),
     "--tp 16 is more than the model's num_key_value_heads=8: AutoTP splits attention by whole key/value heads "
     "(each with its query heads), so rank 8 would hold none; use --tp 8 or less (it need not divide 8) and data "
     "parallelism for the other ranks"),
    (dict(num_attention_heads=24, num_key_value_heads=6, hidden_size=3072), dict(world_size=16, sp=4),
     "--sp 4 and the model's num_key_value_heads=6: one must divide the other (Ulysses splits the KV heads, or "
     "replicates them when there are fewer than sp)"),
], ids=["tp-above-kv-heads", "sp-and-kv-heads"])
def test_a_layout_the_heads_cannot_split_is_refused_as_a_real_start_refuses_it(tmp_path, tokenizer_dir, corpus,
                                                                                 shape, options, refusal):
    folder = model_folder(tmp_path / "model", **shape)
    with pytest.raises(RunRefused) as refused:
        checked(tmp_path, tokenizer_dir, corpus, model=folder, **options)
    assert str(refused.value).splitlines() == [refusal]
    assert not (tmp_path / "run" / "dry_run.json").exists()


def test_a_micro_batch_that_cannot_fit_is_refused_after_the_report(tmp_path, tokenizer_dir, corpus):
    folder = model_folder(tmp_path / "llama-3-8b")
    with pytest.raises(RunRefused) as refused:
        checked(tmp_path, tokenizer_dir, corpus, model=folder, world_size=16, tp=2, micro_batch_size=16,
                gpu_memory_gib=16)
    record = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    estimated, largest = record["memory"], record["memory"]["largest_micro_batch"]
    assert estimated["verdict"] == "does not fit" and 0 < largest["materialized"] < 16
    assert str(refused.value) == (
        f"--micro_batch_size 16 does not fit in 16 GiB GPUs (--gpu_memory_gib): an estimated "
        f"{estimated['total_gpu_bytes'] / 2**30:.1f} GiB per GPU (model states "
        f"{estimated['model_states_gpu_bytes'] / 2**30:.1f} GiB, activations "
        f"{estimated['activation_bytes'] / 2**30:.1f} GiB, logits and loss "
        f"{estimated['logits_and_loss_bytes'] / 2**30:.1f} GiB); the largest that fits is "
        f"{largest['materialized']} ({largest['fused_linear']} with --fused_linear)")


def test_the_dry_run_s_options_need_it_and_whole_nodes(tmp_path, tokenizer_dir, corpus, capsys):
    base = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir, data=[corpus], max_steps=1,
                output_dir=tmp_path)
    for options, message in ((dict(world_size=8), "--world_size is an option of --dry_run"),
                             (dict(dry_run=True, world_size=12), "--world_size 12 is not a whole number of nodes of "
                                                                 "--gpus_per_node 8"),
                             (dict(dry_run=True, gpu_memory_gib=0), "--gpu_memory_gib 0 must be a positive number")):
        with pytest.raises(SystemExit) as exited:
            parse_args(train_flags(**base, **options))
        assert exited.value.code == 2 and message in capsys.readouterr().err
    args = parse_args(train_flags(**base, dry_run=True, world_size=4))
    assert (args.world_size, args.gpus_per_node, args.gpu_memory_gib) == (4, 4, 80.0)


def test_rank_numel_splits_each_parameter_or_leaves_it_whole_on_every_rank():
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    configs = [preset_config("tiny", vocab_size=2048), LlamaConfig(**LLAMA3_8B),
               Qwen2Config(hidden_size=72, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                           intermediate_size=100, vocab_size=1001, tie_word_embeddings=True)]
    for config in configs:
        with torch.device("meta"):
            named = [(name, tuple(p.shape)) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()]
        for tp_size in (1, 2, 3):
            if tp_size > config.num_key_value_heads:
                continue
            for name, shape in named:
                held = [rank_numel(name, shape, config, tp_size, rank) for rank in range(tp_size)]
                assert held == [math.prod(shape)] * tp_size or sum(held) == math.prod(shape), (name, held)
            assert sum(rank_numel(name, shape, config, tp_size, 0) for name, shape in named) == \
                parameter_count(config, tp_size)


def test_the_exchange_s_bytes_are_its_packed_buffer_s():
    from smmd_scale.parallel import HEADER_FIELDS, _PackedBuffer

    for tokens, tp_size, numeric, capacity, dtype, slots in ((96, 2, 1000, 16, torch.float32, 2),
                                                            (4096, 8, 1000, 696, torch.bfloat16, 2),
                                                            (7, 3, 11, 0, torch.bfloat16, 3)):
        layout = _PackedBuffer()
        layout.reserve("header", (tp_size, HEADER_FIELDS), torch.int64)
        layout.reserve("lse", (tokens, tp_size, slots), torch.float32)
        layout.reserve("target", (tokens, ), dtype)
        layout.reserve("numeric", (capacity, numeric), dtype)
        assert exchange_bytes(tokens, tp_size, numeric, capacity, dtype, slots) == layout.words * 4
    # 1/8 headroom, rounded up to a multiple of 8 rows
    assert [grown_capacity(positions) for positions in (1, 8, 13, 64, 600)] == [8, 16, 16, 72, 680]
