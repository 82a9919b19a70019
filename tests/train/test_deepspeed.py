"""smmd_scale.install on DeepSpeed engines, launched with the real deepspeed launcher on 2 CPU
processes (4 for TP=4): ZeRO-3 with AutoTP TP=2 and 4 and a vocabulary-parallel LM head against TP=1, and the fused
linear head (install(..., fused_linear=True)) against the materialized loss under ZeRO-3 (with and
without CPU offload) and ZeRO-3 + AutoTP, tied and untied embeddings. One launch trains every
variant of its layout (tests/scripts/deepspeed_training.py)."""

import json
import sys

import pytest
from helpers.launching import REPO, launch_command, run

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "deepspeed_training.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The variants of five launches, 5 optimizer steps each: TP=1 (one plain process), AutoTP TP=2,
    AutoTP TP=4 (4 processes, untied only, 4 KV heads so that they split, with its own TP=1 twin) and
    ZeRO-3 over 2 data-parallel ranks with and without offload."""
    directory = tmp_path_factory.mktemp("deepspeed")
    run([sys.executable, SCRIPT, "--tp", 1, "--out", directory / "tp1.json"], timeout=600)
    run(launch_command(SCRIPT, "--tp", 2, "--out", directory / "tp2.json", processes=2), timeout=600)
    run([sys.executable, SCRIPT, "--kv_heads", 4, "--embeddings", "untied", "--out", directory / "tp1kv4.json"],
        timeout=600)
    run(launch_command(SCRIPT, "--tp", 4, "--kv_heads", 4, "--embeddings", "untied", "--out", directory / "tp4.json",
                       processes=4), timeout=600)
    run(launch_command(SCRIPT, "--offload", "--embeddings", "untied", "--out", directory / "dp2.json", processes=2),
        timeout=600)
    return {layout: json.loads((directory / f"{layout}.json").read_text())["variants"]
            for layout in ("tp1", "tp2", "tp1kv4", "tp4", "dp2")}


@pytest.mark.parametrize("layout, name", [("tp2", "untied"), ("tp2", "tied"), ("tp4", "untied")])
def test_autotp_vocab_parallel_training_equals_tp1(trained, layout, name):
    single, parallel = trained["tp1kv4" if layout == "tp4" else "tp1"][name], trained[layout][name]
    tp = int(layout[2:])

    # DeepSpeed made the head vocabulary-parallel and installed its CE-only loss; install replaced it.
    assert parallel["deepspeed_loss_function"] == "VocabParallelCausalLMLoss"
    assert parallel["vocab_parallel"] and not single["vocab_parallel"]
    assert parallel["heads"] == [[rank * 2048 // tp, (rank + 1) * 2048 // tp] for rank in range(tp)]
    ours, deepspeeds = parallel["ce_ours_vs_deepspeed"]
    assert ours == pytest.approx(deepspeeds, rel=1e-5)  # weight 0: the same CE as DeepSpeed's loss

    # Five optimizer steps of CE + SMMD: the same losses as one process without tensor parallelism.
    assert parallel["losses"] == pytest.approx(single["losses"], abs=1e-4)
    for tp1_stats, tp2_stats in zip(single["stats"], parallel["stats"]):
        assert tp2_stats["numeric_tokens"] == tp1_stats["numeric_tokens"] > 0
        assert tp2_stats["mmd"] == pytest.approx(tp1_stats["mmd"], abs=1e-5)

    # What crossed the wire: one all-reduce per forward, far below the logits. The exchange's capacity
    # is kept per (group, loss options), so only the group's first call with these options (the CE
    # probe above, or the first step) may pay the second round that grows it.
    logits_bytes = 4 * 24 * 2048 * 4
    calls = [s["comm_calls"] for s in parallel["stats"]]
    assert len(calls) == 5 and calls[0] in (1, 2) and calls[1:] == [1, 1, 1, 1]
    assert all(0 < s["comm_bytes"] < 0.02 * logits_bytes for s in parallel["stats"])
    assert all(s["comm_calls"] == 0 and s["comm_bytes"] == 0 for s in single["stats"])


@pytest.mark.parametrize("layout, name", [("tp1", "untied"), ("tp1", "tied"), ("tp2", "untied"), ("tp2", "tied"),
                                          ("tp4", "untied"), ("dp2", "untied"), ("dp2", "untied-offload")])
def test_fused_linear_head_trains_like_the_materialized_loss(trained, layout, name):
    """Per-step losses equal to 1e-5 relative and final weights to 1e-5 (relative Frobenius norm
    per tensor); the fused variant never computed training logits; under AutoTP its backward ran the
    one d hidden all-reduce of [tokens, H] fp32."""
    materialized, fused = trained[layout][name], trained[layout][f"{name}-fused"]
    assert fused["fused_linear"] and not materialized["fused_linear"]
    assert materialized["training_logits"] and not fused["training_logits"]
    assert fused["losses"] == pytest.approx(materialized["losses"], rel=1e-5)
    assert fused["weights_relative_difference"] <= 1e-5
    for fused_stats, materialized_stats in zip(fused["stats"], materialized["stats"]):
        assert fused_stats["comm_calls"] == materialized_stats["comm_calls"]
        assert fused_stats["comm_bytes"] == materialized_stats["comm_bytes"]
        assert fused_stats["mmd"] == pytest.approx(materialized_stats["mmd"], rel=1e-5)
        tensor_parallel = layout in ("tp2", "tp4")
        assert fused_stats["backward_comm_calls"] == int(tensor_parallel)
        assert fused_stats["backward_comm_bytes"] == (4 * 24 * 64 * 4 if tensor_parallel else 0)
    assert fused["heads"] == materialized["heads"]
