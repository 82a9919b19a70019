"""DeepSpeed integration: find the AutoTP vocabulary-parallel head of an engine or model.

With ``"tensor_parallel": {"autotp_size": T, "vocab_parallel_lm_head": true}`` DeepSpeed replaces
the HF ``lm_head`` by ``deepspeed.module_inject.layers.VocabParallelLinear`` (rank-local logits
``[..., V/T]``; attributes ``mp_group``, ``vocab_start_index``, ``vocab_end_index``,
``vocab_size``) and installs its own CE-only ``VocabParallelCausalLMLoss`` in the model's
``loss_function`` hook. :func:`smmd_scale.install` puts ours there instead. Only module
attributes are read — never a weight, which ZeRO-3 may have partitioned.
"""

from __future__ import annotations

from typing import Optional

from .. import compat


def unwrap_model(model_or_engine):
    """The HF model inside a DeepSpeed engine (or the model itself)."""
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:  # deepspeed is a dependency, but the HF path must not need it
        return model_or_engine
    if isinstance(model_or_engine, DeepSpeedEngine):
        return model_or_engine.module
    return model_or_engine


def find_vocab_parallel_head(model) -> Optional[object]:
    """The one ``VocabParallelLinear`` in ``model`` (None if AutoTP did not shard the head)."""
    head_class = compat.vocab_parallel_linear_class()
    if head_class is None:
        return None
    heads = [module for module in model.modules() if isinstance(module, head_class)]
    if len(heads) > 1:
        raise ValueError(f"found {len(heads)} vocabulary-parallel heads; smmd_scale.install supports one LM head")
    if not heads or not getattr(heads[0], "is_tp_parallel", True):
        return None
    return heads[0]
