"""The demo (launch/demo.sh, launch/demo.py): its help needs nothing installed, and its pieces at toy
settings: Tier A data and tokenizer, CE and CE + SMMD from scratch under ZeRO-3 + AutoTP on 2
processes, greedy evaluation and the table."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers.launching import REPO, environment, run


def test_help_prints_without_setting_anything_up(tmp_path):
    venv = tmp_path / "venv"
    completed = subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), "--help"], capture_output=True, text=True,
                               timeout=60, env={"PATH": os.environ["PATH"], "VENV": str(venv)})
    assert completed.returncode == 0, completed.stderr
    assert "usage: bash launch/demo.sh" in completed.stdout and "--arm" in completed.stdout
    assert not venv.exists()  # no virtual environment was made


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo", REPO / "launch" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_arm_is_the_studys_best_numeric_loss_and_ntl_mse_takes_the_chosen_weight():
    demo = _demo_module()
    results = {"tests": {"exact_match": [
        {"arm": "smmd", "column": "test", "mean_difference": -0.06},
        {"arm": "ntl_was", "column": "test", "mean_difference": -0.02},
        {"arm": "ntl_was", "column": "oor", "mean_difference": 0.5},          # another split: not the criterion
        {"arm": "random_kernel", "column": "test", "mean_difference": 0.9}]},  # the ablation never
        "study": {"ntl_mse_weight": 1e-4}}
    assert demo.best_arm(results) == "ntl_was"
    results["tests"]["exact_match"].append({"arm": "ntl_mse", "column": "test", "mean_difference": 0.01})
    assert demo.best_arm(results) == "ntl_mse"
    assert demo.arm_flags("ntl_mse", results) == {"numeric_loss": ["ntl-mse:0.0001"]}
    with pytest.raises(SystemExit, match="weight the study chose"):
        demo.arm_flags("ntl_mse", {})
    committed = demo.study_results()
    if committed:  # the committed study names an arm the demo can run
        assert demo.best_arm(committed) in demo.ARM_LABELS


@pytest.mark.slow
def test_demo_end_to_end_at_toy_settings(tmp_path):
    work = tmp_path / "demo"
    completed = run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", work, "--steps", 3],
                    timeout=900, env=environment())
    results = json.loads((work / "demo_results.json").read_text())
    demo = _demo_module()
    arm = demo.best_arm(demo.study_results())  # the default: the study's best numeric loss
    assert [row["run"] for row in results["rows"]] == ["CE only", demo.ARM_LABELS[arm]]
    assert f"beside CE: {demo.ARM_LABELS[arm]}, the study's best numeric loss" in completed.stdout
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
                for name in demo.arm_flags(arm, demo.study_results())["numeric_loss"]]
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
