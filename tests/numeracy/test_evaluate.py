"""smmd_numeracy.evaluation and launch/evaluate.py on a tiny Llama that memorized a few QA items, so every
metric has a known value: exact match and MAE exactly, the teacher-forced numeric metrics against a
per-item, unpadded, float64 reference. The same items as prompt/completion records (train.py's
fine-tuning format) score the same, on the tokens train.py's data pipeline builds for them; a copy of
the model whose full-vocabulary argmax is a non-numeric decoy at every numeric answer position tells
the two numeric accuracies apart, and train.py's held-out evaluation agrees with evaluate.py on it."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import models

from smmd_numeracy import evaluate_qa, load_qa, parse_number
from smmd_numeracy.evaluate_cli import main as evaluate_main
from smmd_numeracy.evaluation import check_item, tokenize_items
from smmd_scale import NumericVocab
from smmd_train.data.packing import pack_files

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


@pytest.fixture(scope="module")
def decoyed(memorized, tmp_path_factory):
    """(model dir, model, tokenizer): :func:`decoy_model` of the memorized model, saved."""
    _, model, tokenizer = memorized
    model = decoy_model(model, tokenizer, QA)
    model_dir = tmp_path_factory.mktemp("decoyed")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, model, tokenizer


def reference_numeric(model, tokenizer, qa):
    """(full-vocabulary accuracy, mae, count) over the numeric answer tokens of question/answer items
    (:func:`reference_metrics`)."""
    metrics = reference_metrics(model, tokenizer, qa_rows(tokenizer, qa))
    return metrics["numeric_accuracy_full_vocab"], metrics["numeric_token_mae"], metrics["numeric_tokens"]


def qa_rows(tokenizer, qa):
    """(token ids, labels) of each question/answer item: ``prompt + " " + answer`` without special
    tokens, labels -100 on the prompt's tokens."""
    rows = []
    for item in qa:
        prompt_length = len(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
        ids = tokenizer(item["prompt"] + " " + str(item["answer"]), add_special_tokens=False)["input_ids"]
        rows.append((ids, [-100] * prompt_length + ids[prompt_length:]))
    return rows


def train_rows(tokenizer, path, seq_len=64):
    """(token ids, labels) of each record of a prompt/completion file as train.py's data pipeline builds
    them (``pack_files``, what ``--eval_data`` does), cut after the EOS, the last labelled token."""
    rows = []
    for row in pack_files([path], tokenizer, seq_len):
        length = max(position for position, label in enumerate(row["labels"]) if label != -100) + 1
        rows.append((row["input_ids"][:length], row["labels"][:length]))
    return rows


def reference_metrics(model, tokenizer, rows):
    """The teacher-forced numeric metrics over the labelled numeric targets of ``rows`` ((ids, labels)
    pairs): one row at a time, no padding, float64 logits; the argmax over the numeric tokens and
    over the full vocabulary, the expected value under the softmax over the numeric tokens."""
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    value_of = dict(zip(vocab.token_ids.tolist(), vocab.values.tolist()))
    numeric_columns = vocab.token_ids
    numeric_correct, full_vocab_correct, abs_errors = 0, 0, []
    with torch.no_grad():
        for ids, labels in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
            for position in range(1, len(ids)):
                target = labels[position]
                if target not in value_of:
                    continue
                full_vocab_correct += int(logits[position - 1].argmax()) == target
                numeric_correct += int(numeric_columns[logits[position - 1, numeric_columns].argmax()]) == target
                probabilities = torch.softmax(logits[position - 1, numeric_columns], dim=-1)
                abs_errors.append(abs(float(probabilities @ vocab.values) - value_of[target]))
    count = len(abs_errors)
    return {"numeric_accuracy": numeric_correct / count, "numeric_accuracy_full_vocab": full_vocab_correct / count,
            "numeric_token_mae": sum(abs_errors) / count, "numeric_tokens": count}


def as_completions(qa):
    """``qa`` as train.py's prompt/completion records: the answer after a space is the completion."""
    return [{"prompt": item["prompt"], "completion": f" {item['answer']}",
             **({"task": item["task"]} if "task" in item else {})} for item in qa]


METRICS = ("count", "exact_match", "mae", "relative_error", "unparseable", "numeric_accuracy",
           "numeric_accuracy_full_vocab", "numeric_token_accuracy", "numeric_token_mae", "numeric_tokens")


def decoy_model(model, tokenizer, qa):
    """A copy of ``model`` in which each numeric answer token ``t`` of ``qa`` has a decoy: a word token
    ``x`` that no prompt holds, whose LM-head row is twice ``t``'s, so ``x``'s logit is twice ``t``'s
    wherever ``t`` leads with a positive logit. The numeric tokens' logits are unchanged."""
    import copy

    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    numeric = set(vocab.token_ids.tolist())
    in_prompts = {token for item in qa for token in tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]}
    targets = sorted({token for ids, labels in qa_rows(tokenizer, qa) for token in labels if token in numeric})
    words = [token_id for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda pair: pair[1])
             if token.lstrip("Ġ").isalpha() and len(token.lstrip("Ġ")) >= 3 and token_id not in in_prompts
             and token_id not in tokenizer.all_special_ids]
    decoy = copy.deepcopy(model)
    with torch.no_grad():
        for target, word in zip(targets, words):
            decoy.lm_head.weight[word] = 2 * decoy.lm_head.weight[target]
    return decoy


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


# ----------------------------------------------------------------------------------------------
# Prompt/completion records: train.py's fine-tuning format
# ----------------------------------------------------------------------------------------------

def test_prompt_completion_records_score_as_their_question_answer_twins(memorized, tmp_path):
    _, model, tokenizer = memorized
    data = write_jsonl(tmp_path / "sft.jsonl", as_completions(QA))
    completions = load_qa(data)
    report = evaluate_qa(model, tokenizer, completions, batch_size=BATCH_SIZE)
    twin = evaluate_qa(model, tokenizer, QA, batch_size=BATCH_SIZE)

    assert {key: report[key] for key in METRICS} == {key: twin[key] for key in METRICS}
    assert report["per_task"] == twin["per_task"]
    assert report["examples"][2] == {"prompt": QA[2]["prompt"], "completion": " 14", "generated": " 14",
                                     "parsed": 14}
    # The reference reads the targets off train.py's own rows of the same file.
    reference = reference_metrics(model, tokenizer, train_rows(tokenizer, data))
    assert reference["numeric_tokens"] == report["numeric_tokens"] == 10
    assert report["numeric_accuracy"] == reference["numeric_accuracy"] == 1.0
    assert report["numeric_accuracy_full_vocab"] == reference["numeric_accuracy_full_vocab"] == 1.0
    assert report["numeric_token_mae"] == pytest.approx(reference["numeric_token_mae"], rel=1e-4, abs=1e-6)
    # Both formats in one file.
    mixed = [item if index % 2 else completion for index, (item, completion) in enumerate(zip(QA, completions))]
    assert {key: evaluate_qa(model, tokenizer, mixed, batch_size=BATCH_SIZE)[key] for key in METRICS} == \
        {key: twin[key] for key in METRICS}


def test_evaluation_feeds_the_tokens_train_py_trains_on_without_a_bos(memorized, tmp_path):
    """A tokenizer that adds a BOS by default (Llama's do): train.py's rows have none, and neither have
    the evaluation's prompts and teacher-forced tokens; the report is that of the same tokenizer
    without the BOS."""
    from helpers.style_tokenizers import llama3_style
    from tokenizers.processors import TemplateProcessing

    _, model, tokenizer = memorized
    with_bos = llama3_style()
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{with_bos.bos_token} $A", special_tokens=[(with_bos.bos_token, with_bos.bos_token_id)])
    assert with_bos("Q: 1 + 1? A:")["input_ids"][0] == with_bos.bos_token_id
    data = write_jsonl(tmp_path / "sft.jsonl", as_completions(QA))
    items = load_qa(data)

    prompt_ids, text_ids, answer_starts = tokenize_items(with_bos, items, [check_item(item, "") for item in items])
    rows = train_rows(with_bos, data)
    assert text_ids == [ids[:-1] for ids, _ in rows]  # train.py's row less its EOS
    assert answer_starts == [next(position for position, label in enumerate(labels) if label != -100)
                             for _, labels in rows]
    assert [ids[:start] for ids, start in zip(text_ids, answer_starts)] == prompt_ids
    assert all(with_bos.bos_token_id not in ids for ids in text_ids)
    assert evaluate_qa(model, with_bos, items, batch_size=BATCH_SIZE) == \
        evaluate_qa(model, tokenizer, items, batch_size=BATCH_SIZE)


def test_cli_reads_a_prompt_completion_file(memorized, tmp_path, capsys):
    model_dir, model, tokenizer = memorized
    data = write_jsonl(tmp_path / "sft.jsonl", as_completions(QA))
    output = tmp_path / "report.json"
    evaluate_main([str(model_dir), "--data", str(data), "--batch_size", str(BATCH_SIZE), "--output", str(output)])
    stdout = capsys.readouterr().out

    assert json.loads(output.read_text()) == json.loads(json.dumps(
        evaluate_qa(model, tokenizer, load_qa(data), batch_size=BATCH_SIZE)))
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines()]
    assert table[1][:3] == ["task", "count", "exact_match"] and "num_acc_full_vocab" in table[1]
    assert table[3][:3] == ["all", "8", "1.0000"]

    neither = write_jsonl(tmp_path / "text.jsonl", as_completions(QA[:2]) + [{"text": "Q: 2 + 2? A: 4"}])
    with pytest.raises(SystemExit, match=r"text.jsonl:3: missing field\(s\) \['prompt', 'answer'\]; every item "
                                         r"needs \"prompt\" and \"answer\" \(question/answer\) or \"prompt\" and "
                                         r"\"completion\" \(prompt/completion"):
        evaluate_main([str(model_dir), "--data", str(neither)])


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "completion": " 42"}', '{"prompt": "b", "completion": " forty-two"}'],
     r"qa.jsonl:2: \"completion\" ' forty-two' is not a number"),
    (['{"prompt": "a", "completion": " 42 apples"}'], r"qa.jsonl:1: \"completion\" ' 42 apples' is not a number"),
    (['{"prompt": "a", "completion": " 4e2"}'], r"qa.jsonl:1: \"completion\" ' 4e2' is not a number"),
    (['{"prompt": "a", "completion": 42}'], r"qa.jsonl:1: \"completion\" must be a non-empty string"),
    (['{"prompt": "a", "completion": " "}'], r"qa.jsonl:1: \"completion\" must be a non-empty string"),
    (['{"completion": " 42"}'], r"qa.jsonl:1: missing field\(s\) \['prompt'\]"),
    (['{"prompt": "a", "answer": 42, "completion": " 42"}'], r"qa.jsonl:1: both \"answer\" and \"completion\""),
    (['{"text": "a 42"}'], r"qa.jsonl:1: missing field\(s\) \['prompt', 'answer'\]; every item needs \"prompt\" "
                           r"and \"answer\" \(question/answer\) or \"prompt\" and \"completion\""),
])
def test_load_qa_prompt_completion_errors(tmp_path, lines, message):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        load_qa(path)


def test_completion_answers(tmp_path):
    records = [{"prompt": "a", "completion": " 42"}, {"prompt": "b", "completion": "-12\n"},
               {"prompt": "c", "completion": " 2.5 ", "task": "div"}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    assert load_qa(path) == records
    assert [check_item(record, "") for record in records] == ["42", "-12", "2.5"]


# ----------------------------------------------------------------------------------------------
# The two numeric accuracies
# ----------------------------------------------------------------------------------------------

def test_the_two_numeric_accuracies_differ_where_a_non_numeric_token_leads(decoyed, tmp_path):
    """At every numeric answer position the decoy model's full-vocabulary argmax is a word and its
    argmax over the numeric tokens the target: numeric_accuracy 1, the full-vocabulary one 0, in both
    formats, as the float64 reference reads them off the same rows."""
    _, model, tokenizer = decoyed
    data = write_jsonl(tmp_path / "sft.jsonl", as_completions(QA))
    reference = reference_metrics(model, tokenizer, train_rows(tokenizer, data))
    assert (reference["numeric_accuracy"], reference["numeric_accuracy_full_vocab"]) == (1.0, 0.0)

    for items in (QA, load_qa(data)):
        report = evaluate_qa(model, tokenizer, items, batch_size=BATCH_SIZE)
        assert (report["numeric_accuracy"], report["numeric_accuracy_full_vocab"]) == (1.0, 0.0)
        assert report["numeric_token_accuracy"] == report["numeric_accuracy_full_vocab"]
        assert report["numeric_tokens"] == reference["numeric_tokens"]
        assert report["numeric_token_mae"] == pytest.approx(reference["numeric_token_mae"], rel=1e-4, abs=1e-6)
        assert report["per_task"]["add"]["numeric_accuracy"] == 1.0
        assert report["per_task"]["add"]["numeric_accuracy_full_vocab"] == 0.0


@pytest.mark.slow
def test_train_py_and_evaluate_py_agree_on_the_same_prompt_completion_file(decoyed, tmp_path):
    """The user's case: one prompt/completion file as train.py's --data and --eval_data, then as
    launch/evaluate.py's --data on the exported model. lr 0 keeps the decoy model as it is; float32 on
    both sides."""
    from helpers.host_probe import hang_guard
    from helpers.launching import REPO, environment, metrics, run, train_command

    model_dir = decoyed[0]
    data = write_jsonl(tmp_path / "sft.jsonl", as_completions(QA))
    ds_config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds_config.update(bf16={"enabled": False}, tensorboard={"enabled": False})
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    output_dir = tmp_path / "run"
    run(train_command(launcher="python", deepspeed_config=tmp_path / "ds.json", model=model_dir, data=[data],
                      eval_data=[data], seq_len=32, micro_batch_size=2, max_steps=1, lr=0.0,
                      output_dir=output_dir, export_hf=output_dir / "hf"), timeout=600, env=environment())
    held_out = metrics(output_dir)[1]

    report_path = tmp_path / "report.json"
    completed = subprocess.run([sys.executable, str(REPO / "launch" / "evaluate.py"), str(output_dir / "hf"),
                                "--data", str(data), "--output", str(report_path)], env=environment(), cwd=REPO,
                               capture_output=True, text=True, timeout=hang_guard(120))
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())

    assert held_out["eval/numeric_tokens"] == report["numeric_tokens"] == 10
    assert held_out["eval/numeric_accuracy"] == report["numeric_accuracy"] == 1.0
    assert report["numeric_accuracy_full_vocab"] == 0.0
    assert held_out["eval/numeric_mae"] == pytest.approx(report["numeric_token_mae"], rel=1e-4, abs=1e-6)
    assert f"report: {report_path}" in completed.stdout
