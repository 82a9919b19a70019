"""The trainer's inventory of private upstream APIs (DeepSpeed, torch, datasets, transformers,
argparse): every one ``smmd_train`` uses is reached here and nowhere else.

Each function names what it reaches for, imports lazily (``smmd_train.distributed.groups`` loads this
module before torch is needed), says which upstream version it was checked against, and raises
:class:`~smmd_scale.compat.UpstreamChanged` naming the installed version when the thing is gone.
``tests/train/test_trainer_compat.py`` exercises each one against the installed versions.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager

from smmd_scale.compat import private

# ---------------------------------------------------------------------------------------------
# DeepSpeed
# ---------------------------------------------------------------------------------------------


def init_tensor_parallel_groups(tp_size: int) -> None:
    """Create DeepSpeed's tensor- and data-parallel groups for AutoTP (``groups._init_tp_mesh_device``)
    before the model is partitioned over the data-parallel group (what ``deepspeed.initialize``
    would do later, too late for ``zero.Init``)."""
    from deepspeed.utils import groups

    init = private(groups, "_init_tp_mesh_device", package="deepspeed", checked="0.19.8",
                   purpose="create the AutoTP process groups before ZeRO-3 partitions the model")
    init(tensor_model_parallel_size=tp_size)


def consolidated_state_dict(engine) -> dict:
    """The full model state dict on rank 0 (ZeRO-3 partitions and AutoTP shards gathered); a
    collective: every rank calls it. DeepSpeed's ``save_16bit_model`` does the same but writes one
    file in its own layout, not a Hugging Face directory."""
    if engine.zero_optimization_partition_weights():
        return private(engine, "_zero3_consolidated_16bit_state_dict", package="deepspeed", checked="0.19.8",
                       purpose="gather a ZeRO-3 model for export")()
    return private(engine, "_consolidated_16bit_state_dict", package="deepspeed", checked="0.19.8",
                   purpose="gather an AutoTP model for export")()


def ds_to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's converter of a checkpoint folder into a universal checkpoint, in this process
    (``deepspeed.checkpoint.ds_to_universal.main``: a command-line tool's entry point, called with
    the argument namespace its parser would give; one worker, so no process pool)."""
    from deepspeed.checkpoint import ds_to_universal as converter

    main = private(converter, "main", package="deepspeed", checked="0.19.8",
                   purpose="convert a checkpoint for a resume under another layout")
    main(argparse.Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))


@contextmanager
def universal_checkpoint_loading(engine):
    """Inside this block ``engine.load_checkpoint`` reads a universal checkpoint: DeepSpeed chooses
    its loader by the config's ``"checkpoint": {"load_universal": true}``, read through
    ``engine._config.load_universal_checkpoint``; switched on for the block only (later saves and
    loads of the run are ordinary ones)."""
    config = private(engine, "_config", package="deepspeed", checked="0.19.8", purpose="load a universal checkpoint")
    previous = private(config, "load_universal_checkpoint", package="deepspeed", checked="0.19.8",
                       purpose="load a universal checkpoint")
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


def cpu_allreduce_segment(rank: int) -> str:
    """The ``/dev/shm`` name of DeepSpeed's CPU shared-memory all-reduce buffer of ``rank`` (its C++
    op names it from the user id, MASTER_ADDR and MASTER_PORT, and never unlinks it). Checked against
    deepspeed 0.19.8's ``shm.cpp``."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank}")


def release_sequence_parallel_groups(mpu, group_name: str) -> None:
    """Drop DeepSpeed's module-level references to Ulysses sequence-parallel groups: the all-to-all
    group cache ``deepspeed.sequence.layer._all_to_all_groups`` (entry ``group_name``) and the groups
    of ``mpu`` (``parallel_state_sp._release_sequence_parallel_groups``); no public release exists."""
    from deepspeed.sequence import layer

    private(layer, "_all_to_all_groups", package="deepspeed", checked="0.19.8",
            purpose="release the sequence-parallel groups at shutdown").pop(group_name, None)
    private(mpu, "_release_sequence_parallel_groups", package="deepspeed", checked="0.19.8",
            purpose="release the sequence-parallel groups at shutdown")()


def release_deepspeed_process_groups() -> None:
    """Drop what DeepSpeed keeps at module level that (indirectly) holds process groups, so that the
    groups, and their gloo threads, can go before interpreter shutdown: ``deepspeed.utils.groups``'
    groups and TP mesh (which also lets ``_init_tp_mesh_device`` make new ones after a re-init),
    ZeRO-3's forward-module stack ``parameter_offload.FWD_MODULE_STACK`` (it keeps the model), and
    DeepSpeed's ``functools.lru_cache``-memoized methods
    (``PartitionedParameterCoordinator.__params_to_release`` caches ``self``, hence every
    partitioned parameter and its ``ds_process_group``). ``engine.destroy()`` clears none of them.
    Checked against deepspeed 0.19.8 and Python 3.11's ``functools._lru_cache_wrapper``."""
    import sys

    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    groups = sys.modules.get("deepspeed.utils.groups")
    for name, value in list(vars(groups).items()) if groups is not None else []:
        if isinstance(value, (ProcessGroup, DeviceMesh)):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(item, (ProcessGroup, DeviceMesh)) for item in value.values()):
            value.clear()
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        stack = private(offload, "FWD_MODULE_STACK", package="deepspeed", checked="0.19.8",
                        purpose="release ZeRO-3's module stack at shutdown")
        stack.clear()
    for cache in deepspeed_lru_caches():
        cache.cache_clear()


def deepspeed_lru_caches() -> list:
    """DeepSpeed's ``functools.lru_cache`` wrappers: those its modules made at import, found from the modules'
    functions and classes (through decorators' closures and ``__wrapped__``: the one that matters is inside
    an nvtx wrapper), and any made since, from ``gc.get_objects()``, which does not list objects frozen by
    ``gc.freeze()`` (``smmd_train.distributed.process_start`` freezes what a rank imported)."""
    import functools
    import gc
    import sys
    import types

    cache_type = private(functools, "_lru_cache_wrapper", package="python", checked="3.11",
                         purpose="clear DeepSpeed's memoized methods at shutdown")
    found, seen = {}, set()

    def visit(value, depth: int) -> None:
        if depth > 4 or id(value) in seen:
            return
        seen.add(id(value))
        kind = type(value)  # type(), not isinstance(): some objects warn on any attribute access
        if kind is cache_type:
            found[id(value)] = value
        if kind in (staticmethod, classmethod):
            visit(value.__func__, depth + 1)
        elif kind is property:
            for accessor in (value.fget, value.fset, value.fdel):
                visit(accessor, depth + 1)
        elif kind in (types.FunctionType, cache_type):
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped, depth + 1)
            for cell in getattr(value, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "deepspeed" or name.startswith("deepspeed.")):
            continue
        for value in list(vars(module).values()):
            if issubclass(type(value), type):
                for attribute in list(vars(value).values()):
                    visit(attribute, 0)
            else:
                visit(value, 0)
    for value in gc.get_objects():
        if type(value) is cache_type:
            found[id(value)] = value
    return [cache for cache in found.values() if str(cache.__module__).startswith("deepspeed.")]


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


@contextmanager
def muon_left_unimported(ds_config: dict):
    """Inside this block ``deepspeed.initialize`` does not import DeepSpeed's Muon optimizer module
    unless the config asks for Muon. DeepSpeed imports it while it builds every engine, only to ask
    whether the optimizer is a ``MuonWithAuxAdam``; the import compiles Muon's kernels with
    ``torch.compile``, which loads torch's inductor: about 1.5 CPU seconds per rank for a class that
    is never used. A stand-in module whose class no optimizer is an instance of answers the same
    question; it leaves ``sys.modules`` when the block ends, so a later import gets the real module.
    The module path checked against DeepSpeed 0.19.8."""
    import sys
    import types

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    optimizer = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    if optimizer == "muon" or name in sys.modules:
        yield
        return
    stand_in = types.ModuleType(name, "stand-in: no optimizer of this run is DeepSpeed's Muon")
    stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]


def process_groups() -> list:
    """Every process group c10d made in this process (the default one, DeviceMesh's and DeepSpeed's
    sub-groups): the keys of ``distributed_c10d._world.pg_map``. Checked against torch 2.13."""
    from torch.distributed import distributed_c10d

    world = private(distributed_c10d, "_world", package="torch", checked="2.13",
                    purpose="release every process group at shutdown")
    return list(world.pg_map)


def import_torch_dynamo() -> None:
    """Import ``torch._dynamo`` (a private module; ``torch.compiler`` does not import it). Checked
    against torch 2.13."""
    import torch._dynamo  # noqa: F401


def tensorboard_file_writer(writer):
    """The event-file writer of a ``torch.utils.tensorboard.SummaryWriter`` (``_get_file_writer``), to
    write summary protos into the run itself (``add_hparams`` would open a sub-run per call)."""
    return private(writer, "_get_file_writer", package="torch", checked="2.13",
                   purpose="write HParams into a TensorBoard run's own file")()


# ---------------------------------------------------------------------------------------------
# transformers, datasets
# ---------------------------------------------------------------------------------------------


def attention_implementation(model) -> str:
    """The attention a transformers model runs (``config._attn_implementation``, e.g. ``"sdpa"``); a
    setter (``set_attn_implementation``) is public, a getter is not. Checked against transformers 5.24."""
    return private(model.config, "_attn_implementation", package="transformers", checked="5.24",
                   purpose="check that the model's attention is the one Ulysses sequence parallelism wraps")


def supports_sdpa(model_class) -> bool:
    """Whether a transformers model class runs SDPA when asked to (``_supports_sdpa``, a class flag with
    no public getter; Gemma-2's is False). Checked against transformers 5.24."""
    return bool(private(model_class, "_supports_sdpa", package="transformers", checked="5.24",
                        purpose="tell which attention the memory planner counts for a model family"))


def dataset_fingerprint(dataset) -> str:
    """The fingerprint ``datasets`` gives a dataset's content and history (``Dataset._fingerprint``),
    the key of its own cache. Checked against datasets 5.2."""
    return private(dataset, "_fingerprint", package="datasets", checked="5.2",
                   purpose="key the tokenized-dataset cache by the dataset's content")


# ---------------------------------------------------------------------------------------------
# argparse
# ---------------------------------------------------------------------------------------------


def parser_actions(parser: argparse.ArgumentParser) -> list:
    """Every action of ``parser`` (``ArgumentParser._actions``; argparse has no public list of them).
    Checked against Python 3.11."""
    return private(parser, "_actions", package="python", checked="3.11",
                   purpose="list the trainer's flags")


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help (where it has one),
    through argparse's ``_get_help_string`` hook, as its own ``ArgumentDefaultsHelpFormatter`` does
    (only the formatter classes' names are public). Checked against Python 3.11."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text
