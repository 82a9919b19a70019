"""smmd_numeracy.evaluation and launch/evaluate.py on a tiny Llama that memorized a few QA items, so every
metric has a known value: exact match and MAE exactly, the teacher-forced numeric metrics against a
per-item, unpadded, float64 reference."""

import json

import pytest
import torch
from helpers import models

from smmd_numeracy import evaluate_qa, load_qa, parse_number
from smmd_numeracy.evaluate_cli import main as evaluate_main
from smmd_scale import NumericVocab

# Mixed prompt lengths (left padding is exercised) and answers of 1, 2 and 3 tokens: a negative
# number, a 4-digit one ("123" "4") and a decimal ("2" "." "5").
QA = [
    {"prompt": "Q: What is 237 + 418? A:", "answer": 655, "task": "add"},
    {"prompt": "Q: What is 12 + 30? A:", "answer": 42, "task": "add"},
    {"prompt": "Q: What is 5 + 9? A:", "answer": "14", "task": "add"},
    {"prompt": "Q: What is 900 - 912? A:", "answer": -12, "task": "sub"},
    {"prompt": "Q: What is 500 + 734? A:", "answer": 1234, "task": "add"},
    {"prompt": "Q: Half of 5? A:", "answer": "2.5", "task": "div"},
    {"prompt": "Q: How many days are in a year? A:", "answer": 365, "task": "facts"},
    {"prompt": "Q: What is 3 times 7? A:", "answer": 21},
]
# Answers recorded wrong by a known amount (0: unchanged); the model still answers the memorized ones.
OFFSETS = [-5, 3, 0, 10, -34, 1, 0, 0]
BATCH_SIZE = 3  # several batches, the last one short


def tiny_llama(tokenizer, seed: int):
    return models.tiny_llama(len(tokenizer), kv_heads=4, max_positions=64, seed=seed,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def memorize(model, tokenizer, qa, steps: int = 200) -> float:
    """Full-batch AdamW on "prompt answer<eos>", loss on the answer and EOS; returns the last loss."""
    texts = [tokenizer(item["prompt"] + " " + str(item["answer"]))["input_ids"] + [tokenizer.eos_token_id]
             for item in qa]
    longest = max(len(ids) for ids in texts)
    input_ids = torch.full((len(qa), longest), tokenizer.eos_token_id)
    labels = torch.full((len(qa), longest), -100)
    attention_mask = torch.zeros((len(qa), longest), dtype=torch.long)
    for row, (item, ids) in enumerate(zip(qa, texts)):
        prompt_length = len(tokenizer(item["prompt"])["input_ids"])
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, prompt_length:len(ids)] = torch.tensor(ids[prompt_length:])
        attention_mask[row, :len(ids)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    """(model dir, model loaded back from it, tokenizer): a tiny Llama that memorized QA."""
    from helpers.style_tokenizers import llama3_style
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = llama3_style()
    model = tiny_llama(tokenizer, seed=0)
    final_loss = memorize(model, tokenizer, QA)
    assert final_loss < 0.02, f"the tiny model did not memorize the QA items (answer loss {final_loss:.4f})"
    model_dir = tmp_path_factory.mktemp("memorized")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def reference_numeric(model, tokenizer, qa):
    """(accuracy, mae, count) over numeric answer tokens: one item at a time, no padding, float64 softmax."""
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    value_of = dict(zip(vocab.token_ids.tolist(), vocab.values.tolist()))
    numeric_columns = vocab.token_ids
    correct, abs_errors = 0, []
    with torch.no_grad():
        for item in qa:
            prompt_length = len(tokenizer(item["prompt"])["input_ids"])
            ids = tokenizer(item["prompt"] + " " + str(item["answer"]))["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
            for position in range(prompt_length, len(ids)):
                target = ids[position]
                if target not in value_of:
                    continue
                correct += int(logits[position - 1].argmax()) == target
                probabilities = torch.softmax(logits[position - 1, numeric_columns], dim=-1)
                abs_errors.append(abs(float(probabilities @ vocab.values) - value_of[target]))
    return correct / len(abs_errors), sum(abs_errors) / len(abs_errors), len(abs_errors)


def test_memorized_items_score_perfectly(memorized):
    _, model, tokenizer = memorized
    model.train()
    report = evaluate_qa(model, tokenizer, QA, batch_size=BATCH_SIZE)

    assert report["count"] == len(QA)
    assert (report["exact_match"], report["mae"], report["relative_error"], report["unparseable"]) == (1.0, 0, 0, 0)
    assert report["numeric_token_accuracy"] == 1.0
    accuracy, mae, count = reference_numeric(model, tokenizer, QA)
    assert report["numeric_tokens"] == count == 10  # 1 token each, 2 for "123" "4", 2 for "2" "." "5"
    assert report["numeric_token_mae"] == pytest.approx(mae, rel=1e-4, abs=1e-6)
    assert [example["parsed"] for example in report["examples"]] == [655, 42, 14, -12, 1234]
    assert report["examples"][2] == {"prompt": QA[2]["prompt"], "answer": "14", "generated": " 14", "parsed": 14}
    # Only the items with a "task" are broken down.
    assert sorted(report["per_task"]) == ["add", "div", "facts", "sub"]
    assert report["per_task"]["add"]["count"] == 4 and report["per_task"]["add"]["numeric_tokens"] == 5
    # Caller's state is untouched; a second run gives the same report.
    assert model.training and tokenizer.padding_side == "right" and tokenizer.pad_token is None
    assert evaluate_qa(model, tokenizer, QA, batch_size=BATCH_SIZE) == report


def test_known_answer_errors_give_exact_metrics(memorized):
    _, model, tokenizer = memorized
    wrong = [dict(item, answer=str(float(item["answer"]) + offset) if isinstance(item["answer"], str)
                  else item["answer"] + offset) if offset else item for item, offset in zip(QA, OFFSETS)]
    report = evaluate_qa(model, tokenizer, wrong, batch_size=BATCH_SIZE)

    recorded_values = [float(item["answer"]) for item in wrong]
    assert report["exact_match"] == OFFSETS.count(0) / len(QA)
    assert report["mae"] == sum(abs(offset) for offset in OFFSETS) / len(QA)
    assert report["relative_error"] == pytest.approx(
        sum(abs(offset) / max(abs(value), 1) for offset, value in zip(OFFSETS, recorded_values)) / len(QA))
    assert report["unparseable"] == 0
    assert report["per_task"]["sub"]["mae"] == 10 and report["per_task"]["facts"]["exact_match"] == 1.0
    accuracy, mae, count = reference_numeric(model, tokenizer, wrong)
    assert report["numeric_token_accuracy"] == pytest.approx(accuracy) and report["numeric_tokens"] == count
    assert report["numeric_token_mae"] == pytest.approx(mae, rel=1e-4, abs=1e-6)
    assert report["numeric_token_accuracy"] < 1.0 and report["numeric_token_mae"] > 1.0


def test_untrained_model_scores_low(memorized):
    _, trained, tokenizer = memorized
    report = evaluate_qa(tiny_llama(tokenizer, seed=0), tokenizer, QA, batch_size=BATCH_SIZE)

    assert report["count"] == len(QA) and report["exact_match"] <= 0.25
    assert report["numeric_token_accuracy"] <= 0.2
    assert report["numeric_token_mae"] > 10 * evaluate_qa(trained, tokenizer, QA)["numeric_token_mae"]
    assert report["unparseable"] > 0 or report["mae"] > 0


def test_batching_does_not_change_results_on_an_absolute_position_model():
    """GPT-2's learned positions would shift under left padding unless position ids follow the mask."""
    from helpers.style_tokenizers import gpt2_style
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = gpt2_style()
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    one_at_a_time = evaluate_qa(model, tokenizer, QA, batch_size=1)
    batched = evaluate_qa(model, tokenizer, QA, batch_size=len(QA))

    assert one_at_a_time["examples"] == batched["examples"]
    for key in ("exact_match", "mae", "unparseable", "numeric_token_accuracy", "numeric_tokens"):
        assert batched[key] == one_at_a_time[key], key
    assert batched["numeric_token_mae"] == pytest.approx(one_at_a_time["numeric_token_mae"], rel=1e-5)
    accuracy, mae, count = reference_numeric(model, tokenizer, QA)
    assert batched["numeric_token_mae"] == pytest.approx(mae, rel=1e-4) and batched["numeric_tokens"] == count


def test_cli_writes_the_in_process_report(memorized, tmp_path, capsys):
    model_dir, model, tokenizer = memorized
    data = write_jsonl(tmp_path / "qa.jsonl", QA + [{"prompt": "Q: What is 1 + 1? A:", "answer": 2}])
    output = tmp_path / "reports" / "report.json"
    evaluate_main([str(model_dir), "--data", str(data), "--limit", str(len(QA)), "--batch_size", str(BATCH_SIZE),
                   "--output", str(output)])
    stdout = capsys.readouterr().out

    expected = evaluate_qa(model, tokenizer, load_qa(data)[:len(QA)], batch_size=BATCH_SIZE)
    assert json.loads(output.read_text()) == json.loads(json.dumps(expected))
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines()]
    assert table[1][:3] == ["task", "count", "exact_match"]
    assert table[3][:3] == ["all", "8", "1.0000"]
    assert f"report: {output}" in stdout


def test_cli_rejects_bad_inputs(memorized, tmp_path, capsys):
    model_dir = memorized[0]
    main = evaluate_main
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    cases = [([str(tmp_path / "nowhere"), "--data", str(data)], "no config.json"),
             ([str(model_dir), "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
             ([str(model_dir), "--data", str(data), "--tokenizer", str(tmp_path / "no_tokenizer")], "not a directory"),
             ([str(model_dir), "--data", str(data), "--limit", "0"], "--limit must be >= 1")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as raised:
            main(argv)
        assert raised.value.code == 2 and message in capsys.readouterr().err, argv
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Q: 1 + 1? A:", "answer": 2}\n{"prompt": "Q: 2 + 2? A:"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: missing field\(s\) \['answer'\]"):
        main([str(model_dir), "--data", str(bad)])


@pytest.mark.parametrize("text, expected", [
    (" 655", 655), (" -12 apples", -12), ("+7", 7), (" 2.5", 2.5), ("-0.25", -0.25), ("about 3. Then 4", 3),
    ("x1,000", 1), ("12.5.6", 12.5), ("v2 or 3", 2), ("007", 7), (" - 5", 5), ("", None), (" apples", None),
    ("٣ and ３", None), ("- .", None),
])
def test_parse_number(text, expected):
    parsed = parse_number(text)
    assert parsed == expected and type(parsed) is type(expected)


def test_load_qa(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"prompt": "Q: 1 + 1? A:", "answer": 2}\n\n{"prompt": "Q: 3 / 2? A:", "answer": "1.5", '
                    '"task": "div"}\n')
    assert load_qa(path) == [{"prompt": "Q: 1 + 1? A:", "answer": 2},
                             {"prompt": "Q: 3 / 2? A:", "answer": "1.5", "task": "div"}]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2'], r"qa.jsonl:2: not valid JSON"),
    (['{"prompt": "a", "answer": 1}', "", '{"answer": 3}'], r"qa.jsonl:3: missing field\(s\) \['prompt'\]"),
    (['{"prompt": "a"}'], r"qa.jsonl:1: missing field\(s\) \['answer'\]"),
    (['{"prompt": "a", "answer": "many"}'], r"qa.jsonl:1: \"answer\" 'many' is not a plain decimal number"),
    (['{"prompt": "a", "answer": "1e5"}'], r"qa.jsonl:1: \"answer\" '1e5' is not a plain decimal number"),
    (['{"prompt": "a", "answer": true}'], r"qa.jsonl:1: \"answer\" must be a number"),
    (['{"prompt": "", "answer": 1}'], r"qa.jsonl:1: \"prompt\" must be a non-empty string"),
    (['{"prompt": "a", "answer": 1, "task": 3}'], r"qa.jsonl:1: \"task\" must be a string"),
    (['[1, 2]'], r"qa.jsonl:1: expected a JSON object"),
    (["", "  "], r"holds no QA items"),
])
def test_load_qa_errors(tmp_path, lines, message):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        load_qa(path)


def test_load_qa_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_qa(tmp_path / "missing.jsonl")


def test_evaluate_qa_checks_items_and_arguments(memorized):
    _, model, tokenizer = memorized
    with pytest.raises(ValueError, match=r"qa\[1\]: missing field"):
        evaluate_qa(model, tokenizer, [QA[0], {"prompt": "Q: 1 + 1? A:"}])
    with pytest.raises(ValueError, match="qa is empty"):
        evaluate_qa(model, tokenizer, [])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        evaluate_qa(model, tokenizer, QA, batch_size=0)
