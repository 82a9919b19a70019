"""Every private DeepSpeed / transformers / tokenizers / torch API the project relies on, in one place.

Upstream can change these without notice. Each function below names what it reaches for, imports
lazily (``import smmd_scale`` needs neither DeepSpeed nor transformers), and raises
:class:`UpstreamChanged` naming the package version when the thing is gone, instead of failing
somewhere deep in a training job. ``tests/test_compat.py`` exercises each one against the installed
versions, so an upgrade that breaks one fails there first. Written against deepspeed 0.19.8 and
transformers 5.23.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from importlib import metadata
from typing import Callable, Optional


class UpstreamChanged(RuntimeError):
    """A private upstream API smmd-scale uses is missing or different in the installed version."""


def _private(owner, name: str, package: str, purpose: str):
    """``getattr(owner, name)``, or :class:`UpstreamChanged` saying what it was for."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise UpstreamChanged(f"{package} {metadata.version(package)} has no {getattr(owner, '__name__', owner)}."
                              f"{name}, which smmd-scale uses to {purpose}; this smmd-scale was written against "
                              f"deepspeed 0.19.8 / transformers 5.23 (see smmd_scale/compat.py)") from None


# ---------------------------------------------------------------------------------------------
# transformers / tokenizers (used by the loss plugin)
# ---------------------------------------------------------------------------------------------

def model_token_to_id(tokenizer) -> Callable[[str], Optional[int]]:
    """The token -> id lookup of a tokenizer's *model*, bypassing its added-token table.

    Fast tokenizers: ``backend_tokenizer.model.token_to_id`` (public). Python ("slow") tokenizers
    have no public equivalent: ``_convert_token_to_id`` is the per-model lookup every one implements.
    """
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend.model.token_to_id
    return _private(tokenizer, "_convert_token_to_id", "transformers",
                    "tell a tokenizer's own tokens from tokens added on top of it")


def trainer_count_items(trainer, batch_samples: list, device):
    """What ``transformers.Trainer`` passes as ``num_items_in_batch`` for ``batch_samples`` (the
    step's micro-batches): its own count of labels != -100, gathered and divided exactly as it does
    for the devices (``Trainer._get_num_items_in_batch``, private)."""
    count = _private(trainer, "_get_num_items_in_batch", "transformers",
                     "count the numeric targets of a Trainer step the way the Trainer counts its tokens")
    return count(batch_samples, device)


def router_load_balancing_loss(model) -> Callable:
    """The ``load_balancing_loss_func`` of the transformers modeling module that defines ``model``'s
    class (Mixtral, Qwen2-MoE, Qwen3-MoE): the router auxiliary loss their ``ForCausalLM.forward`` adds,
    used as is so that the fused forward adds exactly the same term. Module-level, not exported."""
    import sys

    return _private(sys.modules[type(model).__module__], "load_balancing_loss_func", "transformers",
                    f"add {type(model).__name__}'s router auxiliary loss to the fused head's loss")


# HF causal LMs keep an assigned ``loss_function`` in this instance attribute (the property's setter);
# reading it tells whether the model had its own hook before smmd_scale.install replaced it.
_LOSS_FUNCTION_ATTRIBUTE = "_loss_function"


def assigned_loss_function(model) -> tuple:
    """``(True, hook)`` if ``model.loss_function`` was assigned on this instance, else ``(False, None)``."""
    own = vars(model)
    return (_LOSS_FUNCTION_ATTRIBUTE in own), own.get(_LOSS_FUNCTION_ATTRIBUTE)


def forget_loss_function(model) -> None:
    """Undo an assignment of ``model.loss_function``: the model's class default applies again."""
    vars(model).pop(_LOSS_FUNCTION_ATTRIBUTE, None)


# ---------------------------------------------------------------------------------------------
# DeepSpeed (used by the integrations and the trainer)
# ---------------------------------------------------------------------------------------------

def vocab_parallel_linear_class():
    """``deepspeed.module_inject.layers.VocabParallelLinear`` (AutoTP's vocabulary-parallel LM head),
    or None when DeepSpeed is not installed. Its attributes ``mp_group``, ``vocab_start_index``,
    ``vocab_end_index``, ``vocab_size`` and ``is_tp_parallel`` are what the loss reads."""
    try:
        from deepspeed.module_inject import layers
    except ImportError:
        return None
    return _private(layers, "VocabParallelLinear", "deepspeed", "find AutoTP's vocabulary-parallel LM head")


def init_tensor_parallel_groups(tp_size: int) -> None:
    """Create DeepSpeed's tensor- and data-parallel groups for AutoTP (``groups._init_tp_mesh_device``)
    before the model is partitioned over the data-parallel group (what ``deepspeed.initialize``
    would do later, too late for ``zero.Init``)."""
    from deepspeed.utils import groups

    _private(groups, "_init_tp_mesh_device", "deepspeed", "create the AutoTP process groups before ZeRO-3 "
             "partitions the model")(tensor_model_parallel_size=tp_size)


def consolidated_state_dict(engine) -> dict:
    """The full model state dict on rank 0 (ZeRO-3 partitions and AutoTP shards gathered); a
    collective: every rank calls it. DeepSpeed's ``save_16bit_model`` does the same but writes one
    file in its own layout, not a Hugging Face directory."""
    if engine.zero_optimization_partition_weights():
        return _private(engine, "_zero3_consolidated_16bit_state_dict", "deepspeed",
                        "gather a ZeRO-3 model for export")()
    return _private(engine, "_consolidated_16bit_state_dict", "deepspeed", "gather an AutoTP model for export")()


def ds_to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's converter of a checkpoint folder into a universal checkpoint, in this process
    (``deepspeed.checkpoint.ds_to_universal.main``: a command-line tool's entry point, called with
    the argument namespace its parser would give; one worker, so no process pool)."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal as converter

    main = _private(converter, "main", "deepspeed", "convert a checkpoint for a resume under another layout")
    main(Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=1,
                   num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))


@contextmanager
def universal_checkpoint_loading(engine):
    """Inside this block ``engine.load_checkpoint`` reads a universal checkpoint: DeepSpeed chooses
    its loader by the config's ``"checkpoint": {"load_universal": true}``, read through
    ``engine._config.load_universal_checkpoint``; switched on for the block only (later saves and
    loads of the run are ordinary ones)."""
    config = _private(engine, "_config", "deepspeed", "load a universal checkpoint")
    previous = _private(config, "load_universal_checkpoint", "deepspeed", "load a universal checkpoint")
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


def tensorboard_file_writer(writer):
    """The event-file writer of a ``torch.utils.tensorboard.SummaryWriter`` (``_get_file_writer``), to
    write summary protos into the run itself (``add_hparams`` would open a sub-run per call)."""
    return _private(writer, "_get_file_writer", "torch", "write HParams into a TensorBoard run's own file")()


def cpu_allreduce_segment(rank: int) -> str:
    """The ``/dev/shm`` name of DeepSpeed's CPU shared-memory all-reduce buffer of ``rank`` (its C++
    op names it from the user id, MASTER_ADDR and MASTER_PORT, and never unlinks it)."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank}")


def release_deepspeed_process_groups() -> None:
    """Drop what DeepSpeed keeps at module level that (indirectly) holds process groups, so that the
    groups, and their gloo threads, can go before interpreter shutdown: ``deepspeed.utils.groups``'
    groups and TP mesh (which also lets ``_init_tp_mesh_device`` make new ones after a re-init),
    ZeRO-3's forward-module stack ``parameter_offload.FWD_MODULE_STACK`` (it keeps the model), and
    DeepSpeed's ``functools.lru_cache``-memoized methods
    (``PartitionedParameterCoordinator.__params_to_release`` caches ``self``, hence every
    partitioned parameter and its ``ds_process_group``). ``engine.destroy()`` clears none of them."""
    import functools
    import gc
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
        stack = _private(offload, "FWD_MODULE_STACK", "deepspeed", "release ZeRO-3's module stack at shutdown")
        stack.clear()
    for cache in gc.get_objects():  # type(), not isinstance(): some objects warn on any attribute access
        if type(cache) is functools._lru_cache_wrapper and str(cache.__module__).startswith("deepspeed."):
            cache.cache_clear()
