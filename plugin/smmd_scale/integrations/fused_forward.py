"""Training forward without logits for Hugging Face causal LMs (``install(..., fused_linear=True)``).

HF's ``ForCausalLM.forward`` runs the backbone, then ``logits = self.lm_head(hidden)``, then
``self.loss_function(logits, labels, ...)``: the logits exist before any loss hook sees them. The
fused path replaces the model's ``forward`` (on this instance only) with one that, when training
with labels, runs the backbone and computes CE + the numeric loss with
:func:`smmd_scale.linear_numeric_cross_entropy` from the final hidden states, returning
``logits=None``. Everything else (no labels, ``model.eval()``, ``skip_logits=False``,
``logits_to_keep``, ``return_dict=False``) goes to the model's own forward, where the installed
``loss_function`` hook computes the same loss on the logits.

The head's weight is used **through the head module**: for the duration of one call the head's
``forward`` is our fused loss, and ``head(hidden)`` is called. DeepSpeed ZeRO-3's module hooks
therefore gather the (partitioned) weight for the forward, re-gather it before the loss's backward
(the outputs pass through its pre-backward hook) and reduce-scatter its gradient, exactly as for
the head's own forward; under AutoTP the weight is this rank's vocabulary shard of the
``VocabParallelLinear`` head, whose backward all-reduce of ``d hidden`` the fused loss runs itself.

Only model families whose forward is exactly backbone -> linear head -> loss are accepted; heads
that do more (soft-capping, logit scales) and forwards that add a loss (MoE routers) are refused at
install time, naming the model and the feature, rather than trained on a different objective.
"""

from __future__ import annotations

import functools
import inspect

# Families whose ForCausalLM.forward is backbone (self.model) -> self.lm_head -> self.loss_function,
# checked against transformers' modeling code and by tests/test_fused_forward.py.
FUSED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Config attributes that mean the head or the loss is more than a linear map + CE on it.
_REFUSED_FEATURES = (
    ("final_logit_softcapping", "final logit soft-capping (tanh of the logits before the loss)"),
    ("logit_scale", "a scale on the logits before the loss"),
    ("logits_scaling", "a division of the logits before the loss"),
    ("output_router_logits", "a mixture-of-experts router auxiliary loss added to the loss"),
    ("router_aux_loss_coef", "a mixture-of-experts router auxiliary loss added to the loss"),
)


def check_fused_support(model) -> None:
    """Raise ``ValueError`` naming the model and the feature when the fused path would not compute
    exactly what the model's own forward computes."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    model_type = getattr(config, "model_type", None)
    for attribute, feature in _REFUSED_FEATURES:
        value = getattr(config, attribute, None)
        if value not in (None, False):
            raise ValueError(f"fused_linear=True cannot train {name} ({model_type}) exactly: its forward applies "
                             f"{feature} (config.{attribute}={value!r}), which the fused head + loss does not "
                             "reproduce; install with fused_linear=False")
    if model_type not in FUSED_FAMILIES:
        raise ValueError(f"fused_linear=True supports the model families {FUSED_FAMILIES}, whose forward is exactly "
                         f"backbone -> linear head -> loss; {name} ({model_type}) is not one of them; install with "
                         "fused_linear=False")
    if not hasattr(model, "model") or model.get_output_embeddings() is None:
        raise ValueError(f"fused_linear=True needs {name}.model (the backbone) and an output embedding (the head)")


def call_through_module(head, compute, hidden):
    """``compute(hidden)`` run as ``head``'s forward, so the module's hooks (ZeRO-3's gather/release)
    fire around it as for the head's own forward. ``hidden`` is passed positionally: ZeRO-3's
    pre-hooks only see positional inputs."""
    had_own_forward = "forward" in vars(head)
    previous = vars(head).get("forward")
    head.forward = compute
    try:
        return head(hidden)
    finally:
        if had_own_forward:
            head.forward = previous
        else:
            del head.forward


def fused_forward(model, original_forward, hook, head_finder):
    """The per-instance ``forward`` that trains without logits (see the module docstring).

    ``hook``: the installed :class:`NumericCausalLMLoss`; ``head_finder()``: the head module, looked up at
    call time (AutoTP replaces ``lm_head`` inside ``deepspeed.initialize``).
    """
    signature = inspect.signature(original_forward)
    var_keyword = next((name for name, parameter in signature.parameters.items()
                        if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        arguments = signature.bind(*args, **kwargs).arguments
        extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
        labels, shift_labels = arguments.get("labels"), extra.get("shift_labels")
        has_labels = labels is not None or shift_labels is not None
        if skip_logits and not has_labels:
            raise ValueError("skip_logits=True needs labels (or shift_labels): without them there is nothing to "
                             "compute instead of the logits")
        fused = (model.training and has_labels) if skip_logits is None else bool(skip_logits)
        if not fused or arguments.get("logits_to_keep", 0) not in (0, None) or extra.get("return_dict") is False:
            return original_forward(*args, **kwargs)

        from transformers.modeling_outputs import CausalLMOutputWithPast

        backbone_arguments = {name: value for name, value in arguments.items()
                              if name not in ("labels", "logits_to_keep")}
        outputs = model.model(**backbone_arguments, **extra)
        loss = hook.fused_loss(head_finder(), call_through_module, outputs.last_hidden_state, labels=labels,
                               shift_labels=shift_labels, num_items_in_batch=extra.get("num_items_in_batch"),
                               ignore_index=extra.get("ignore_index", -100),
                               num_numeric_in_batch=extra.get("num_numeric_in_batch"))
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    return forward
