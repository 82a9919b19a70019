"""install(..., fused_linear=True) under HF Trainer's bf16 AMP (torch.autocast): a bf16 backbone with its
head kept in fp32 hands the head bf16 hidden states and an fp32 weight, which the fused op computes as
autocast would; the per-step losses follow the materialized hook's."""

import pytest
import torch
import transformers
from helpers.models import token_rows
from test_fused_forward import batch, numeric_vocab, tiny

import smmd_scale
from smmd_scale import SMMDLoss


def test_trainer_bf16_amp_with_an_fp32_head_trains_like_the_materialized_hook(tmp_path, generator):
    ids, labels = batch(generator, rows=4, length=16)
    histories, head_dtypes = {}, {}
    for fused in (False, True):
        model = tiny("llama", tied=False, dtype=torch.bfloat16)
        model.lm_head.float()  # the head kept in fp32, as keep_in_fp32_modules or a stability recipe does
        smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=1.0, fused_linear=fused)
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(fused)), max_steps=5, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=3e-3, report_to=[], use_cpu=True, bf16=True,
            save_strategy="no", logging_steps=1, seed=0)
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=token_rows(ids, labels, 8))
        trainer.train()
        histories[fused] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        head_dtypes[fused] = model.lm_head.weight.dtype
    assert head_dtypes == {False: torch.float32, True: torch.float32}
    assert len(histories[True]) == 5
    assert histories[True] == pytest.approx(histories[False], rel=2e-2)
    assert histories[True][-1] < histories[True][0]
