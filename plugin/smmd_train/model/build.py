"""Model creation for training and export: architecture from a preset or a local HF dir,
built partitioned under ZeRO-3 through HF's DeepSpeed integration."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from .presets import PRESETS, preset_config


def check_local_sources(model: str, tokenizer: Optional[str]) -> None:
    """Refuse, with what to do, a ``--model`` that is neither a preset nor a local Hugging Face model
    folder, and a ``--tokenizer`` that is not a folder: train.py reads local files only (every rank of
    a job would otherwise contact the Hub, and a typo'd path ends in a hub lookup's traceback)."""
    from pathlib import Path

    if model not in PRESETS:
        folder = Path(model)
        if not folder.is_dir():
            import difflib

            close = difflib.get_close_matches(model, PRESETS, n=1)
            hint = f" (did you mean the preset {close[0]}?)" if close else ""
            raise ValueError(f"--model {model}: no such folder, and not a preset{hint}; presets: {', '.join(PRESETS)}. "
                             "train.py reads a model from a local folder: download it first (e.g. `hf download "
                             "<repo> --local-dir DIR`) and pass --model DIR")
        if not (folder / "config.json").is_file():
            raise ValueError(f"--model {model} has no config.json: it is not a Hugging Face model folder")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: no such folder; pass a local tokenizer folder (one written by "
                         "save_pretrained)")


def model_config(model: str, tokenizer, seq_len: int, trust_remote_code: bool = False):
    """The architecture: a preset sized for the tokenizer (its vocabulary padded to a multiple of 64,
    the same at every TP degree: AutoTP splits any vocabulary), or the model dir's own config."""
    if model in PRESETS:
        vocab_size = -(-len(tokenizer) // 64) * 64
        config = preset_config(model, vocab_size=vocab_size, max_position_embeddings=max(seq_len, 128))
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        return config
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def zero_init_config(ds_config: dict) -> dict:
    """The part of the run's DeepSpeed config that partitions the model while it is built/loaded.

    Without ``train_batch_size`` (zero.Init would check it against the whole world, but with
    AutoTP the data-parallel size is world / TP; ``deepspeed.initialize`` checks the arithmetic)
    and without ``tensor_parallel`` (AutoTP shards inside ``deepspeed.initialize``, after the
    weights are loaded; transformers refuses to convert checkpoint weights while a config names
    tensor parallelism).
    """
    return {key: value for key, value in ds_config.items() if key not in ("train_batch_size", "tensor_parallel")}


def build_model(config, partition_config: dict, pretrained_dir: Optional[str] = None,
                trust_remote_code: bool = False, gradient_checkpointing: bool = False) -> tuple:
    """Create the model partitioned as it is built: fresh weights from ``config``, or the weights
    of the local HF model in ``pretrained_dir``.

    HF's DeepSpeed integration runs ``from_config`` / ``from_pretrained`` under
    ``deepspeed.zero.Init`` when ``partition_config`` (see :func:`zero_init_config`) is ZeRO-3 (and
    initialises the weights
    properly, which a bare ``zero.Init`` around the constructor does not), so no rank ever holds
    the whole model. Returns (model, the HfDeepSpeedConfig, which must stay alive until
    ``deepspeed.initialize``).
    """
    zero_init = HfDeepSpeedConfig(partition_config)
    if pretrained_dir is None:
        network = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    else:
        network = AutoModelForCausalLM.from_pretrained(pretrained_dir, config=config, torch_dtype=torch.float32,
                                                       trust_remote_code=trust_remote_code)
    network.config.use_cache = False
    if gradient_checkpointing:
        network.gradient_checkpointing_enable()
    return network, zero_init


def config_from_dict(values: dict):
    """Rebuild a saved ``config.to_dict()`` (run_config.json) as its config class."""
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward) plus the attention products.

    Counted before AutoTP shards the model; ``ds_numel`` is a ZeRO-3-partitioned parameter's size.
    """
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    config = model.config
    return 6.0 * parameters + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def rank_parameters(model) -> dict:
    """What this rank holds of ``model`` under ZeRO-3 (+ AutoTP), counted from its parameters:
    ``tensor_parallel``, the elements of its AutoTP shard (``ds_numel``: a ZeRO-3 parameter's whole size;
    without AutoTP the whole model), and ``zero_partition``, the elements of its ZeRO-3 partition of them
    (``ds_tensor``: each parameter split into equal parts, the last padded: a parameter AutoTP shards
    over the world / TP data-parallel ranks, one it leaves whole, built under ``zero.Init`` before AutoTP,
    over the world). A dry run (``smmd_train.tools.dry_run``) computes the same two numbers from the model's
    shapes."""
    parameters = list(model.parameters())
    return {"tensor_parallel": sum(p.ds_numel for p in parameters),
            "zero_partition": sum(p.ds_tensor.ds_numel for p in parameters)}
