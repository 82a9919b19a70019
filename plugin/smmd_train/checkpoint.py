"""Checkpoints that resume exactly and are never half-trusted.

DeepSpeed's ``save_checkpoint`` writes every rank's shards; but with ``save_latest=True`` rank 0
writes ``latest`` before the other ranks are known to be done and not atomically, so a crash in
that window leaves ``latest`` pointing at a broken checkpoint. Here each save is *committed* only
after every rank returned: rank 0 writes ``<tag>/commit.json`` and then replaces ``latest``
atomically. Resuming trusts ``latest`` only if its tag is committed, else the newest committed tag.

Besides model and optimizer state (DeepSpeed's), a checkpoint holds the training step, the data
position, and every rank's RNG states (``<tag>/rng_rank<r>.pt``), so that a resumed run
reproduces the per-step losses of an uninterrupted one.

A ZeRO-3 checkpoint also resumes under another world size or tensor-parallel degree: it is converted
once into DeepSpeed's universal checkpoint in ``<tag>/universal`` (:func:`convert_to_universal`, by
rank 0 when the run resumes, or beforehand in one process: ``python -m smmd_train.checkpoint convert
OUTPUT_DIR [TAG]``) and loaded from there (:func:`load_universal`).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

COMMIT_FILE = "commit.json"
LATEST_FILE = "latest"
UNIVERSAL_DIR = "universal"  # <tag>/universal: the tag converted to a DeepSpeed universal checkpoint
UNIVERSAL_DONE = "converted.json"  # written last into <tag>/universal: the conversion is complete
ZERO3_STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what ZeRO-3 keeps per parameter, and the universal files


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


def commit(output_dir: str, tag: str, record: dict) -> None:
    """Commit ``tag``, whose files every rank has written: its marker ``record``, then ``latest``."""
    _atomic_write(Path(output_dir, tag, COMMIT_FILE), json.dumps(record))
    _atomic_write(Path(output_dir, LATEST_FILE), tag)


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
    """The commit marker of ``tag`` (:func:`commit_record`): its step, world size and (written since
    the marker has them) ``tp_size``, ``sp_size``, ``schedule``, ``objective`` and ``data``."""
    return json.loads(Path(output_dir, tag, COMMIT_FILE).read_text())


def run_record(topology, schedule: dict, experiment: Optional[dict] = None) -> dict:
    """What a commit marker records about the run besides step and world size: the parallel layout
    its shards depend on, the learning-rate schedule a resume continues and ``experiment``, the
    objective and the data that a resume must not change unasked
    (``smmd_train.experiment.experiment_record``)."""
    return {"tp_size": topology.tp_size, "sp_size": topology.sp_size, "schedule": schedule, **(experiment or {})}


def saved_layout(output_dir: str, tag: str, committed: dict) -> tuple:
    """(world size, tensor-parallel degree, ZeRO stage) of the run that wrote ``tag``, from its commit
    marker; markers written before they recorded them: the TP degree is the number of ZeRO-3
    model-state files of ZeRO rank 0 (one per TP rank), the stage 3 when those files exist."""
    model_files = list(Path(output_dir, tag).glob("zero_pp_rank_0_mp_rank_*_model_states.pt"))
    tp_size = committed.get("tp_size") or len(model_files) or None
    return committed["world_size"], tp_size, committed.get("zero_stage", 3 if model_files else None)


def check_resume_layout(output_dir: str, tag: str, committed: dict, topology, zero_stage: int,
                        global_batch_size: int) -> Optional[str]:
    """Check, before any model is built, that this run (``topology``, its DeepSpeed config's
    ``zero_stage`` and ``global_batch_size``: micro-batch x accumulation x DP) can resume ``tag``;
    returns None when its shards load as they are, else a line for the log saying that the checkpoint
    will be converted to a universal checkpoint (:func:`load_universal`) and where.

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


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("[train]", message, flush=True)


def load(engine, output_dir: str, tag: str, tp_size: Optional[int] = None) -> dict:
    """Load model, optimizer and scheduler state and this rank's RNG state; returns client state.
    ``tp_size``: this run's AutoTP degree (default: the engine's model-parallel size). Written under
    another world size or TP degree, the checkpoint loads through its universal checkpoint
    (:func:`load_universal`; the plan allowed it: :func:`check_resume_layout`)."""
    committed = read_commit(output_dir, tag)
    world_size, saved_tp, _ = saved_layout(output_dir, tag, committed)
    tp_size = tp_size or engine.mp_world_size
    if (world_size, saved_tp or tp_size) != (dist.get_world_size(), tp_size):
        return load_universal(engine, output_dir, tag)
    load_path, client_state = engine.load_checkpoint(output_dir, tag=tag, load_module_strict=True,
                                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {output_dir}")
    set_rng_state(torch.load(Path(output_dir, tag, f"rng_rank{dist.get_rank()}.pt"), weights_only=True))
    return client_state


def load_universal(engine, output_dir: str, tag: str) -> dict:
    """:func:`load` of a ZeRO-3 checkpoint written under another world size or TP degree; call on
    every rank. Rank 0 converts ``tag`` into ``<tag>/universal`` unless a complete conversion is there
    (:func:`convert_to_universal`), the others wait (``run_on_rank_zero``: a long gloo timeout, and an
    error raised on every rank alike); then every rank loads it with DeepSpeed's universal loader,
    switched on for this load only (``compat.universal_checkpoint_loading``).

    DeepSpeed 0.19.8's ZeRO-3 universal loader gives all optimizer sub-groups one shared Adam ``step``
    tensor, which torch's Adam then advances once per sub-group and step (a wrong bias correction
    from the second step on): each sub-group gets its own copy here. Rank ``r`` restores
    ``rng_rank<r>.pt`` if the saving run had a rank ``r``, else keeps its seeded RNG state."""
    from . import compat
    from .distributed import run_on_rank_zero

    universal = Path(output_dir, tag, UNIVERSAL_DIR)
    run_on_rank_zero(lambda: convert_to_universal(output_dir, tag, log=_say))
    with compat.universal_checkpoint_loading(engine):
        load_path, client_state = engine.load_checkpoint(str(universal.parent), tag=UNIVERSAL_DIR,
                                                         load_module_strict=True, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {universal}")
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    rng_file = Path(output_dir, tag, f"rng_rank{dist.get_rank()}.pt")
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return client_state  # (the ranks that keep their seeded RNG are named in the plan's warning)


def convert_to_universal(output_dir: str, tag: str, log=None) -> Path:
    """Convert the committed ZeRO-3 checkpoint ``tag`` (with or without AutoTP) into DeepSpeed's
    universal checkpoint ``<tag>/universal``, in this one process, unless a complete conversion is
    there; returns its path. Complete means its marker file, written last, exists: an interrupted
    conversion is redone from scratch. ``log``: called with a line about what was done.

    Two DeepSpeed 0.19.8 gaps are bridged. ``ds_to_universal`` reads every ZeRO-3 sub-group as
    partitioned over the data-parallel group, but under AutoTP the parameters AutoTP keeps whole
    (the norms) are partitioned over the whole world, as HF's ``zero.Init`` created them, and their
    AutoTP layout records are empty: the files are first rewritten into a temporary folder with
    those groups re-split over the data-parallel ranks (:func:`repartition_over_dp`) and the empty
    records dropped. And without TP it writes bare tensors, which the ZeRO-3 loader does not split
    for AutoTP: they are rewritten as ``{"param": tensor}`` (:func:`wrapped_universal_state`)."""
    from . import compat

    if not is_committed(output_dir, tag):
        raise FileNotFoundError(f"{Path(output_dir, tag)} is not a committed checkpoint (no {COMMIT_FILE})")
    tag_dir = Path(output_dir, tag)
    universal = tag_dir / UNIVERSAL_DIR
    if (universal / UNIVERSAL_DONE).is_file():
        if log:
            log(f"{tag}: loading its universal checkpoint {universal}, converted before")
        return universal
    began = time.perf_counter()
    shutil.rmtree(universal, ignore_errors=True)
    normalized = tag_dir / (UNIVERSAL_DIR + ".input")
    shutil.rmtree(normalized, ignore_errors=True)
    try:
        _dp_partitioned_copy(tag_dir, normalized)
        compat.ds_to_universal(str(normalized), str(universal))
    finally:
        shutil.rmtree(normalized, ignore_errors=True)
        (tag_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer beside its output
    for path in universal.glob("zero/*/*.pt"):
        if path.stem in ZERO3_STATES:
            state = load_deepspeed_shard(path)
            wrapped = wrapped_universal_state(state)
            if wrapped is not state:
                torch.save(wrapped, path)
    _atomic_write(universal / UNIVERSAL_DONE, json.dumps({"from": tag, "commit": read_commit(output_dir, tag)}))
    if log:
        log(f"{tag}: converted to a universal checkpoint in {universal} ({time.perf_counter() - began:.1f} s)")
    return universal


def load_deepspeed_shard(path: Path):
    """One of DeepSpeed's own shard files of this run's checkpoint tag (or of its universal
    conversion). They hold pickled objects besides tensors (configs, enums), so they are read as
    DeepSpeed's ``engine.load_checkpoint`` reads them, without ``weights_only``: the one such read in
    the project, and only ever on files under the run's own ``--output_dir``."""
    return torch.load(path, map_location="cpu", weights_only=False)


def wrapped_universal_state(state):
    """A universal checkpoint's per-parameter state as the ZeRO-3 loader splits it for AutoTP:
    ``{"param": tensor}`` for a bare tensor (what ``ds_to_universal`` writes without TP), else
    ``state`` itself."""
    return {"param": state} if torch.is_tensor(state) else state


def repartition_over_dp(by_rank: list, numels: list, tp_size: int, dp_size: int) -> list:
    """One ZeRO-3 flat sub-group partitioned over the whole world, re-split over the data-parallel
    group: ``by_rank[g]`` is global rank ``g``'s flat partition (``g = dp_rank * tp_size + tp_rank``:
    DeepSpeed's AutoTP groups are consecutive ranks), which holds ``ceil(n / world)`` elements of
    each of the group's parameters of ``numels`` in turn (zero-padded). Returns ``dp_size`` flat
    partitions, each ``ceil(n / dp_size)`` elements of each parameter in turn, zero-padded: what
    every tensor-parallel rank of that data-parallel rank holds of a parameter it keeps whole."""
    world = tp_size * dp_size
    if len(by_rank) != world:
        raise ValueError(f"{len(by_rank)} partitions for {tp_size} x {dp_size} ranks")
    pieces, offset = [[] for _ in range(dp_size)], 0
    for numel in numels:
        world_part, dp_part = math.ceil(numel / world), math.ceil(numel / dp_size)
        whole = torch.cat([flat[offset:offset + world_part] for flat in by_rank])[:numel]
        whole = torch.cat([whole, whole.new_zeros(dp_part * dp_size - numel)])
        for dp in range(dp_size):
            pieces[dp].append(whole[dp * dp_part:(dp + 1) * dp_part])
        offset += world_part
    return [torch.cat(parts) for parts in pieces]


def _zero3_files(directory: Path, kind: str) -> dict:
    """{(tp rank, dp rank): path} of the ZeRO-3 ``kind`` ("model" or "optim") state files."""
    files = {}
    for path in directory.glob(f"zero_pp_rank_*_mp_rank_*_{kind}_states.pt"):
        match = re.fullmatch(rf"zero_pp_rank_(\d+)_mp_rank_(\d+)_{kind}_states\.pt", path.name)
        if match:
            dp_rank, tp_rank = map(int, match.groups())
            files[tp_rank, dp_rank] = path
    return files


def _dp_partitioned_copy(tag_dir: Path, target: Path) -> None:
    """The DeepSpeed files of ``tag_dir`` in ``target`` with every ZeRO-3 sub-group partitioned over
    the data-parallel group (what ``ds_to_universal`` reads; :func:`repartition_over_dp` for the
    sub-groups partitioned over the whole world) and no AutoTP layout record of an empty shape
    (``ds_to_universal`` then treats those parameters as replicated, as they are). Files that need
    no change are linked, not copied."""
    models, optims = _zero3_files(tag_dir, "model"), _zero3_files(tag_dir, "optim")
    if not models or models.keys() != optims.keys():
        raise ValueError(f"{tag_dir} has no complete set of ZeRO-3 model and optimizer state files "
                         f"(model: {sorted(models)}, optimizer: {sorted(optims)}); only ZeRO-3 checkpoints convert")
    tp_size, dp_size = max(tp for tp, _ in models) + 1, max(dp for _, dp in models) + 1
    world = tp_size * dp_size
    if len(models) != world:
        raise ValueError(f"{tag_dir} has {len(models)} ZeRO-3 model-state files, not {tp_size} x {dp_size}")
    model_states = {key: load_deepspeed_shard(path) for key, path in models.items()}
    optim_states = {key: load_deepspeed_shard(path)["optimizer_state_dict"]
                    for key, path in optims.items()}
    target.mkdir(parents=True)
    optims_changed = False
    for group, shapes in enumerate(model_states[0, 0]["param_shapes"]):
        numels = [shape.numel() for shape in shapes.values()]
        length = optim_states[0, 0]["fp32_flat_groups"][group].numel()
        if length == sum(math.ceil(n / dp_size) for n in numels):
            continue
        same_shapes = all(list(states["param_shapes"][group].items()) == list(shapes.items())
                          for states in model_states.values())
        if length != sum(math.ceil(n / world) for n in numels) or not same_shapes:
            raise ValueError(f"ZeRO-3 sub-group {group} of {tag_dir} ({length} elements per rank) is partitioned "
                             f"neither over the {dp_size} data-parallel ranks nor over all {world} ranks alike")
        optims_changed = True
        ranks = [divmod(rank, tp_size)[::-1] for rank in range(world)]  # global rank -> (tp rank, dp rank)
        for name in ZERO3_STATES:
            flats = [_flat_state(optim_states[key], group, name) for key in ranks]
            split = repartition_over_dp(flats, numels, tp_size, dp_size)
            for tp, dp in ranks:
                _set_flat_state(optim_states[tp, dp], group, name, split[dp])
    for key, path in optims.items():
        if optims_changed:
            state = load_deepspeed_shard(path)
            state["optimizer_state_dict"] = optim_states[key]
            torch.save(state, target / path.name)
        else:
            os.symlink(path.resolve(), target / path.name)
    for key, path in models.items():
        layout = model_states[key].get("universal_checkpoint_info", {}).get("affine_map", {}).get("params", {})
        empty = [pattern for pattern, entry in layout.items() if math.prod(entry["logical_shape"]) == 0]
        for pattern in empty:
            del layout[pattern]
        if empty:
            torch.save(model_states[key], target / path.name)
        else:
            os.symlink(path.resolve(), target / path.name)


def _flat_state(optimizer: dict, group: int, name: str) -> torch.Tensor:
    if name == "fp32":
        return optimizer["fp32_flat_groups"][group].detach()
    return optimizer["optimizer_state_dict"]["state"][group][name]


def _set_flat_state(optimizer: dict, group: int, name: str, flat: torch.Tensor) -> None:
    if name == "fp32":
        optimizer["fp32_flat_groups"][group] = flat
    else:
        optimizer["optimizer_state_dict"]["state"][group][name] = flat


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


def main(argv=None) -> None:
    """``python -m smmd_train.checkpoint convert OUTPUT_DIR [TAG]``: convert a run's committed
    checkpoint (default: the one a resume would take) to a universal checkpoint in one process, no
    engine and no process group, so that a resume under another layout loads it as it is (useful
    for big models: the conversion holds the whole optimizer state in this process's memory)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m smmd_train.checkpoint", description=main.__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a committed ZeRO-3 checkpoint into <tag>/universal")
    convert.add_argument("output_dir", help="the run's --output_dir")
    convert.add_argument("tag", nargs="?", help="the checkpoint (default: the one --resume would load)")
    args = parser.parse_args(argv)
    tag = args.tag or find_resume_tag(args.output_dir)
    if tag is None:
        parser.exit(1, f"no committed checkpoint in {args.output_dir}\n")
    try:
        convert_to_universal(args.output_dir, tag, log=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"{error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
