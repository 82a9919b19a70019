"""Tier A of the numeracy study (benchmarks/numeracy/tier_a.py, study_a.py, analyze_a.py): the data
splits, the per-item scoring, and the statistics and report on synthetic runs with known answers."""

import json
import math

import numpy as np
import pytest
import torch

from benchmarks.numeracy import analyze_a, stats, study_a  # scipy comes with the test extras
from smmd_numeracy import tier_a


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(generator.initial_seed()))


# ----------------------------------------------------------------------------------------------
# Data and scoring
# ----------------------------------------------------------------------------------------------

def test_splits_are_disjoint_one_token_and_out_of_range_where_they_say(tmp_path):
    splits = tier_a.split_pairs(operand_range=20, held_out_share=0.2, oor_band=5, seed=3)
    sets = {split: set(problems) for split, problems in splits.items()}
    for first in tier_a.SPLITS:
        for second in tier_a.SPLITS:
            if first < second:
                assert not sets[first] & sets[second], (first, second)
    for split, problems in splits.items():
        for op, a, b in problems:
            assert 0 <= tier_a.answer(op, a, b) <= 999
            in_range = max(a, b) < 20
            assert in_range == (split != "oor"), (split, op, a, b)
    # Every in-range pair with a one-token answer is in exactly one of train / val / test.
    for op in tier_a.OPERATIONS:
        in_range = {(op, a, b) for a, b in tier_a.pairs(op, 0, 20)}
        assert in_range == {p for split in ("train", "val", "test") for p in sets[split] if p[0] == op}
    # Identities and +-1 facts (stated by the counting lines) are never held out.
    assert all(min(a, b) >= 2 for split in ("val", "test") for _, a, b in splits[split])
    # The split depends on the seed, and only on it.
    assert tier_a.split_pairs(20, 0.2, 5, seed=3) == splits
    assert tier_a.split_pairs(20, 0.2, 5, seed=4)["test"] != splits["test"]


def test_build_data_writes_training_text_that_matches_the_prompts(tmp_path):
    data = tier_a.build_data(tmp_path, operand_range=12, held_out_share=0.3, oor_band=4, eval_per_split=30,
                             counting_share=0.2, seed=0)
    documents = [row["text"] for row in map(json.loads, open(data["train"]))]
    counting = [document for document in documents if "," in document]
    assert len(counting) == data["counting_documents"] > 0
    for line in counting:
        numbers = [int(number) for number in line.split(",")]
        assert numbers == list(range(numbers[0], numbers[0] + tier_a.COUNTING_LENGTH)) and numbers[-1] <= 999
    train_lines = [line for document in documents if "," not in document for line in document.split("\n")]
    assert len(train_lines) == data["train_pairs"]
    qa = [json.loads(line) for line in open(data["qa_eval"])]
    assert {item["task"].split("/")[0] for item in qa} == {"val", "test", "oor"}
    for item in qa:
        assert item["prompt"] + str(item["answer"]) not in train_lines  # held out
    assert "7+3=10" in train_lines or "7+3=10" in {item["prompt"] + str(item["answer"]) for item in qa}


def test_score_counts_exact_within_one_and_unparseable():
    items = [{"prompt": "1+1=", "answer": 2, "task": "test/add"}, {"prompt": "5-1=", "answer": 4, "task": "test/sub"},
             {"prompt": "3*3=", "answer": 9, "task": "test/mul"}, {"prompt": "9+9=", "answer": 18, "task": "oor/add"}]
    report = tier_a.score(items, [2, 5, None, 10])
    assert report["test"]["count"] == 3
    assert report["test"]["exact_match"] == pytest.approx(1 / 3)
    assert report["test"]["within_1"] == pytest.approx(2 / 3)
    assert report["test"]["mae"] == pytest.approx(0.5)            # the unparseable answer is left out
    assert report["test"]["unparseable"] == pytest.approx(1 / 3)
    # Capped: the test answers span 9 - 2 = 7, so the unparseable answer counts 7: (0 + 1 + 7) / 3.
    assert report["test"]["mae_cap"] == 7 and report["test"]["mae_capped"] == pytest.approx(8 / 3)
    assert report["test/sub"]["mae_capped"] == pytest.approx(1.0) and report["test/mul"]["mae_capped"] == 7
    # One oor answer: a span of 0 becomes the cap's floor of 1, so the error 8 counts 1.
    assert report["oor/add"] == {"count": 1, "exact_match": 0.0, "within_1": 0.0, "mae": 8.0, "unparseable": 0.0,
                                 "mae_capped": 1.0, "mae_cap": 1}
    with pytest.raises(ValueError, match="one parsed answer per item"):
        tier_a.score(items, [1])


def test_evaluate_model_scores_the_first_generated_token_beside_the_first_number(tmp_path):
    """A random tiny model answers with arbitrary tokens; the post-hoc score is the first generated
    token alone, the pre-registered one the first number of three tokens (which can join two)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from smmd_numeracy import train_numeric_tokenizer
    from smmd_numeracy.evaluation import load_qa, parse_number

    data = tier_a.build_data(tmp_path / "data", operand_range=12, held_out_share=0.3, oor_band=4, eval_per_split=20,
                             counting_share=0.5, seed=0)
    texts = [json.loads(line)["text"] for line in open(data["train"])]
    tokenizer = train_numeric_tokenizer(texts, vocab_size=1400)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # push the output toward number tokens so some answers are two numbers run together
        numbers = [tokenizer.convert_tokens_to_ids(str(n)) for n in range(100, 200)]
        model.lm_head.weight[numbers] += 0.5 * model.model.embed_tokens.weight.std()
        model.lm_head.bias = None
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = tier_a.evaluate_model(tmp_path / "model", data["qa_eval"], first_token=True)
    assert "metrics_first_token" not in tier_a.evaluate_model(tmp_path / "model", data["qa_eval"])  # only when asked
    items = load_qa(data["qa_eval"])
    loaded = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(result["answers_first_token"]) == len(result["answers"]) == len(items)
    joined = 0
    for first, three in zip(result["answers_first_token"], result["answers"]):
        if first is not None:
            assert 0 <= first <= 999                     # one token is at most a 3-digit group
            assert three is not None and str(three).startswith(str(first))  # greedy: the same first token
            joined += three != first
    assert result["metrics_first_token"] == tier_a.score(items, result["answers_first_token"])
    assert result["metrics"] == tier_a.score(items, result["answers"])
    assert parse_number(loaded.decode(loaded("123")["input_ids"])) == 123
    assert joined > 0, "the test should see at least one continuation that joins two number tokens"
    # A run scored before the post-hoc check: executing it again adds the check, trains nothing.
    run_dir = tmp_path / "ce-seed0"
    (run_dir / "hf").parent.mkdir()
    (run_dir / "hf").symlink_to(tmp_path / "model")
    (run_dir / "run.json").write_text(json.dumps({"arm": "ce", "seed": 0, "train_seconds": 1.0,
                                                   "eval": result["metrics"]}))
    (run_dir / "answers.json").write_text(json.dumps({"answers": result["answers"]}))
    record = study_a.execute({}, data, "ce", {}, 0, run_dir, {}, study_a.evaluate_a)
    assert record["eval_first_token"] == result["metrics_first_token"] and record["eval_reproduced"] is True


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------

def test_bootstrap_interval_matches_the_normal_approximation_for_many_values(rng):
    values = rng.normal(2.0, 1.0, size=400)
    low, high = stats.bootstrap_interval(values, resamples=4000, seed=1)
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert low == pytest.approx(values.mean() - half, abs=0.25 * half)
    assert high == pytest.approx(values.mean() + half, abs=0.25 * half)
    assert stats.bootstrap_interval([3.0, 3.0, 3.0]) == (3.0, 3.0)
    assert all(math.isnan(bound) for bound in stats.bootstrap_interval([1.0, None]))


def test_minimal_detectable_effect_has_the_stated_power():
    for n in (5, 10):
        effect = stats.minimal_detectable_effect(n)
        assert stats.paired_power(n, effect) == pytest.approx(0.8, abs=1e-4)
    assert stats.minimal_detectable_effect(10) < stats.minimal_detectable_effect(5)
    assert stats.minimal_detectable_effect(5, alpha=0.005) > stats.minimal_detectable_effect(5)
    assert math.isnan(stats.minimal_detectable_effect(1))


def test_compare_finds_a_real_effect_and_not_a_null_one(rng):
    seeds = list(range(8))
    ce = list(rng.uniform(0.3, 0.6, size=8))
    better = [value + 0.10 + rng.normal(0, 0.01) for value in ce]
    null = [value + rng.normal(0, 0.01) for value in ce]
    result = stats.compare({"test": {"ce": ce, "better": better, "null": null}}, seeds)
    rows = {row["arm"]: row for row in result["rows"]}
    assert rows["better"]["ci95_low"] > 0.05 and rows["better"]["p_holm"] < 0.01
    assert rows["better"]["mean_difference"] == pytest.approx(np.mean(np.subtract(better, ce)))
    assert rows["null"]["ci95_low"] < 0.02 and rows["null"]["ci95_high"] > -0.02
    assert all(row["p_holm"] >= row["p_value"] for row in result["rows"])
    assert result["pairs"] == 8 and result["tests"] == 2
    assert result["mde_holm_sd"] > result["mde_sd"]
    assert rows["null"]["mde"] == pytest.approx(result["mde_sd"] * rows["null"]["sd_difference"])
    # A missing seed drops that pair only.
    null_missing = [None] + null[1:]
    row = stats.compare({"test": {"ce": ce, "null": null_missing}}, seeds)["rows"][0]
    assert row["n"] == 7


def _synthetic_run(directory, arm, seed, exact, curve, first_token_mae=None):
    directory.mkdir(parents=True)
    split_metrics = {"count": 10, "exact_match": exact, "within_1": min(1.0, exact + 0.2), "mae": 5 - 4 * exact,
                     "unparseable": 0.0}
    evaluation = {split: dict(split_metrics) for split in ("val", "test", "oor")}
    evaluation.update({f"{split}/{op}": dict(split_metrics) for split in ("val", "test", "oor")
                       for op in tier_a.OPERATIONS})
    record = {"arm": arm, "seed": seed, "flags": {}, "eval": evaluation, "train_seconds": 10.0,
              "train_cpu_seconds": 9.0, "eval_seconds": 1.0}
    if first_token_mae is not None:  # the post-hoc scoring: the same answers but MAE first_token_mae
        record["eval_first_token"] = {key: dict(value, mae=first_token_mae) for key, value in evaluation.items()}
        record["eval_reproduced"] = True
    (directory / "run.json").write_text(json.dumps(record))
    lines = [json.dumps({"step": step, "eval/numeric_accuracy": accuracy}) + "\n" for step, accuracy in curve]
    (directory / "metrics.jsonl").write_text("".join(lines))


def test_report_and_pipeline_check_on_synthetic_runs(tmp_path, rng):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    (work / "study.json").write_text(json.dumps({"tier": "a", "settings": study_a.SETTINGS, "parameters": 1e6,
                                                 "ntl_mse_weight": 1e-3}))
    for seed in range(6):
        base = rng.uniform(0.3, 0.5)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base, [(100, 0.1), (200, 0.2)])
        _synthetic_run(work / f"smmd-seed{seed}", "smmd", seed, base + 0.1, [(100, 0.15), (200, 0.25)])
    analysis = analyze_a.write_report(work, results)
    row = analysis["tests"]["exact_match"]["rows"][0]
    assert row["arm"] == "smmd" and row["mean_difference"] == pytest.approx(0.1)
    assert row["p_value"] != row["p_value"] or row["p_value"] < 0.05  # constant differences: no t-test
    curve = analysis["tests"]["curve_auc"]["rows"][0]
    assert curve["mean_difference"] == pytest.approx(0.05) and curve["column"] == "test"
    saved = json.loads((results / "tier_a.json").read_text())
    assert saved["seeds"] == list(range(6)) and len(saved["runs"]) == 12
    assert "Tier A" in (results / "tier_a_summary.md").read_text()
    assert study_a.check_pipeline(results, ["ce", "smmd"], list(range(6))) == []
    problems = study_a.check_pipeline(results, ["ce", "smmd"], list(range(7)))
    assert any("missing" in problem for problem in problems)
    assert "Post hoc" not in (results / "tier_a_summary.md").read_text()  # no run has the post-hoc scores
    assert "selection" not in (results / "tier_a_summary.md").read_text()
    (work / "selection.json").write_text(json.dumps({"weight": 1e-3, "candidates": [
        {"weight": 1e-4, "train_cpu_seconds": 1800.0}, {"weight": 1e-3, "train_cpu_seconds": 1800.0}]}))
    analyze_a.write_report(work, results)
    assert "selection's 2 runs 1.00 CPU-hours more" in (results / "tier_a_summary.md").read_text()
    assert "12 runs reported" in (results / "tier_a_summary.md").read_text()  # selection runs are not arms
    # A seed one arm lacks drops out of that arm's comparison only.
    (work / "smmd-seed5" / "run.json").unlink()
    assert analyze_a.write_report(work, results)["tests"]["exact_match"]["rows"][0]["n"] == 5


def test_post_hoc_first_token_section_tests_its_own_metrics(tmp_path, rng):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    (work / "study.json").write_text(json.dumps({"tier": "a", "settings": study_a.SETTINGS, "parameters": 1e6}))
    for seed in range(5):
        base = rng.uniform(0.3, 0.5)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base, [(100, 0.1)], first_token_mae=2.0)
        _synthetic_run(work / f"smmd-seed{seed}", "smmd", seed, base, [(100, 0.1)], first_token_mae=1.5)
    analysis = analyze_a.write_report(work, results)
    row = analysis["tests"]["mae_first_token"]["rows"][0]
    assert row["mean_difference"] == pytest.approx(-0.5) and row["n"] == 5
    assert analysis["tests"]["mae"]["rows"][0]["mean_difference"] == pytest.approx(0.0)  # pre-registered kept
    summary = (results / "tier_a_summary.md").read_text()
    assert "Post hoc" in summary and "10 of 10 runs scored" in summary and "in 10 of 10" in summary
    # A run without the post-hoc scores is missing there only.
    record = json.loads((work / "smmd-seed4" / "run.json").read_text())
    del record["eval_first_token"]
    (work / "smmd-seed4" / "run.json").write_text(json.dumps(record))
    analysis = analyze_a.write_report(work, results)
    assert analysis["tests"]["mae_first_token"]["rows"][0]["n"] == 4
    assert analysis["tests"]["mae"]["rows"][0]["n"] == 5


def test_report_regenerates_from_its_results_json_as_from_the_work_dir(tmp_path, rng):
    work, from_work, from_results = tmp_path / "work", tmp_path / "from_work", tmp_path / "from_results"
    work.mkdir()
    (work / "study.json").write_text(json.dumps({"tier": "a", "settings": study_a.SETTINGS, "parameters": 1e6,
                                                 "data": {"test_pairs": 25}}))
    for seed in range(4):  # scored before the capped MAE existed, no answers.json: it cannot be recomputed
        base = rng.uniform(0.3, 0.5)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base, [(100, 0.1), (200, 0.2)], first_token_mae=2.0)
        _synthetic_run(work / f"smmd-seed{seed}", "smmd", seed, base + rng.normal(0.05, 0.02),
                       [(100, 0.15), (200, 0.2 + rng.uniform(0, 0.1))], first_token_mae=1.5)
    analyze_a.main(["--work_dir", str(work), "--results_dir", str(from_work)])
    analyze_a.main(["--from_results", str(from_work / "tier_a.json"), "--results_dir", str(from_results)])
    # The same runs, cells, tests and power in the same schema: the numbers come from the recorded runs alone.
    saved = json.loads((from_work / "tier_a.json").read_text())
    assert json.loads((from_results / "tier_a.json").read_text()) == saved
    assert all(cell["n"] == 0 for cells in saved["cells"]["mae_capped"].values() for cell in cells.values())
    summary, regenerated = ((directory / "tier_a_summary.md").read_text() for directory in (from_work, from_results))
    provenance = ("Regenerated from tier_a.json (the runs' work directory is gone): the statistics are recomputed "
                  "from what it recorded of each run (scores, learning curve, timings).\n\n")
    assert provenance not in summary and regenerated.replace(provenance, "") == summary
    limits = ("Scored before the capped MAE existed (8 of 8 runs), without the per-item answers it needs: MAE over "
              "the parseable answers, not capped (the capped MAE is left out of the tables); each run scored 10 of "
              "the 25 test pairs; Tier A' (study_aprime) trains this setting again with every validation and test "
              "pair scored and capped MAE.")
    assert limits in regenerated and "capped at the split's answer span" not in regenerated  # no n/a table
    assert "95% t-interval" in regenerated and "## Pre-registered decision" in regenerated
    for argv in (["--work_dir", str(work), "--from_results", str(from_work / "tier_a.json")],  # one source at a time
                 ["--from_results", str(work / "tier_a.json")]):  # no such file
        with pytest.raises(SystemExit) as refused:
            analyze_a.main(argv)
        assert refused.value.code == 2


def test_ntl_mse_takes_the_weight_chosen_on_validation():
    assert tier_a.arm_flags("ntl_mse", 1e-4) == {"numeric_loss": ["ntl-mse:0.0001"]}
    assert tier_a.arm_flags("smmd") == {"numeric_loss": ["smmd:1"]}
    with pytest.raises(ValueError, match="weight the study chose"):
        tier_a.arm_flags("ntl_mse")
    with pytest.raises(ValueError, match="unknown Tier A arm 'smd'"):
        tier_a.arm_flags("smd")


def test_run_order_puts_the_headline_pair_first_and_ntl_mse_last():
    order = study_a.run_order(["ce", "smmd", "ntl_was", "ntl_mse", "random_kernel"], [0, 1])
    assert order[:4] == [("ce", 0), ("smmd", 0), ("ce", 1), ("smmd", 1)]
    assert order[4:8] == [("ntl_was", 0), ("random_kernel", 0), ("ntl_was", 1), ("random_kernel", 1)]
    assert order[8:] == [("ntl_mse", 0), ("ntl_mse", 1)]
    assert sorted(order) == sorted((arm, seed) for arm in ["ce", "smmd", "ntl_was", "ntl_mse", "random_kernel"]
                                   for seed in [0, 1])


def test_t_interval_is_the_paired_student_interval_and_wider_than_the_bootstrap():
    differences = [-0.14, -0.02, 0.01, -0.09, -0.06]
    low, high = stats.t_interval(differences)
    mean, sd = np.mean(differences), np.std(differences, ddof=1)
    half = 2.7764451051977987 * sd / math.sqrt(5)  # t(0.975, 4)
    assert (low, high) == pytest.approx((mean - half, mean + half), abs=1e-12)
    boot_low, boot_high = stats.bootstrap_interval(differences)
    assert low < boot_low and high > boot_high  # 5 seeds: the percentile bootstrap is too narrow
    assert stats.t_interval([0.2, 0.2]) == pytest.approx((0.2, 0.2))
    assert all(math.isnan(bound) for bound in stats.t_interval([0.1, None]))


def test_decision_rule_reads_the_preregistered_words_and_turns_lower_is_better():
    rule = stats.load_rule("c")
    assert rule["metric"] == "exact_match" and rule["split"] == "test" and "before" in rule["written"]

    def row(low, high, mde=0.05):
        return {"t95_low": low, "t95_high": high, "mde": mde}

    assert stats.decide(row(0.01, 0.09), True, rule) == "recommend"
    assert stats.decide(row(-0.09, -0.01), True, rule) == "warn"
    assert stats.decide(row(-0.03, 0.04), True, rule) == "no effect of MDE or more"
    assert stats.decide(row(-0.03, 0.08), True, rule) == "inconclusive"
    assert stats.decide(row(-2.0, -1.0), False, rule) == "recommend"  # MAE lower: better
    assert stats.decide(row(math.nan, math.nan), True, rule).startswith("untestable")
    with pytest.raises(KeyError, match="no pre-registered rule for tier 'z'"):
        stats.load_rule("z")


def test_study_wide_holm_counts_every_preregistered_test_and_leaves_post_hoc_out(tmp_path, rng):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    (work / "study.json").write_text(json.dumps({"tier": "a", "settings": study_a.SETTINGS, "parameters": 1e6}))
    for seed in range(5):
        base = rng.uniform(0.3, 0.5)
        _synthetic_run(work / f"ce-seed{seed}", "ce", seed, base, [(100, 0.1)], first_token_mae=2.0)
        _synthetic_run(work / f"smmd-seed{seed}", "smmd", seed, base + rng.normal(0.05, 0.02), [(100, 0.1)],
                       first_token_mae=1.5)
    analysis = analyze_a.write_report(work, results)
    family = [row for metric in analyze_a.METRICS for row in analysis["tests"][metric]["rows"]]
    finite = [row for row in family if math.isfinite(row["p_value"])]
    assert analysis["tests"]["exact_match"]["tests_study"] == len(finite) > analysis["tests"]["exact_match"]["tests"]
    for row in finite:
        assert row["p_holm"] <= row["p_holm_study"] + 1e-15  # a larger family never lowers an adjusted p
    smallest = min(finite, key=lambda row: row["p_value"])
    assert smallest["p_holm_study"] == pytest.approx(min(1.0, len(finite) * smallest["p_value"]))
    assert all(math.isnan(row["p_holm_study"]) for metric in analyze_a.POST_HOC_METRICS
               for row in analysis["tests"][metric]["rows"])
    summary = (results / "tier_a_summary.md").read_text()
    assert "95% t-interval" in summary and "p (Holm, study)" in summary and "## Pre-registered decision" in summary


def test_capped_mae_is_rescored_from_the_answers_of_a_run_scored_before_it(tmp_path):
    items = [{"prompt": "1+1=", "answer": 2, "task": "test/add"},
             {"prompt": "5+5=", "answer": 10, "task": "test/add"},
             {"prompt": "99+1=", "answer": 100, "task": "oor/add"},
             {"prompt": "99+3=", "answer": 102, "task": "oor/add"}]
    answers = [2, None, 150, 101]
    old = {key: {name: value for name, value in scores.items() if name not in ("mae_capped", "mae_cap")}
           for key, scores in tier_a.score(items, answers).items()}
    rescored = analyze_a.with_capped_mae(old, answers, items)
    assert rescored["test"]["mae_capped"] == pytest.approx((0 + 8) / 2)  # span 8: the unparseable answer counts 8
    assert rescored["oor"]["mae_capped"] == pytest.approx((2 + 1) / 2)   # span 2: the error 50 counts 2
    assert rescored["test"]["mae"] == old["test"]["mae"]
    assert analyze_a.with_capped_mae(old, None, items) == old  # no answers: nothing to rescore


@pytest.mark.parametrize("sigma", tier_a.PRIME_SIGMAS)
def test_shuffled_kernel_control_is_positive_semidefinite_and_the_random_kernel_is_not(sigma):
    # SMMD's objective in the numeric distribution p is (p - e_y)^T K (p - e_y) + alpha p^T L p, L = D - K:
    # its Hessian is 2 (K + alpha L). Tier A''s control (raw distances, values shuffled across the tokens)
    # must leave that positive semi-definite, so descent still pulls p toward the target.
    from smmd_scale.value_kernel import build_kernel

    values = torch.arange(1000, dtype=torch.float64)

    def smallest_and_largest(**options):
        matrices = build_kernel(values, **options)
        laplacian = torch.diag(matrices.degree) - matrices.kernel
        eigenvalues = torch.linalg.eigvalsh(matrices.kernel + matrices.alpha * laplacian)
        return float(eigenvalues[0]), float(eigenvalues[-1])

    low, high = smallest_and_largest(kernel="shuffled", sigmas=(sigma, ), squash_factor=0.0)
    # LAPACK's symmetric eigenvalues are exact to about N * eps * the largest (2e-13 relative): 1e-10 is rounding.
    assert low >= -1e-10 * high, (sigma, low, high)
    assert smallest_and_largest(kernel="gaussian", sigmas=(sigma, ), squash_factor=0.0)[0] >= -1e-10 * high
    random_low, random_high = smallest_and_largest(kernel="random")
    assert random_low < -1e-3 * random_high  # Tier A's random kernel: an indefinite objective


def test_tier_a_prime_arms_flags_and_the_selection_chooses_on_validation(tmp_path):
    from benchmarks.numeracy import study_aprime

    grid_candidates = study_aprime.candidates(quick=False)
    assert len(grid_candidates) == 9
    assert grid_candidates["sigma10-w0.3"] == {"numeric_loss": ["smmd:0.3"], "smmd_squash_factor": 0.0,
                                               "smmd_sigmas": [10.0]}
    assert list(study_aprime.candidates(quick=True)) == ["sigma10-w1"]
    assert tier_a.PRIME_SETTINGS["eval_per_split"] is None  # every validation and test pair is scored
    # A selection whose runs finished (a resumed one) is decided from their validation scores alone.
    grid = {"settings": tier_a.PRIME_SETTINGS, "data": {}, "work_dir": tmp_path, "env": {}, "began": 0.0,
            "study": {}}
    val = {"sigma3-w0.1": (0.30, 2.0), "sigma10-w1": (0.36, 1.5), "sigma30-w0.3": (0.36, 1.2), "reference": (0.33, 1.0)}
    for label, (exact, capped) in val.items():
        scores = {"count": 10, "exact_match": exact, "mae": capped, "mae_capped": capped, "within_1": 0.9,
                  "unparseable": 0.0}
        # the reference (CE on the selection seed) is one run that every arm's selection shares
        run_dir = tmp_path / "selection" / ("reference" if label == "reference" else f"smmd_raw-{label}")
        run_dir.mkdir(parents=True)
        flags = tier_a.ARMS["ce"] if label == "reference" else grid_candidates[label]
        (run_dir / "run.json").write_text(json.dumps({"eval": {"val": scores}, "eval_first_token": {}, "flags": flags,
                                                      "train_seconds": 1.0, "train_cpu_seconds": 2.0}))
    chosen = study_a.select_on_validation("smmd_raw", {label: grid_candidates.get(label, {}) for label in val
                                                       if label != "reference"}, tier_a.ARMS["ce"], grid, 1000,
                                          study_a.evaluate_a)
    assert chosen["chosen"] == "sigma30-w0.3"  # tied exact match: the lower capped MAE
    assert chosen["beats_reference"] is True and chosen["reference"]["val_exact_match"] == 0.33
    assert json.loads((tmp_path / "selection-smmd_raw.json").read_text()) == chosen
    assert study_aprime.flags_for("shuffled_kernel", dict(grid, smmd_raw=chosen["flags"]))["smmd_kernel"] == "shuffled"
    summary = analyze_a.selections_section([chosen])
    assert "sigma30-w0.3 beats CE (weight 0)" in summary[2]
