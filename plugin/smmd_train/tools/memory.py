"""The memory planner: per-GPU memory for training a Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma-2 or
Gemma-3 model (a preset, or a Hugging Face model folder / config.json: :func:`model_config`) under
ZeRO-3 (+ AutoTP), before booking a cluster, and what to change when it does not fit.
``launch/estimate.py`` runs :func:`main`.

    result = estimate(model_config("/models/llama-3-8b"), nodes=4, gpus_per_node=8, tp_size=2)
    result["total_gpu_bytes"], result["verdict"], next_steps(config, nodes=4, gpus_per_node=8)

Per GPU, in bf16 mixed precision with Adam (``precision="fp32"``: a run whose model, activations and
logits are fp32, as on DeepSpeed's CPU accelerator, where the DeepSpeed config's bf16 ``"auto"`` is off):

* **model states** (bf16 params and grads, fp32 master params and Adam moments), from DeepSpeed's
  own ``estimate_zero3_model_states_mem_needs`` with ``zero_init`` (the model is built under
  ``zero.Init``) and its default CPU ``additional_buffer_factor`` of 1.5. With ``--tp T`` AutoTP
  first splits the model T ways; ZeRO-3 partitions what it splits over the world / T data-parallel
  ranks, and what it leaves whole on every TP rank (the norms, an untied embedding) over the whole
  world, as ``zero.Init`` built it (``smmd_train.model.presets.zero_partition_params``: the partition
  ``smmd_train.model.build.rank_parameters`` counts on a real engine); the estimator is given the model whose
  even split over the data-parallel ranks is that partition (T of them per node, so the CPU memory
  per node is T times the estimator's). An untied embedding, whole on every TP rank, is the gathered
  largest layer from 7b up. ``--offload`` moves params and optimizer to CPU, as
  ``ds_configs/zero3_offload.json``. In fp32 (DeepSpeed's estimator is bf16's) each partitioned
  parameter holds 20 bytes instead of 18 (the fp32 parameter and gradient, the fp32 master copy
  ZeRO-3 keeps even of fp32 parameters, two Adam moments) and the gathered largest layer 8 per
  parameter (fp32 parameter and gradient) instead of 4.
* **activations** kept for backward, counted tensor by tensor for HF's Llama layer (the method of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"; their
  GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes, s*b*h*(10 + 24/t + 5*a*s/(h*t)) under t-way TP;
  HF's Llama layer keeps more: RMSNorm upcasts to fp32 and SwiGLU keeps four intermediate-wide
  tensors; Gemma's RMSNorms keep their normalized output in fp32, Gemma-2/3 have four per layer,
  Gemma-2's attention runs eager with soft-capped scores, sliding-window layers keep their mask
  under SDPA). See :func:`layer_activation_bytes`. With gradient checkpointing, each layer's bf16
  input plus one layer's activations while it is recomputed. With ``--sp S`` (Ulysses sequence
  parallelism, ``train.py --sp``) a rank holds seq_len / S tokens of every sequence and the core
  attention sees the whole sequence for heads / S heads: every per-token term is divided by S, the
  eager scores still span the whole sequence, and the attention output exists twice (head-sharded
  from the core attention, sequence-sharded after the all-to-all back, the o_proj input). ZeRO-3
  partitions the model states over all GPUs as without SP.
* **logits and loss**: the vocabulary-parallel bf16 logits, the fused CE + SMMD loss's one fp32
  ``[tokens, V/T]`` buffer, and the bf16 logits gradient it returns (and the bf16 tanh of Gemma-2/3's
  final logit soft-cap, which the model's forward applies before the loss); with ``--fused_linear``
  (``smmd_scale.linear_numeric_cross_entropy``) no logits at all: one block of them (fp32, and its
  bf16 copy) and the fp32 gradient of the head's input, a few hundred MiB instead of several GiB
  at a 128k vocabulary. The report gives the largest micro batch that fits with and without it.

In fp32 every bf16 tensor of these counts is fp32 (4 bytes instead of 2), and the fp32 copies bf16
needs (an RMSNorm's upcast input, the softmax's and the loss's gradient cast back) are the tensors
themselves.

The total is a sum of these (a slight over-estimate with gradient checkpointing, where the
recomputed layer and the logits are not alive at once). It leaves out the CUDA context, NCCL
buffers, ZeRO-3 prefetch beyond the largest layer, and allocator fragmentation: an estimate
within ``HEADROOM_FRACTION`` of the GPU memory is reported as ``tight``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import transformers
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from smmd_scale.block_plan import DeviceProperties, fused_head_plan
from smmd_scale.fused_linear import default_chunk_size

from ..model.autotp import kv_head_shares, near_even_shares
from ..model.presets import (
    PRESETS,
    decoder_family,
    head_dim,
    largest_layer_params,
    parameter_count,
    preset_config,
    sliding_window_layers,
    zero_partition_params,
)

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator detection to stdout
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

GIB = 2**30
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default margin on the CPU memory
HEADROOM_FRACTION = 0.1  # what this estimate does not count (see the module docstring)
TABLE_PRESETS = ("1b", "3b", "7b", "13b", "34b", "70b")
MAX_NODES_TRIED = 1024
LLAMA3_VOCAB_SIZE = 128256  # a preset's vocabulary unless --vocab_size says otherwise
# The families whose layer activations layer_activation_bytes counts (checked against autograd).
ESTIMATED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
# Bytes per element of the activations and logits of a run in each precision the planner counts.
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}


def check_estimated_family(model_type) -> None:
    """Refuse (ValueError naming it) a model type whose decoder layer this planner does not count."""
    if model_type not in ESTIMATED_FAMILIES:
        raise ValueError(f"model_type {model_type!r}: not a decoder family this planner knows; the planner "
                         f"estimates {', '.join(ESTIMATED_FAMILIES)}")


def has_sdpa(config) -> bool:
    """Whether transformers runs ``config``'s model with SDPA when asked to (its default): not
    Gemma-2, whose soft-capped attention runs eager whatever ``--flash_attention`` says."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..compat import supports_sdpa

    return supports_sdpa(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]))


def model_config(model: str, vocab_size: Optional[int] = None):
    """The config to plan for: a preset name (a ``LlamaConfig``, vocabulary ``vocab_size``, default
    Llama-3's), or a local Hugging Face model folder or its ``config.json`` (its own config class and
    vocabulary unless ``vocab_size`` is given; only the config is read, no weights, no hub). Raises
    ValueError naming what is wrong: neither a preset nor a file, not JSON, or a model type whose
    layers this planner does not count (:data:`ESTIMATED_FAMILIES`)."""
    if model in PRESETS:
        return preset_config(model, vocab_size=vocab_size or LLAMA3_VOCAB_SIZE)
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(f"not a preset ({', '.join(PRESETS)}), and "
                         + ("the folder has no config.json" if path.is_dir() else "no such file or folder"))
    try:
        values = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not JSON: {error}") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    try:
        check_estimated_family(model_type)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None
    config = transformers.CONFIG_MAPPING[model_type].from_dict(values)
    if vocab_size:
        config.vocab_size = vocab_size
    return config


def element_bytes(precision: str) -> int:
    """Bytes per activation element in ``precision`` (a key of :data:`ACTIVATION_BYTES`)."""
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision={precision!r}: the planner counts {', '.join(ACTIVATION_BYTES)}")
    return ACTIVATION_BYTES[precision]


def _norm_bytes(config, tokens: int, width: int, element: int = 2) -> int:
    """One RMSNorm over ``width`` applied to ``tokens`` rows, without its output: the fp32 input copy
    (4 per element; in fp32 the input itself), the normalized values (``element`` bytes: bf16 2, fp32
    4; Gemma's: fp32, 4), the fp32 rsqrt (4 per row); Gemma's also keeps its fp32 ``1 + weight`` (4 per
    element of the weight, once per call)."""
    if decoder_family(config).gemma_norms:
        return tokens * (8 * width + 4) + 4 * width
    return tokens * ((4 + element) * width + 4)


def layer_activation_bytes(config, seq_len: int, micro_batch: int, tp_size: int = 1,
                           flash_attention: bool = True, sp_size: int = 1, sliding_window: bool = False,
                           precision: str = "bf16") -> int:
    """Bytes one HF decoder layer of Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma-2 or Gemma-3 keeps
    for backward on one GPU, with bf16 activations, causal attention without a padding mask (packed
    sequences), and attention dropout 0; ``sliding_window``: a layer that attends through
    ``config.sliding_window`` (:func:`sliding_window_layers`).

    Per token (``h`` hidden, ``a`` heads and ``k`` KV heads of ``d``, ``I`` MLP width, ``t`` TP):

    * each RMSNorm: its fp32 input copy (4h), the normalized values (bf16 2h; Gemma's stay fp32, 4h),
      the fp32 rsqrt (4); the two norms whose output projections read (the input norm and the
      one before the MLP) add that bf16 output (2h each): Llama 16h + 8; Gemma 20h + 8; Gemma-2/3,
      whose post-attention and post-feed-forward norms feed only the residual add, 36h + 16. Gemma's
      norms also keep their fp32 ``1 + weight`` (4h per norm per layer, not per token). On every TP rank;
    * SDPA (``flash_attention``): q and the attention output (2*a*d each; o_proj keeps the same
      output), k and v (2*k*d each, GQA is not expanded), the fp32 log-sum-exp (4a); a sliding-window
      layer whose window does not cover the sequence (``seq_len >= sliding_window``) also gets a 4D
      mask, which SDPA keeps as a bf16 ``[b, 1, s, s]`` in every such layer (2*s bytes per token on
      every TP rank; not under Ulysses, which drops masks); with that mask, or with d > 256,
      transformers expands k and v to a heads (2*a*d each);
      eager: q, the expanded k and v, the o_proj input (2*a*d each) and per score the fp32 softmax
      and its bf16 copy (6 bytes, a*s scores per token), 8 bytes with Gemma-2's soft-capped scores
      (``attn_logit_softcapping``: tanh's bf16 output too). Gemma-2 always runs eager: transformers
      has no SDPA for it (:func:`has_sdpa`), so ``flash_attention`` does not change its count; Gemma-3
      runs SDPA, and its modeling code never applies ``attn_logit_softcapping``;
    * the query and key head norms (Qwen3, Gemma-3): per head, a norm over d as above (Qwen3
      6d + 4, Gemma-3 8d + 4 and 2 * 4d for the two ``1 + weight``); their output is not kept (RoPE
      keeps cos and sin); Qwen2's q/k/v biases keep nothing more;
    * the gated MLP (SwiGLU; Gemma's GELU-tanh keeps the same): gate (the activation's input), the
      activation's output, up and their product (the down_proj input), 2*I each -> 8I;

    everything but the norms and the mask split t ways (heads and MLP width are sharded; AutoTP has no
    sequence parallelism), counted for TP rank 0, which holds the largest share when the KV heads or
    the MLP width do not divide by t (:mod:`smmd_train.model.autotp`). Ulysses ``sp_size`` S: per rank,
    ``seq_len / S`` tokens of each term, the KV heads at least S (Ulysses replicates fewer), the
    attention output twice with SDPA (its head-sharded copy and the o_proj input after the all-to-all
    back; eager keeps both already). ``precision="fp32"``: every bf16 tensor above is fp32 (4 bytes
    per element instead of 2), a non-Gemma norm keeps its input itself (the fp32 copy) and the eager
    softmax no bf16 copy (4 bytes per score, 8 soft-capped). tests/train/test_presets.py and
    tests/train/test_sequence_parallel.py check this against the tensors autograd saves.
    """
    check_estimated_family(getattr(config, "model_type", None))
    if config.attention_dropout:
        raise ValueError(f"attention_dropout={config.attention_dropout}: this estimate assumes 0 (as every preset "
                         "has); dropout masks would add activations it does not count")
    family, element = decoder_family(config), element_bytes(precision)
    tokens = seq_len * micro_batch // sp_size
    kv_heads = kv_head_shares(config.num_key_value_heads, tp_size)[0]  # this rank's
    heads, width = config.num_attention_heads // config.num_key_value_heads * kv_heads, head_dim(config)
    norms = (family.layer_norms * _norm_bytes(config, tokens, config.hidden_size, element)
             + tokens * 2 * element * config.hidden_size)
    if family.qk_norm:  # before Ulysses' all-to-all: this rank's tokens, its TP share of heads
        norms += (_norm_bytes(config, tokens * heads, width, element)
                  + _norm_bytes(config, tokens * kv_heads, width, element))
    kv_heads = max(kv_heads, sp_size) if sp_size > 1 else kv_heads
    if flash_attention and has_sdpa(config):
        masked = sliding_window and sp_size == 1 and seq_len >= config.sliding_window
        if masked or width > 256:  # transformers' SDPA takes GQA's k and v unexpanded only without a mask
            kv_heads = heads
        attention = tokens * (element * (2 * heads * width + 2 * kv_heads * width) + 4 * heads
                              + (element * heads * width if sp_size > 1 else 0) + (element * seq_len if masked else 0))
    else:
        softcapped = family.score_softcap and config.attn_logit_softcapping is not None
        # per score: the fp32 softmax, its copy in the model's dtype (none in fp32), tanh's output when soft-capped
        score = 4 + (element if element != 4 else 0) + (element if softcapped else 0)
        attention = tokens * (4 * element * heads * width + score * heads * seq_len)
    mlp = tokens * 4 * element * near_even_shares(config.intermediate_size, tp_size)[0]
    return norms + attention + mlp


def activation_bytes(config, seq_len: int, micro_batch: int, tp_size: int = 1, gradient_checkpointing: bool = False,
                     flash_attention: bool = True, sp_size: int = 1, precision: str = "bf16") -> int:
    """Bytes of activations kept for backward on one GPU by the whole ``*ForCausalLM`` up to the
    lm_head input: every layer (:func:`layer_activation_bytes`, sliding-window layers as such), or
    with gradient checkpointing each layer's bf16 input (2h per token) plus the largest layer being
    recomputed; and the final RMSNorm (fp32 copy, normalized, rsqrt as in a layer, and its bf16 output
    = the lm_head input: Llama 8h + 4 per token, Gemma 10h + 4 and 4h for its ``1 + weight``); per
    rank of ``sp_size`` Ulysses ranks, which hold seq_len / sp_size tokens each. Gemma's embedding
    scale (sqrt(h)) keeps no more than a bf16 scalar: the first norm's fp32 copy is what backward
    reads, as for the unscaled embedding. ``precision="fp32"``: as :func:`layer_activation_bytes` counts
    it (the layer inputs and the lm_head input 4h per token)."""
    tokens, element = seq_len * micro_batch // sp_size, element_bytes(precision)
    sliding = sliding_window_layers(config)
    full, windowed = (layer_activation_bytes(config, seq_len, micro_batch, tp_size, flash_attention, sp_size, window,
                                             precision)
                      if not window or sliding else 0 for window in (False, True))
    final_norm = _norm_bytes(config, tokens, config.hidden_size, element) + tokens * element * config.hidden_size
    if gradient_checkpointing:  # the windowed layer is the larger one: it keeps at least what a full one does
        return config.num_hidden_layers * tokens * element * config.hidden_size + max(full, windowed) + final_norm
    return (config.num_hidden_layers - sliding) * full + sliding * windowed + final_norm


def logits_and_loss_bytes(vocab_size: int, seq_len: int, micro_batch: int, tp_size: int = 1,
                          fused_linear: bool = False, hidden_size: int = 0, sp_size: int = 1,
                          logit_softcap: bool = False, precision: str = "bf16",
                          gpu_free_bytes: Optional[int] = None) -> int:
    """Bytes of the loss's working set on one GPU; SMMD's ``[P, N]`` numeric part is negligible.

    Materialized: bf16 logits ``[tokens, V/T]`` (2 B), the fused loss's fp32 buffer (4 B, the
    softmax turned into the gradient in place) and the bf16 logits gradient it returns (2 B);
    ``logit_softcap`` (Gemma-2/3's ``final_logit_softcapping``, applied by the model's forward between
    its head and the loss): tanh's bf16 output, which autograd keeps, 2 B more.
    ``fused_linear``: one block of logits as the op plans it (fp32 and its bf16 copy, 6 B per
    element; soft-capped, the fused op applies the cap itself and its backward holds the fp32 block
    and the cap's fp32 slope at once, 8 B): with ``gpu_free_bytes`` (a GPU) the accelerator's plan,
    blocks of at most min(4 GiB, a quarter of the memory free when the loss runs), one block when the
    whole head fits; without it the CPU's plan, a ``[tokens, H]``-sized block; and ``d hidden``
    ``[tokens, H]`` in fp32 (the head's gradient is a model state). With ``sp_size`` Ulysses ranks,
    each holds the loss of its seq_len / sp_size tokens. ``precision="fp32"``: fp32 logits (4 B) and
    tanh output (4 B); the loss returns its fp32 buffer as the gradient, and the fused op's block has
    no copy (4 B, 8 soft-capped)."""
    tokens, rows = seq_len * micro_batch // sp_size, near_even_shares(vocab_size, tp_size)[0]  # rank 0: the most rows
    element = element_bytes(precision)
    cast = element if element != 4 else 0  # a copy in the model's dtype of an fp32 tensor (none in fp32)
    if not fused_linear:
        return tokens * rows * (element + 4 + cast + (element if logit_softcap else 0))
    per_element = 4 + (4 if logit_softcap else cast)
    if gpu_free_bytes is None:
        block = tokens * default_chunk_size(tokens, hidden_size, rows)
    else:  # the op's own plan on the GPU
        product = torch.bfloat16 if element == 2 else torch.float32
        block = tokens * fused_head_plan(tokens, hidden_size, rows, product, torch.float32,
                                         DeviceProperties("cuda", free_bytes=max(int(gpu_free_bytes), 1))).chunk_size
    return block * per_element + tokens * hidden_size * 4


def model_states_bytes(config, nodes: int, gpus_per_node: int, tp_size: int = 1, offload: bool = False,
                       precision: str = "bf16") -> dict:
    """ZeRO-3 model states from DeepSpeed's estimator: ``gpu_bytes`` per GPU and ``cpu_per_node_bytes``
    for the ``tp_params`` / ``tp_largest_layer_params`` one AutoTP rank holds, of which
    ``zero_partition_params`` are in this GPU's ZeRO-3 partition
    (:func:`~smmd_train.model.presets.zero_partition_params`). ``gpu_bytes`` is ``partitioned_bytes`` (this
    GPU's partition of every state) plus ``gathered_bytes`` (the largest layer gathered whole, its
    parameters and gradients). ``precision="fp32"``: 20 bytes per partitioned parameter and 8 per
    gathered one (see the module docstring); not with ``offload``. ``optimizer_step_bytes``: what the
    optimizer step holds beyond the states for a moment: 0 in bf16 on a GPU (DeepSpeed's fused Adam updates
    in place); in fp32, the CPU run, torch's AdamW (foreach) forms two fp32 temporaries the size of its
    parameter group, which ZeRO-3 makes the rank's flat partition: 8 bytes per partitioned parameter
    (benchmarks/real_width.py measures it: the step's peak at TP 1 on one rank)."""
    tp_params, tp_largest = parameter_count(config, tp_size), largest_layer_params(config, tp_size)
    dp_ranks = nodes * gpus_per_node // tp_size
    partition = zero_partition_params(config, tp_size, nodes * gpus_per_node)
    cpu_bytes, gpu_bytes, gathered = estimate_zero3_model_states_mem_needs(
        total_params=round(partition * dp_ranks), largest_layer_params=tp_largest,
        num_gpus_per_node=gpus_per_node // tp_size, num_nodes=nodes, cpu_offload=offload, cpu_offload_params=offload,
        zero_init=True, additional_buffer_factor=ADDITIONAL_BUFFER_FACTOR)
    if element_bytes(precision) == 4:
        if offload:
            raise ValueError("precision='fp32' with offload: an fp32 run is a CPU run here, and ZeRO offloads to "
                             "the CPU from an accelerator; plan it without offload")
        gathered = 8 * tp_largest
        gpu_bytes = gathered + round(20 * partition)
    optimizer_step = round(8 * partition) if element_bytes(precision) == 4 else 0
    return {"gpu_bytes": gpu_bytes, "partitioned_bytes": gpu_bytes - gathered, "gathered_bytes": gathered,
            "optimizer_step_bytes": optimizer_step,
            "cpu_per_node_bytes": tp_size * cpu_bytes, "tp_params": tp_params, "tp_largest_layer_params": tp_largest,
            "zero_partition_params": round(partition)}


def _check_layout(nodes, gpus_per_node, tp_size, seq_len, micro_batch, gpu_memory_gib, sp_size=1, config=None):
    for name, value in dict(nodes=nodes, gpus_per_node=gpus_per_node, tp_size=tp_size, seq_len=seq_len,
                            micro_batch=micro_batch, sp_size=sp_size).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if gpus_per_node % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide gpus_per_node={gpus_per_node}: AutoTP groups are "
                         "placed inside a node (tensor parallelism over the inter-node network is too slow)")
    if not gpu_memory_gib > 0:
        raise ValueError(f"gpu_memory_gib={gpu_memory_gib!r} must be positive")
    if sp_size > 1:
        from ..distributed.sequence_parallel import check_sequence_parallel

        if gpus_per_node % sp_size:
            raise ValueError(f"sp_size={sp_size} must divide gpus_per_node={gpus_per_node}: the planner places each "
                             "sequence-parallel group inside a node (two all-to-alls per layer)")
        check_sequence_parallel(config, sp_size, seq_len, tp_size, nodes * gpus_per_node)


def estimate(config, nodes: int = 1, gpus_per_node: int = 8, tp_size: int = 1, offload: bool = False,
             seq_len: int = 4096, micro_batch: int = 1, gradient_checkpointing: bool = False,
             flash_attention: bool = True, gpu_memory_gib: float = 80.0, fused_linear: bool = False,
             sp_size: int = 1) -> dict:
    """Memory per GPU (and CPU per node) for training ``config`` (a ``LlamaConfig``) on ``nodes``
    x ``gpus_per_node`` GPUs with ZeRO-3 over world / ``tp_size`` data-parallel ranks, or with
    ``sp_size`` Ulysses sequence-parallel ranks per sequence (world / ``sp_size`` data-parallel).

    Returns ``setup`` (these arguments), ``params``, ``tp_params`` and ``tp_largest_layer_params``
    (one TP rank's share), ``dp_size``, the ``*_bytes`` parts (``model_states_gpu_bytes``,
    ``model_states_cpu_per_node_bytes``, ``activation_bytes``, ``logits_and_loss_bytes``,
    ``total_gpu_bytes``), ``verdict``: "fits", "tight" (within ``HEADROOM_FRACTION`` of
    ``gpu_memory_gib``) or "does not fit", and ``attention``: the attention counted, "SDPA" or
    "eager" (eager for a model transformers runs only so, Gemma-2, whatever ``flash_attention`` says).
    """
    _check_layout(nodes, gpus_per_node, tp_size, seq_len, micro_batch, gpu_memory_gib, sp_size, config)
    if sp_size > 1 and not flash_attention:
        raise ValueError("sp_size > 1 needs SDPA / flash attention: DeepSpeed's Ulysses refuses eager attention (its "
                         "4D mask would span the whole sequence)")
    if sp_size > 1 and not has_sdpa(config):
        raise ValueError(f"sp_size > 1 needs SDPA, but transformers runs model_type {config.model_type!r} with eager "
                         "attention only (its soft-capped scores), which DeepSpeed's Ulysses refuses; use sp_size 1")
    setup = dict(nodes=nodes, gpus_per_node=gpus_per_node, tp_size=tp_size, offload=offload, seq_len=seq_len,
                 micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing,
                 flash_attention=flash_attention, gpu_memory_gib=gpu_memory_gib, fused_linear=fused_linear,
                 sp_size=sp_size)
    states = model_states_bytes(config, nodes, gpus_per_node, tp_size, offload)
    activations = activation_bytes(config, seq_len, micro_batch, tp_size, gradient_checkpointing, flash_attention,
                                   sp_size)
    # the fused head plans its blocks from the memory free when the loss runs: the GPU's, less the
    # model states and the activations
    logits = logits_and_loss_bytes(config.vocab_size, seq_len, micro_batch, tp_size, fused_linear,
                                   config.hidden_size, sp_size,
                                   getattr(config, "final_logit_softcapping", None) is not None,
                                   gpu_free_bytes=gpu_memory_gib * GIB - states["gpu_bytes"] - activations)
    total = states["gpu_bytes"] + activations + logits
    gpu_bytes = gpu_memory_gib * GIB
    verdict = ("fits" if total <= (1 - HEADROOM_FRACTION) * gpu_bytes else
               "tight" if total <= gpu_bytes else "does not fit")
    return {"setup": setup, "params": parameter_count(config), "tp_params": states["tp_params"],
            "tp_largest_layer_params": states["tp_largest_layer_params"],
            "dp_size": nodes * gpus_per_node // (tp_size * sp_size),
            "model_states_gpu_bytes": states["gpu_bytes"],
            "model_states_cpu_per_node_bytes": states["cpu_per_node_bytes"], "activation_bytes": activations,
            "logits_and_loss_bytes": logits, "total_gpu_bytes": total, "verdict": verdict,
            "attention": "SDPA" if flash_attention and has_sdpa(config) else "eager"}


def largest_micro_batch(config, limit: int = 1 << 16, **setup) -> int:
    """The most sequences per micro batch, at most ``limit``, whose estimate "fits" with ``setup``
    (0 if not even one)."""
    def fits(micro_batch):
        return estimate(config, **{**setup, "micro_batch": micro_batch})["verdict"] == "fits"

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:  # fits(low), not fits(high) (or high is past the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _options(config, setup: dict) -> list:
    """Every setup reachable from ``setup`` by the changes this estimate knows, at ``setup``'s micro
    batch: the fused linear head, gradient checkpointing, more TP (doubling, inside the node, while
    every rank keeps a KV head), CPU offload. :func:`_cheapest_fit` then lowers each one's micro
    batch to the largest that fits (gradient accumulation keeps the global batch)."""
    tp_sizes = [setup["tp_size"]]
    while setup.get("sp_size", 1) == 1 and setup["gpus_per_node"] % (2 * tp_sizes[-1]) == 0:  # TP or SP, not both
        try:
            parameter_count(config, 2 * tp_sizes[-1])
        except ValueError:  # more ranks than KV heads: AutoTP cannot split the attention that many ways
            break
        tp_sizes.append(2 * tp_sizes[-1])
    return [{**setup, "gradient_checkpointing": checkpointing, "tp_size": tp_size, "offload": offload,
             "fused_linear": fused}
            for checkpointing in {setup["gradient_checkpointing"], True} for tp_size in tp_sizes
            for offload in {setup["offload"], True} for fused in {setup["fused_linear"], True}]


def _cost(setup: dict) -> tuple:
    """Order of preference among setups that fit: offload is the slowest (every step moves the
    model through PCIe); then more TP (an all-reduce per layer on the critical path, smaller
    GEMMs); then recomputation (~1/3 more compute); then a smaller micro batch; the fused linear
    head costs least (one more pass of the head's GEMM, no other change)."""
    return (setup["offload"], setup["tp_size"], setup["gradient_checkpointing"], -setup["micro_batch"],
            setup["fused_linear"])


def _cheapest_fit(config, setup: dict, offload: bool = True) -> Optional[dict]:
    """The estimate of the cheapest setup (by :func:`_cost`) that fits among :func:`_options`, each
    at the largest micro batch up to ``setup``'s that fits (:func:`largest_micro_batch`), only those
    without offload when ``offload`` is False; None if none fits even at micro batch 1."""
    fitting = []
    for candidate in _options(config, setup):
        if candidate["offload"] and not offload:
            continue
        micro_batch = largest_micro_batch(config, limit=setup["micro_batch"], **candidate)
        if micro_batch:
            fitting.append(estimate(config, **{**candidate, "micro_batch": micro_batch}))
    return min(fitting, key=lambda result: _cost(result["setup"]), default=None)


def next_steps(config, **setup) -> Optional[dict]:
    """What to change when :func:`estimate` (same arguments) is not "fits", or None when it is.

    ``flags`` (for this CLI) and ``estimate`` of the cheapest setup that fits (:func:`_cheapest_fit`),
    or of the smallest one when none does (then ``fits`` is False). When that setup needs offload,
    ``without_offload`` gives the fewest ``nodes`` (doubling) on which one fits without it, with its
    ``flags`` and ``total_gpu_bytes`` (None beyond ``MAX_NODES_TRIED`` nodes).
    """
    current = estimate(config, **setup)
    if current["verdict"] == "fits":
        return None
    setup = current["setup"]  # with the defaults filled in
    best = _cheapest_fit(config, setup)
    fits = best is not None
    if not fits:
        best = min((estimate(config, **{**option, "micro_batch": 1}) for option in _options(config, setup)),
                   key=lambda result: result["total_gpu_bytes"])
    steps = {"flags": _flags(setup, best["setup"]), "estimate": best, "fits": fits, "without_offload": None}
    if best["setup"]["offload"] and not setup["offload"]:
        nodes = 2 * setup["nodes"]
        while nodes <= MAX_NODES_TRIED and steps["without_offload"] is None:
            on_more_nodes = _cheapest_fit(config, {**setup, "nodes": nodes}, offload=False)
            if on_more_nodes is not None:
                steps["without_offload"] = {"nodes": nodes, "flags": _flags(setup, on_more_nodes["setup"]),
                                            "total_gpu_bytes": on_more_nodes["total_gpu_bytes"]}
            nodes *= 2
    return steps


def _flags(old: dict, new: dict) -> list:
    """The command-line flags that turn setup ``old`` into ``new``."""
    flags = []
    if new["nodes"] != old["nodes"]:
        flags.append(f"--nodes {new['nodes']}")
    if new["micro_batch"] != old["micro_batch"]:
        flags.append(f"--micro_batch {new['micro_batch']}")
    if new["gradient_checkpointing"] and not old["gradient_checkpointing"]:
        flags.append("--gradient_checkpointing")
    if new["tp_size"] != old["tp_size"]:
        flags.append(f"--tp {new['tp_size']}")
    if new["offload"] and not old["offload"]:
        flags.append("--offload")
    if new["fused_linear"] and not old["fused_linear"]:
        flags.append("--fused_linear")
    return flags


def with_gib(record):
    """``record`` with a rounded ``*_gib`` next to every ``*_bytes`` value, at any depth (for JSON)."""
    if not isinstance(record, dict):
        return record
    converted = {}
    for key, value in record.items():
        converted[key] = with_gib(value)
        if key.endswith("_bytes"):
            converted[key[:-len("_bytes")] + "_gib"] = round(value / GIB, 3)
    return converted


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f}"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"


def _advice(steps: dict) -> str:
    """One line saying what to try next, from :func:`next_steps`."""
    total = _gib(steps["estimate"]["total_gpu_bytes"])
    if not steps["flags"]:
        return "nothing left to try here: shorten --seq_len or use larger GPUs"
    text = f"try {' '.join(steps['flags'])} ({total} GiB" + ("" if steps["fits"] else ", still too much")
    if steps["estimate"]["setup"]["offload"]:
        text += f"; {_gib(steps['estimate']['model_states_cpu_per_node_bytes'])} GiB CPU memory per node"
    text += ")"
    alternative = steps["without_offload"]
    if alternative:
        text += f", or without offload: {' '.join(alternative['flags'])} ({_gib(alternative['total_gpu_bytes'])} GiB)"
    return text


def _describe(setup: dict, vocab_size: int, attention: str) -> str:
    nodes, gpus, tp = setup["nodes"], setup["gpus_per_node"], setup["tp_size"]
    sp = setup.get("sp_size", 1)
    return (f"{nodes} node{'s' * (nodes > 1)} x {gpus} GPUs, TP {tp} x DP {nodes * gpus // (tp * sp)}"
            f"{f' x SP {sp}' if sp > 1 else ''}, ZeRO-3"
            f"{' with CPU offload' if setup['offload'] else ''}; seq {setup['seq_len']}, micro batch "
            f"{setup['micro_batch']}, vocab {vocab_size}, {attention} attention"
            f"{', gradient checkpointing' if setup['gradient_checkpointing'] else ''}"
            f"{', fused linear head' if setup['fused_linear'] else ''}; "
            f"{setup['gpu_memory_gib']:g} GiB GPUs")


def format_report(name: str, config, result: dict, steps: Optional[dict], largest: dict) -> str:
    """The readable table for one preset; ``largest``: the largest micro batch that fits, materialized
    and with the fused linear head (:func:`largest_micro_batch`)."""
    setup = result["setup"]
    rows = [("model states / GPU (ZeRO-3, DeepSpeed estimator)", result["model_states_gpu_bytes"]),
            ("activations / GPU", result["activation_bytes"]),
            ("logits + loss buffers / GPU", result["logits_and_loss_bytes"]),
            ("total / GPU", result["total_gpu_bytes"]),
            ("CPU memory / node (ZeRO-3, DeepSpeed estimator)", result["model_states_cpu_per_node_bytes"])]
    lines = [f"{name}: {_count(result['params'])} params ({_count(result['tp_params'])} per TP rank, largest "
             f"layer {_count(result['tp_largest_layer_params'])})",
             _describe(setup, config.vocab_size, result["attention"]), "", f"{'':<50}{'GiB':>8}"]
    lines += [f"{label:<50}{_gib(value):>8}" for label, value in rows]
    lines += ["", f"verdict: {result['verdict']} in {setup['gpu_memory_gib']:g} GiB"
              + (f"; {_advice(steps)}" if steps else "")]
    lines.append(_largest_line(largest, setup["seq_len"]))
    return "\n".join(lines)


def _largest_line(largest: dict, seq_len: int) -> str:
    """The largest micro batch that fits as set up, with materialized logits and with --fused_linear."""
    if not any(largest.values()):
        return ("no micro batch fits as set up, not even 1 sequence, with materialized logits or --fused_linear "
                "(the advice above says what would)")

    def sequences(count):
        return f"{count} sequence{'s' * (count > 1)} ({count * seq_len:,} tokens)" if count else "none"

    return (f"largest micro batch that fits: {sequences(largest['materialized'])} with materialized logits, "
            f"{sequences(largest['fused_linear'])} with --fused_linear")


# The table of --all: (result key, header); the sizes are in GiB.
TABLE_COLUMNS = (("model_states_gpu_bytes", "model states / GPU"), ("model_states_cpu_per_node_bytes", "CPU / node"),
                 ("activation_bytes", "activations / GPU"), ("logits_and_loss_bytes", "logits + loss / GPU"),
                 ("total_gpu_bytes", "total / GPU"))


def format_markdown(results: list, vocab_size: int) -> str:
    """A markdown table (``smmd_cli.tables``), one row per (preset name, result, next steps)."""
    setup = results[0][1]["setup"]
    rows = [{"model": name, "params": _count(result["params"]),
             **{key: _gib(result[key]) for key, _ in TABLE_COLUMNS},
             "verdict": result["verdict"] + (f": {_advice(steps)}" if steps else "")}
            for name, result, steps in results]
    columns = [("model", "model", ""), ("params", "params", ""), *((key, header, "") for key, header in TABLE_COLUMNS),
               ("verdict", "verdict", "")]
    return f"**{_describe(setup, vocab_size, results[0][1]['attention'])}** (GiB)\n\n" + markdown_table(rows, columns)


@dataclass(frozen=True, kw_only=True)
class EstimateOptions:
    """The command line of ``launch/estimate.py`` (``smmd-estimate``)."""

    model: Optional[str] = option("--model", one_of="model", help=f"a preset ({', '.join(PRESETS)}), or a local "
                                  "Hugging Face model folder or its config.json (model_type llama, mistral, qwen2, "
                                  "qwen3, gemma, gemma2 or gemma3_text; only the config is read)")
    all: bool = option("--all", one_of="model", action="store_true",
                       help=f"a markdown table for {', '.join(TABLE_PRESETS)}")
    nodes: int = option("--nodes", type=int, default=1)
    gpus_per_node: int = option("--gpus_per_node", type=int, default=8)
    tp: int = option("--tp", type=int, default=1, help="AutoTP size, inside a node (default 1)")
    sp: int = option("--sp", type=int, default=1, help="Ulysses sequence-parallel size, inside a node (train.py "
                     "--sp; default 1; not with --tp > 1)")
    offload: bool = option("--offload", action="store_true", help="ZeRO-3 offload of params and optimizer to CPU")
    seq_len: int = option("--seq_len", type=int, default=4096)
    micro_batch: int = option("--micro_batch", type=int, default=1, help="sequences per GPU per micro step")
    gradient_checkpointing: bool = option("--gradient_checkpointing", action="store_true")
    fused_linear: bool = option("--fused_linear", action="store_true", help="CE + SMMD without materialized logits "
                                "(train.py --fused_linear)")
    flash_attention: bool = option("--flash_attention", action=argparse.BooleanOptionalAction, default=True,
                                   help="SDPA / flash attention, HF's default (--no-flash_attention: eager, keeps the "
                                        "a*s*s attention scores; Gemma-2 always runs eager)")
    vocab_size: Optional[int] = option("--vocab_size", type=int, help=f"default: the model's own (a Hugging Face "
                                       f"config), {LLAMA3_VOCAB_SIZE} (Llama-3's) for a preset")
    gpu_memory_gib: float = option("--gpu_memory_gib", type=float, default=80.0)
    json: bool = option("--json", action="store_true", help="print JSON instead of a table")


def parse_args(argv=None) -> EstimateOptions:
    options, _ = parse_options(EstimateOptions, argv, description="Per-GPU memory for training a Llama, Mistral, "
                               "Qwen2/3 or Gemma (-2, -3) model (a preset or a Hugging Face config) under ZeRO-3 "
                               "(+ AutoTP), before booking a cluster")
    return options


def main(argv=None) -> None:
    options = parse_args(argv)
    setup = dict(nodes=options.nodes, gpus_per_node=options.gpus_per_node, tp_size=options.tp,
                 offload=options.offload, seq_len=options.seq_len, micro_batch=options.micro_batch,
                 gradient_checkpointing=options.gradient_checkpointing, flash_attention=options.flash_attention,
                 gpu_memory_gib=options.gpu_memory_gib, fused_linear=options.fused_linear, sp_size=options.sp)
    results = []
    for name in (TABLE_PRESETS if options.all else [options.model]):
        try:
            config = model_config(name, options.vocab_size)
            largest = {key: largest_micro_batch(config, **{**setup, "fused_linear": key == "fused_linear"})
                       for key in ("materialized", "fused_linear")}
            results.append((name, config, estimate(config, **setup), next_steps(config, **setup), largest))
        except ValueError as error:  # a model that cannot be read, a layout or TP size that does not fit it
            raise SystemExit(f"estimate.py: {name}: {error}") from None
    if options.json:
        records = [with_gib({"model": name, **result, "next_steps": steps, "largest_micro_batch": largest})
                   for name, _, result, steps, largest in results]
        print(json.dumps(records if options.all else records[0], indent=2))
    elif options.all:
        print(format_markdown([(name, result, steps) for name, _, result, steps, _ in results],
                              results[0][1].vocab_size))
    else:
        print(format_report(*results[0]))
