"""What a run does with the checkpoints already in its --output_dir, decided when it is planned
(before any model exists), through train.py's own set-up (``smmd_train.run.prepare_run``): a
forgotten --resume is refused, --overwrite_output_dir clears the old run, a resume under another
world size or --tp plans a conversion to a universal checkpoint, what cannot be loaded is refused
with the reason, and a resumed run continues its checkpoint's learning-rate
schedule, saying what it does not apply. The checkpoints here are commit markers as
``checkpoint.save`` writes them (the shards are not read before the engine exists); test_launch.py
resumes real ones."""

import math

import pytest
from helpers.corpora import write_corpus
from helpers.launching import REPO, train_flags

from smmd_train.checkpoint.commits import commit
from smmd_train.checkpoint.resume import clear_run
from smmd_train.checkpoint.saving import commit_record, run_record, tag_for_step
from smmd_train.components.schedule import lr_factor
from smmd_train.config.arguments import parse_args
from smmd_train.config.deepspeed import Topology
from smmd_train.config.run_config import RunConfig
from smmd_train.distributed.groups import Launch
from smmd_train.run import RunRefused, prepare_run

ZERO3 = REPO / "ds_configs" / "zero3.json"
SCHEDULE = {"lr": 3e-3, "warmup_steps": 1, "max_steps": 6, "min_lr_ratio": 0.1}


def committed_checkpoint(output_dir, step=6, world_size=2, tp_size=1, sp_size=1, schedule=SCHEDULE, zero_stage=3,
                         global_batch_size=None):
    """The commit marker and ``latest`` of a checkpoint at ``step``, by ``checkpoint.save``'s writer (its
    ``global_batch_size`` None: a marker written before it was recorded)."""
    tag = tag_for_step(step)
    (output_dir / tag).mkdir(parents=True)
    topology = Topology(world_size=world_size, tp_size=tp_size, dp_size=world_size // (tp_size * sp_size),
                        sp_size=sp_size)
    data = {} if global_batch_size is None else {"data": {"global_batch_size": global_batch_size}}
    commit(str(output_dir), tag, commit_record(step, world_size, zero_stage, data, run_record(topology, schedule)))
    return tag


def plan(tmp_path, tokenizer_dir, output_dir, world_size=2, **options):
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    values = dict(deepspeed_config=ZERO3, model="tiny", tokenizer=tokenizer_dir, data=[corpus], seq_len=48,
                  micro_batch_size=2, max_steps=6, warmup_steps=1, lr=3e-3, output_dir=output_dir)
    values.update(options)
    return prepare_run(RunConfig.from_args(parse_args(train_flags(**values))),
                       Launch(0, world_size, 0, world_size, "single"), until="plan")


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
    # Each keeps the checkpoint's global batch (2 sequences per data-parallel rank at save).
    (dict(world_size=2, tp_size=2), dict(world_size=2, tp=1, micro_batch_size=1),
     "2 ranks with --tp 2 and this run has 2 with --tp 1"),
    (dict(world_size=2, tp_size=1), dict(world_size=1, micro_batch_size=4),
     "2 ranks with --tp 1 and this run has 1 with --tp 1"),
    (dict(world_size=2, tp_size=2), dict(world_size=4, tp=2, micro_batch_size=1),
     "2 ranks with --tp 2 and this run has 4 with --tp 2"),
])
def test_a_resume_under_another_layout_plans_a_conversion_and_says_where(
        tmp_path, tokenizer_dir, written, resumed, named):
    output = tmp_path / "run"
    dp_size = written["world_size"] // written["tp_size"]
    tag = committed_checkpoint(output, **written, global_batch_size=2 * dp_size)
    run = plan(tmp_path, tokenizer_dir, output, resume=True, **resumed)
    assert run.resume_tag == tag
    notes = [warning for warning in run.plan.warnings if "universal checkpoint" in warning]
    assert len(notes) == 1 and named in notes[0]
    assert f"converted to a DeepSpeed universal checkpoint in {output / tag / 'universal'} by rank 0" in notes[0]
    assert ("keep their seeded one" in notes[0]) == (resumed["world_size"] > written["world_size"])
    # A complete conversion already there (e.g. python -m smmd_train.checkpoint convert) is reused.
    (output / tag / "universal").mkdir()
    (output / tag / "universal" / "converted.json").write_text("{}")
    again = plan(tmp_path, tokenizer_dir, output, resume=True, **resumed)
    assert [warning for warning in again.plan.warnings if "the complete conversion there is reused" in warning]


@pytest.mark.parametrize("written, resumed, named", [
    # The global batch differs (2 ranks at --tp 1 with 2 sequences each make 4, the checkpoint's is 2).
    (dict(world_size=2, tp_size=2, global_batch_size=2), dict(world_size=2, tp=1),
     "a global batch of 2 sequences, this run has 4"),
    (dict(world_size=2, tp_size=1, global_batch_size=4), dict(world_size=2, micro_batch_size=1),
     "a global batch of 4 sequences, this run has 2"),
    (dict(world_size=2, tp_size=2, zero_stage=2), dict(world_size=2, tp=1, micro_batch_size=1),
     "only a ZeRO-3 checkpoint resumed under ZeRO-3 converts to another layout (checkpoint: ZeRO stage 2"),
    (dict(world_size=2, tp_size=1, sp_size=2), dict(world_size=1, micro_batch_size=4),
     "a layout change with sequence parallelism is not supported (checkpoint --sp 2, this run --sp 1)"),
    (dict(world_size=2, tp_size=1), dict(world_size=4, sp=2, micro_batch_size=2),
     "a layout change with sequence parallelism is not supported (checkpoint --sp 1, this run --sp 2)"),
])
def test_what_a_resume_cannot_load_is_refused_before_the_model_with_the_reason(
        tmp_path, tokenizer_dir, written, resumed, named):
    output = tmp_path / "run"
    committed_checkpoint(output, **written)
    with pytest.raises(RunRefused, match="cannot be resumed by this run") as refused:
        plan(tmp_path, tokenizer_dir, output, resume=True, **resumed)
    assert named in str(refused.value) and "launch/export_hf.py" in str(refused.value)
    assert "\n" not in str(refused.value)


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
