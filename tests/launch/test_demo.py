"""The demo's pieces at toy settings: corpus generation, tokenizer training, a short CE pretrain,
CE and CE + SMMD continued pretraining under ZeRO-3 + AutoTP on 2 processes, and evaluation."""

import json
import sys

import pytest
from helpers.launching import REPO, environment, run

pytestmark = pytest.mark.slow


def test_demo_end_to_end_at_toy_settings(tmp_path):
    work = tmp_path / "demo"
    completed = run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", work, "--train_per_task", 200,
                     "--test_per_task", 6, "--pretrain_steps", 2, "--continue_steps", 2, "--seq_len", 64,
                     "--micro_batch_size", 4], timeout=900, env=environment())
    results = json.loads((work / "demo_results.json").read_text())
    assert [row["run"].split(" ")[:3] for row in results["rows"]] == [["CE", "only"], ["CE", "+", "1"]]
    for row in results["rows"]:
        assert row["report"]["count"] == 30 and 0 <= row["exact match"] <= 1 and row["tokens/s"] > 0
    # Both continued runs started from the exported CE checkpoint, on the same data, through AutoTP.
    for name in ("ce", "smmd"):
        config = json.loads((work / name / "run_config.json").read_text())
        assert config["tp_size"] == 2 and config["args"]["model"] == str(work / "pretrained")
        assert list((work / "tensorboard" / name).rglob("events.out.tfevents.*"))
        assert (work / name / "hf" / "numeric_eval.json").is_file()
    numeric_losses = [json.loads((work / name / "run_config.json").read_text())["args"]["numeric_loss"]
                      for name in ("ce", "smmd")]
    assert numeric_losses == [[["smmd", 0.0]], [["smmd", 1.0]]]
    assert "| CE only |" in completed.stdout and "tensorboard --logdir" in completed.stdout
    assert len(list((work / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the HParams experiment, once
