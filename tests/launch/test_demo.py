"""The demo (launch/demo.sh, launch/demo.py): its help needs nothing installed, its refusals come
before anything trains, and its pieces at toy settings: Tier A data and tokenizer, CE and CE + SMMD
from scratch on 1 process each, the SMMD run's last steps again under ZeRO-3 + AutoTP on 2 processes,
greedy evaluation and the table."""

import json
import os
import subprocess
import sys

import pytest
from helpers.dashboards import Dashboards
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, run

from smmd_numeracy import tier_a
from smmd_train.monitor.metrics_file import read_metrics

STUDY_RESULTS = REPO / "benchmarks" / "numeracy" / "results" / "tier_a.json"


def test_help_prints_without_setting_anything_up(tmp_path):
    venv = tmp_path / "venv"
    completed = subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), "--help"], capture_output=True, text=True,
                               timeout=hang_guard(60), env={"PATH": os.environ["PATH"], "VENV": str(venv)})
    assert completed.returncode == 0, completed.stderr
    assert "usage: bash launch/demo.sh" in completed.stdout and "--arm" in completed.stdout
    # The arms it offers are the study's numeric-loss arms (ARM_LABELS lives in demo.py for this help).
    offered = completed.stdout.split("--arm {", 1)[1].split("}", 1)[0].split(",")
    assert set(offered) == set(tier_a.ARMS) - {"ce"}
    assert not venv.exists()  # no virtual environment was made


@pytest.mark.slow  # imports torch before it refuses (the study's settings live in smmd_numeracy)
@pytest.mark.parametrize("arguments", [["--steps", "4", "--tp_steps", "4"], ["--tp_steps", "0"]])
def test_a_segment_that_does_not_fit_the_run_is_refused_before_training(tmp_path, arguments):
    work = tmp_path / "demo"
    completed = subprocess.run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", work, *arguments],
                               capture_output=True, text=True, timeout=hang_guard(120), env=environment())
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.strip().splitlines() == [completed.stderr.strip()]  # one line
    assert f"--tp_steps {arguments[-1]} must be between 1 and --steps - 1" in completed.stderr
    assert not work.exists()  # nothing written, nothing trained


def losses(output_dir) -> list:
    return [record["loss/total"] for record in read_metrics(output_dir) if "loss/total" in record]


@pytest.mark.slow
def test_demo_end_to_end_at_toy_settings(tmp_path):
    work = tmp_path / "demo"
    arguments = ["--steps", 4, "--tp_steps", 2]
    completed = run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", work, *arguments],
                    timeout=900, env=environment())
    results = json.loads((work / "demo_results.json").read_text())
    study = json.loads(STUDY_RESULTS.read_text())
    arm = "smmd"  # the default, fixed in advance: not the arm that did best on the study's test split
    assert results["args"]["arm"] == arm
    assert [row["run"] for row in results["rows"]] == ["CE only", "CE + SMMD", "CE + SMMD, last 2 steps at TP=2"]
    for row in results["rows"]:
        assert row["report"]["test"]["count"] == 600 and 0 <= row["test exact"] <= row["test within 1"] <= 1
        assert row["tokens/s"] > 0
    # The table says what the study found for the arm against CE: it did not beat it on test exact match.
    comparison = next(row for row in study["tests"]["exact_match"] if row["arm"] == arm and row["column"] == "test")
    assert comparison["t95_low"] <= 0 <= comparison["t95_high"]  # the study's primary interval
    verdict = f"did not beat CE: {100 * comparison['mean_difference']:+.1f} pp"
    assert all(row["study vs CE"].startswith(verdict) for row in results["rows"][1:])
    assert results["rows"][0]["study vs CE"] is None and "did not beat CE" in completed.stdout
    # Both runs trained from scratch on the same data on one process each; the arm's last 2 steps trained
    # again from its step-2 checkpoint through AutoTP on 2 processes; one thread per process.
    for name, world_size, tp_size in (("ce", 1, 1), (arm, 1, 1), (f"{arm}_tp2", 2, 2)):
        config = json.loads((work / name / "run_config.json").read_text())
        assert (config["world_size"], config["tp_size"]) == (world_size, tp_size)
        assert config["args"]["model"] == "tiny" and config["args"]["max_steps"] == 4
        assert list((work / "tensorboard" / name).rglob("events.out.tfevents.*"))
        assert (work / name / "tier_a_eval.json").is_file()
    assert "converted to a universal checkpoint" in (work / f"{arm}_tp2.log").read_text()
    numeric_losses = [json.loads((work / name / "run_config.json").read_text())["args"]["numeric_loss"]
                      for name in ("ce", arm, f"{arm}_tp2")]
    expected = [[name.split(":")[0], float(name.split(":")[1]) if ":" in name else 1.0]
                for name in tier_a.arm_flags(arm)["numeric_loss"]]
    assert numeric_losses == [[["smmd", 0.0]], expected, expected]
    # The segment's losses are the 1-process run's steps 3-4, within the demo's tolerance (its reason
    # is in demo.py: the same model summed in another order), and the demo says so.
    segment, reference = losses(work / f"{arm}_tp2"), losses(work / arm)
    assert len(segment) == 2 and len(reference) == 4
    assert results["tp_check"]["within"] and results["tp_check"]["steps"] == [3, 4]
    tolerance = results["tp_check"]["tolerance"]
    assert tolerance <= 1e-5 and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(segment, reference[2:]))
    assert "-> equal within it" in completed.stdout
    assert "| CE only |" in completed.stdout and "tensorboard --logdir" in completed.stdout
    assert "cannot" in completed.stdout  # what one seed cannot show
    # Its closing word is Tier C's (a pretrained model): each numeric arm's paired difference from CE as the
    # committed report's JSON has it, and where to read which loss to choose.
    pretrained = json.loads(STUDY_RESULTS.with_name("tier_c.json").read_text())
    assert results["pretrained"] in completed.stdout and "docs/objective.md" in results["pretrained"]
    compared = [row for row in pretrained["tests"]["exact_match"] if row["column"] == "test"]
    assert len(compared) == len(pretrained["study"]["arms"]) - 1
    for row in compared:
        low, high = 100 * row["t95_low"], 100 * row["t95_high"]
        words = "beat CE" if low > 0 else "lost to CE" if high < 0 else "did not beat CE"
        assert f"{row['arm'].replace('_', '-').upper()} at weight {pretrained['study']['weights'][row['arm']]:g} " \
               f"{words} ({100 * row['mean_difference']:+.1f} pp [{low:+.1f}, {high:+.1f}])" in results["pretrained"]
    assert len(list((work / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the HParams experiment, once
    # It flags (shows first) the settings in which the three runs' HParams rows differ: the numeric loss
    # (CE is smmd:0) and the segment's layout; the segment's launcher (deepspeed, not one process) too.
    dashboard = Dashboards(work / "tensorboard")
    flagged = {info["name"] for info in dashboard.experiment()["hparamInfos"] if info["differs"]}
    rows = [group["hparams"] for group in dashboard.session_groups()]
    differing = {name for name in rows[0] if len({str(row[name]) for row in rows}) > 1}
    assert len(rows) == 3 and flagged == {"numeric_loss", "tp_size", "world_size"}
    assert flagged <= differing and differing - flagged == {"launcher"}
    # The demo is deterministic: run again, one run at a time instead of side by side, it trains the same
    # steps (identical per-step losses) and prints the same table but for tokens/s (each process runs
    # one thread; concurrency changes only timing).
    again = tmp_path / "again"
    run([sys.executable, REPO / "launch" / "demo.py", "--work_dir", again, *arguments, "--one_at_a_time"],
        timeout=900, env=environment())
    repeated = json.loads((again / "demo_results.json").read_text())
    for name in ("ce", arm, f"{arm}_tp2"):
        assert losses(work / name) == losses(again / name)
    for first, second in zip(results["rows"], repeated["rows"], strict=True):
        assert {key: value for key, value in first.items() if key != "tokens/s"} == \
            {key: value for key, value in second.items() if key != "tokens/s"}
