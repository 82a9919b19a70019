"""The demo (launch/demo.sh, launch/demo.py): its help needs nothing installed, and its pieces at toy
settings: Tier A data and tokenizer, CE and CE + SMMD from scratch under ZeRO-3 + AutoTP on 2
processes, greedy evaluation and the table."""

import json
import os
import subprocess
import sys

import pytest
from helpers.launching import REPO, environment, run

from smmd_numeracy import tier_a

STUDY_RESULTS = REPO / "benchmarks" / "numeracy" / "results" / "tier_a.json"


def test_help_prints_without_setting_anything_up(tmp_path):
    venv = tmp_path / "venv"
    completed = subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), "--help"], capture_output=True, text=True,
                               timeout=60, env={"PATH": os.environ["PATH"], "VENV": str(venv)})
    assert completed.returncode == 0, completed.stderr
    assert "usage: bash launch/demo.sh" in completed.stdout and "--arm" in completed.stdout
    # The arms it offers are the study's numeric-loss arms (ARM_LABELS lives in demo.py for this help).
    offered = completed.stdout.split("--arm {", 1)[1].split("}", 1)[0].split(",")
    assert set(offered) == set(tier_a.ARMS) - {"ce"}
    assert not venv.exists()  # no virtual environment was made


@pytest.mark.slow
def test_demo_end_to_end_at_toy_settings(tmp_path):
    work = tmp_path / "demo"
    completed = run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", work, "--steps", 3],
                    timeout=900, env=environment())
    results = json.loads((work / "demo_results.json").read_text())
    study = json.loads(STUDY_RESULTS.read_text())
    arm = tier_a.best_arm(study)  # the default: the study's best numeric loss
    assert results["args"]["arm"] == arm and results["rows"][0]["run"] == "CE only"
    assert f"beside CE: {results['rows'][1]['run']}, the study's best numeric loss" in completed.stdout
    for row in results["rows"]:
        assert row["report"]["test"]["count"] == 600 and 0 <= row["test exact"] <= row["test within 1"] <= 1
        assert row["tokens/s"] > 0
    # Both runs trained from scratch on the same data, through AutoTP, one thread per process.
    for name in ("ce", arm):
        config = json.loads((work / name / "run_config.json").read_text())
        assert config["tp_size"] == 2 and config["args"]["model"] == "tiny" and config["args"]["max_steps"] == 3
        assert list((work / "tensorboard" / name).rglob("events.out.tfevents.*"))
        assert (work / name / "tier_a_eval.json").is_file()
    numeric_losses = [json.loads((work / name / "run_config.json").read_text())["args"]["numeric_loss"]
                      for name in ("ce", arm)]
    expected = [[name.split(":")[0], float(name.split(":")[1]) if ":" in name else 1.0]
                for name in tier_a.arm_flags(arm, study["study"].get("ntl_mse_weight"))["numeric_loss"]]
    assert numeric_losses == [[["smmd", 0.0]], expected]
    assert "| CE only |" in completed.stdout and "tensorboard --logdir" in completed.stdout
    assert "cannot" in completed.stdout  # what one seed cannot show
    assert len(list((work / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the HParams experiment, once
    # Side by side (the default) and one at a time train the same steps: identical per-step losses and
    # the same table but for tokens/s (each process runs one thread; concurrency changes only timing).
    again = tmp_path / "again"
    run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", again, "--steps", 3, "--one_at_a_time"],
        timeout=900, env=environment())
    repeated = json.loads((again / "demo_results.json").read_text())
    for name in ("ce", arm):
        losses = [[record["loss/total"] for record in map(json.loads, open(folder / name / "metrics.jsonl"))
                   if "loss/total" in record] for folder in (work, again)]
        assert len(losses[0]) == 3 and losses[0] == losses[1]
    for first, second in zip(results["rows"], repeated["rows"]):
        assert {key: value for key, value in first.items() if key != "tokens/s"} == \
            {key: value for key, value in second.items() if key != "tokens/s"}
