"""Launch-level faults of train.py through the deepspeed launcher on 2 CPU ranks: a rank killed
mid-step ends the job quickly, NaN/inf steps are skipped together and abort after K in a row with
an intact checkpoint, and a data error on rank 0 is raised on every rank. (A crash mid-save is in
test_launch.py, where it reuses the ZeRO-3 run as its reference.)"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.corpora import write_corpus
from helpers.host_probe import hang_guard
from helpers.launching import REPO, TRAIN, environment, launch_command, metrics, run, train_flags
from helpers.models import tiny_llama

pytestmark = pytest.mark.slow
SEQ_LEN = 48


def deepspeed_command(processes, script, *args):
    return launch_command(script, *args, processes=processes)


def train_command(tokenizer_or_model, data, output_dir, steps=4, model="tiny", **options):
    return [TRAIN, *train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model=model,
                                tokenizer=tokenizer_or_model if model == "tiny" else None, data=[data],
                                seq_len=SEQ_LEN, micro_batch_size=2, max_steps=steps, warmup_steps=1, lr=3e-3,
                                output_dir=output_dir, **options)]


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
        tokenizer_dir, data, output, process_group_timeout_minutes=1, steps=500))]
    launcher = subprocess.Popen(command, env=environment(), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + hang_guard(300)
        while not ((output / "metrics.jsonl").exists() and len(metrics(output)) > 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        victims = [pid for pid, command in rank_processes(str(output)) if "--local_rank=1" in command]
        assert len(victims) == 1, rank_processes(str(output))
        killed_at = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        returncode = launcher.wait(timeout=hang_guard(120))
        assert returncode != 0 and time.monotonic() - killed_at < hang_guard(90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def _model_with_a_nan_embedding_row(directory, tokenizer_dir, token: str):
    """A tiny untied Llama whose *input* embedding of ``token`` is NaN: any sequence containing the
    token gets a NaN loss, sequences without it are unaffected."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_llama(len(tokenizer), tie_word_embeddings=False)
    token_id = tokenizer.convert_tokens_to_ids(token)
    with torch.no_grad():
        model.model.embed_tokens.weight[token_id] = float("nan")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return token_id


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, tokenizer_dir):
    """10 steps (a checkpoint every 2, an HF export) of a model whose embedding of "777" is NaN, on
    data where some batches hold 777: (output dir, model dir, the poisoned token id)."""
    root = tmp_path_factory.mktemp("nan")
    model_dir = root / "model"
    token_id = _model_with_a_nan_embedding_row(model_dir, tokenizer_dir, "777")
    data = write_corpus(root / "train.jsonl", 600, number_share=0.04, number=777)
    output = root / "run"
    run(deepspeed_command(2, *train_command(None, data, output, max_skipped_steps=50, export_hf=output / "hf",
                                            save_steps=2, steps=10, model=model_dir)), timeout=600)
    return output, model_dir, token_id


def test_non_finite_steps_are_skipped_on_every_rank(nan_run):
    output, _, token_id = nan_run
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


def test_consecutive_non_finite_steps_abort_with_an_intact_checkpoint(tmp_path, nan_run):
    import shutil

    output, model_dir = tmp_path / "run", nan_run[1]
    shutil.copytree(nan_run[0], output, ignore=shutil.ignore_patterns("hf", "tensorboard"))
    skipped_before = metrics(output)[10]["train/skipped_steps"]
    # As many documents as the run's own data (a resume checks the data still packs into as many
    # blocks): clean ones, and the same documents with the token whose embedding is NaN in each.
    # Other data than the checkpoint's: the resumes say so (--allow_objective_change).
    clean = write_corpus(tmp_path / "clean.jsonl", 600)
    poisoned = write_corpus(tmp_path / "poisoned.jsonl", 600, number_share=1.0, number=777)
    # Steps 11, 12, 13 are skipped; the checkpoint at step 12 still commits (a skipped step leaves
    # the weights as they were, and its data position is past the poisoned batches).
    with pytest.raises(AssertionError, match=r"(?s)exited 3.*3 consecutive optimizer steps had a NaN/inf loss.*"
                                              r"the last committed checkpoint is step00000012"):
        run(deepspeed_command(2, *train_command(None, poisoned, output, save_steps=2, resume=True,
                                                allow_objective_change=True, max_skipped_steps=3, steps=16,
                                                model=model_dir)),
            timeout=600)
    assert (output / "latest").read_text() == "step00000012"
    assert metrics(output)[13]["train/skipped_steps"] == skipped_before + 3 and 14 not in metrics(output)
    # The checkpoint is intact: a run on clean data resumes from it and finishes.
    completed = run(deepspeed_command(2, *train_command(None, clean, output, save_steps=2, resume=True, steps=14,
                                                        allow_objective_change=True, model=model_dir)), timeout=600)
    assert "resumed from step00000012 at step 12" in completed.stdout
    assert all(not torch.isnan(torch.tensor(metrics(output)[step]["loss/total"])) for step in (13, 14))


def test_a_data_error_on_rank_zero_is_raised_on_every_rank(tmp_path, tokenizer_dir):
    data = write_corpus(tmp_path / "train.jsonl", 200)
    began = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run(deepspeed_command(2, *train_command(tokenizer_dir, data, tmp_path / "run", text_field="body")),
            timeout=300)
    assert time.monotonic() - began < hang_guard(240)
    output = str(failure.value)
    # Rank 0 prints the refusal once, naming the problem, and the job ends as a refusal (exit code 2
    # from whichever rank the launcher saw first, then it stops the other). That the error reaches
    # rank 1 itself, within seconds, is tests/train/test_rank_zero_work.py's (gloo ranks, no launcher).
    assert "[train] refused: " in output and "has no column 'body'" in output
    assert output.count("[train] refused: ") == 1
    assert re.search(r"--local_rank=[01].*exits with return code = 2", output)
