"""Checkpoints that resume exactly: saved and committed on every rank, loaded back under the same
layout or, through a universal checkpoint, under another.

Besides model and optimizer state (DeepSpeed's), a checkpoint holds the training step, the data
position, and every rank's RNG states (``<tag>/rng_rank<r>.pt``), so that a resumed run
reproduces the per-step losses of an uninterrupted one. Each save is committed only after every
rank returned (``smmd_train.checkpoint.commits``: what a resume trusts). A ZeRO-3 checkpoint also resumes under
another world size or tensor-parallel degree, through DeepSpeed's universal checkpoint
(``smmd_train.checkpoint.universal``).

    python -m smmd_train.checkpoint convert OUTPUT_DIR [TAG]    # that conversion, beforehand (:func:`main`)
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from smmd_cli.options import option, parse_options

from .commits import commit, find_resume_tag, read_commit, saved_layout
from .universal import convert_to_universal, load_universal


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


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
    """Save and commit a checkpoint for ``step`` on every rank; returns its tag. The commit marker
    (:func:`commit_record`) holds what a resume reads before any model is built."""
    tag = tag_for_step(step)
    engine.save_checkpoint(output_dir, tag=tag, client_state={**client_state, "step": step}, save_latest=False)
    rank = dist.get_rank()
    torch.save(rng_state(), Path(output_dir, tag, f"rng_rank{rank}.pt"))
    dist.barrier()  # every rank's files are on disk before the commit
    if rank == 0:
        commit(output_dir, tag, commit_record(step, dist.get_world_size(), engine.zero_optimization_stage(),
                                              client_state, run_record))
    dist.barrier()
    return tag


def commit_record(step: int, world_size: int, zero_stage: int, client_state: dict,
                  run_record: Optional[dict] = None) -> dict:
    """The commit marker of a checkpoint at ``step`` written by ``world_size`` ranks under ZeRO
    ``zero_stage``: besides those, ``run_record`` (the layout, the learning-rate schedule and what
    the run trains on, :func:`run_record`) and, from ``client_state``'s data position
    (``PackedBatches.state_dict``), the global batch, the number of packed blocks and the seed that
    its order continues with."""
    data = client_state.get("data", {})
    return {"step": step, "world_size": world_size, **(run_record or {}), "zero_stage": zero_stage,
            **{key: data[key] for key in ("global_batch_size", "num_blocks", "seed") if key in data}}


def run_record(topology, schedule: dict, experiment: Optional[dict] = None) -> dict:
    """What a commit marker records about the run besides step and world size: the parallel layout
    its shards depend on, the learning-rate schedule a resume continues and ``experiment``, the
    objective and the data that a resume must not change unasked
    (``smmd_train.checkpoint.experiment.experiment_record``)."""
    return {"tp_size": topology.tp_size, "sp_size": topology.sp_size, "schedule": schedule, **(experiment or {})}


def load(engine, output_dir: str, tag: str, tp_size: Optional[int] = None) -> dict:
    """Load model, optimizer and scheduler state and this rank's RNG state; returns client state.
    ``tp_size``: this run's AutoTP degree (default: the engine's model-parallel size). Written under
    another world size or TP degree, the checkpoint loads through its universal checkpoint
    (``smmd_train.checkpoint.universal.load_universal``; the plan allowed it:
    ``smmd_train.checkpoint.resume.check_resume_layout``), and rank ``r`` restores ``rng_rank<r>.pt`` if the
    saving run had a rank ``r``, else keeps its seeded RNG state (the plan's warning names those ranks)."""
    committed = read_commit(output_dir, tag)
    world_size, saved_tp, _ = saved_layout(output_dir, tag, committed)
    tp_size = tp_size or engine.mp_world_size
    converting = (world_size, saved_tp or tp_size) != (dist.get_world_size(), tp_size)
    if converting:
        client_state = load_universal(engine, output_dir, tag)
    else:
        load_path, client_state = engine.load_checkpoint(output_dir, tag=tag, load_module_strict=True,
                                                         load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {output_dir}")
    rng_file = Path(output_dir, tag, f"rng_rank{dist.get_rank()}.pt")
    if not converting or rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
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
        state.load_state_dict(load(self.engine, self.output_dir, tag, (self.record or {}).get("tp_size")))
        self.last_tag = tag

    def maybe_save(self, state: TrainState) -> Optional[str]:
        """Save ``state`` if its step is due; returns the new tag, or None."""
        if self.save_steps and (state.step % self.save_steps == 0 or state.step == self.max_steps):
            client_state = state.state_dict()
            self.last_tag = save(self.engine, self.output_dir, client_state.pop("step"), client_state, self.record)
            return self.last_tag
        return None


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    output_dir: str = option(help="the run's --output_dir")
    tag: Optional[str] = option(nargs="?", help="the checkpoint (default: the one --resume would load)")


def main(argv=None) -> None:
    """``python -m smmd_train.checkpoint convert OUTPUT_DIR [TAG]``: convert a run's committed
    checkpoint (default: the one a resume would take) to a universal checkpoint in one process, no
    engine and no process group, so that a resume under another layout loads it as it is (useful
    for big models: the conversion holds the whole optimizer state in this process's memory)."""
    options, parser = parse_options(ConvertOptions, argv, prog="python -m smmd_train.checkpoint",
                                    description=main.__doc__.split("\n\n")[0], subcommand=(
                                        "convert", "convert a committed ZeRO-3 checkpoint into <tag>/universal"))
    tag = options.tag or find_resume_tag(options.output_dir)
    if tag is None:
        parser.exit(1, f"no committed checkpoint in {options.output_dir}\n")
    try:
        convert_to_universal(options.output_dir, tag, log=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"{error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
