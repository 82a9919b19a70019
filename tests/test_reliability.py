"""Reliability: bad inputs raise the same error on every tensor-parallel rank (never a hang), NaN/inf
steps are skipped together and abort after K in a row, a lost rank ends the job quickly, a crash
mid-save never leaves a trusted broken checkpoint, and bad configs and data fail before training."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks, values_or_raise
from launching import REPO, deepspeed_command, environment, metrics, run
from smmd_scale import NumericVocab, SMMDLoss, smmd_cross_entropy

# ------------------------------------------------------------------------------------------------
# The loss-level catalogue, on 2 and 4 gloo ranks: (scenario, rank that gets the bad input or "all")
# -> the error every rank must raise.
# ------------------------------------------------------------------------------------------------

CATALOGUE = {
    "target_out_of_range": (1, "ValueError", r"rank 1 of the group: targets\[4\] = \d+ is outside the vocabulary"),
    "negative_target": ("last", "ValueError", r"targets\[2\] = -5 is outside"),
    "targets_differ_across_ranks": (0, "ValueError", "targets differ across the tensor-parallel ranks"),
    "float_targets": (1, "TypeError", "rank 1 of the group: targets have dtype torch.float32"),
    "bool_targets": (0, "TypeError", "targets have dtype torch.bool"),
    "integer_logits": (1, "TypeError", "rank 1 of the group: logits have dtype torch.int64"),
    "targets_shape": (0, "ValueError", "rank 0 of the group: targets hold 11 positions"),
    "targets_rank_shape_all": ("all", "ValueError", "targets hold 12 positions in 2 dims but logits .* 1 dims"),
    "shards_overlap": (1, "ValueError", "do not tile the vocabulary"),
    "shards_leave_a_gap": ("last", "ValueError", "do not tile the vocabulary"),
    "shard_beyond_vocabulary": ("last", "ValueError", r"shard covers vocabulary ids \[\d+, \d+\) which is not inside"),
    "different_vocabulary": (1, "ValueError", "hold different numeric vocabularies or SMMD options"),
    "different_options": (0, "ValueError", "hold different numeric vocabularies or SMMD options"),
    "negative_weight": (1, "ValueError", "weight=-0.5 must be a finite number >= 0"),
    "nan_weight": (0, "ValueError", "weight=nan must be"),
    "negative_num_items": (1, "ValueError", "num_items_in_batch=-3 must be >= 0"),
    "empty_vocabulary": ("all", "ValueError", "empty numeric vocabulary"),
    "one_value_vocabulary": ("all", "ValueError", "needs at least two distinct"),
    "bad_sigmas": ("all", "ValueError", "sigmas=.* must be a non-empty sequence of finite positive numbers"),
}


def _one_scenario(rank, world_size, scenario):
    where, _, _ = CATALOGUE[scenario]
    bad = where == "all" or where == rank or (where == "last" and rank == world_size - 1)
    vocab_size, tokens = 30 * world_size, 12
    width = vocab_size // world_size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab_size, generator=generator)
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::3] = 5
    start, end = rank * width, (rank + 1) * width
    weight, num_items = 1.0, None
    began = time.monotonic()
    try:
        ids, values, options = [1, 5, width + 2, vocab_size - 1], [1.0, 5.0, 9.0, 2.0], {}
        if bad and scenario == "different_vocabulary":
            ids, values = [1, 5], [1.0, 5.0]
        if bad and scenario == "different_options":
            options = {"sigmas": (1.0, )}
        if bad and scenario == "empty_vocabulary":
            ids, values = [], []
        if bad and scenario == "one_value_vocabulary":
            values = [3.0] * 4
        if bad and scenario == "bad_sigmas":
            options = {"sigmas": (-1.0, )}
        smmd = SMMDLoss(NumericVocab(ids, values, vocab_size), **options)
        if bad:
            if scenario == "target_out_of_range":
                targets[4] = vocab_size + 7
            elif scenario == "negative_target":
                targets[2] = -5
            elif scenario == "targets_differ_across_ranks":
                targets[7] = (targets[7] + 1) % vocab_size
            elif scenario == "float_targets":
                targets = targets.float()
            elif scenario == "bool_targets":
                targets = targets > 3
            elif scenario == "integer_logits":
                logits = logits.long()
            elif scenario == "targets_shape":
                targets = targets[:-1]
            elif scenario == "targets_rank_shape_all":
                targets = targets.reshape(3, 4)
            elif scenario == "shards_overlap":
                start -= 1
            elif scenario == "shards_leave_a_gap":
                start += 1
            elif scenario == "shard_beyond_vocabulary":
                start, end = start + 2, end + 2
            elif scenario == "negative_weight":
                weight = -0.5
            elif scenario == "nan_weight":
                weight = float("nan")
            elif scenario == "negative_num_items":
                num_items = -3
        shard = logits[:, start:min(end, vocab_size)] if scenario != "shard_beyond_vocabulary" or not bad else \
            torch.cat([logits[:, start:vocab_size], logits[:, :2]], dim=1)
        smmd_cross_entropy(shard, targets, smmd, weight=weight, tp_group=dist.group.WORLD, vocab_start_index=start,
                           num_items_in_batch=num_items)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error), time.monotonic() - began
    return "no error", "", time.monotonic() - began


def _catalogue(rank, world_size):
    outcomes = {}
    for scenario in CATALOGUE:
        outcomes[scenario] = _one_scenario(rank, world_size, scenario)
        # A healthy call after each failure: the group is still usable, nothing is left half-done.
        vocab = NumericVocab([1, 5], [1.0, 5.0], 10 * world_size)
        logits = torch.randn(6, 10 * world_size)
        out = smmd_cross_entropy(logits[:, rank * 10:(rank + 1) * 10], torch.tensor([1, 5, 7, 9, -100, 3]),
                                 SMMDLoss(vocab), tp_group=dist.group.WORLD, vocab_start_index=rank * 10)
        assert torch.isfinite(out.total)
    return outcomes


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_bad_input_raises_the_same_error_on_every_rank(world_size):
    assert len(CATALOGUE) >= 15
    results = values_or_raise(run_ranks(_catalogue, world_size, timeout=180, pg_timeout=30))
    for scenario, (_, error_type, pattern) in CATALOGUE.items():
        seen = [result[scenario] for result in results]
        assert all(kind == error_type for kind, _, _ in seen), (scenario, seen)
        assert len({message for _, message, _ in seen}) == 1, (scenario, seen)  # the same error everywhere
        assert re.search(pattern, seen[0][1]), (scenario, seen[0][1])
        assert max(seconds for _, _, seconds in seen) < 5.0, (scenario, seen)


# ------------------------------------------------------------------------------------------------
# Launch-level faults (train.py through the deepspeed launcher, 2 CPU ranks)
# ------------------------------------------------------------------------------------------------

TRAIN = REPO / "launch" / "train.py"
SEQ_LEN = 48


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from style_tokenizers import llama3_style

    directory = tmp_path_factory.mktemp("tokenizer")
    llama3_style().save_pretrained(directory)
    return directory


def write_corpus(path, documents: int, seed: int = 0, number_share: float = 0.0, number: int = 123):
    """Arithmetic lines; ``number`` replaces the fixed filler number in ``number_share`` of them
    (the token count of the corpus is the same whatever ``number`` is: both are single tokens)."""
    import random

    generator = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(documents):
            a, b = generator.randint(0, 499), generator.randint(0, 499)
            filler = number if generator.random() < number_share else 123
            handle.write(json.dumps({"text": f"Q: {a} + {b} = ? A: {a + b}. Then {filler} more."}) + "\n")
    return path


def train_command(tokenizer_or_model, data, output_dir, *extra, steps=4, model="tiny", config="cpu_zero3.json"):
    source = ["--model", model, "--tokenizer", tokenizer_or_model] if model == "tiny" else ["--model", model]
    return [TRAIN, "--deepspeed_config", REPO / "ds_configs" / config, *source, "--data", data, "--seq_len",
            SEQ_LEN, "--micro_batch_size", 2, "--max_steps", steps, "--warmup_steps", 1, "--lr", 3e-3,
            "--output_dir", output_dir, *extra]


def rank_processes(marker: str) -> list:
    """PIDs of train.py rank processes whose command line holds ``marker`` (the output dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "train.py" in command and marker in command and "--local_rank" in command:
            found.append((int(entry.name), command))
    return found


def test_a_rank_killed_mid_step_ends_the_job_quickly(tmp_path, tokenizer_dir):
    data = write_corpus(tmp_path / "train.jsonl", 400)
    output = tmp_path / "run"
    command = [str(part) for part in deepspeed_command(2, *train_command(
        tokenizer_dir, data, output, "--process_group_timeout_minutes", 1, steps=500))]
    launcher = subprocess.Popen(command, env=environment(), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ((output / "metrics.jsonl").exists() and len(metrics(output)) > 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        victims = [pid for pid, command in rank_processes(str(output)) if "--local_rank=1" in command]
        assert len(victims) == 1, rank_processes(str(output))
        killed_at = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        returncode = launcher.wait(timeout=120)
        assert returncode != 0 and time.monotonic() - killed_at < 90
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_crash_mid_save_never_resumes_from_the_broken_checkpoint(tmp_path, tokenizer_dir):
    data = write_corpus(tmp_path / "train.jsonl", 400)
    output = tmp_path / "run"
    run(deepspeed_command(2, *train_command(tokenizer_dir, data, output, "--save_steps", 2)), timeout=600)
    expected = metrics(output)
    # What a crash in the middle of saving step 4 leaves: shards half written, no commit marker,
    # and a "latest" that already names the new tag (DeepSpeed's own save writes it that early).
    (output / "step00000004" / "commit.json").unlink()
    shard = next((output / "step00000004").glob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    (output / "latest").write_text("step00000004")
    completed = run(deepspeed_command(2, *train_command(tokenizer_dir, data, output, "--save_steps", 2,
                                                        "--resume")), timeout=600)
    assert "resumed from step00000002 at step 2" in completed.stdout
    resumed = metrics(output)
    for step in (3, 4):
        assert resumed[step]["loss/total"] == pytest.approx(expected[step]["loss/total"], rel=1e-6)


def _model_with_a_nan_embedding_row(directory, tokenizer_dir, token: str):
    """A tiny untied Llama whose *input* embedding of ``token`` is NaN: any sequence containing the
    token gets a NaN loss, sequences without it are unaffected."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, tie_word_embeddings=False))
    token_id = tokenizer.convert_tokens_to_ids(token)
    with torch.no_grad():
        model.model.embed_tokens.weight[token_id] = float("nan")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return token_id


def test_non_finite_steps_are_skipped_on_every_rank(tmp_path, tokenizer_dir):
    model_dir = tmp_path / "model"
    token_id = _model_with_a_nan_embedding_row(model_dir, tokenizer_dir, "777")
    data = write_corpus(tmp_path / "train.jsonl", 600, number_share=0.04, number=777)
    output = tmp_path / "run"
    run(deepspeed_command(2, *train_command(None, data, output, "--max_skipped_steps", 50, "--export_hf",
                                            output / "hf", steps=10, model=model_dir)), timeout=600)
    logged = metrics(output)
    skipped = [torch.isnan(torch.tensor(logged[step]["loss/total"])).item() for step in range(1, 11)]
    # Data-parallel ranks see different batches; a NaN on either one skips the step for both.
    assert 0 < sum(skipped) < 10, skipped
    for step in range(1, 11):
        assert logged[step]["train/skipped_steps"] == sum(skipped[:step])
        if not skipped[step - 1]:
            assert torch.isfinite(torch.tensor(logged[step]["train/grad_norm"]))
    # No NaN leaked into any update: only the poisoned embedding row is still NaN.
    from safetensors.torch import load_file
    weights = load_file(output / "hf" / "model.safetensors")
    for name, tensor in weights.items():
        if name == "model.embed_tokens.weight":
            assert torch.isnan(tensor[token_id]).all()
            tensor = torch.cat([tensor[:token_id], tensor[token_id + 1:]])
        assert torch.isfinite(tensor).all(), name


def test_consecutive_non_finite_steps_abort_with_an_intact_checkpoint(tmp_path, tokenizer_dir):
    model_dir = tmp_path / "model"
    _model_with_a_nan_embedding_row(model_dir, tokenizer_dir, "777")
    clean = write_corpus(tmp_path / "clean.jsonl", 300)
    output = tmp_path / "run"
    run(deepspeed_command(2, *train_command(None, clean, output, "--save_steps", 2, steps=2, model=model_dir)),
        timeout=600)
    # The same documents, but now every one holds the token whose embedding is NaN.
    poisoned = write_corpus(tmp_path / "poisoned.jsonl", 300, number_share=1.0, number=777)
    # Steps 3, 4, 5 are skipped; the checkpoint at step 4 still commits (a skipped step leaves the
    # weights as they were, and its data position is past the poisoned batches).
    with pytest.raises(AssertionError, match=r"(?s)exited 3.*3 consecutive optimizer steps had a NaN/inf loss.*"
                                              r"the last committed checkpoint is step00000004"):
        run(deepspeed_command(2, *train_command(None, poisoned, output, "--save_steps", 2, "--resume",
                                                "--max_skipped_steps", 3, steps=8, model=model_dir)),
            timeout=600)
    assert (output / "latest").read_text() == "step00000004"
    assert metrics(output)[5]["train/skipped_steps"] == 3 and 6 not in metrics(output)
    # The checkpoint is intact: a run on clean data resumes from it and finishes.
    completed = run(deepspeed_command(2, *train_command(None, clean, output, "--save_steps", 2, "--resume",
                                                        steps=6, model=model_dir)), timeout=600)
    assert "resumed from step00000004 at step 4" in completed.stdout
    assert all(not torch.isnan(torch.tensor(metrics(output)[step]["loss/total"])) for step in (5, 6))


# ------------------------------------------------------------------------------------------------
# Bad configs and data: a clear error before training starts
# ------------------------------------------------------------------------------------------------


def _config(tmp_path, edit, base="cpu_zero3.json"):
    config = json.loads((REPO / "ds_configs" / base).read_text())
    edit(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _small_hf_model(directory, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(directory)
    return directory


BAD_SETUPS = {
    "autotp_size_does_not_divide_world": (
        lambda tmp, tok: {"config": REPO / "ds_configs" / "cpu_zero3_autotp.json"},
        r"autotp_size=2 must divide the world size 1"),
    "zero_stage_2": (lambda tmp, tok: {"config": _config(tmp, lambda c: c["zero_optimization"].update(stage=2))},
                     r"zero_optimization.stage=2: train.py runs ZeRO stage 3"),
    "offload_on_the_cpu_accelerator": (
        lambda tmp, tok: {"config": _config(tmp, lambda c: c["zero_optimization"].update(
            offload_optimizer={"device": "cpu"}))}, r"offloads to the CPU, but this run already trains on the CPU"),
    "batch_sizes_do_not_multiply_out": (
        lambda tmp, tok: {"config": _config(tmp, lambda c: c.update(train_batch_size=7))},
        r"train_batch_size=7 but train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x data-parallel "
        r"size 1"),
    "invalid_json_config": (
        lambda tmp, tok: {"config": (tmp / "broken.json", (tmp / "broken.json").write_text("{"))[0]},
        r"is not valid JSON"),
    "tokenizer_larger_than_model": (
        lambda tmp, tok: {"model": _small_hf_model(tmp / "small", 100), "tokenizer": tok},
        r"the tokenizer has \d+ tokens but the model's embedding has 100 rows"),
    "missing_text_field": (lambda tmp, tok: {"extra": ["--text_field", "body"]}, r"'body'.*text"),
    "empty_dataset": (lambda tmp, tok: {"data": (tmp / "empty.jsonl", (tmp / "empty.jsonl").write_text(""))[0]},
                      r"empty"),
    "dataset_smaller_than_one_block": (
        lambda tmp, tok: {"data": write_corpus(tmp / "tiny.jsonl", 1)}, r"too small|fewer"),
    "non_utf8_line": (lambda tmp, tok: {"data": _non_utf8(tmp / "bad.jsonl")}, r"bad.jsonl.*line 3.*UTF-8"),
    "preset_without_tokenizer": (lambda tmp, tok: {"tokenizer": None}, r"is a preset .* pass --tokenizer"),
}


def _non_utf8(path):
    lines = [json.dumps({"text": "fine line 1"}).encode(), json.dumps({"text": "fine line 2"}).encode(),
             b'{"text": "broken \xff\xfe bytes"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("setup", sorted(BAD_SETUPS))
def test_bad_configs_and_data_fail_before_training(tmp_path, tokenizer_dir, setup):
    make, pattern = BAD_SETUPS[setup]
    values = {"config": REPO / "ds_configs" / "cpu_zero3.json", "model": "tiny", "tokenizer": tokenizer_dir,
              "data": write_corpus(tmp_path / "train.jsonl", 200), "extra": []}
    values.update(make(tmp_path, tokenizer_dir))
    command = [sys.executable, TRAIN, "--deepspeed_config", values["config"], "--model", values["model"], "--data",
               values["data"], "--seq_len", SEQ_LEN, "--micro_batch_size", 2, "--max_steps", 2, "--output_dir",
               tmp_path / "run", *values["extra"]]
    if values["tokenizer"] is not None:
        command += ["--tokenizer", values["tokenizer"]]
    completed = subprocess.run([str(part) for part in command], env=environment(), cwd=REPO, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode != 0
    assert re.search(pattern, completed.stderr), completed.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was trained


def test_a_data_error_on_rank_zero_is_raised_on_every_rank(tmp_path, tokenizer_dir):
    data = write_corpus(tmp_path / "train.jsonl", 200)
    began = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run(deepspeed_command(2, *train_command(tokenizer_dir, data, tmp_path / "run", "--text_field", "body")),
            timeout=300)
    assert time.monotonic() - began < 240
    assert "[rank1]" in str(failure.value) and "on rank 0:" in str(failure.value)


# ------------------------------------------------------------------------------------------------
# Safety
# ------------------------------------------------------------------------------------------------


def _calls(text: str, name: str) -> list:
    """The full text of every ``name(...)`` call in ``text`` (balanced parentheses)."""
    found = []
    for match in re.finditer(re.escape(name) + r"\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        found.append(text[match.start():end + 1])
    return found


def test_no_shell_no_remote_code_no_pickles_from_elsewhere():
    sources = {path: path.read_text() for folder in ("plugin", "launch", "benchmarks")
               for path in (REPO / folder).rglob("*.py")}
    for path, text in sources.items():
        assert "shell=True" not in text, path
        assert "trust_remote_code=True" not in text, path  # only ever the user's --trust_remote_code flag
        for call in _calls(text, "torch.load"):
            assert "weights_only=True" in call, (path, call)
    train = sources[REPO / "launch" / "train.py"]
    assert "trust_remote_code=args.trust_remote_code" in train and '"--trust_remote_code", action="store_true"' in train
    # Checkpoints are only ever loaded from the run's own --output_dir.
    assert re.findall(r"checkpoint\.load\(engine, ([^,]+),", train) == ["args.output_dir"]
