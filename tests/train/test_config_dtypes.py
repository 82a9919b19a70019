"""The shipped DeepSpeed configs train bf16 models with fp32 gradients where it matters, as Megatron
does: ZeRO-3 accumulates the partitioned gradients in fp32 (``data_types.grad_accum_dtype``) and
reduce-scatters them in fp32 (``communication_data_type``); left out, DeepSpeed does both in bf16.
Checked on the resolved GPU config and on a real bf16 ZeRO-3 engine (one gloo rank, CPU)."""

import pytest
import torch
from helpers.distributed import run_ranks, values_or_raise
from helpers.launching import REPO

from smmd_train.config.deepspeed import load_config, resolve_config

CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def resolved(path, accelerator: str) -> dict:
    config, _ = resolve_config(load_config(str(path)), world_size=8, micro_batch_size=1, gradient_accumulation_steps=4,
                               learning_rate=1e-4, weight_decay=0.1, bf16_supported=True, hidden_size=64,
                               accelerator=accelerator)
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_every_config_accumulates_and_reduces_gradients_in_fp32_on_a_gpu(path):
    config = resolved(path, "cuda")
    assert config["bf16"]["enabled"] is True
    assert config["data_types"]["grad_accum_dtype"] == "fp32" and config["communication_data_type"] == "fp32"


def _bf16_engine_dtypes(rank, world_size):
    import os

    import deepspeed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group run_ranks started
    config = resolved(REPO / "ds_configs" / "zero3.json", "cpu")
    config.update(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config["bf16"] = {"enabled": True}
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().square().mean()
    engine.backward(loss)
    dtypes = (str(next(engine.module.parameters()).dtype), str(engine.optimizer.gradient_accumulation_dtype),
              str(engine.communication_data_type))
    engine.step()
    engine.destroy()
    return dtypes


@pytest.mark.gloo
@pytest.mark.slow  # DeepSpeed's first init on a fresh machine compiles its CPU shared-memory op
def test_a_bf16_zero3_engine_built_from_the_config_accumulates_and_reduces_in_fp32():
    assert values_or_raise(run_ranks(_bf16_engine_dtypes, 1, fresh=True)) == [("torch.bfloat16", "torch.float32",
                                                                   "torch.float32")]
