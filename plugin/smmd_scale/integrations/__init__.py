"""Where the loss meets frameworks: Hugging Face (``hf``), DeepSpeed AutoTP (``deepspeed``) and
Megatron-core (``megatron``). :func:`install` is the one entry point for HF models and engines."""

from __future__ import annotations

from typing import Optional

from ..numeric_loss import NumericLoss
from ..removed import module_attribute, removed_error
from ..vocab import NumericVocab
from .deepspeed import find_vocab_parallel_head, unwrap_model
from .fused_forward import check_fused_support, fused_forward
from .hf import DetachedLosses, InstalledLoss, NumericCausalLMLoss, set_loss_function
from .megatron import vocab_parallel_numeric_cross_entropy


def install(model_or_engine, loss: NumericLoss, weight: float = 1.0, *, fused_linear: bool = False,
            ce_options: Optional[dict] = None) -> InstalledLoss:
    """Make a Hugging Face causal LM (or a DeepSpeed engine wrapping one) train on CE + weight *
    ``loss``, a numeric loss (``SMMDLoss(vocab)``, ``NTLoss(vocab)``, ``SMMDLoss(vocab) + 0.3 * NTLoss(vocab)``,
    ...), whose numeric vocabulary must match the model's logits.

    Replaces ``model.loss_function``. If DeepSpeed AutoTP made the LM head vocabulary-parallel,
    the hook computes on this rank's logits shard with the head's ``mp_group`` and
    ``vocab_start_index`` (one packed all-reduce per forward); otherwise on full logits.
    ``fused_linear=True`` also replaces this model's ``forward`` so that a training forward with
    labels never computes the logits (``integrations/fused_forward.py``: Llama, Mistral, Qwen2,
    Qwen3, Gemma-2, Gemma-3 (text), Cohere, Mixtral, Qwen2-MoE and Qwen3-MoE, with their logit
    soft-capping, logit scale and router auxiliary loss; other models are refused); evaluation and
    generation still return logits. ``ce_options`` (e.g. ``{"z_loss": 1e-4, "label_smoothing": 0.1}``)
    go to every call of the op (:class:`NumericCausalLMLoss`). Returns an :class:`InstalledLoss` with
    ``last_stats``, ``last_path`` and ``restore()``.

    The second-round call, ``install(model, vocab, ...)`` (a vocabulary), was removed in 0.3.0: it is
    refused naming the call that replaced it.
    """
    if isinstance(loss, NumericVocab):
        raise removed_error("install(model, vocab, ...)", TypeError)
    if not isinstance(loss, NumericLoss):
        raise TypeError(f"install needs a smmd_scale numeric loss (SMMDLoss(vocab), NTLoss(vocab), ...) as its second "
                        f"argument; got {type(loss).__name__}")
    vocab = loss.vocab
    model = unwrap_model(model_or_engine)
    fused_head = check_fused_support(model) if fused_linear else None
    head = find_vocab_parallel_head(model)
    if head is not None:
        if head.vocab_size != vocab.vocab_size:
            raise ValueError(f"the vocabulary-parallel head scores {head.vocab_size} tokens but the numeric vocabulary "
                             f"was built for vocab_size={vocab.vocab_size}; build it with vocab_size="
                             f"{head.vocab_size}")
        hook = NumericCausalLMLoss(loss, weight, tp_group=head.mp_group,
                                   vocab_start_index=head.vocab_start_index, ce_options=ce_options)
    else:
        config_vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if config_vocab_size is not None and config_vocab_size != vocab.vocab_size:
            raise ValueError(f"the model's logits have {config_vocab_size} columns (config.vocab_size) but the "
                             f"numeric vocabulary was built for vocab_size={vocab.vocab_size}; build it with "
                             f"NumericVocab.from_tokenizer(tokenizer, vocab_size={config_vocab_size})")
        hook = NumericCausalLMLoss(loss, weight, ce_options=ce_options)
    installed = InstalledLoss(model, hook, head)
    set_loss_function(model, hook)
    if fused_linear:
        # The head is looked up at call time: with AutoTP it is the VocabParallelLinear found above.
        model.forward = fused_forward(model, model.forward, hook,
                                      lambda: head if head is not None else model.get_output_embeddings(), fused_head)
        installed.fused_linear = True
    return installed


def __getattr__(name: str):
    """``NumericLossCallback`` (``hf_callback``), imported on first use: it needs transformers."""
    if name == "NumericLossCallback":
        from .hf_callback import NumericLossCallback

        return NumericLossCallback
    return module_attribute(__name__, name)  # a name removed in 0.3.0 is refused with what replaced it


__all__ = ["install", "DetachedLosses", "InstalledLoss", "NumericCausalLMLoss", "NumericLossCallback",
           "find_vocab_parallel_head", "unwrap_model", "vocab_parallel_numeric_cross_entropy"]
