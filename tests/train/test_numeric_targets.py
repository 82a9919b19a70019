"""A numeric loss never silently does nothing (``smmd_train.data.numeric_targets``): the tokenizer's number
style; the numeric-target positions of the first optimizer steps, counted for each registered loss as the
train step counts them, against a count from the token strings and against the positions the loss itself
scores; and what train.py's set-up makes of them before the model is built, in one process (its own
``prepare_run``) and through a real launch/train.py: a refusal where the data hold no target of the loss,
a warning where the first steps hold none."""

import json
import random
import re
import subprocess

import pytest
import torch
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, metrics, train_command, train_flags
from helpers.style_tokenizers import gpt2_style, llama2_style, llama3_style, qwen_style

import smmd_scale
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss
from smmd_scale.vocab import dot_token_ids
from smmd_train.config.arguments import parse_args
from smmd_train.config.run_config import RunConfig
from smmd_train.data.batches import PackedBatches
from smmd_train.data.numeric_targets import (
    CHECKED_STEPS,
    check_digit_losses,
    number_style,
    numeric_targets,
    step_numeric_targets,
)
from smmd_train.data.packing import pack_files
from smmd_train.distributed.groups import Launch
from smmd_train.run import RunRefused, prepare_run

SEQ_LEN = 48
ZERO3 = REPO / "ds_configs" / "zero3.json"
STYLES = {"llama3": llama3_style, "gpt2": gpt2_style, "qwen": qwen_style, "llama2": llama2_style}
DIGIT_STYLES = ("qwen", "llama2")  # they spell numbers digit by digit
DIGIT_LOSSES = sorted(name for name, entry in NUMERIC_LOSSES.items() if entry.digits_reason)
# Each registered loss on the tokenizers it can read, with the vocabulary policy it reads them with.
LOSS_CASES = [(name, style, "digits" if name in DIGIT_LOSSES else policy) for name in sorted(NUMERIC_LOSSES)
              for style, policy in (("qwen", "digits"), ("llama2", "integers"), ("llama3", "integers"),
                                    ("gpt2", "integers"))
              if name not in DIGIT_LOSSES or style in DIGIT_STYLES]
_WORDS = "the of and to in is was for on that with as by at from this have are be".split()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Each style's tokenizer, saved as a Hugging Face directory: style -> (tokenizer, directory)."""
    saved = {}
    for style, build in STYLES.items():
        tokenizer, directory = build(), tmp_path_factory.mktemp(style)
        tokenizer.save_pretrained(directory)
        saved[style] = (tokenizer, directory)
    return saved


def numeric_text(rng: random.Random) -> str:
    """A line with numbers of one to five digits, decimals and words."""
    words = " ".join(rng.choices(_WORDS, k=rng.randint(0, 12)))
    return (f"In {rng.randint(1900, 2030)} we sold {rng.randint(0, 9)} cars and {rng.randint(10, 99999)} bikes "
            f"at {rng.randint(0, 999)}.{rng.randint(0, 99)} each; {words}")


def write_lines(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps({"prompt": prompt, "completion": completion}) + "\n"
                            for prompt, completion in records))
    return str(path)


def reference_is_numeric(token: str, policy: str, max_value: float = 999) -> bool:
    """Whether a token string is numeric under ``policy``, read from the string: one space marker, then
    one ASCII digit (digits), a canonical integer <= max_value (integers); a byte-fallback digit always."""
    if re.fullmatch(r"<0x3[0-9]>", token):
        return True
    bare = token[1:] if token[:1] in ("Ġ", "▁", " ") else token
    if policy == "digits":
        return re.fullmatch(r"[0-9]", bare) is not None
    return re.fullmatch(r"0|[1-9][0-9]*", bare) is not None and int(bare) <= max_value


def reference_targets(batch: dict):
    """The targets of a micro-batch of smmd_train.data, shifted by hand: labels (or input_ids) from position 1."""
    return batch.get("labels", batch["input_ids"])[:, 1:]


ONE_PROCESS = Launch(0, 1, 0, 1, "single")


def prepared(directory, data, output_dir, launch=ONE_PROCESS, **options):
    """train.py's own set-up (its parser, then ``prepare_run``) up to its data stage, on ``launch``'s ranks."""
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=directory, data=[data], seq_len=SEQ_LEN,
                  micro_batch_size=2, max_steps=20, output_dir=output_dir)
    values.update(options)
    return prepare_run(RunConfig.from_args(parse_args(train_flags(**values))), launch, until="data")


# ------------------------------------------------------------------------------------------------
# The tokenizer's number style
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style, kind, example", [
    ("llama3", "multi-digit", "12345 -> '123' '45'"),
    ("gpt2", "multi-digit", "12345 -> '12' '3' '45'"),
    ("qwen", "digit by digit", "12345 -> '1' '2' '3' '4' '5'"),
    ("llama2", "digit by digit", "12345 -> '1' '2' '3' '4' '5'"),
])
def test_the_number_style_of_each_tokenizer_family(tokenizers, style, kind, example):
    found = number_style(tokenizers[style][0])
    assert (found.kind, found.example) == (kind, example)
    assert found.digit_by_digit is (style in DIGIT_STYLES)
    assert str(found).endswith(f"({example})")


def test_a_tokenizer_without_digit_tokens_has_no_number_style():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "the": 1, "cat": 2}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    found = number_style(tokenizer)
    assert (found.kind, found.example, found.digit_by_digit) == ("no digits", "12345 -> '<unk>'", False)
    # the vocabulary refuses such a tokenizer in its own words ("no numeric token found ...")
    assert check_digit_losses([("del", 1.0)], tokenizer, "integers") == []


@pytest.mark.parametrize("name", DIGIT_LOSSES)
def test_a_loss_that_reads_digits_on_multi_digit_tokens_is_refused_or_warned_naming_what_works(tokenizers, name):
    llama3 = tokenizers["llama3"][0]
    with pytest.raises(ValueError) as refused:
        check_digit_losses([("smmd", 1.0), (name, 0.5)], llama3, "integers")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(NUMERIC_LOSSES[name].digits_reason)
    assert "writes numbers as multi-digit tokens (12345 -> '123' '45')" in message
    assert "(--numeric_loss smmd, ntl-was, ntl-mse, dist2 or gauss-ls) with --numeric_policy integers" in message
    assert message.endswith("; build it with --numeric_policy digits from a tokenizer that spells numbers digit by "
                            "digit")
    (warning, ) = check_digit_losses([(name, 1.0)], llama3, "digits")
    assert warning.startswith(f"--numeric_loss {name} reads numbers digit by digit, but this tokenizer writes numbers "
                              "as multi-digit tokens (12345 -> '123' '45'): it would see only the digits")
    for style in DIGIT_STYLES:
        assert check_digit_losses([(name, 1.0)], tokenizers[style][0], "integers") == []
    assert check_digit_losses([("smmd", 1.0)], llama3, "integers") == []


# ------------------------------------------------------------------------------------------------
# Counting: as the train step counts, what each loss scores
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, style, policy", LOSS_CASES)
@pytest.mark.parametrize("data_format", ["text", "prompt_completion"])
def test_the_count_is_the_positions_each_registered_loss_scores(tmp_path, tokenizers, generator, name, style,
                                                                policy, data_format):
    tokenizer = tokenizers[style][0]
    rng = random.Random(int(torch.randint(0, 2**31, (1, ), generator=generator)))
    if data_format == "text":
        data = write_lines(tmp_path / "train.jsonl", [numeric_text(rng) for _ in range(30)])
    else:
        data = write_records(tmp_path / "train.jsonl", [(numeric_text(rng), f" {rng.randint(0, 99999)}")
                                                        for _ in range(12)])
    blocks = pack_files([data], tokenizer, SEQ_LEN * 2 if data_format == "prompt_completion" else SEQ_LEN)
    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy=policy)
    loss = build_numeric_loss(vocab, [(name, 1.0)], dot_token_ids=dot_token_ids(tokenizer))
    batches, counted = PackedBatches(blocks, 4, 0, 1, seed=0), 0
    for _ in range(3):
        batch = next(batches)
        ours = numeric_targets(batch, loss.vocab.token_ids)
        targets = reference_targets(batch)
        from_strings = sum(reference_is_numeric(token, policy)
                           for row in targets.tolist() for token in tokenizer.convert_ids_to_tokens(
                               [token_id for token_id in row if token_id != -100]))
        logits = torch.randn(*targets.shape, len(tokenizer), generator=generator)
        scored = smmd_scale.numeric_cross_entropy(logits, targets, loss).stats["numeric_tokens"]
        assert ours == from_strings == scored, (name, style)
        counted += ours
    assert counted > 0


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (1, 1, 8), (2, 4, 1), (3, 1, 1)],
                         ids=lambda layout: "micro{}-dp{}-accumulation{}".format(*layout))
def test_a_step_s_count_is_the_sum_over_the_micro_batches_each_rank_trains_on(tmp_path, tokenizers, generator, layout):
    """Each step's count is what the train step sums over its ranks: every data-parallel rank's own
    ``PackedBatches``, ``accumulation`` micro-batches each, counted one by one."""
    micro_batch_size, dp_size, accumulation = layout
    tokenizer = tokenizers["llama3"][0]
    rng = random.Random(int(torch.randint(0, 2**31, (1, ), generator=generator)))
    texts = [numeric_text(rng) if rng.random() < 0.3 else " ".join(rng.choices(_WORDS, k=30)) for _ in range(120)]
    blocks = pack_files([write_lines(tmp_path / "train.jsonl", texts)], tokenizer, SEQ_LEN)
    numeric_token_ids = smmd_scale.NumericVocab.from_tokenizer(tokenizer).token_ids
    ranks = [PackedBatches(blocks, micro_batch_size, dp_rank, dp_size, seed=3, accumulation=accumulation)
             for dp_rank in range(dp_size)]
    steps = 2 * len(blocks) // (micro_batch_size * dp_size * accumulation)  # two epochs
    expected = [sum(numeric_targets(next(batches), numeric_token_ids) for batches in ranks for _ in range(accumulation))
                for _ in range(steps)]
    counts = step_numeric_targets(blocks, numeric_token_ids, micro_batch_size=micro_batch_size, dp_size=dp_size,
                                  accumulation=accumulation, seed=3)
    assert [next(counts) for _ in range(steps)] == expected
    assert sum(expected) > 0


def test_data_shorter_than_one_step_are_refused_in_the_words_of_the_run_s_layout(tmp_path, tokenizers):
    tokenizer = tokenizers["llama3"][0]
    blocks = pack_files([write_lines(tmp_path / "train.jsonl", ["we sold 12 cars " * 20] * 3)], tokenizer, SEQ_LEN)
    numeric_token_ids = smmd_scale.NumericVocab.from_tokenizer(tokenizer).token_ids
    with pytest.raises(ValueError, match=rf"the dataset has {len(blocks)} blocks, fewer than one optimizer step of "
                                         r"micro_batch_size=2 x dp_size=4 x accumulation=2 = 16"):
        next(step_numeric_targets(blocks, numeric_token_ids, micro_batch_size=2, dp_size=4, accumulation=2, seed=0))


# ------------------------------------------------------------------------------------------------
# train.py's set-up: refused or warned before the model is built
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NUMERIC_LOSSES))
def test_data_without_a_number_are_refused_for_every_registered_loss(tmp_path, tokenizers, name):
    style = "qwen" if name in DIGIT_LOSSES else "llama3"
    data = write_lines(tmp_path / "train.jsonl", [" ".join(random.Random(row).choices(_WORDS, k=20))
                                                  for row in range(60)])
    with pytest.raises(RunRefused) as refused:
        prepared(tokenizers[style][1], data, tmp_path / "run", numeric_loss=[f"{name}:0.5"],
                 numeric_policy="digits" if name in DIGIT_LOSSES else "integers")
    assert re.fullmatch(rf"--numeric_loss {name} would never see a target: this tokenizer "
                        rf"{re.escape(str(number_style(tokenizers[style][0])))}, and none of the [\d,]+ targets of "
                        r"--data is a number token; train on data with numbers \(prompt/completion records: in the "
                        r"completions\), or without a numeric loss \(--framework_loss\)", str(refused.value))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # no numeric loss, or one of weight 0: nothing to refuse
    assert prepared(tokenizers[style][1], data, tmp_path / "ce", numeric_loss=[f"{name}:0"],
                    numeric_policy="digits").plan.warnings == []
    assert prepared(tokenizers[style][1], data, tmp_path / "framework", framework_loss=True).plan.warnings == []


def test_a_digit_vocabulary_on_multi_digit_numbers_is_refused_naming_the_policy_that_reads_them(tmp_path,
                                                                                                  tokenizer_dir):
    """The user's report: --numeric_policy digits on a Llama-3-style tokenizer and data whose numbers
    are all two or three digits: 0 numeric positions at every step, now refused."""
    generator = random.Random(0)
    data = write_lines(tmp_path / "train.jsonl", [f"Q: {generator.randint(10, 499)} + {generator.randint(10, 499)} "
                                                  f"= ? A: {generator.randint(20, 998)}." for _ in range(200)])
    style = "writes numbers as multi-digit tokens (12345 -> '123' '45')"
    with pytest.raises(RunRefused) as refused:
        prepared(tokenizer_dir, data, tmp_path / "run", numeric_loss=["del"], numeric_policy="digits")
    assert re.fullmatch(rf"--numeric_loss del would never see a target: this tokenizer {re.escape(style)}, and none "
                        r"of the [\d,]+ targets of --data is one of its 10 numeric tokens \(--numeric_policy digits: "
                        r"the values 0..9\): the data's numbers are tokens such as '\d+', '\d+', '\d+'; train a loss "
                        r"that reads whole-number tokens \(--numeric_loss smmd, ntl-was, ntl-mse, dist2 or gauss-ls\) "
                        r"with --numeric_policy integers, or del on a tokenizer that spells numbers digit by digit",
                        str(refused.value))
    with pytest.raises(RunRefused) as refused:
        prepared(tokenizer_dir, data, tmp_path / "run", numeric_loss=["smmd", "ntl-was:0.3"], numeric_policy="digits")
    assert str(refused.value).startswith(f"--numeric_loss smmd ntl-was would never see a target: this tokenizer "
                                         f"{style}")
    assert str(refused.value).endswith("; use --numeric_policy integers")
    with pytest.raises(RunRefused) as refused:  # the values above the bound: the bound that reads them all
        prepared(tokenizer_dir, data, tmp_path / "run", numeric_loss=["ntl-was"], numeric_max_value=9)
    largest = max(int(number) for text in open(data) for number in re.findall(r"\d+", json.loads(text)["text"]))
    assert str(refused.value).endswith(f"; use --numeric_max_value {largest}")
    run = prepared(tokenizer_dir, data, tmp_path / "run", numeric_loss=["smmd", "ntl-was:0.3"],  # what it suggests
                   ntl_squash_factor=9.0)
    assert run.plan.warnings == []


def test_first_steps_without_a_numeric_target_warn_in_one_line(tmp_path, tokenizer_dir):
    """A few numbers among many words: a seed whose first steps hold none of them warns (the numeric
    term is 0 there); one whose first step holds one does not."""
    texts = [" ".join(random.Random(row).choices(_WORDS, k=40)) for row in range(400)] + ["we sold 7 cars"] * 3
    data = write_lines(tmp_path / "train.jsonl", texts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = pack_files([data], tokenizer, SEQ_LEN)
    numeric_token_ids = smmd_scale.NumericVocab.from_tokenizer(tokenizer).token_ids

    def first_steps_hold(seed, steps):  # by the blocks of each step, in the order PackedBatches serves them
        whole_steps = PackedBatches(blocks, 2, 0, 1, seed=seed)
        return any(numeric_targets(next(whole_steps), numeric_token_ids) for _ in range(steps))

    quiet = next(seed for seed in range(200) if not first_steps_hold(seed, CHECKED_STEPS))
    warned = prepared(tokenizer_dir, data, tmp_path / "run", seed=quiet).plan.warnings
    assert warned == [f"the first {CHECKED_STEPS} optimizer steps hold no target among the 1000 numeric tokens "
                      "(--numeric_policy integers: the values 0..999) of --numeric_loss smmd; later steps of --data "
                      "do: until then the numeric loss trains nothing, CE alone"]
    short = prepared(tokenizer_dir, data, tmp_path / "run", seed=quiet, max_steps=3, warmup_steps=1).plan.warnings
    assert [warning for warning in short if "optimizer steps hold no target" in warning] == [
        warned[0].replace(f"the first {CHECKED_STEPS} ", "the first 3 ")]
    lucky = next(seed for seed in range(2000) if first_steps_hold(seed, 1))
    assert prepared(tokenizer_dir, data, tmp_path / "run", seed=lucky).plan.warnings == []


def _prepare_without_targets(rank, world_size, tokenizer_dir: str, data: str, output_dir: str):
    import torch.distributed as dist

    try:
        prepared(tokenizer_dir, data, output_dir, numeric_loss=["del"], numeric_policy="digits",
                 launch=Launch(rank, world_size, rank, world_size, "test"))
    except RunRefused as error:
        dist.barrier()  # no rank is left inside a collective: they all refused at the same point
        return str(error)
    return None


@pytest.mark.gloo
@pytest.mark.slow  # starts processes: the fast loop keeps one test of this kind
def test_every_rank_refuses_the_same_line_without_a_collective(tmp_path, tokenizer_dir):
    from helpers.distributed import run_ranks, values_or_raise

    generator = random.Random(0)
    data = write_lines(tmp_path / "train.jsonl", [f"Q: {generator.randint(10, 499)} + {generator.randint(10, 499)} "
                                                  f"= ? A: {generator.randint(20, 998)}." for _ in range(200)])
    messages = values_or_raise(run_ranks(_prepare_without_targets, 2, str(tokenizer_dir), data, str(tmp_path / "run"),
                                         timeout=180, pg_timeout=60, fresh=True))
    assert messages[0] == messages[1] and messages[0].startswith("--numeric_loss del would never see a target")


@pytest.mark.slow  # starts launch/train.py
def test_train_py_refuses_a_numeric_loss_without_targets_in_one_line_before_the_model(tmp_path, tokenizer_dir):
    generator = random.Random(0)
    data = write_lines(tmp_path / "train.jsonl", [f"Q: {generator.randint(10, 499)} + {generator.randint(10, 499)} "
                                                  f"= ? A: {generator.randint(20, 998)}." for _ in range(200)])
    command = train_command(launcher="python", deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir,
                            data=[data], seq_len=SEQ_LEN, micro_batch_size=2, max_steps=3,
                            output_dir=tmp_path / "run", numeric_loss=["del:1"], numeric_policy="digits")
    completed = subprocess.run([str(part) for part in command], env=environment(), cwd=REPO, capture_output=True,
                               text=True, timeout=hang_guard(120))
    refusals = [line for line in completed.stderr.splitlines() if line.startswith("[train] refused:")]
    assert completed.returncode == 2, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert len(refusals) == 1 and refusals[0].startswith("[train] refused: --numeric_loss del would never see a "
                                                         "target: this tokenizer writes numbers as multi-digit tokens "
                                                         "(12345 -> '123' '45')")
    assert refusals[0].endswith("train a loss that reads whole-number tokens (--numeric_loss smmd, ntl-was, ntl-mse, "
                                "dist2 or gauss-ls) with --numeric_policy integers, or del on a tokenizer that spells "
                                "numbers digit by digit")
    assert "[train] world " not in completed.stdout  # the model was not built
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # starts launch/train.py
def test_train_py_warns_before_the_model_and_its_steps_score_the_counted_positions(tmp_path, tokenizer_dir):
    """DEL on the Llama-3-style tokenizer's lone digits: warned about before the model is built, and
    each step scores the positions the set-up counts for it."""
    from transformers import AutoTokenizer

    generator = random.Random(1)
    data = write_lines(tmp_path / "train.jsonl", [f"At {generator.randint(1, 9)}:{generator.randint(10, 59)} we "
                                                  f"counted {generator.randint(2, 999)} boxes." for _ in range(300)])
    command = train_command(launcher="python", deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir,
                            data=[data], seq_len=SEQ_LEN, micro_batch_size=2, gradient_accumulation_steps=2,
                            max_steps=3, warmup_steps=1, output_dir=tmp_path / "run", numeric_loss=["del"],
                            numeric_policy="digits", seed=5)
    completed = subprocess.run([str(part) for part in command], env=environment(), cwd=REPO, capture_output=True,
                               text=True, timeout=hang_guard(300))
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    warning = next(index for index, line in enumerate(lines) if line.startswith(
        "[train] warning: --numeric_loss del reads numbers digit by digit, but this tokenizer writes numbers as "
        "multi-digit tokens (12345 -> '123' '45')"))
    assert warning < next(index for index, line in enumerate(lines) if line.startswith("[train] world "))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = pack_files([data], tokenizer, SEQ_LEN)
    counts = step_numeric_targets(blocks, smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy="digits").token_ids,
                                  micro_batch_size=2, dp_size=1, accumulation=2, seed=5)
    logged = metrics(tmp_path / "run")
    assert [logged[step]["numeric/positions"] for step in (1, 2, 3)] == [next(counts) for _ in range(3)]
    assert logged[1]["numeric/positions"] > 0
