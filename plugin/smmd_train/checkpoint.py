"""Checkpoints that resume exactly and are never half-trusted.

DeepSpeed's ``save_checkpoint`` writes every rank's shards; but with ``save_latest=True`` rank 0
writes ``latest`` before the other ranks are known to be done and not atomically, so a crash in
that window leaves ``latest`` pointing at a broken checkpoint. Here each save is *committed* only
after every rank returned: rank 0 writes ``<tag>/commit.json`` and then replaces ``latest``
atomically. Resuming trusts ``latest`` only if its tag is committed, else the newest committed tag.

Besides model and optimizer state (DeepSpeed's), a checkpoint holds the training step, the data
position, and every rank's RNG states (``<tag>/rng_rank<r>.pt``), so that a resumed run
reproduces the per-step losses of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

COMMIT_FILE = "commit.json"
LATEST_FILE = "latest"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def rng_state() -> dict:
    """This process's RNG states as tensors and plain values, so that loading them back needs no
    pickle (``torch.load(..., weights_only=True)``)."""
    version, python_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": [version, torch.tensor(python_state, dtype=torch.int64), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state.tolist()), gauss))
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, output_dir: str, step: int, client_state: dict, run_record: Optional[dict] = None) -> str:
    """Save and commit a checkpoint for ``step`` on every rank; returns its tag. ``run_record`` (the
    layout and the learning-rate schedule, :func:`run_record`) goes into the commit marker, where a
    resume reads it before any model is built."""
    tag = tag_for_step(step)
    engine.save_checkpoint(output_dir, tag=tag, client_state={**client_state, "step": step}, save_latest=False)
    rank = dist.get_rank()
    torch.save(rng_state(), Path(output_dir, tag, f"rng_rank{rank}.pt"))
    dist.barrier()  # every rank's files are on disk before the commit
    if rank == 0:
        _atomic_write(Path(output_dir, tag, COMMIT_FILE), json.dumps({"step": step, "world_size":
                                                                       dist.get_world_size(), **(run_record or {})}))
        _atomic_write(Path(output_dir, LATEST_FILE), tag)
    dist.barrier()
    return tag


def is_committed(output_dir: str, tag: str) -> bool:
    return Path(output_dir, tag, COMMIT_FILE).is_file()


def find_resume_tag(output_dir: str) -> Optional[str]:
    """The tag to resume from: ``latest`` if committed, else the newest committed tag, else None."""
    directory = Path(output_dir)
    latest = directory / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        if is_committed(output_dir, tag):
            return tag
    committed = sorted(path.parent.name for path in directory.glob(f"*/{COMMIT_FILE}"))
    return committed[-1] if committed else None


def agreed_resume_tag(output_dir: str) -> Optional[str]:
    """:func:`find_resume_tag` as rank 0 sees it, on every rank; call on every rank.

    Only rank 0 writes the commit files, so a rank that sees ``output_dir`` differently (a node-local
    disk, or a stale network-filesystem cache) would start at another step and the job would hang at
    its first mismatched collective. Every rank checks that it sees rank 0's choice committed and no
    newer checkpoint (and, when rank 0 sees none, none at all); otherwise all raise the same
    ValueError naming each rank's view."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return find_resume_tag(output_dir)
    decided = [find_resume_tag(output_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(decided, src=0)
    tag = decided[0]
    own = find_resume_tag(output_dir)
    # A stale `latest` may name an older tag than rank 0's; a newer one means the directories differ.
    agrees = own is None if tag is None else is_committed(output_dir, tag) and (own is None or own <= tag)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (agrees, own))
    if all(agreed for agreed, _ in views):
        return tag
    disagreeing = ", ".join(f"rank {rank} sees {view or 'none'}" for rank, (agreed, view) in enumerate(views)
                            if not agreed)
    raise ValueError(f"the ranks see different checkpoints in --output_dir {output_dir}: rank 0 resumes from "
                     f"{tag or 'none (step 0)'} but {disagreeing}; the output directory must be one directory on a "
                     "filesystem every node shares (not a node-local disk), written by rank 0 and read by all")


def read_commit(output_dir: str, tag: str) -> dict:
    """The commit marker of ``tag``: its step, world size and (written since the marker has them)
    ``tp_size``, ``sp_size`` and ``schedule``."""
    return json.loads(Path(output_dir, tag, COMMIT_FILE).read_text())


def run_record(topology, schedule: dict) -> dict:
    """What a commit marker records about the run besides step and world size: the parallel layout
    its shards depend on and the learning-rate schedule a resume continues."""
    return {"tp_size": topology.tp_size, "sp_size": topology.sp_size, "schedule": schedule}


def check_resume_layout(output_dir: str, tag: str, committed: dict, topology) -> None:
    """Refuse, before any model is built, a resume whose parallel layout cannot load ``tag``'s shards:
    another world size, or another AutoTP degree (the model states are saved per tensor-parallel
    rank, and DeepSpeed's loader looks for this layout's slices of every weight). A
    sequence-parallel degree changes no shard (Ulysses keeps whole weights) and is allowed."""
    problems = []
    if committed["world_size"] != topology.world_size:
        problems.append(f"{committed['world_size']} ranks, this run has {topology.world_size}")
    if committed.get("tp_size", topology.tp_size) != topology.tp_size:
        problems.append(f"--tp {committed['tp_size']}, this run has --tp {topology.tp_size}")
    if problems:
        raise ValueError(f"checkpoint {tag} in {output_dir} was written with {'; '.join(problems)}: its ZeRO-3 and "
                         "tensor-parallel shards load only into the same layout; resume with the checkpoint's "
                         "layout, or export it (launch/export_hf.py) and continue pretraining from the HF directory "
                         "under the new one")


def clear_run(output_dir: str, tensorboard_dir: Optional[str]) -> list:
    """Remove what an earlier run left in ``output_dir`` (``--overwrite_output_dir``): its checkpoint
    tags and ``latest``, metrics.jsonl and run_config.json, and the event files in
    ``tensorboard_dir``; other files (an export, the data cache) stay. Returns the removed paths."""
    import shutil

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


def load(engine, output_dir: str, tag: str) -> dict:
    """Load model, optimizer and scheduler state and this rank's RNG state; returns client state.
    (The layout was checked when the run was planned: :func:`check_resume_layout`.)"""
    load_path, client_state = engine.load_checkpoint(output_dir, tag=tag, load_module_strict=True,
                                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {output_dir}")
    set_rng_state(torch.load(Path(output_dir, tag, f"rng_rank{dist.get_rank()}.pt"), weights_only=True))
    return client_state


class TrainState:
    """What a checkpoint holds besides DeepSpeed's model, optimizer and scheduler state: the last
    finished optimizer ``step``, the data position (``batches``: PackedBatches) and the run's count of
    steps skipped for a non-finite loss (``guard``: NonFiniteGuard)."""

    def __init__(self, batches, guard, step: int = 0):
        self.batches, self.guard, self.step = batches, guard, step

    def state_dict(self) -> dict:
        # (not "skipped_steps": DeepSpeed keeps its own key of that name and drops it from client_state)
        return {"step": self.step, "data": self.batches.state_dict(), "non_finite_skips": self.guard.total_skips}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.batches.load_state_dict(state["data"])
        self.guard.total_skips = state.get("non_finite_skips", 0)


class Checkpointer:
    """The checkpoint cadence of a run: every ``save_steps`` optimizer steps and at ``max_steps``
    (``save_steps`` 0: never), each save committed (:func:`save`); :meth:`resume` loads the newest
    committed one. ``last_tag``: the newest committed checkpoint of this run (None: none yet)."""

    def __init__(self, engine, output_dir: str, save_steps: int, max_steps: int, record: Optional[dict] = None):
        self.engine, self.output_dir, self.save_steps, self.max_steps = engine, output_dir, save_steps, max_steps
        self.record = record  # the commit markers' run record (:func:`run_record`)
        self.last_tag: Optional[str] = None

    def resume(self, state: TrainState, tag: str) -> None:
        """Load the committed checkpoint ``tag`` (the one every rank agreed on when the run was
        planned) into the engine and ``state``."""
        state.load_state_dict(load(self.engine, self.output_dir, tag))
        self.last_tag = tag

    def maybe_save(self, state: TrainState) -> Optional[str]:
        """Save ``state`` if its step is due; returns the new tag, or None."""
        if self.save_steps and (state.step % self.save_steps == 0 or state.step == self.max_steps):
            client_state = state.state_dict()
            self.last_tag = save(self.engine, self.output_dir, client_state.pop("step"), client_state, self.record)
            return self.last_tag
        return None
