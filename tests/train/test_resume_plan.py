"""What a run does with the checkpoints already in its --output_dir, decided when it is planned
(before any model exists), through train.py's own set-up (``smmd_train.run.prepare_run``): a
forgotten --resume is refused, --overwrite_output_dir clears the old run, a resume under another
layout is refused with the reason, and a resumed run continues its checkpoint's learning-rate
schedule, saying what it does not apply. The checkpoints here are commit markers as
``checkpoint.save`` writes them (the shards are not read before the engine exists); test_launch.py
resumes real ones."""

import json
import math

import pytest
from helpers.corpora import write_corpus
from helpers.launching import REPO, train_flags

from smmd_train.arguments import parse_args
from smmd_train.checkpoint import COMMIT_FILE, LATEST_FILE, clear_run, run_record, tag_for_step
from smmd_train.config import Topology
from smmd_train.distributed import Launch
from smmd_train.run import RunRefused, prepare_run
from smmd_train.schedule import lr_factor

ZERO3 = REPO / "ds_configs" / "zero3.json"
SCHEDULE = {"lr": 3e-3, "warmup_steps": 1, "max_steps": 6, "min_lr_ratio": 0.1}


def committed_checkpoint(output_dir, step=6, world_size=2, tp_size=1, sp_size=1, schedule=SCHEDULE):
    """The commit marker and ``latest`` of a checkpoint at ``step`` (what ``checkpoint.save`` writes)."""
    tag = tag_for_step(step)
    (output_dir / tag).mkdir(parents=True)
    topology = Topology(world_size=world_size, tp_size=tp_size, dp_size=world_size // (tp_size * sp_size),
                        sp_size=sp_size)
    record = {"step": step, "world_size": world_size, **run_record(topology, schedule)}
    (output_dir / tag / COMMIT_FILE).write_text(json.dumps(record))
    (output_dir / LATEST_FILE).write_text(tag)
    return tag


def plan(tmp_path, tokenizer_dir, output_dir, world_size=2, **options):
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir, data=[corpus], seq_len=48,
                  micro_batch_size=2, max_steps=6, warmup_steps=1, lr=3e-3, output_dir=output_dir)
    values.update(options)
    return prepare_run(parse_args(train_flags(**values)), Launch(0, world_size, 0, world_size, "single"),
                       until="plan")


def test_a_forgotten_resume_is_refused_naming_both_ways_on(tmp_path, tokenizer_dir):
    output = tmp_path / "run"
    committed_checkpoint(output)
    with pytest.raises(RunRefused) as refused:
        plan(tmp_path, tokenizer_dir, output)
    message = str(refused.value)
    assert "holds a committed checkpoint of an earlier run (step00000006, step 6)" in message
    assert "--resume" in message and "--overwrite_output_dir" in message and "\n" not in message
    # An empty or fresh output dir plans a run from step 0, with or without --resume.
    assert plan(tmp_path, tokenizer_dir, tmp_path / "fresh").resume_tag is None
    assert plan(tmp_path, tokenizer_dir, tmp_path / "fresh", resume=True).resume_tag is None


def test_overwrite_output_dir_plans_a_new_run_and_clears_only_the_old_run_s_files(tmp_path, tokenizer_dir):
    output = tmp_path / "run"
    committed_checkpoint(output, step=4)
    committed_checkpoint(output, step=6)
    (output / "metrics.jsonl").write_text("{}\n")
    (output / "run_config.json").write_text("{}")
    (output / "hf").mkdir()
    (output / "hf" / "config.json").write_text("{}")
    (output / "notes.txt").write_text("mine")
    events = output / "tensorboard"
    events.mkdir()
    (events / "events.out.tfevents.1.host").write_text("")
    run = plan(tmp_path, tokenizer_dir, output, overwrite_output_dir=True)
    assert run.resume_tag is None
    removed = clear_run(str(output), run.plan.tensorboard_dir)
    assert len(removed) == 6
    assert sorted(path.name for path in output.iterdir()) == ["hf", "notes.txt", "tensorboard"]
    assert not list(events.iterdir()) and (output / "hf" / "config.json").is_file()
    with pytest.raises(SystemExit):
        parse_args(train_flags(deepspeed_config=ZERO3, model=tmp_path, data=["d"], max_steps=1,
                               output_dir=output, resume=True, overwrite_output_dir=True))


@pytest.mark.parametrize("written, resumed, named", [
    (dict(world_size=2, tp_size=2), dict(world_size=2, tp=1), "--tp 2, this run has --tp 1"),
    (dict(world_size=2, tp_size=1), dict(world_size=1), "2 ranks, this run has 1"),
    (dict(world_size=2, tp_size=2), dict(world_size=4, tp=2), "2 ranks, this run has 4"),
])
def test_a_resume_under_another_layout_is_refused_before_the_model_with_the_reason(
        tmp_path, tokenizer_dir, written, resumed, named):
    output = tmp_path / "run"
    committed_checkpoint(output, **written)
    with pytest.raises(RunRefused, match="load only into the same layout") as refused:
        plan(tmp_path, tokenizer_dir, output, resume=True, **resumed)
    assert named in str(refused.value) and "launch/export_hf.py" in str(refused.value)


def test_a_resume_with_another_sequence_parallel_degree_is_planned(tmp_path, tokenizer_dir):
    output = tmp_path / "run"
    committed_checkpoint(output, world_size=2, sp_size=1)
    assert plan(tmp_path, tokenizer_dir, output, resume=True, sp=2).resume_tag == "step00000006"


def test_a_longer_run_keeps_the_checkpoint_s_schedule_and_says_so(tmp_path, tokenizer_dir):
    output = tmp_path / "run"
    committed_checkpoint(output, step=6)
    run = plan(tmp_path, tokenizer_dir, output, resume=True, max_steps=10)
    assert run.resume_tag == "step00000006"
    schedule = run.plan.schedule
    assert schedule.as_dict() == SCHEDULE  # not 10 steps, not the 10-step run's warmup cap
    # The rates of the steps the longer run adds: the schedule's final rate, not a climb back up.
    for step in range(7, 11):
        assert lr_factor(step, schedule.warmup_steps, schedule.max_steps, schedule.min_lr_ratio) == 0.1
    assert lr_factor(6, 1, 10, 0.1) > 0.1 + 0.05  # what planning 10 steps afresh would have given step 6
    notes = [warning for warning in run.plan.warnings if "--max_steps 10" in warning]
    assert len(notes) == 1 and "keeps its 6-step horizon" in notes[0] and "steps 7-10" in notes[0]
    assert "0.0003" in notes[0]


def test_a_shorter_run_and_changed_rates_are_named_as_not_applied(tmp_path, tokenizer_dir):
    output = tmp_path / "run"
    committed_checkpoint(output, step=4, schedule={**SCHEDULE, "max_steps": 8})
    run = plan(tmp_path, tokenizer_dir, output, resume=True, max_steps=6, lr=1e-3)
    assert run.plan.schedule.max_steps == 8 and math.isclose(run.plan.schedule.lr, 3e-3)
    text = "\n".join(run.plan.warnings)
    assert "--max_steps 6 stops a run scheduled for 8 steps early" in text
    assert "not applied on resume: --lr 0.001 (the checkpoint's: 0.003)" in text
    # The same options on the same checkpoint's schedule: nothing to say.
    same = plan(tmp_path, tokenizer_dir, output, resume=True, max_steps=8)
    assert not [warning for warning in same.plan.warnings if "schedule" in warning or "resume" in warning]
