"""Llama-architecture presets for pretraining from scratch, and their exact parameter counts.

Shapes (the ``config.json`` of each HF checkpoint, as documented by transformers' Llama pages):

* ``1b``  = Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied embeddings,
  rope_theta 500000. ``3b`` = Llama-3.2-3B: hidden 3072, 28 layers, 24 heads (head_dim 128),
  8 KV heads, MLP 8192, tied, rope_theta 500000. Their ``llama3`` RoPE scaling (factor 32, for
  128k-token contexts) is left out: a model trained from scratch learns its own context length.
* ``7b`` / ``13b`` / ``70b`` = Llama-2-7B / 13B / 70B: hidden 4096 / 5120 / 8192, layers
  32 / 40 / 80, heads 32 / 40 / 64, KV heads 32 / 40 / 8, MLP 11008 / 13824 / 28672,
  rope_theta 10000, untied.
* ``34b`` = CodeLlama-34B: hidden 8192, 48 layers, 64 heads, 8 KV heads, MLP 22016,
  rope_theta 1000000, untied.
* ``125m`` / ``350m``: GPT-3 Small / Medium (Brown et al. 2020, Table 2.1: d_model 768 / 1024,
  12 / 24 layers, 12 / 16 heads of 64) in Llama form: RMSNorm, RoPE, SwiGLU with Llama's MLP
  width 8/3 * hidden rounded up to a multiple of 256 (2048 / 2816), tied embeddings. The names
  count GPT-3's 50k vocabulary; with Llama-3's 128k one they have 183M / 440M parameters.
* ``tiny``: 1.0M parameters with a 2048-token vocabulary (hidden 128, 4 layers, 4 heads of 32,
  2 KV heads so GQA and a 2-way TP split are exercised, MLP 8/3 * 128 rounded up to 352), for CPU
  tests and the demo.
* ``10m``: 10.6M parameters without the embeddings (hidden 384, 6 layers, 6 heads of 64, MLP 8/3 * 384 =
  1024, tied embeddings), the size of the numeracy study's Tier B (digit-level arithmetic on one
  CPU core); with a 448-token vocabulary it has 10.8M parameters.

All use RMSNorm eps 1e-5 (Llama-2 and Llama-3), no biases, SiLU, attention dropout 0. Embeddings
are tied for ``tiny``, ``10m`` .. ``3b`` (as Llama-3.2 1B/3B) and untied for ``7b`` and up (as Llama-2).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from .autotp import check_tensor_parallel_split, kv_head_shares, near_even_shares

if TYPE_CHECKING:
    import transformers

_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, attention_dropout=0.0)


def _preset(hidden, layers, heads, kv_heads, intermediate, rope_theta, tied):
    return dict(_COMMON, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=tied,
                rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)})


PRESETS: dict[str, dict] = {
    "tiny": _preset(128, 4, 4, 2, 352, 10_000, tied=True),
    "10m": _preset(384, 6, 6, 6, 1024, 10_000, tied=True),
    "125m": _preset(768, 12, 12, 12, 2048, 10_000, tied=True),
    "350m": _preset(1024, 24, 16, 16, 2816, 10_000, tied=True),
    "1b": _preset(2048, 16, 32, 8, 8192, 500_000, tied=True),
    "3b": _preset(3072, 28, 24, 8, 8192, 500_000, tied=True),
    "7b": _preset(4096, 32, 32, 32, 11008, 10_000, tied=False),
    "13b": _preset(5120, 40, 40, 40, 13824, 10_000, tied=False),
    "34b": _preset(8192, 48, 64, 8, 22016, 1_000_000, tied=False),
    "70b": _preset(8192, 80, 64, 8, 28672, 10_000, tied=False),
}
"""LlamaConfig keyword arguments of each preset, without ``vocab_size`` (that is the tokenizer's)."""


def preset_config(name: str, vocab_size: int, max_position_embeddings: int = 4096,
                  **overrides) -> transformers.LlamaConfig:
    """The ``LlamaConfig`` of preset ``name`` for a ``vocab_size``-token vocabulary; ``overrides``
    are further LlamaConfig keyword arguments and win over the preset's."""
    import transformers  # here, not at the top: train.py's parser reads PRESETS before the heavy imports

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "(or pass a local Hugging Face model dir where a dir is accepted)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} must be a positive int (the tokenizer's size, padded)")
    return transformers.LlamaConfig(**{**PRESETS[name], "vocab_size": vocab_size,
                                       "max_position_embeddings": max_position_embeddings, **overrides})


class DecoderFamily(NamedTuple):
    """What a family's decoder layer has beyond Llama's (its transformers modeling file): the weights
    ``parameter_count`` counts and the activations ``smmd_train.tools.memory`` counts differ only in these.

    qkv_bias:       q/k/v projections always have a bias and o_proj none (Qwen2), instead of all four
                    following ``config.attention_bias`` (Llama, Qwen3, Gemma; Mistral has none)
    qk_norm:        an RMSNorm over ``head_dim`` on every query and key head (Qwen3, Gemma-3)
    layer_norms:    RMSNorms per layer: 2 (input, post-attention), 4 with Gemma-2/3's pre- and
                    post-feed-forward norms
    gemma_norms:    Gemma's RMSNorm: the normalized output stays fp32 and is weighted by
                    ``1 + weight`` (also fp32) before the cast back, instead of Llama's cast, then weight
    score_softcap:  the attention applies ``config.attn_logit_softcapping`` to its scores (Gemma-2;
                    Gemma-3's modeling code reads the field but never passes it to its attention)
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    layer_norms: int = 2
    gemma_norms: bool = False
    score_softcap: bool = False


# The dense decoder families train.py trains (by ``model_type``): the Llama layer and its variants.
DECODER_FAMILIES = {
    "llama": DecoderFamily(), "mistral": DecoderFamily(), "qwen2": DecoderFamily(qkv_bias=True),
    "qwen3": DecoderFamily(qk_norm=True), "gemma": DecoderFamily(gemma_norms=True),
    "gemma2": DecoderFamily(layer_norms=4, gemma_norms=True, score_softcap=True),
    "gemma3_text": DecoderFamily(qk_norm=True, layer_norms=4, gemma_norms=True),
}


def decoder_family(config) -> DecoderFamily:
    """The family of ``config`` (its ``model_type``); ValueError for a model type not in
    :data:`DECODER_FAMILIES`, whose layers these counts would get wrong."""
    family = DECODER_FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise ValueError(f"model_type {getattr(config, 'model_type', None)!r}: the parameter and memory counts know "
                         f"the decoder layers of {', '.join(DECODER_FAMILIES)}")
    return family


def head_dim(config) -> int:
    """The attention head width: the config's ``head_dim`` where it sets one (Gemma, Qwen3; Mistral
    may leave it None), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_params(config, tp_size: int) -> dict:
    """Parameters of each attention projection of one layer on rank 0 of ``tp_size`` (the largest
    share, :mod:`smmd_train.model.autotp`): q/k/v are column-parallel (weight and bias split by KV head,
    each with its query heads), o_proj row-parallel (weight split, bias whole)."""
    hidden, width, kv_heads = config.hidden_size, head_dim(config), config.num_key_value_heads
    rank_kv_heads = kv_head_shares(kv_heads, tp_size)[0]
    q_width = config.num_attention_heads // kv_heads * rank_kv_heads * width
    kv_width = rank_kv_heads * width
    if decoder_family(config).qkv_bias:
        bias, o_bias = True, False
    else:
        bias = o_bias = bool(getattr(config, "attention_bias", False))
    return {"q_proj": (hidden + bias) * q_width, "k_proj": (hidden + bias) * kv_width,
            "v_proj": (hidden + bias) * kv_width, "o_proj": q_width * hidden + o_bias * hidden}


def _mlp_params(config, tp_size: int) -> dict:
    """Parameters of each SwiGLU projection of one layer on rank 0 of ``tp_size``: gate/up
    column-parallel, down row-parallel, the width split near-evenly."""
    hidden, bias = config.hidden_size, bool(getattr(config, "mlp_bias", False))
    width = near_even_shares(config.intermediate_size, tp_size)[0]
    return {"gate_proj": (hidden + bias) * width, "up_proj": (hidden + bias) * width,
            "down_proj": width * hidden + bias * hidden}


def _embedding_and_head_params(config, tp_size: int) -> tuple:
    """(embedding, lm_head) parameters on rank 0 of ``tp_size``, lm_head 0 when tied.

    DeepSpeed AutoTP with ``vocab_parallel_lm_head`` (what smmd-scale runs) splits the head over
    the vocabulary, near-evenly; HF's Llama TP plan leaves ``embed_tokens`` whole on every rank
    unless it is tied to the head, in which case it becomes a VocabParallelEmbedding sharing the
    head's shard.
    """
    full = config.vocab_size * config.hidden_size
    shard = near_even_shares(config.vocab_size, tp_size)[0] * config.hidden_size
    if config.tie_word_embeddings:
        return shard, 0
    return full, shard


def parameter_count(config, tp_size: int = 1) -> int:
    """Exact parameter count of ``AutoModelForCausalLM.from_config(config)`` for a family of
    :data:`DECODER_FAMILIES`, a tied lm_head counted once: the embedding, per layer the attention
    (GQA-sized k/v, the family's biases) and gated MLP projections, its RMSNorms (and the query/key
    head norms of Qwen3 and Gemma-3), the final RMSNorm, and the lm_head unless tied.

    With ``tp_size`` > 1: the parameters tensor-parallel rank 0 (the largest share when the heads,
    widths or vocabulary split unevenly) holds under DeepSpeed AutoTP with a vocabulary-parallel
    head (projections and head split, norms and an untied embedding whole), i.e. what ZeRO-3 then
    partitions over that rank's data-parallel group. A TP degree AutoTP cannot split the model by
    raises ValueError (:func:`smmd_train.model.autotp.check_tensor_parallel_split`).
    """
    check_tensor_parallel_split(config, tp_size)
    family = decoder_family(config)
    embedding, head = _embedding_and_head_params(config, tp_size)
    norms = family.layer_norms * config.hidden_size + family.qk_norm * 2 * head_dim(config)  # whole on every rank
    layer = sum(_attention_params(config, tp_size).values()) + sum(_mlp_params(config, tp_size).values()) + norms
    return embedding + config.num_hidden_layers * layer + config.hidden_size + head


def zero_partition_params(config, tp_size: int, world_size: int) -> float:
    """Parameters in the ZeRO-3 partition of rank 0 of ``world_size`` ranks at AutoTP degree ``tp_size``
    (of :func:`parameter_count`'s share): what AutoTP splits is partitioned over the world / ``tp_size``
    data-parallel ranks; what it leaves whole (the norms, the row-parallel projections' biases, an untied
    embedding) keeps the split ``zero.Init`` gave it as the model was built, over the whole world. As
    ``smmd_train.model.build.rank_parameters`` counts an engine's partition and ``smmd_train.tools.dry_run`` a model's
    shapes, less ZeRO-3's padding (under one element per parameter)."""
    family = decoder_family(config)
    embedding, _ = _embedding_and_head_params(config, tp_size)
    # o_proj's and down_proj's biases: row-parallel layers keep theirs whole
    biases = ((bool(getattr(config, "attention_bias", False)) and not family.qkv_bias)
              + bool(getattr(config, "mlp_bias", False)))
    norms = family.layer_norms * config.hidden_size + family.qk_norm * 2 * head_dim(config)
    whole = ((0 if config.tie_word_embeddings else embedding)
             + config.num_hidden_layers * (norms + biases * config.hidden_size) + config.hidden_size)
    return (parameter_count(config, tp_size) - whole) * tp_size / world_size + whole / world_size


# The projections AutoTP splits, by the module name of a Llama-family decoder (Llama, Mistral, Qwen2/3,
# Gemma): column-parallel ones split their output rows (and bias), row-parallel ones their input columns
# (their bias stays whole); the LM head splits its vocabulary rows.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


def rank_numel(name: str, shape: tuple, config, tp_size: int, rank: int) -> int:
    """Elements of the parameter ``name`` (``shape``: its whole shape in the model of ``config``) that
    tensor-parallel ``rank`` of ``tp_size`` holds under AutoTP with a vocabulary-parallel head: the
    attention projections by KV head (each with its query heads), the MLP widths and the vocabulary
    near-evenly (:mod:`smmd_train.model.autotp`), the embedding split only when tied to the head; norms and
    every other parameter whole. Summed over a model's parameters on rank 0 it is
    :func:`parameter_count`; a model type outside :data:`DECODER_FAMILIES` raises ValueError."""
    *_, module, kind = ["", *name.split(".")]
    numel = math.prod(shape)
    if tp_size == 1:
        return numel
    decoder_family(config)
    width = head_dim(config)
    kv_heads = kv_head_shares(config.num_key_value_heads, tp_size)[rank]
    split = {"q_proj": config.num_attention_heads // config.num_key_value_heads * kv_heads * width,
             "k_proj": kv_heads * width, "v_proj": kv_heads * width,
             "gate_proj": near_even_shares(config.intermediate_size, tp_size)[rank],
             "up_proj": near_even_shares(config.intermediate_size, tp_size)[rank]}
    split["o_proj"], split["down_proj"] = split["q_proj"], split["gate_proj"]
    vocab_rows = near_even_shares(config.vocab_size, tp_size)[rank]
    if module in _COLUMN_PARALLEL:
        return numel // shape[0] * split[module]
    if module in _ROW_PARALLEL:
        return split[module] * shape[0] if kind == "weight" else numel
    if module == "lm_head" or (module == "embed_tokens" and config.tie_word_embeddings):
        return vocab_rows * numel // shape[0]
    return numel


def largest_layer_params(config, tp_size: int = 1) -> int:
    """Parameters of the largest single module of the model of ``config`` (its own
    parameters, not its children's), as ``deepspeed.runtime.zero.stage3.model_to_params`` counts
    them for the ZeRO-3 estimator: the embedding / lm_head, unless an MLP projection is larger.
    ``tp_size`` > 1: on AutoTP rank 0, as in :func:`parameter_count`. A tied head is the
    embedding's weight, so it is as large as the embedding."""
    check_tensor_parallel_split(config, tp_size)
    embedding, head = _embedding_and_head_params(config, tp_size)
    return max(embedding, head, *_attention_params(config, tp_size).values(), *_mlp_params(config, tp_size).values())


def sliding_window_layers(config) -> int:
    """How many decoder layers attend through a sliding window: those ``config.layer_types`` names
    ``sliding_attention`` (Gemma-2/3, Qwen2/3), or every layer of a config with a ``sliding_window``
    and no layer types (Mistral)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return config.num_hidden_layers if getattr(config, "sliding_window", None) else 0
    return sum(kind == "sliding_attention" for kind in layer_types[:config.num_hidden_layers])
