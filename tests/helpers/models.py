"""Factories for the tiny models the tests train, export and load: Llama, and one small config of each
family the fused linear head supports."""

import torch


def tiny_llama(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               max_positions: int = 128, seed=0, **config):
    """A randomly initialised ``LlamaForCausalLM`` (``intermediate_size = 2 * hidden_size``), seeded
    with ``torch.manual_seed(seed)`` unless ``seed`` is None; ``config``: more ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                        intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        max_position_embeddings=max_positions, **config))


# Per family: the transformers config class and what makes its head or loss differ from Llama's,
# set so that it bites on a tiny random model (a soft-cap near the logits' size, a scale far from 1,
# a router auxiliary loss with a large coefficient, on by default); Cohere's default special token
# ids lie outside a small vocabulary.
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", {}), "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", {"final_logit_softcapping": 0.5}),
    "gemma3_text": ("Gemma3TextConfig", {"final_logit_softcapping": 0.5}),
    "cohere": ("CohereConfig", {"logit_scale": 4.0, "bos_token_id": 1, "eos_token_id": 2}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                                  "router_aux_loss_coef": 0.5}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                     "shared_expert_intermediate_size": 16, "output_router_logits": True,
                                     "router_aux_loss_coef": 0.5}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                     "output_router_logits": True, "router_aux_loss_coef": 0.5}),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_causal_lm(family: str, vocab_size: int, *, tied: bool, hidden_size: int = 16, heads: int = 2,
                   kv_heads: int = 1, layers: int = 2, seed=0, dtype=torch.float64, **config):
    """A randomly initialised ``AutoModelForCausalLM`` of ``family`` (a key of ``FAMILY_CONFIGS``; head
    dimension ``hidden_size // heads``, ``intermediate_size = 2 * hidden_size`` unless ``config`` says
    otherwise) created in ``dtype``, seeded with ``torch.manual_seed(seed)`` unless ``seed`` is None;
    ``config``: more config fields, over the family's. MoE experts run their eager loop (the
    grouped-GEMM kernels have no float64)."""
    import transformers

    class_name, family_fields = FAMILY_CONFIGS[family]
    fields = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hidden_size // heads, max_position_embeddings=64, tie_word_embeddings=tied)
    fields.update(family_fields)
    fields.update(config)
    if seed is not None:
        torch.manual_seed(seed)
    options = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**fields), dtype=dtype,
                                                         **options)


def saved_activation_bytes(model, **inputs) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in ``model(**inputs)``."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs)
    return sum(saved.values())


def token_rows(ids, labels, length=None):
    """A ``torch.utils.data.Dataset`` of ``{"input_ids", "labels"}`` rows of ``ids [R, S]`` and
    ``labels``, cycling through them for ``length`` items (default R): what a Trainer test trains on."""
    rows = len(ids)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return length or rows

        def __getitem__(self, index):
            return {"input_ids": ids[index % rows], "labels": labels[index % rows]}

    return Rows()
