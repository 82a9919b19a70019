"""Real 2-rank resumes (the deepspeed launcher on CPU) that would change the experiment: another
--numeric_loss or other data is refused before the model is built (exit code 2, one line per change
on rank 0), and --allow_objective_change continues with a warning naming the change; the older
checkpoint of a run resumed at another --tp exports with its own layout. One short training run with
a checkpoint is shared; each check resumes a copy of it.
tests/train/test_resume_experiment.py checks every recorded flag without launching."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.corpora import write_corpus
from helpers.host_probe import hang_guard
from helpers.launching import REPO, TRAIN, environment, launch_command, metrics, run, train_flags

pytestmark = pytest.mark.slow
EXPORT = REPO / "launch" / "export_hf.py"
BASE_LOSS = ["smmd:1", "ntl-was:0.3"]
# Printed by train.py as it starts to build the engine: absent, the run stopped before any model existed.
ENGINE_LINE = "[train] world 2 = "


def train(data, output_dir, tokenizer_dir, steps=2, numeric_loss=BASE_LOSS, micro_batch_size=2, **options) -> list:
    return launch_command(TRAIN, *train_flags(
        deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny", tokenizer=tokenizer_dir, data=[data],
        seq_len=48, micro_batch_size=micro_batch_size, max_steps=steps, warmup_steps=1, save_steps=2,
        output_dir=output_dir, numeric_loss=numeric_loss, **options), processes=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_dir):
    """(corpus, run dir): 2 steps of a 2-rank ZeRO-3 run of smmd:1 ntl-was:0.3, checkpoint at step 2."""
    root = tmp_path_factory.mktemp("resume_changes")
    corpus = write_corpus(root / "train.jsonl", documents=60)
    completed = run(train(corpus, root / "run", tokenizer_dir), timeout=600)
    assert ENGINE_LINE in completed.stdout  # the line the refusals below must not reach
    return corpus, root / "run"


def copy_of(trained, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(trained[1], output, ignore=shutil.ignore_patterns("tensorboard"))
    return output


def refused(command) -> str:
    """The output of a launch that must end as a refusal: exit code 2, before the engine."""
    completed = subprocess.run([str(part) for part in command], env=environment(), cwd=REPO, capture_output=True,
                               text=True, timeout=hang_guard(300))
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output[-4000:]
    assert ENGINE_LINE not in output and "[train] loss:" not in output, output[-4000:]
    return output


def refusal_lines(output: str) -> list:
    return [line.removeprefix("[train] refused: ") for line in output.splitlines()
            if line.startswith("[train] refused: ")]


def test_another_numeric_loss_is_refused_before_the_model(trained, tmp_path, tokenizer_dir):
    corpus, _ = trained
    output = copy_of(trained, tmp_path)
    before = metrics(output)
    lines = refusal_lines(refused(train(corpus, output, tokenizer_dir, steps=3, numeric_loss=["ntl-mse:0.5"],
                                        resume=True)))
    assert lines == ["resuming step00000002 changes --numeric_loss smmd:1 ntl-was:0.3 -> ntl-mse:0.5",
                     "resume step00000002 with the settings it was trained with, pass --allow_objective_change to "
                     "continue it with this run's, or start a new run (another --output_dir, or "
                     "--overwrite_output_dir)"]
    assert (output / "latest").read_text() == "step00000002" and metrics(output) == before


@pytest.fixture(scope="module")
def continued(trained, tmp_path_factory, tokenizer_dir):
    """(output of the launch, run dir): a copy of ``trained`` resumed to step 3 with ntl-mse:0.5 and
    --allow_objective_change, at --tp 2 (micro-batch 4 keeps the global batch), whose launch rewrote
    run_config.json."""
    corpus, _ = trained
    output = copy_of(trained, tmp_path_factory.mktemp("continued"))
    completed = run(train(corpus, output, tokenizer_dir, steps=3, numeric_loss=["ntl-mse:0.5"], resume=True,
                          allow_objective_change=True, tp=2, micro_batch_size=4), timeout=600)
    return completed.stdout, output


def test_allow_objective_change_continues_with_the_new_loss_and_says_so(continued):
    stdout, output = continued
    assert ("[train] warning: --allow_objective_change: step00000002 continues with --numeric_loss smmd:1 "
            "ntl-was:0.3 -> ntl-mse:0.5") in stdout
    assert "resumed from step00000002 at step 2" in stdout
    trained_steps = metrics(output)
    assert "loss/ntl_mse" in trained_steps[3] and "loss/ntl_mse" not in trained_steps[2]
    # The new checkpoint records the objective it was trained with: a resume of it is the new run's.
    record = json.loads((output / "step00000003" / "commit.json").read_text())
    assert record["objective"]["--numeric_loss"] == "ntl-mse:0.5"


def test_an_older_tag_exports_with_its_own_layout(continued):
    # step00000002 was written at --tp 1; run_config.json is the --tp 2 launch's. One plain process
    # consolidates it offline (with the latest launch's layout it would ask for a 2-rank AutoTP export).
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    _, output = continued
    assert json.loads((output / "run_config.json").read_text())["tp_size"] == 2
    completed = run([sys.executable, EXPORT, output / "step00000002", output / "hf2"], timeout=300)
    assert f"exported {output}/step00000002 -> {output / 'hf2'}" in completed.stdout
    exported = AutoModelForCausalLM.from_pretrained(output / "hf2").state_dict()
    saved = get_fp32_state_dict_from_zero_checkpoint(str(output), tag="step00000002")
    assert saved.keys() <= exported.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name  # fp32 written and read back: bit for bit


def test_other_data_is_refused_before_the_model(trained, tmp_path, tokenizer_dir):
    corpus, _ = trained
    output = copy_of(trained, tmp_path)
    other = write_corpus(tmp_path / "other.jsonl", documents=90, seed=1)
    lines = refusal_lines(refused(train(other, output, tokenizer_dir, steps=3, resume=True)))
    # Other documents, and more of them: named, and the data order cannot continue (not even with
    # --allow_objective_change, which the last line says).
    assert lines[0].startswith("resuming step00000002 changes packed blocks ")
    assert lines[1] == f"resuming step00000002 changes --data {corpus} -> {other}"
    assert lines[2].startswith("checkpoint step00000002 cannot continue here: its data order shuffles ")
    assert lines[3].startswith("resume step00000002 on its data, --seq_len, tokenizer and --seed")
    assert len(lines) == 4
