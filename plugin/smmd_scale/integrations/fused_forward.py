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

Each accepted family's ``ForCausalLM.forward`` was read in transformers' modeling code and is
reproduced step for step (``FUSED_FAMILIES``): backbone -> linear head -> [Gemma-2/3: final logit
soft-capping ``cap * tanh(logits / cap)``; Cohere: ``logits * logit_scale``] -> loss [+ Mixtral,
Qwen2-MoE, Qwen3-MoE: ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` when
``output_router_logits`` (the call's, else the config's)]. The soft-cap and the scale go into the
fused op (its ``logit_softcap`` / ``logit_scale``), so CE and the numeric loss read the same
transformed logits the model's own ``loss_function`` is given; the router loss is the model module's
own function on the backbone's router logits and the call's ``attention_mask``, returned as
``aux_loss`` beside ``router_logits`` as the model does. Anything else (another family, a subclass
with its own forward) is refused at install time, naming the model and the reason, rather than
trained on a different objective.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, NamedTuple, Optional

from .. import compat
from ..fused_linear import linear_numeric_cross_entropy
from ..numeric_loss import IGNORE_INDEX


class Family(NamedTuple):
    """What one family's ``ForCausalLM.forward`` does around the linear head."""

    causal_lm: str  # the transformers class whose forward is reproduced
    logits: Optional[str] = None  # the op keyword that reproduces its logit transform, if any
    router_loss: bool = False  # adds an MoE router auxiliary loss


# Checked against transformers' modeling code and by tests/loss/test_fused_forward.py.
FUSED_FAMILIES = {
    "llama": Family("LlamaForCausalLM"), "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM"), "qwen3": Family("Qwen3ForCausalLM"),
    "gemma2": Family("Gemma2ForCausalLM", logits="logit_softcap"),
    "gemma3_text": Family("Gemma3ForCausalLM", logits="logit_softcap"),
    "cohere": Family("CohereForCausalLM", logits="logit_scale"),
    "mixtral": Family("MixtralForCausalLM", router_loss=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", router_loss=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", router_loss=True),
}


class FusedHead(NamedTuple):
    """How the fused forward reproduces one model's head and loss (from :func:`check_fused_support`)."""

    family: Family
    router_loss: Optional[Callable]  # the model module's load_balancing_loss_func, for MoE families

    def op_options(self, model) -> dict:
        """The fused op's keyword for the logit transform, read at call time as the model's forward does."""
        if self.family.logits == "logit_softcap" and model.config.final_logit_softcapping is not None:
            return {"logit_softcap": model.config.final_logit_softcapping}
        if self.family.logits == "logit_scale":
            return {"logit_scale": model.logit_scale}
        return {}


def check_fused_support(model) -> FusedHead:
    """How to reproduce ``model``'s forward with the fused head, or ``ValueError`` naming the model and
    the reason when the fused path would not compute exactly what the model's own forward computes."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    model_type = getattr(config, "model_type", None)
    family = FUSED_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"fused_linear=True supports the model families {tuple(FUSED_FAMILIES)}, whose forward it "
                         f"reproduces; {name} ({model_type}) is not one of them; install with fused_linear=False")
    import transformers

    expected = getattr(transformers, family.causal_lm)
    if type(model).forward is not expected.forward:
        raise ValueError(f"fused_linear=True reproduces {family.causal_lm}.forward, but {name} ({model_type}) has a "
                         "forward of its own, which the fused head + loss may not match; install with "
                         "fused_linear=False")
    if family.logits is not None and family.logits not in inspect.signature(linear_numeric_cross_entropy).parameters:
        raise ValueError(f"fused_linear=True cannot train {name} ({model_type}) exactly: its forward transforms the "
                         f"logits before the loss and this smmd_scale's linear_numeric_cross_entropy has no "
                         f"{family.logits} option to do the same; install with fused_linear=False")
    if not hasattr(model, "model") or model.get_output_embeddings() is None:
        raise ValueError(f"fused_linear=True needs {name}.model (the backbone) and an output embedding (the head)")
    return FusedHead(family, compat.router_load_balancing_loss(model) if family.router_loss else None)


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


def model_output(output_class, backbone_outputs, **values):
    """``output_class(**values)`` with the backbone's cache, hidden states and attentions, as the model's
    forward returns them (the cache field is ``cache`` in transformers 5.24, ``past_key_values`` before)."""
    names = {field.name for field in dataclasses.fields(output_class)}
    cache = "cache" if "cache" in names else "past_key_values"
    return output_class(**values, **{cache: getattr(backbone_outputs, cache)},
                        hidden_states=backbone_outputs.hidden_states, attentions=backbone_outputs.attentions)


def fused_forward(model, original_forward, hook, head_finder, head: FusedHead):
    """The per-instance ``forward`` that trains without logits (see the module docstring).

    ``hook``: the installed :class:`NumericCausalLMLoss`; ``head_finder()``: the head module, looked up at
    call time (AutoTP replaces ``lm_head`` inside ``deepspeed.initialize``); ``head``: what
    :func:`check_fused_support` found the family's forward does around the head.
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

        backbone_arguments = {name: value for name, value in arguments.items()
                              if name not in ("labels", "logits_to_keep")}
        if head.router_loss is not None:  # as the MoE forward: the call's choice, else the config's
            output_router_logits = arguments.get("output_router_logits")
            backbone_arguments["output_router_logits"] = (model.config.output_router_logits
                                                          if output_router_logits is None else output_router_logits)
        outputs = model.model(**backbone_arguments, **extra)
        loss = hook.fused_loss(head_finder(), call_through_module, outputs.last_hidden_state, labels=labels,
                               shift_labels=shift_labels, num_items_in_batch=extra.get("num_items_in_batch"),
                               ignore_index=extra.get("ignore_index", IGNORE_INDEX),
                               num_numeric_in_batch=extra.get("num_numeric_in_batch"),
                               op_options=head.op_options(model), sequence_shard=extra.get("sequence_shard"))
        from transformers import modeling_outputs

        if head.router_loss is None:
            return model_output(modeling_outputs.CausalLMOutputWithPast, outputs, loss=loss, logits=None)
        aux_loss = None
        if backbone_arguments["output_router_logits"]:
            aux_loss = head.router_loss(outputs.router_logits, model.num_experts, model.num_experts_per_tok,
                                        arguments.get("attention_mask"))
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
        return model_output(modeling_outputs.MoeCausalLMOutputWithPast, outputs, loss=loss, aux_loss=aux_loss,
                            logits=None, router_logits=outputs.router_logits)

    return forward
