"""The loss plugin's inventory of private upstream APIs (transformers, tokenizers, TRL, DeepSpeed): every
one ``smmd_scale`` uses is reached here and nowhere else.

Upstream can change these without notice. Each function below names what it reaches for, imports
lazily (``import smmd_scale`` needs neither DeepSpeed nor transformers), and raises
:class:`UpstreamChanged` naming the installed version and the one the access was checked against
when the thing is gone, instead of failing somewhere deep in a training job.
``tests/loss/test_compat.py`` exercises each one against the installed versions, so an upgrade that
breaks one fails there first. The trainer and the numeracy study keep their own inventories
(``smmd_train.compat``, ``smmd_numeracy.compat``); ``tests/test_structure.py`` refuses a private
upstream access anywhere else.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Callable, Optional


class UpstreamChanged(RuntimeError):
    """A private upstream API smmd-scale uses is missing or different in the installed version."""


def private(owner, name: str, *, package: str, checked: str, purpose: str):
    """``getattr(owner, name)``, or :class:`UpstreamChanged` saying what it was for and which version of
    ``package`` (a distribution's name, or ``"python"`` for the standard library) the access was
    checked against (``checked``)."""
    try:
        return getattr(owner, name)
    except AttributeError:
        installed = platform.python_version() if package == "python" else metadata.version(package)
        raise UpstreamChanged(f"{package} {installed} has no {getattr(owner, '__name__', owner)}."
                              f"{name}, which smmd-scale uses to {purpose}; it was checked against {package} "
                              f"{checked} (the inventories of private upstream APIs: smmd_*/compat.py)") from None


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------

def has_mixed_precision_gemm(device_type: str) -> bool:
    """Whether ``device_type`` registers GEMMs that take bf16/fp16 inputs and write fp32
    (``torch.mm(..., out_dtype=)``, ``aten::mm.dtype`` and ``aten::addmm.dtype``; PyTorch 2.8+, CUDA but
    not the CPU), asked of the dispatcher (``torch._C``, private) as DeepSpeed's fused linear CE does,
    rather than by trying one. Checked against torch 2.13; False where the dispatcher cannot say."""
    import torch

    try:
        key = torch._C._dispatch_key_for_device(device_type)
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
                   for op in ("aten::mm.dtype", "aten::addmm.dtype"))
    except (AttributeError, RuntimeError):
        return False


def torch_dispatch_mode():
    """``TorchDispatchMode``, the base of a mode that sees every ATen op a region dispatches (what
    ``op_count`` counts); it lives in a private module (``torch.utils._python_dispatch``), checked
    against torch 2.13."""
    from torch.utils import _python_dispatch

    return private(_python_dispatch, "TorchDispatchMode", package="torch", checked="2.13.0",
                   purpose="count the ATen ops and host syncs of a loss call")


def device_assert(condition, message: str) -> None:
    """Fail with ``message`` where ``condition`` (a bool tensor) is False, checked on its device without a
    host sync (``torch._assert_async``, private; checked against torch 2.13): on a GPU the kernel
    asserts and the process's next sync reports it; on the CPU it raises at once (RuntimeError)."""
    import torch

    private(torch, "_assert_async", package="torch", checked="2.13.0",
            purpose="check the loss's input values on the device without reading them back")(condition, message)


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
    return private(tokenizer, "_convert_token_to_id", package="transformers", checked="5.24",
                   purpose="tell a tokenizer's own tokens from tokens added on top of it")


def trainer_count_items(trainer, batch_samples: list, device):
    """What ``transformers.Trainer`` passes as ``num_items_in_batch`` for ``batch_samples`` (the
    step's micro-batches): its own count of labels != -100, gathered and divided exactly as it does
    for the devices (``Trainer._get_num_items_in_batch``, private)."""
    count = private(trainer, "_get_num_items_in_batch", package="transformers", checked="5.24",
                    purpose="count the numeric targets of a Trainer step the way the Trainer counts its tokens")
    return count(batch_samples, device)


def router_load_balancing_loss(model) -> Callable:
    """The ``load_balancing_loss_func`` of the transformers modeling module that defines ``model``'s
    class (Mixtral, Qwen2-MoE, Qwen3-MoE): the router auxiliary loss their ``ForCausalLM.forward`` adds,
    used as is so that the fused forward adds exactly the same term. Module-level, not exported."""
    import sys

    return private(sys.modules[type(model).__module__], "load_balancing_loss_func", package="transformers",
                   checked="5.24",
                   purpose=f"add {type(model).__name__}'s router auxiliary loss to the fused head's loss")


# HF causal LMs keep an assigned ``loss_function`` in this instance attribute (the property's setter);
# reading it tells whether the model had its own hook before smmd_scale.install replaced it. Checked
# against transformers 5.24.
_LOSS_FUNCTION_ATTRIBUTE = "_loss_function"


def assigned_loss_function(model) -> tuple:
    """``(True, hook)`` if ``model.loss_function`` was assigned on this instance, else ``(False, None)``."""
    own = vars(model)
    return (_LOSS_FUNCTION_ATTRIBUTE in own), own.get(_LOSS_FUNCTION_ATTRIBUTE)


def forget_loss_function(model) -> None:
    """Undo an assignment of ``model.loss_function``: the model's class default applies again."""
    vars(model).pop(_LOSS_FUNCTION_ATTRIBUTE, None)


# ---------------------------------------------------------------------------------------------
# TRL (the SFTTrainer integration, integrations/trl.py)
# ---------------------------------------------------------------------------------------------

def sft_metrics(trainer) -> dict:
    """``{"train": {name: [values]}, "eval": {...}}``: the metrics ``SFTTrainer.compute_loss`` records per
    micro-batch and ``SFTTrainer.log`` averages into the logs, then clears (``SFTTrainer._metrics``)."""
    return private(trainer, "_metrics", package="trl", checked="1.16.0",
                   purpose="record SFTTrainer's entropy, token accuracy and token count beside the numeric loss hook")


def sft_train_tokens(trainer, tokens: int) -> int:
    """Add a training micro-batch's input ``tokens`` (counted over all processes) to ``SFTTrainer``'s
    ``num_tokens`` total as it does (``_total_train_tokens += tokens // _tp_size``: tensor-parallel
    ranks share a batch); returns the total."""
    purpose = "count SFTTrainer's num_tokens metric beside the numeric loss hook"
    tp_size = private(trainer, "_tp_size", package="trl", checked="1.16.0", purpose=purpose)
    total = private(trainer, "_total_train_tokens", package="trl", checked="1.16.0", purpose=purpose)
    trainer._total_train_tokens = total + tokens // tp_size
    return trainer._total_train_tokens


# ---------------------------------------------------------------------------------------------
# DeepSpeed (used by the integrations)
# ---------------------------------------------------------------------------------------------

def vocab_parallel_linear_class():
    """``deepspeed.module_inject.layers.VocabParallelLinear`` (AutoTP's vocabulary-parallel LM head),
    or None when DeepSpeed is not installed. Its attributes ``mp_group``, ``vocab_start_index``,
    ``vocab_end_index``, ``vocab_size`` and ``is_tp_parallel`` are what the loss reads."""
    try:
        from deepspeed.module_inject import layers
    except ImportError:
        return None
    return private(layers, "VocabParallelLinear", package="deepspeed", checked="0.19.8",
                   purpose="find AutoTP's vocabulary-parallel LM head")
