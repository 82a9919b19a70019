"""Which checkpoints of a run are committed, and what their commit markers say.

DeepSpeed's ``save_checkpoint`` writes every rank's shards; but with ``save_latest=True`` rank 0
writes ``latest`` before the other ranks are known to be done and not atomically, so a crash in
that window leaves ``latest`` pointing at a broken checkpoint. Here each save is *committed* only
after every rank returned (``smmd_train.checkpoint.saving.save``): rank 0 writes ``<tag>/commit.json`` and
then replaces ``latest`` atomically (:func:`commit`). Resuming trusts ``latest`` only if its tag is
committed, else the newest committed tag (:func:`find_resume_tag`).

Files only: no engine, no model (export and the resume plan read the markers before any exists).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch.distributed as dist

COMMIT_FILE = "commit.json"
LATEST_FILE = "latest"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part."""
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def commit(output_dir: str, tag: str, record: dict) -> None:
    """Commit ``tag``, whose files every rank has written: its marker ``record``, then ``latest``."""
    atomic_write(Path(output_dir, tag, COMMIT_FILE), json.dumps(record))
    atomic_write(Path(output_dir, LATEST_FILE), tag)


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
    """The commit marker of ``tag`` (``smmd_train.checkpoint.saving.commit_record``): its step, world size and
    (written since
    the marker has them) ``tp_size``, ``sp_size``, ``schedule``, ``objective`` and ``data``."""
    return json.loads(Path(output_dir, tag, COMMIT_FILE).read_text())


def saved_layout(output_dir: str, tag: str, committed: dict) -> tuple:
    """(world size, tensor-parallel degree, ZeRO stage) of the run that wrote ``tag``, from its commit
    marker; markers written before they recorded them: the TP degree is the number of ZeRO-3
    model-state files of ZeRO rank 0 (one per TP rank), the stage 3 when those files exist."""
    model_files = list(Path(output_dir, tag).glob("zero_pp_rank_0_mp_rank_*_model_states.pt"))
    tp_size = committed.get("tp_size") or len(model_files) or None
    return committed["world_size"], tp_size, committed.get("zero_stage", 3 if model_files else None)
