"""Run under the deepspeed launcher (or as one plain process for TP=1) by tests/test_deepspeed.py.

A tiny LlamaForCausalLM from a config, ZeRO-3 (fp32, torch AdamW), optionally AutoTP with a
vocabulary-parallel LM head; smmd_scale.install on the engine; a few optimizer steps on fixed
batches. Rank 0 writes the per-step losses and the installed loss's statistics as JSON.
"""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations import HfDeepSpeedConfig

import smmd_scale
from smmd_scale import compat
from smmd_train.distributed import init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--tied", action="store_true")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

init_distributed(timeout_minutes=5)
VOCAB, BATCH, LENGTH = 2048, 4, 24
config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "torch_adam": True, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6}
if args.tp > 1:
    config["tensor_parallel"] = {"autotp_size": args.tp, "vocab_parallel_lm_head": True}
    compat.init_tensor_parallel_groups(args.tp)
torch.manual_seed(0)
zero_init = HfDeepSpeedConfig(dict(config))
model = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=args.tied), torch_dtype=torch.float32)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                       mpu=groups if args.tp > 1 else None)
del zero_init

# Numeric tokens on both sides of the TP=2 split at 1024: ids 100..119 and 1100..1109.
vocab = smmd_scale.NumericVocab(list(range(100, 120)) + list(range(1100, 1110)), list(range(20)) + list(range(10)),
                                VOCAB)
generator = torch.Generator().manual_seed(1)
batches = []
for _ in range(args.steps):
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    numeric = torch.rand(BATCH, LENGTH, generator=generator) < 0.4
    ids[numeric] = vocab.token_ids[torch.randint(0, len(vocab), (int(numeric.sum()), ), generator=generator)]
    batches.append(ids)

result = {"tp": args.tp, "tokens": BATCH * LENGTH, "vocab_size": VOCAB}  # positions the loss sees
if args.tp > 1:
    # DeepSpeed installed its own CE-only vocab-parallel loss; ours with weight 0 must agree with it.
    with torch.no_grad():
        deepspeed_ce = engine(input_ids=batches[0], labels=batches[0]).loss.item()
    result["deepspeed_loss_function"] = type(engine.module.loss_function).__name__
    probe = smmd_scale.install(engine, vocab, weight=0.0)
    with torch.no_grad():
        ours_ce = engine(input_ids=batches[0], labels=batches[0]).loss.item()
    result["ce_ours_vs_deepspeed"] = [ours_ce, deepspeed_ce]
    probe.restore()

installed = smmd_scale.install(engine, vocab, weight=1.0)
result["vocab_parallel"] = installed.vocab_parallel
result["head"] = None if installed.head is None else [installed.head.vocab_start_index,
                                                       installed.head.vocab_end_index]
losses, stats = [], []
for ids in batches:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    stats.append(installed.last_stats)
result.update(losses=losses, stats=stats)
heads = [None] * dist.get_world_size()
dist.all_gather_object(heads, result["head"])
result["heads"] = heads
if dist.get_rank() == 0:
    with open(args.out, "w") as handle:
        json.dump(result, handle)
dist.destroy_process_group()
