"""smmd_scale.install on DeepSpeed engines, launched with the real deepspeed launcher on 2 CPU
processes (4 for TP=4): ZeRO-3 with AutoTP TP=2 and 4 and a vocabulary-parallel LM head against TP=1
(heads and vocabularies that split evenly and ones that do not), and the fused
linear head (install(..., fused_linear=True)) against the materialized loss under ZeRO-3 (with and
without CPU offload) and ZeRO-3 + AutoTP, tied and untied embeddings, for Llama and for every other
family the fused head supports (Mistral, Qwen2, Qwen3, Gemma-2/3 with soft-capping, Cohere with its
logit scale, Mixtral and Qwen2/Qwen3-MoE with their router loss). One launch per process count and TP
degree trains every variant of each of its layouts' model shapes (tests/scripts/deepspeed_training.py)."""

import json
import os
import sys

import pytest
from helpers.launching import REPO, environment, launch_command, run_many
from helpers.models import FAMILY_CONFIGS

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "deepspeed_training.py"


# A model shape: query heads, KV heads, vocabulary, embeddings (tests/scripts/deepspeed_training.py --shape).
SHAPES = {"even": (4, 2, 2048, "untied,tied"), "even-untied": (4, 2, 2048, "untied"), "kv4": (4, 4, 2048, "untied"),
          "uneven2": (9, 3, 50257, "untied,tied"),  # SmolLM2-135M's heads, GPT-2's vocabulary
          "uneven4": (6, 6, 32002, "untied")}
# Each launch: (processes, the script's options, {layout: shape}); the shapes of a launch train one after the
# other in the same processes (a process start costs seconds of imports). An AutoTP layout's TP=1 twin is
# "tp1" + its shape.
LAUNCHES = {"tp1": (1, (), {"tp1": "even", "tp1kv4": "kv4", "tp1-uneven2": "uneven2", "tp1-uneven4": "uneven4"}),
            "tp2": (2, ("--tp", 2), {"tp2": "even", "tp2-uneven2": "uneven2"}),
            "tp4": (4, ("--tp", 4), {"tp4": "kv4", "tp4-uneven4": "uneven4"}),
            "dp2": (2, ("--offload", ), {"dp2": "even-untied"})}
TWINS = {"tp2": "tp1", "tp4": "tp1kv4", "tp2-uneven2": "tp1-uneven2", "tp4-uneven4": "tp1-uneven4"}
FAMILIES = sorted(set(FAMILY_CONFIGS) - {"llama"})
# DeepSpeed 0.19.8's vocabulary-parallel head refuses to shard an embedding tied to it whose forward is
# its own, which Gemma-2's scaled embedding is (it allows Gemma-3's): tied Gemma-2 is trained at TP=1 only.
FAMILY_LAUNCHES = {"families-tp1": (1, ("--families", *FAMILIES), {"families-tp1": "even"}),
                   "families-tp2": (2, ("--tp", 2, "--families", *FAMILIES, "--untied_only", "gemma2"),
                                    {"families-tp2": "even"})}
FAMILY_VARIANTS = [(family, embeddings, layout) for family in FAMILIES for embeddings in ("untied", "tied")
                   for layout in sorted(FAMILY_LAUNCHES)
                   if (family, embeddings, layout) != ("gemma2", "tied", "families-tp2")]


def train(directory, launches: dict) -> dict:
    """Each layout's result; the script imports the tiny models of tests/helpers."""
    env = environment(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
    commands = {}
    for launch, (processes, options, layouts) in launches.items():
        shapes = [part for layout, shape in layouts.items() for part in ("--shape", layout, *SHAPES[shape])]
        out = ("--out", directory)
        commands[launch] = ([sys.executable, SCRIPT, *options, *shapes, *out] if processes == 1 else
                            launch_command(SCRIPT, *options, *shapes, *out, processes=processes))
    run_many(commands, timeout=1200, env=env)
    return {layout: json.loads((directory / f"{layout}.json").read_text())
            for _, _, layouts in launches.values() for layout in layouts}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The variants of every launch, 5 optimizer steps each: TP=1 (one plain process), AutoTP TP=2 and
    TP=4 (4 KV heads so that they split evenly, with its own TP=1 twin), uneven AutoTP TP=2 (9 heads over
    3 KV heads split 6+3 / 2+1, a 50,257 vocabulary 25,129 + 25,128) and TP=4 (6 KV heads split 2+2+1+1, a
    32,002 vocabulary), each with its TP=1 twin, and ZeRO-3 over 2 data-parallel ranks with and without
    offload."""
    return train(tmp_path_factory.mktemp("deepspeed"), LAUNCHES)


@pytest.fixture(scope="module")
def families_trained(tmp_path_factory):
    """Every family but Llama, tied and untied, materialized and fused, 5 optimizer steps each: ZeRO-3 in
    one process, and ZeRO-3 + AutoTP TP=2 with a vocabulary-parallel head (the MoE families' attention
    sharded, their router and experts whole on each rank)."""
    return train(tmp_path_factory.mktemp("families"), FAMILY_LAUNCHES)


@pytest.mark.parametrize("layout, name, vocab_shards, q_proj_rows", [
    ("tp2", "untied", [1024, 1024], [32, 32]), ("tp2", "tied", [1024, 1024], [32, 32]),
    ("tp4", "untied", [512] * 4, [16] * 4),
    ("tp2-uneven2", "untied", [25129, 25128], [96, 48]), ("tp2-uneven2", "tied", [25129, 25128], [96, 48]),
    ("tp4-uneven4", "untied", [8001, 8001, 8000, 8000], [32, 32, 16, 16])])
def test_autotp_vocab_parallel_training_equals_tp1(trained, layout, name, vocab_shards, q_proj_rows):
    """Even and uneven splits of the heads and the vocabulary train as one process without TP."""
    single, parallel = trained[TWINS[layout]]["variants"][name], trained[layout]["variants"][name]
    vocab_size = trained[layout]["vocab_size"]

    # DeepSpeed made the head vocabulary-parallel and installed its CE-only loss; install replaced it.
    assert parallel["deepspeed_loss_function"] == "VocabParallelCausalLMLoss"
    assert parallel["vocab_parallel"] and not single["vocab_parallel"]
    starts = [sum(vocab_shards[:rank]) for rank in range(len(vocab_shards) + 1)]
    assert parallel["heads"] == [[start, end] for start, end in zip(starts, starts[1:])] and starts[-1] == vocab_size
    assert parallel["q_proj_rows"] == q_proj_rows  # whole heads of 16, the first ranks one KV group more
    ours, deepspeeds = parallel["ce_ours_vs_deepspeed"]
    # fp32 CE of order 8-11 computed another way than DeepSpeed's vocab-parallel loss: rounding (measured 2.7e-7).
    assert ours == pytest.approx(deepspeeds, rel=1e-5)  # weight 0: the same CE as DeepSpeed's loss

    # Five optimizer steps of CE + SMMD: the same losses as one process without tensor parallelism.
    # fp32: the vocab shards and AutoTP's split matmuls regroup sums, Adam carries it on (measured 1.7e-7).
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-5)
    for tp1_stats, tp2_stats in zip(single["stats"], parallel["stats"]):
        assert tp2_stats["numeric_tokens"] == tp1_stats["numeric_tokens"] > 0
        # fp32 SMMD of order 0.6 on the regrouped logits (measured 2.9e-7).
        assert tp2_stats["mmd"] == pytest.approx(tp1_stats["mmd"], abs=1e-5)

    # What crossed the wire: one all-reduce per forward, far below the logits (a second one only grows the
    # exchange's numeric capacity, kept per group and loss; the weight-0 probe above already grew it).
    logits_bytes = 4 * 24 * vocab_size * 4
    assert len(parallel["stats"]) == 5
    assert [s["comm_calls"] for s in parallel["stats"]] == [1, 1, 1, 1, 1]
    assert all(0 < s["comm_bytes"] < 0.02 * logits_bytes for s in parallel["stats"])
    assert all(s["comm_calls"] == 0 and s["comm_bytes"] == 0 for s in single["stats"])


def assert_fused_trains_like_materialized(result: dict, name: str, weights_tolerance: float) -> None:
    """Per-step losses equal to 1e-5 relative, the first step's gradient norm to 1e-6 and final weights
    to ``weights_tolerance`` (relative Frobenius norm, per tensor); the fused variant never computed
    training logits; the same forward exchange; under AutoTP its backward ran the one d hidden
    all-reduce of [tokens, H] fp32."""
    materialized, fused = result["variants"][name], result["variants"][f"{name}-fused"]
    assert fused["fused_linear"] and not materialized["fused_linear"]
    assert materialized["training_logits"] and not fused["training_logits"]
    # fp32: the fused head's blocks sum in another order, 5 Adam steps carry it on (measured 1.7e-7).
    assert fused["losses"] == pytest.approx(materialized["losses"], rel=1e-5)
    # At the first step both paths hold the same weights: the gradient norms compare the gradients, whose scale
    # Adam's steps do not show (measured 3.5e-8 at most); later norms follow the weights Adam parts.
    assert fused["grad_norms"][0] == pytest.approx(materialized["grad_norms"][0], rel=1e-6)
    # A key projection's bias shifts every score of a query by the same amount, which softmax ignores: its
    # gradient is zero but for rounding, which Adam turns into full steps; its values are noise on both paths.
    differences = {tensor: difference for tensor, difference in fused["weights_relative_differences"].items()
                   if not tensor.endswith("k_proj.bias")}
    assert max(differences.values()) <= weights_tolerance, max(differences, key=differences.get)
    for fused_stats, materialized_stats in zip(fused["stats"], materialized["stats"]):
        assert fused_stats["comm_calls"] == materialized_stats["comm_calls"]
        assert fused_stats["comm_bytes"] == materialized_stats["comm_bytes"]
        # fp32 SMMD of order 0.6 on logits the two paths round differently (measured 5.8e-7).
        assert fused_stats["mmd"] == pytest.approx(materialized_stats["mmd"], rel=1e-5)
        tensor_parallel = result["tp"] > 1
        assert fused_stats["backward_comm_calls"] == int(tensor_parallel)
        assert fused_stats["backward_comm_bytes"] == (4 * 24 * result["hidden_size"] * 4 if tensor_parallel else 0)
    assert fused["heads"] == materialized["heads"]


@pytest.mark.parametrize("layout, name", [("tp1", "untied"), ("tp1", "tied"), ("tp2", "untied"), ("tp2", "tied"),
                                          ("tp4", "untied"), ("tp2-uneven2", "untied"), ("tp2-uneven2", "tied"),
                                          ("tp4-uneven4", "untied"), ("dp2", "untied"), ("dp2", "untied-offload")])
def test_fused_linear_head_trains_like_the_materialized_loss(trained, layout, name):
    """Llama: final weights to 1e-5 (1e-4 with the 32,002 and 50,257 vocabularies)."""
    # With 96 targets a step, nearly every row of a 32k-50k head gets only the softmax's ~1/V gradient, which
    # Adam scales up to a full step: fp32 rounding of the fused and the materialized paths then parts the
    # weights by up to 9e-5 after 5 steps, the same at TP=1 (measured 2.6e-5 untied, 8.8e-5 tied there).
    # With 2,048 rows they part less: measured 5.2e-6 (TP=1 and 2, tied and untied).
    assert_fused_trains_like_materialized(trained[layout], name,
                                          1e-5 if trained[layout]["vocab_size"] == 2048 else 1e-4)


@pytest.mark.parametrize("family, embeddings, layout", FAMILY_VARIANTS)
def test_each_family_fused_trains_like_its_materialized_loss(families_trained, family, embeddings, layout):
    """Each family's own forward (soft-cap, logit scale, router loss) with the fused head: its losses
    equal the materialized loss's; under AutoTP, ours at weight 0 equals DeepSpeed's CE-only loss on the
    model's (transformed) logits, and TP=2 trains as one process. Final weights to 1e-3: Adam moves
    each element by about the learning rate whatever its gradient's size, so elements whose gradient is
    near zero take steps that fp32 rounding decides: the query biases of Qwen2 and Qwen2-MoE at
    initialisation (up to 7e-5 measured), and above all an embedding row first seen in the last step
    (Gemma-3 untied at TP=2: one row, 4.6e-4 of the embedding), while the losses agree to 1.1e-7."""
    result = families_trained[layout]
    name = f"{family}-{embeddings}"
    assert_fused_trains_like_materialized(result, name, 1e-3)
    if result["tp"] > 1:
        parallel, single = result["variants"][name], families_trained["families-tp1"]["variants"][name]
        assert parallel["vocab_parallel"] and parallel["heads"] == [[0, 1024], [1024, 2048]]
        ours, deepspeeds = parallel["ce_ours_vs_deepspeed"]
        # fp32 CE computed another way than DeepSpeed's, on the same transformed logits: rounding (measured 1.3e-7).
        assert ours == pytest.approx(deepspeeds, rel=1e-5)
        # fp32: TP=2 regroups the vocab and attention sums, 5 Adam steps carry it on (measured 1.1e-7).
        assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-5)
