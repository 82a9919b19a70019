"""Export a trained engine as a Hugging Face model directory that ``from_pretrained`` loads.

``smmd_train.compat.consolidated_state_dict`` gathers the ZeRO-3 partitions and, under AutoTP,
the tensor-parallel shards (DeepSpeed's ``GatherReplacedLayerParams``) into full tensors on rank 0
(in the training dtype: fp32 stays fp32). It is a collective: every rank calls :func:`export_hf`.
Rank 0 then builds a fresh model from the config and writes it
(``smmd_train.distributed.groups.run_on_rank_zero``: the others wait past the process-group timeout).
"""

from __future__ import annotations

import copy
from pathlib import Path

from .. import compat
from ..config.deepspeed import set_tensor_parallel
from ..distributed.groups import run_on_rank_zero
from .commits import read_commit, saved_layout


def export_hf(engine, output_dir: str, tokenizer=None) -> None:
    """Write ``output_dir`` (config, weights, and the tokenizer if given). Call on every rank."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    state_dict = compat.consolidated_state_dict(engine)

    def write() -> None:
        config = copy.deepcopy(engine.module.config)
        config.use_cache = True  # training turns the KV cache off; generation with the export wants it
        unset_hf_deepspeed_config()  # or from_config would partition the fresh model with zero.Init
        model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state_dict.values())).dtype)
        if model.generation_config is not None:
            model.generation_config.use_cache = True
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        # Tied output heads are not separate tensors in the state dict.
        missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"exported state dict does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(output_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)

    # Building and writing a large model on rank 0 can outlast the process-group timeout: the others
    # wait outside any collective, and see rank 0's error if it fails.
    run_on_rank_zero(write)


def checkpoint_layout(run_dir, tag: str, run: dict) -> tuple:
    """(world size, AutoTP degree) that checkpoint ``tag`` in ``run_dir`` was written with, from its
    commit marker (:func:`~smmd_train.checkpoint.commits.saved_layout`): what launch/export_hf.py loads it
    with. ``run`` (run_config.json, written by the run's latest launch, which may have resumed under
    another layout) gives the degree only where neither the marker nor ZeRO-3 shard files say it."""
    world_size, tp_size, _ = saved_layout(str(run_dir), tag, read_commit(str(run_dir), tag))
    return world_size, tp_size or run["tp_size"]


def layout_config(ds_config: dict, world_size: int, tp_size: int) -> dict:
    """The run's resolved DeepSpeed config for an engine of ``world_size`` ranks at AutoTP degree
    ``tp_size`` (the checkpoint's layout; run_config.json's is the latest launch's)."""
    config = set_tensor_parallel(ds_config, tp_size)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                  * (world_size // tp_size))
    return config
