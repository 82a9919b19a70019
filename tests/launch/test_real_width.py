"""benchmarks/real_width.py at hidden 1,024 (at the 7B shape's 4,096 it is a benchmark of minutes): two CPU
ranks train under ZeRO-3 + AutoTP TP 2 with --fused_linear and SMMD and save, the checkpoint converts to a
universal one and resumes at TP 1 on the same ranks, the export loads and generates, and each rank's
resident memory is split next to the planner's terms (into a temporary --results_dir)."""

import json
import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment

SMALL = ["--hidden_size", "1024", "--num_attention_heads", "8", "--num_key_value_heads", "2", "--intermediate_size",
         "2816", "--vocab_size", "4096", "--seq_len", "128", "--steps", "2", "--resumed_steps", "2"]


@pytest.mark.slow
def test_a_narrow_7b_shape_trains_at_tp_2_resumes_at_tp_1_exports_and_is_measured(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.real_width", *SMALL, "--work_dir", str(tmp_path / "work"),
                          "--results_dir", str(tmp_path / "results"), "--name", "real_width_small"],
                         capture_output=True, text=True, timeout=hang_guard(900), cwd=REPO, env=environment())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| phase | term | planner GiB (fp32) |" in run.stdout
    results = json.loads((tmp_path / "results" / "real_width_small.json").read_text())
    trained, resumed = results["phases"]["train TP 2"], results["phases"]["resume TP 1"]

    # Trained at TP 2, then continued from its checkpoint at TP 1 through the universal checkpoint it was
    # converted to beforehand (the resume reused that conversion).
    assert (trained["tp"], trained["dp"], trained["steps"]) == (2, 1, [1, 2])
    assert (resumed["tp"], resumed["dp"], resumed["steps"]) == (1, 2, [3, 4])
    assert any("[train] resumed from step00000002 at step 2" in line for line in results["stages"]["resume"]["log"])
    assert any("converted before" in line for line in results["stages"]["resume"]["log"])

    # The export loads, answers, and holds the trained weights, not the initial ones.
    answer = results["answer"]
    assert answer["generated_tokens"] == 8 and answer["logits_finite"]
    assert answer["tensors_changed_by_training"] == answer["tensors"] > 0

    for phase in (trained, resumed):
        # The planner counts the partition the trainer reports (AutoTP's whole parameters over the world).
        planned = phase["planner"]["fp32"]
        assert phase["rank_parameters"]["tensor_parallel"] == planned["tp_params"]
        assert 0 <= phase["rank_parameters"]["zero_partition"] - planned["zero_partition_params"] < 64
        assert planned["model_states_bytes"] == pytest.approx(20 * planned["zero_partition_params"], abs=20)
        assert all(planned[key] > 0 for key in ("gathered_layer_bytes", "activation_bytes", "logits_and_loss_bytes"))
        for rank, measured in phase["measured"].items():
            assert measured["runtime_bytes"] > 0 and measured["step_bytes"] > 0, (rank, measured)
            assert measured["training_peak_bytes"] == (measured["runtime_bytes"] + measured["model_states_bytes"]
                                                       + measured["step_bytes"])
            assert measured["process_peak_bytes"] >= measured["training_peak_bytes"]
            # The 20 bytes per partitioned parameter are resident, and a little more: ZeRO's buffers, library pages
            # (1.2x here, 1.08x with a 32,000-token vocabulary); a broken split or count would not be.
            assert 0.9 < measured["model_states_bytes"] / planned["model_states_bytes"] < 1.6, (rank, measured)
        # The trainer's own peak is the max over ranks of the same high-water mark, since its process began.
        assert phase["trainer_peak_gib"] * 2**30 >= max(measured["training_peak_bytes"]
                                                        for measured in phase["measured"].values()) * 0.99
