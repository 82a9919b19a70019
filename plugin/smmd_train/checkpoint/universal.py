"""A ZeRO-3 checkpoint resumed under another world size or tensor-parallel degree: converted once into
DeepSpeed's universal checkpoint in ``<tag>/universal`` (:func:`convert_to_universal`: by rank 0 when
the run resumes, or beforehand in one process, ``python -m smmd_train.checkpoint convert OUTPUT_DIR
[TAG]``) and loaded from there (:func:`load_universal`).

DeepSpeed 0.19.8 needs three workarounds on the way, each where it applies: ZeRO-3 sub-groups that
AutoTP partitions over the whole world are re-split over the data-parallel ranks before
``ds_to_universal`` reads them (:func:`repartition_over_dp`), the bare tensors it writes without TP
are wrapped for the AutoTP loader (:func:`wrapped_universal_state`), and the Adam ``step`` tensor its
loader shares among the optimizer's sub-groups is copied per sub-group (:func:`load_universal`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .commits import COMMIT_FILE, atomic_write, is_committed, read_commit

UNIVERSAL_DIR = "universal"  # <tag>/universal: the tag converted to a DeepSpeed universal checkpoint
UNIVERSAL_DONE = "converted.json"  # written last into <tag>/universal: the conversion is complete
ZERO3_STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what ZeRO-3 keeps per parameter, and the universal files


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("[train]", message, flush=True)


def load_universal(engine, output_dir: str, tag: str) -> dict:
    """``smmd_train.checkpoint.saving.load`` of a ZeRO-3 checkpoint written under another world size or TP
    degree, but for the RNG states (``load`` restores those); call on every rank. Rank 0 converts
    ``tag`` into ``<tag>/universal`` unless a complete conversion is there (:func:`convert_to_universal`),
    the others wait (``run_on_rank_zero``: a long gloo timeout, and an
    error raised on every rank alike); then every rank loads it with DeepSpeed's universal loader,
    switched on for this load only (``compat.universal_checkpoint_loading``).

    DeepSpeed 0.19.8's ZeRO-3 universal loader gives all optimizer sub-groups one shared Adam ``step``
    tensor, which torch's Adam then advances once per sub-group and step (a wrong bias correction
    from the second step on): each sub-group gets its own copy here."""
    from .. import compat
    from ..distributed.groups import run_on_rank_zero

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
    return client_state


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
    from .. import compat

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
    atomic_write(universal / UNIVERSAL_DONE, json.dumps({"from": tag, "commit": read_commit(output_dir, tag)}))
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
