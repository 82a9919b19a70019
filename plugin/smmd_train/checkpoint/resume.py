"""What happens to a run's ``--output_dir`` that holds an earlier run: resumed, refused or overwritten.

Decided when the run is planned, before any model exists and alike on every rank (:func:`plan_resume`,
with :func:`check_resume_layout`: what this run can load, and the refusals), carried out once the
engine exists (:func:`resume_or_start`: the checkpoint loaded, or the earlier run's files removed,
:func:`clear_run`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from ..components.schedule import resumed_schedule
from ..config.run_config import Checkpointing
from ..distributed.groups import run_on_rank_zero
from .commits import LATEST_FILE, agreed_resume_tag, read_commit, saved_layout
from .universal import UNIVERSAL_DIR, UNIVERSAL_DONE


def plan_resume(checkpointing: Checkpointing, plan) -> Optional[str]:
    """The committed checkpoint in ``--output_dir`` this run continues (None: it starts at step 0),
    decided before any model exists and alike on every rank (``commits.agreed_resume_tag``). ``plan``:
    the run's ``smmd_train.plan.RunPlan`` (a floor above this room: read and updated, not imported), of
    which its topology and DeepSpeed config are read and its schedule and warnings updated.

    Without ``--resume`` a committed checkpoint is refused unless ``--overwrite_output_dir`` says to
    start over (:func:`resume_or_start` then clears the old run's files): a forgotten ``--resume`` must not repoint
    ``latest`` and append a second run to the first one's metrics. With ``--resume`` this run must be
    able to load the checkpoint (:func:`check_resume_layout`: the same global batch; another
    world size or --tp converts the checkpoint to a universal one when it is loaded, which goes to
    ``plan.warnings``), and it continues the checkpoint's learning-rate schedule
    (``schedule.resumed_schedule``; the differences go to ``plan.warnings``)."""
    output_dir = checkpointing.output_dir
    tag = agreed_resume_tag(output_dir)
    if tag is None:
        return None
    committed = read_commit(output_dir, tag)
    if not checkpointing.resume:
        if checkpointing.overwrite_output_dir:
            return None
        raise ValueError(f"--output_dir {output_dir} holds a committed checkpoint of an earlier run ({tag}, "
                         f"step {committed['step']}): pass --resume to continue that run, or --overwrite_output_dir to "
                         "start a new one there (its checkpoints, metrics.jsonl and TensorBoard events are removed)")
    conversion = check_resume_layout(output_dir, tag, committed, plan.topology,
                                     plan.ds_config.get("zero_optimization", {}).get("stage", 0),
                                     plan.ds_config["train_batch_size"])
    if conversion is not None:
        plan.warnings.append(conversion)
    if "schedule" in committed:
        plan.schedule, notes = resumed_schedule(committed["schedule"], plan.schedule, committed["step"])
        plan.warnings += notes
    return tag


def check_resume_layout(output_dir: str, tag: str, committed: dict, topology, zero_stage: int,
                        global_batch_size: int) -> Optional[str]:
    """Check, before any model is built, that this run (``topology``, its DeepSpeed config's
    ``zero_stage`` and ``global_batch_size``: micro-batch x accumulation x DP) can resume ``tag``;
    returns None when its shards load as they are, else a line for the log saying that the checkpoint
    will be converted to a universal checkpoint (``smmd_train.checkpoint.universal.load_universal``) and where.

    The shards load as they are into the same world size and AutoTP degree (a sequence-parallel
    degree changes no shard: Ulysses keeps whole weights). Another world size or ``--tp`` converts,
    which is done for ZeRO-3 without sequence parallelism on either side (the layouts the conversion
    was checked on). Refused with the reason: a conversion of anything else, and a global batch
    other than the checkpoint's where the marker records it (the data order continues only in steps
    of the same global batch; ``PackedBatches.load_state_dict`` would refuse it after the load)."""
    problems = []
    saved_batch = committed.get("global_batch_size")
    if saved_batch is not None and saved_batch != global_batch_size:
        problems.append(f"a global batch of {saved_batch} sequences, this run has {global_batch_size} (micro-batch x "
                        "gradient accumulation x data-parallel ranks); keep the checkpoint's, e.g. by another "
                        "--micro_batch_size or --gradient_accumulation_steps")
    world_size, tp_size, saved_stage = saved_layout(output_dir, tag, committed)
    tp_size = tp_size or topology.tp_size
    converting = (world_size, tp_size) != (topology.world_size, topology.tp_size)
    if converting:
        changed = (f"{world_size} ranks with --tp {tp_size}, this run has {topology.world_size} with --tp "
                   f"{topology.tp_size}")
        if saved_stage != 3 or zero_stage != 3:
            problems.append(f"{changed}: only a ZeRO-3 checkpoint resumed under ZeRO-3 converts to another layout "
                            f"(checkpoint: ZeRO stage {saved_stage}, this run: {zero_stage})")
        saved_sp = committed.get("sp_size", 1)
        if saved_sp != 1 or topology.sp_size != 1:
            problems.append(f"{changed}: a layout change with sequence parallelism is not supported (checkpoint "
                            f"--sp {saved_sp}, this run --sp {topology.sp_size}); resume with --sp 1 under the "
                            "checkpoint's world size and --tp, or with the checkpoint's world size, --tp and any --sp")
    if problems:
        raise ValueError(f"checkpoint {tag} in {output_dir} cannot be resumed by this run: it was written with "
                         f"{'; '.join(problems)}; or export it (launch/export_hf.py) and continue pretraining "
                         "from the HF directory")
    if not converting:
        return None
    universal = Path(output_dir, tag, UNIVERSAL_DIR)
    reused = " (the complete conversion there is reused)" if (universal / UNIVERSAL_DONE).is_file() else (
        " by rank 0 before the load")
    kept = (f"; ranks {world_size}-{topology.world_size - 1} have no saved RNG state and keep their seeded one"
            if topology.world_size > world_size else "")
    return (f"checkpoint {tag} was written by {world_size} ranks with --tp {tp_size} and this run has "
            f"{topology.world_size} with --tp {topology.tp_size}: it is converted to a DeepSpeed universal checkpoint "
            f"in {universal}{reused} and loaded from there{kept}")


def clear_run(output_dir: str, tensorboard_dir: Optional[str]) -> list:
    """Remove what an earlier run left in ``output_dir`` (``--overwrite_output_dir``): its checkpoint
    tags and ``latest``, metrics.jsonl and run_config.json, and the event files in
    ``tensorboard_dir``; other files (an export, the data cache) stay. Returns the removed paths."""
    directory = Path(output_dir)
    removed = [path for path in directory.glob("step" + "[0-9]" * 8) if path.is_dir()]
    for path in removed:
        shutil.rmtree(path)
    for name in (LATEST_FILE, "metrics.jsonl", "run_config.json"):
        if (directory / name).is_file():
            (directory / name).unlink()
            removed.append(directory / name)
    if tensorboard_dir:
        for path in Path(tensorboard_dir).glob("events.out.tfevents.*"):
            path.unlink()
            removed.append(path)
    return removed


def resume_or_start(run, checkpointer, state) -> Optional[str]:
    """Carry out the plan's decision on ``--output_dir`` (``run.resume_tag``, :func:`plan_resume`) on
    every rank: load the checkpoint into ``run``'s engine and ``state`` (``smmd_train.checkpoint.saving``'s
    ``Checkpointer`` and ``TrainState``), or with ``--overwrite_output_dir`` remove an earlier run's
    files (rank 0, :func:`clear_run`), or start at step 0. Returns the line for the log, or None."""
    checkpointing = run.config.checkpointing
    if run.resume_tag is not None:
        checkpointer.resume(state, run.resume_tag)
        return f"resumed from {run.resume_tag} at step {state.step}"
    if checkpointing.resume:
        return f"no committed checkpoint in {checkpointing.output_dir}; starting from step 0"
    if checkpointing.overwrite_output_dir:
        removed = run_on_rank_zero(lambda: clear_run(checkpointing.output_dir, run.plan.tensorboard_dir))
        if removed:
            return f"--overwrite_output_dir: removed {len(removed)} file(s) and checkpoint(s) of an earlier run"
    return None
