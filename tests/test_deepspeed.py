"""smmd_scale.install on a DeepSpeed engine: ZeRO-3 with AutoTP TP=2 and a vocabulary-parallel
LM head, launched with the real deepspeed launcher on 2 CPU processes, against TP=1 ZeRO-3."""

import json
import sys

import pytest

from launching import REPO, launch_command, run

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "deepspeed_tp_training.py"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_autotp_vocab_parallel_training_equals_tp1(tmp_path, tied):
    flags = ["--tied"] if tied else []
    run([sys.executable, str(SCRIPT), "--tp", "1", "--out", tmp_path / "tp1.json", *flags], timeout=600)
    run(launch_command(SCRIPT, "--tp", "2", "--out", tmp_path / "tp2.json", *flags, processes=2), timeout=600)
    single = json.loads((tmp_path / "tp1.json").read_text())
    parallel = json.loads((tmp_path / "tp2.json").read_text())

    # DeepSpeed made the head vocabulary-parallel and installed its CE-only loss; install replaced it.
    assert parallel["deepspeed_loss_function"] == "VocabParallelCausalLMLoss"
    assert parallel["vocab_parallel"] and not single["vocab_parallel"]
    assert parallel["heads"] == [[0, 1024], [1024, 2048]]
    ours, deepspeeds = parallel["ce_ours_vs_deepspeed"]
    assert ours == pytest.approx(deepspeeds, rel=1e-5)  # weight 0: the same CE as DeepSpeed's loss

    # Three optimizer steps of CE + SMMD: the same losses as one process without tensor parallelism.
    assert parallel["losses"] == pytest.approx(single["losses"], abs=1e-4)
    for tp1_stats, tp2_stats in zip(single["stats"], parallel["stats"]):
        assert tp2_stats["numeric_tokens"] == tp1_stats["numeric_tokens"] > 0
        assert tp2_stats["mmd"] == pytest.approx(tp1_stats["mmd"], abs=1e-5)

    # What crossed the wire: one all-reduce per forward after the first, far below the logits.
    logits_bytes = parallel["tokens"] * parallel["vocab_size"] * 4
    assert [s["comm_calls"] for s in parallel["stats"]] == [2, 1, 1]
    assert all(0 < s["comm_bytes"] < 0.02 * logits_bytes for s in parallel["stats"])
    assert all(s["comm_calls"] == 0 and s["comm_bytes"] == 0 for s in single["stats"])
