"""Tier B of the numeracy study (smmd_numeracy/tier_b.py, benchmarks/numeracy/study_b.py, analyze_b.py):
the generated data, the digit-level tokenizer's numeric vocabulary, the scoring of whole answers, and
the report on synthetic runs with known answers."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mathematics_dataset")  # the bench extra

from helpers.host_probe import hang_guard

from benchmarks.numeracy import analyze_b, study_a, study_b  # noqa: E402  (after the skip)
from smmd_numeracy import compat, tier_a, tier_b, train_numeric_tokenizer  # noqa: E402
from smmd_scale import NTLoss, NumericVocab  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tier_b.build_data(tmp_path_factory.mktemp("tier_b"), train_per_level=150, eval_per_split=60, seed=0)


def _rows(path):
    return [json.loads(line) for line in open(path)]


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def test_splits_are_disjoint_and_in_the_documented_format(data):
    train = [row["text"] for row in _rows(data["train"])]
    qa = _rows(data["qa_eval"])
    assert len(train) == data["train_problems"] == 3 * 150
    questions = {split: [item["prompt"] for item in qa if item["task"].startswith(split + "/")]
                 for split in tier_b.TEST_SPLITS}
    assert {split: len(prompts) for split, prompts in questions.items()} == {"interpolate": 60, "extrapolate": 60}
    assert all(len(set(prompts)) == len(prompts) for prompts in questions.values())
    assert not set(questions["interpolate"]) & set(questions["extrapolate"])
    train_prompts = {text.rsplit(" ", 1)[0] for text in train}
    assert not train_prompts & (set(questions["interpolate"]) | set(questions["extrapolate"]))
    for text in train:
        question, answer = text.removeprefix("Q: ").rsplit("\nA: ", 1)
        assert text == tier_b.text(question, int(answer)) and tier_b.parse_answer(answer) == int(answer)
    assert any(item["answer"] < 0 for item in qa) and all(isinstance(item["answer"], int) for item in qa)
    assert {item["task"] for item in qa} == {"interpolate/add_sub_multiple", "extrapolate/add_sub_multiple_longer"}
    assert [row["text"] for row in _rows(data["eval"])] == [
        f"{item['prompt']} {item['answer']}" for item in qa if item["task"].startswith("interpolate/")]


def test_extrapolate_problems_are_longer_than_training_ones(data):
    def terms(question):
        return sum(character.isdigit() and not previous.isdigit() for previous, character in zip(" " + question,
                                                                                                  question))

    train_terms = [terms(row["text"].split("\nA:")[0]) for row in _rows(data["train"])]
    extrapolate_terms = [terms(item["prompt"]) for item in _rows(data["qa_eval"])
                         if item["task"].startswith("extrapolate/")]
    assert np.mean(extrapolate_terms) > np.mean(train_terms) + 2


def test_generation_is_deterministic_and_leaves_the_global_generators_alone():
    random.seed(123)
    np.random.seed(7)
    before = random.random(), np.random.random()
    random.seed(123)
    np.random.seed(7)
    first = tier_b.generate_problems("train-medium", 40, seed=3)
    assert (random.random(), np.random.random()) == before
    assert tier_b.generate_problems("train-medium", 40, seed=3) == first
    assert tier_b.generate_problems("train-medium", 40, seed=4) != first
    assert tier_b.generate_problems("train-easy", 40, seed=3) != first
    # ... and in a fresh process with another string-hash seed.
    code = ("from smmd_numeracy import tier_b; import json; "
            "print(json.dumps(tier_b.generate_problems('train-medium', 40, seed=3)))")
    processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONHASHSEED": hash_seed}) for hash_seed in ("1", "2")]
    for process in processes:  # started together: each spends seconds importing
        output = process.communicate(timeout=hang_guard(300))[0]
        assert process.returncode == 0
        assert [tuple(problem) for problem in json.loads(output)] == first
    with pytest.raises(ValueError, match="unknown split"):
        tier_b.generate_problems("train", 1, seed=0)


def test_training_entropy_is_the_packages_third_of_its_training_range():
    """The package's own training levels (mathematics_dataset's inventory entry, checked against 1.0.1):
    level i of 3 maps an entropy range [x, x + y] to its i-th third."""
    assert [tuple(compat.training_entropy(level, 3)((3.0, 12.0))) for level in range(3)] == [
        (3.0, 6.0), (6.0, 9.0), (9.0, 12.0)]


def test_digit_tokenizer_gives_the_ten_digits_as_the_numeric_vocabulary(data):
    texts = [row["text"] for row in _rows(data["train"])]
    tokenizer = train_numeric_tokenizer(texts, vocab_size=400, max_digits=1)
    digits = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    assert digits.tokens == tuple("0123456789") and digits.values.tolist() == list(range(10))
    # train.py's default policy finds the same ten tokens on this tokenizer.
    assert NumericVocab.from_tokenizer(tokenizer).token_id_list == digits.token_id_list
    assert tokenizer.tokenize("A: -306") == ["A", ":", "Ġ-", "3", "0", "6"]
    assert tokenizer.decode(tokenizer("Q: What is 12 - -40?\nA: 52")["input_ids"]) == "Q: What is 12 - -40?\nA: 52"
    NTLoss(digits, digit_level=True)  # the ten digits, as ntloss's digit_level wants
    # Squashing onto [1, 9] is the identity on the digits 0..9 (why ntl_was has no squash factor here).
    assert NTLoss(digits, squash_factor=9.0).distances.equal(NTLoss(digits).distances)
    # The default keeps Llama-3's 1-3 digit groups.
    assert train_numeric_tokenizer(texts, vocab_size=1400).tokenize("306") == ["306"]
    with pytest.raises(ValueError, match="max_digits"):
        train_numeric_tokenizer(texts, max_digits=4)


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("continuation, expected", [
    (" -36", -36), (" 7\nQ: What", 7), (" 0", 0), ("  12  ", 12), (" 036", None), (" --3", None), (" 3 + 1", None),
    ("", None), (" -", None), (" 1.5", None), ("\n5", None),
])
def test_parse_answer_reads_a_whole_integer_only(continuation, expected):
    assert tier_b.parse_answer(continuation) == expected


def test_scoring_known_answers():
    items = [{"prompt": "Q: a\nA:", "answer": -36, "task": "interpolate/add_sub_multiple"},
             {"prompt": "Q: b\nA:", "answer": 12, "task": "interpolate/add_sub_multiple"},
             {"prompt": "Q: c\nA:", "answer": 5, "task": "interpolate/add_sub_multiple"},
             {"prompt": "Q: d\nA:", "answer": -1000, "task": "extrapolate/add_sub_multiple_longer"}]
    continuations = [" -36", " 21", " 5 +", " 1000"]
    report = tier_a.score(items, [tier_b.parse_answer(text) for text in continuations])
    assert report["interpolate"]["exact_match"] == pytest.approx(1 / 3)
    assert report["interpolate"]["mae"] == pytest.approx(4.5)            # |21 - 12| / 2, the unparseable left out
    assert report["interpolate"]["unparseable"] == pytest.approx(1 / 3)
    assert report["extrapolate"] == {"count": 1, "exact_match": 0.0, "within_1": 0.0, "mae": 2000.0,
                                     "unparseable": 0.0, "mae_capped": 1.0, "mae_cap": 1}  # one answer: cap 1
    # Capped: the interpolate answers span 12 - (-36) = 48; errors 0, 9 and the unparseable one at 48.
    assert report["interpolate"]["mae_capped"] == pytest.approx((0 + 9 + 48) / 3)
    # Room for the longest answer: "-1000" is Ġ- 1 0 0 0, then EOS.
    assert tier_b.max_new_tokens(items) == 7


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def _synthetic_run(directory, arm, seed, exact, mae, curve):
    directory.mkdir(parents=True)
    evaluation = {}
    for split, module in tier_b.TEST_SPLITS.items():
        metrics = {"count": 100, "exact_match": exact[split], "within_1": exact[split], "mae": mae[split],
                   "unparseable": 0.01}
        evaluation[split] = evaluation[f"{split}/{module}"] = metrics
    (directory / "run.json").write_text(json.dumps({"arm": arm, "seed": seed, "flags": tier_b.ARMS[arm],
                                                    "eval": evaluation, "train_seconds": 100.0,
                                                    "train_cpu_seconds": 90.0, "eval_seconds": 5.0}))
    lines = [{"step": step, "perf/step_seconds": 0.5 + 0.1 * step} for step in (1, 2, 3)]
    lines += [{"step": step, "eval/numeric_accuracy": accuracy} for step, accuracy in curve]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (directory / "answers.json").write_text(json.dumps({"answers": [seed, -1, 7, None, 7]}))


def test_report_and_pipeline_check_on_synthetic_runs(tmp_path, generator):
    rng = np.random.default_rng(int(generator.initial_seed()))
    work, results = tmp_path / "work", tmp_path / "results"
    (work / "data").mkdir(parents=True)
    qa = [{"prompt": "Q: a\nA:", "answer": -4, "task": "interpolate/add_sub_multiple"},
          {"prompt": "Q: b\nA:", "answer": 0, "task": "interpolate/add_sub_multiple"},
          {"prompt": "Q: c\nA:", "answer": 30, "task": "extrapolate/add_sub_multiple_longer"}]
    (work / "data" / "qa_eval.jsonl").write_text("".join(json.dumps(item) + "\n" for item in qa))
    (work / "data" / "data.json").write_text(json.dumps({"qa_eval": str(work / "data" / "qa_eval.jsonl")}))
    (work / "study.json").write_text(json.dumps({"tier": "b", "settings": study_b.SETTINGS, "parameters": 1.07e7,
                                                 "data": {"train_problems": 30000}}))
    seeds = [0, 1, 2]
    # Per-seed noise with mean exactly 0, so the mean differences are known.
    noise = {(arm, seed): value for arm in ("ntl_was", "smmd")
             for seed, value in zip(seeds, [-0.004, 0.001, 0.003] if arm == "smmd" else [0.002, -0.005, 0.003])}
    for seed in seeds:
        base = rng.uniform(0.1, 0.3)
        for arm, gain in (("ce", 0.0), ("ntl_was", 0.05), ("smmd", -0.02)):
            gain += 0.0 if arm == "ce" else noise[arm, seed]
            _synthetic_run(work / f"{arm}-seed{seed}", arm, seed,
                           {"interpolate": base + gain, "extrapolate": base / 2 + gain},
                           {"interpolate": 10 - 20 * gain, "extrapolate": 40.0 + seed},
                           [(100, 0.2 + gain), (200, 0.3 + gain)])
    analysis = analyze_b.write_report(work, results)
    rows = {(row["arm"], row["column"]): row for row in analysis["tests"]["exact_match"]["rows"]}
    assert set(rows) == {(arm, split) for arm in ("ntl_was", "smmd") for split in tier_b.TEST_SPLITS}
    assert rows["ntl_was", "interpolate"]["mean_difference"] == pytest.approx(0.05)
    assert rows["smmd", "extrapolate"]["mean_difference"] == pytest.approx(-0.02)
    mae = {(row["arm"], row["column"]): row for row in analysis["tests"]["mae"]["rows"]}
    assert mae["ntl_was", "interpolate"]["mean_difference"] == pytest.approx(-1.0)
    assert mae["smmd", "extrapolate"]["mean_difference"] == pytest.approx(0.0)  # the same on every seed: no test
    curve = analysis["tests"]["curve_auc"]["rows"]
    assert {row["column"] for row in curve} == {"interpolate"}
    assert {row["arm"]: row["mean_difference"] for row in curve} == pytest.approx({"ntl_was": 0.05, "smmd": -0.02})
    saved = json.loads((results / "tier_b.json").read_text())
    assert saved["seeds"] == seeds and len(saved["runs"]) == 9
    assert saved["reference_answer_0"]["interpolate"]["mae"] == pytest.approx(2.0)       # |-4| and |0|
    assert saved["reference_answer_0"]["interpolate"]["exact_match"] == pytest.approx(0.5)
    assert saved["reference_answer_0"]["extrapolate"]["mae"] == pytest.approx(30.0)
    assert saved["runs"][0]["step_seconds"] == pytest.approx(0.7)  # the median of 0.6, 0.7, 0.8
    assert [run["distinct_answers"] for run in saved["runs"]][:3] == [4, 4, 4]  # seed, -1, 7, None
    summary = (results / "tier_b_summary.md").read_text()
    assert "Tier B" in summary and "0.70 s per training step" in summary and "0.23 CPU-hours" in summary  # 9 x 90 s
    check = dict(report="tier_b", splits=tuple(tier_b.TEST_SPLITS), tested_metrics=analyze_b.METRICS)
    assert study_a.check_pipeline(results, list(tier_b.ARMS), seeds, **check) == []
    assert any("missing" in problem for problem in study_a.check_pipeline(results, list(tier_b.ARMS), [0, 1, 2, 3],
                                                                            **check))
    # From tier_b.json alone (the work dir gone): the same record; step seconds, distinct answers and the
    # answer-0 reference as recorded there.
    analyze_b.main(["--from_results", str(results / "tier_b.json"), "--results_dir", str(tmp_path / "again")])
    assert json.loads((tmp_path / "again" / "tier_b.json").read_text()) == saved
    regenerated = (tmp_path / "again" / "tier_b_summary.md").read_text()
    assert "Regenerated from tier_b.json" in regenerated and "0.70 s per training step" in regenerated
    assert "Scored before the capped MAE existed (9 of 9 runs)" in summary and "Regenerated" not in summary


def test_arms_use_the_digit_vocabulary_and_ntls_default_distances():
    assert list(tier_b.ARMS) == ["ce", "ntl_was", "smmd"]
    assert all(flags["numeric_policy"] == "digits" for flags in tier_b.ARMS.values())
    assert tier_b.ARMS["ntl_was"] == {"numeric_loss": ["ntl-was:0.3"], "numeric_policy": "digits"}  # no squash
    args = study_b.parse_args([])
    assert args.arms == ["ce", "ntl_was", "smmd"] and args.work_dir.name == "tier_b"
    assert study_b.parse_args(["--quick"]).work_dir.name == "tier_b_quick"


@pytest.mark.slow
def test_quick_pipeline_runs_and_checks_itself(tmp_path):
    # 6 tiny runs of 30 steps, two at a time (--jobs 2: the path a grid takes side by side), their evaluation
    # and the report: about 70 CPU-s, most of each run its process's imports.
    from benchmarks.numeracy import run_study

    run_study.main(["--tier", "b", "--quick", "--jobs", "2", "--work_dir", str(tmp_path / "work")])
    results = json.loads((tmp_path / "work" / "results" / "tier_b.json").read_text())
    assert len(results["runs"]) == 6
    study = json.loads((tmp_path / "work" / "study.json").read_text())
    assert study["invocations"][-1]["jobs"] == 2 and study["invocations"][-1]["runs_completed"] == 6
    assert study["settings"]["nice"] == 0  # a pipeline check runs at the suite's priority
    # each run's training CPU is its own process's: positive, and at most its wall time x its one thread
    # plus the interpreter's helper threads (bounded well under 2x)
    for run in results["runs"]:
        assert 0 < run["train_cpu_seconds"] < 2 * run["train_seconds"] + 5
