"""A resume cannot silently change the experiment: what the checkpoint was trained on (objective
and data, ``smmd_train.checkpoint.experiment``) is in its commit marker, and a resumed run that differs is
refused before any model is built, one line per change, unless --allow_objective_change says to
continue with a warning that names the changes. Through train.py's own set-up up to the data
(``prepare_run(until="data")``: plan, then the packed blocks), on commit markers written by the
checkpointer's own writer (``checkpoint.commit``) from a run planned the same way;
tests/launch/test_resume_changes.py refuses and allows real resumes."""

import re
from pathlib import Path

import pytest
from helpers.corpora import write_corpus
from helpers.launching import REPO, train_flags

from smmd_scale.registry import NUMERIC_LOSSES
from smmd_train.checkpoint.commits import commit
from smmd_train.checkpoint.experiment import experiment_changes
from smmd_train.checkpoint.saving import commit_record, run_record, tag_for_step
from smmd_train.components.loss_reporter import LOSS_FLAGS
from smmd_train.config.arguments import parse_args
from smmd_train.config.run_config import RunConfig
from smmd_train.data.batches import PackedBatches
from smmd_train.distributed.groups import Launch
from smmd_train.run import RunRefused, prepare_run

ZERO3 = REPO / "ds_configs" / "zero3.json"
BASE = dict(numeric_loss=["smmd:1", "ntl-was:0.3"])
ADVICE = "pass --allow_objective_change to continue it with this run's"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.jsonl", documents=40)


def prepared(tokenizer_dir, corpus, output_dir, **options):
    """``prepare_run`` of a 2-rank run on ``corpus`` up to its packed data."""
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir, data=[corpus], seq_len=48,
                  micro_batch_size=2, max_steps=6, warmup_steps=1, output_dir=output_dir, **BASE)
    values.update(options)
    return prepare_run(RunConfig.from_args(parse_args(train_flags(**values))), Launch(0, 2, 0, 2, "single"),
                       until="data")


def checkpoint_of(run, step=4) -> str:
    """Commit a checkpoint of ``run`` at ``step`` the way ``checkpoint.save`` does (the shards are
    not read before the engine exists): its record, and its data position from the run's batches."""
    topology, tag = run.plan.topology, tag_for_step(step)
    batches = PackedBatches(run.train_blocks, 2, 0, topology.dp_size, run.config.optimization.seed)
    Path(run.config.checkpointing.output_dir, tag).mkdir(parents=True)
    commit(run.config.checkpointing.output_dir, tag, commit_record(
        step, topology.world_size, 3, {"data": batches.state_dict()},
        run_record(topology, run.plan.schedule.as_dict(), run.experiment)))
    return tag


@pytest.fixture
def trained(tmp_path, tokenizer_dir, corpus):
    """An output dir with a committed step-4 checkpoint of a run of ``BASE``."""
    output = tmp_path / "run"
    checkpoint_of(prepared(tokenizer_dir, corpus, output))
    return output


def refusal(tokenizer_dir, corpus, output, **options) -> list:
    with pytest.raises(RunRefused) as refused:
        prepared(tokenizer_dir, corpus, output, resume=True, **options)
    return str(refused.value).splitlines()


def test_the_same_run_resumes_and_every_numeric_loss_has_its_flags_recorded(trained, tokenizer_dir, corpus):
    run = prepared(tokenizer_dir, corpus, trained, resume=True)
    assert run.resume_tag == "step00000004"
    assert not [warning for warning in run.plan.warnings if "allow_objective_change" in warning]
    assert set(LOSS_FLAGS) == set(NUMERIC_LOSSES)  # a new loss must say which flags shape it


def test_a_changed_numeric_loss_is_refused_one_line_per_change_and_allowed_with_the_flag(
        trained, tokenizer_dir, corpus):
    lines = refusal(tokenizer_dir, corpus, trained, numeric_loss=["ntl-mse:0.5"])
    # The SMMD and NTL-WAS options are not compared: the new run does not use them.
    assert lines == ["resuming step00000004 changes --numeric_loss smmd:1 ntl-was:0.3 -> ntl-mse:0.5",
                     "resume step00000004 with the settings it was trained with, pass --allow_objective_change to "
                     "continue it with this run's, or start a new run (another --output_dir, or "
                     "--overwrite_output_dir)"]
    run = prepared(tokenizer_dir, corpus, trained, resume=True, numeric_loss=["ntl-mse:0.5"],
                   allow_objective_change=True)
    assert run.resume_tag == "step00000004"
    assert run.plan.warnings[-1] == ("--allow_objective_change: step00000004 continues with --numeric_loss smmd:1 "
                                     "ntl-was:0.3 -> ntl-mse:0.5")


VOCAB = r"numeric vocabulary 1000 tokens, sha256 \w{12} -> %d tokens, sha256 \w{12}"


@pytest.mark.parametrize("options, changes", [
    (dict(smmd_sigmas=[1, 4]), ["--smmd_sigmas 2 -> 1 4"]),
    (dict(smmd_kernel="laplace", smmd_mode="mmd"), ["--smmd_mode smmd -> mmd", "--smmd_kernel gaussian -> laplace"]),
    (dict(ntl_squash_factor=9, ntl_reweigh=False), ["--ntl_reweigh on -> off", "--ntl_squash_factor none -> 9"]),
    (dict(z_loss=1e-4, label_smoothing=0.1), ["--z_loss 0 -> 0.0001", "--label_smoothing 0 -> 0.1"]),
    (dict(numeric_loss=["smmd:0.5", "ntl-was:0.15"]), ["--numeric_loss smmd:1 ntl-was:0.3 -> smmd:0.5 ntl-was:0.15"]),
    (dict(numeric_max_value=99), ["--numeric_max_value 999 -> 99", re.compile(VOCAB % 100)]),
    (dict(numeric_policy="digits"), ["--numeric_policy integers -> digits", re.compile(VOCAB % 10)]),
    (dict(framework_loss=True), ["--framework_loss off -> on"]),
    (dict(numeric_values="shuffled", numeric_values_seed=2),
     ["--numeric_values parsed -> shuffled (seed 2)", re.compile(VOCAB % 1000)]),
])
def test_each_change_of_the_objective_is_named(trained, tokenizer_dir, corpus, options, changes):
    lines = refusal(tokenizer_dir, corpus, trained, **options)
    assert len(lines) == len(changes) + 1 and ADVICE in lines[-1]
    for line, change in zip(lines, changes):
        pattern = change.pattern if isinstance(change, re.Pattern) else re.escape(change)
        assert re.fullmatch("resuming step00000004 changes " + pattern, line), line


def test_what_does_not_change_the_objective_resumes(tmp_path, tokenizer_dir, corpus):
    # The fused head computes the same loss; an option of a loss the run does not use, and the bound
    # of a policy that has none, change nothing.
    output = tmp_path / "run"
    checkpoint_of(prepared(tokenizer_dir, corpus, output, numeric_loss=["ntl-mse"], numeric_policy="digits"))
    run = prepared(tokenizer_dir, corpus, output, resume=True, numeric_loss=["ntl-mse"], numeric_policy="digits",
                   fused_linear=True, smmd_sigmas=[5], ntl_squash_factor=9, numeric_max_value=50)
    assert run.resume_tag == "step00000004"
    assert not [warning for warning in run.plan.warnings if "allow_objective_change" in warning]


def test_a_moved_corpus_resumes_and_other_data_are_refused(trained, tmp_path, tokenizer_dir, corpus):
    moved = tmp_path / "elsewhere" / "corpus.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(corpus.read_bytes())
    assert prepared(tokenizer_dir, corpus, trained, resume=True, data=[moved]).resume_tag == "step00000004"
    # Other documents that pack into as many blocks: the data changed, the data order can continue.
    other = write_corpus(tmp_path / "other.jsonl", documents=40, number_share=1.0, number=77)
    lines = refusal(tokenizer_dir, corpus, trained, data=[other])
    assert lines[0].startswith("resuming step00000004 changes packed blocks ")
    assert lines[1] == f"resuming step00000004 changes --data {corpus} -> {other}"
    assert len(lines) == 3 and ADVICE in lines[2]
    blocks_line = lines[0].removeprefix("resuming step00000004 changes packed blocks ")
    old, new = blocks_line.split(" -> ")
    assert old.split(", sha256")[0] == new.split(", sha256")[0] and old != new  # as many blocks, other tokens
    run = prepared(tokenizer_dir, corpus, trained, resume=True, data=[other], allow_objective_change=True)
    assert run.plan.warnings[-1].startswith("--allow_objective_change: step00000004 continues with packed blocks ")


def test_a_data_order_that_cannot_continue_is_refused_even_with_the_flag(trained, tmp_path, tokenizer_dir, corpus):
    # Other data with another number of blocks, another --seq_len, another --seed: the checkpoint's
    # data position is in a shuffle of its own blocks by its own seed (PackedBatches would refuse it
    # only after the model was built).
    bigger = write_corpus(tmp_path / "bigger.jsonl", documents=80)
    lines = refusal(tokenizer_dir, corpus, trained, data=[bigger], allow_objective_change=True)
    assert lines[0].startswith("resuming step00000004 changes packed blocks ")
    order = [line for line in lines if line.startswith("checkpoint step00000004 cannot continue here: ")]
    assert len(order) == 1 and "its data order shuffles" in order[0]
    assert lines[-1].startswith("resume step00000004 on its data, --seq_len, tokenizer and --seed "
                                "(--allow_objective_change cannot continue another data order)")
    lines = refusal(tokenizer_dir, corpus, trained, seq_len=32)
    assert "resuming step00000004 changes --seq_len 48 -> 32" in lines
    lines = refusal(tokenizer_dir, corpus, trained, seed=7, allow_objective_change=True)
    assert lines[0] == ("checkpoint step00000004 cannot continue here: its data order was shuffled by --seed 1234, "
                        "this run has --seed 7")
    assert len(lines) == 2


def test_changes_are_compared_only_where_both_records_have_them():
    old = {"objective": {"--framework_loss": False, "--numeric_loss": "smmd:1", "--smmd_sigmas": [2.0]},
           "data": {"packed blocks": "10 blocks x 8 tokens, sha256 a", "--data": ["/a"], "--seq_len": 8}}
    new = {"objective": {"--framework_loss": False, "--numeric_loss": "ntl-mse:1", "--ntl_reweigh": True},
           "data": {"packed blocks": "10 blocks x 8 tokens, sha256 a", "--data": ["/b"], "--seq_len": 8}}
    assert experiment_changes(old, new) == ["--numeric_loss smmd:1 -> ntl-mse:1"]
    assert experiment_changes({"step": 4, "world_size": 2}, new) == []  # a marker written before the record
    assert experiment_changes(old, old) == []


def test_prompt_completion_rows_that_move_text_between_prompt_and_completion_are_other_data():
    """The same token ids with other labels (a word moved from the completion into the prompt) are
    another objective's data; rows without labels (packed text) hash their ids alone."""
    import datasets

    from smmd_train.checkpoint.experiment import blocks_fingerprint

    ids = [[5, 6, 7, 8, 2, 0], [9, 10, 11, 2, 0, 0]]
    labels = [[-100, -100, 7, 8, 2, -100], [-100, 10, 11, 2, -100, -100]]
    moved = [[-100, -100, -100, 8, 2, -100], [-100, 10, 11, 2, -100, -100]]
    rows = blocks_fingerprint(datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}))
    assert rows.startswith("2 blocks x 6 tokens, sha256 ")
    assert blocks_fingerprint(datasets.Dataset.from_dict({"input_ids": ids, "labels": moved})) != rows
    assert blocks_fingerprint(datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})) == rows
    assert blocks_fingerprint(datasets.Dataset.from_dict({"input_ids": ids})) != rows
