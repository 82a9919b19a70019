"""Pretraining and continued pretraining with CE + SMMD under DeepSpeed ZeRO-3 (+ AutoTP).

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

Reads top to bottom: start the process group -> tokenizer and architecture -> resolve the
DeepSpeed config -> model (partitioned as it is created) -> data -> engine -> install the SMMD loss
on the (possibly vocabulary-parallel) LM head -> resume -> train, evaluate, checkpoint -> export.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups
from tqdm import tqdm
from transformers import AutoTokenizer

import smmd_scale
from smmd_scale.integrations.ntl import install_ntl
from smmd_scale.monitor import TrainingMonitor
from smmd_scale.training import checkpoint
from smmd_scale.training.config import load_config, resolve_config
from smmd_scale.training.data import (PackedBatches, check_tokenizer_fits_model, eval_batches, load_text_dataset,
                                      tokenize_and_pack)
from smmd_scale.training.distributed import init_distributed, rank_zero_first
from smmd_scale.training.export import export_hf
from smmd_scale.training.guard import NonFiniteGuard, NonFiniteLossError
from smmd_scale.training.model import build_model, flops_per_token, model_config, zero_init_config
from smmd_scale.training.presets import PRESETS


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", required=True, help=f"a local HF model dir (continued pretraining) or a preset "
                       f"to pretrain from scratch: {', '.join(PRESETS)}")
    model.add_argument("--tokenizer", help="tokenizer dir (default: the model dir; required with a preset)")
    model.add_argument("--trust_remote_code", action="store_true",
                       help="allow model/tokenizer code shipped inside the model dir to run (off by default)")
    model.add_argument("--data", nargs="+", required=True, help=".jsonl/.json/.txt/.parquet files or "
                       "datasets.save_to_disk dirs")
    model.add_argument("--text_field", default="text")
    model.add_argument("--seq_len", type=int, default=1024)
    model.add_argument("--eval_data", nargs="+", help="held-out data, packed like --data")
    model.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    model.add_argument("--eval_batches", type=int, default=50, help="micro-batches per evaluation")
    model.add_argument("--cache_dir", help="where tokenized/packed data is cached (default <output_dir>/cache)")
    model.add_argument("--num_proc", type=int, default=1, help="processes for tokenization")

    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, required=True, help="optimizer steps")
    train.add_argument("--micro_batch_size", type=int, default=1, help="resolves train_micro_batch_size_per_gpu")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--lr", type=float, default=3e-4)
    train.add_argument("--weight_decay", type=float, default=0.1)
    train.add_argument("--warmup_steps", type=int, default=100)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--gradient_checkpointing", action="store_true")
    train.add_argument("--output_dir", required=True)
    train.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps and at the end (0: never)")
    train.add_argument("--resume", action="store_true", help="continue from the latest committed checkpoint in "
                       "--output_dir (starts fresh if there is none, so restart loops can always pass it)")
    train.add_argument("--export_hf", help="write a Hugging Face model dir here at the end")
    train.add_argument("--tensorboard_dir", help="default <output_dir>/tensorboard")
    train.add_argument("--process_group_timeout_minutes", type=float, default=30.0,
                       help="how long a collective waits for a lost rank before the job fails")
    train.add_argument("--max_skipped_steps", type=int, default=10,
                       help="stop after this many consecutive steps with a NaN/inf loss (each is skipped on every "
                       "rank)")

    smmd = parser.add_argument_group("SMMD loss")
    smmd.add_argument("--smmd_weight", type=float, default=1.0, help="0 = CE only (numeric metrics still logged)")
    smmd.add_argument("--smmd_policy", default="integers", choices=["integers", "digits", "floats"])
    smmd.add_argument("--smmd_max_value", type=float, default=999)
    smmd.add_argument("--smmd_mode", default="smmd", choices=["smmd", "mmd", "smooth"])
    smmd.add_argument("--smmd_kernel", default="gaussian", choices=["gaussian", "laplace", "random", "shuffled"])
    smmd.add_argument("--smmd_sigmas", type=float, nargs="+", default=[2.0])
    smmd.add_argument("--ntl_weight", type=float, default=0.0,
                      help="for comparisons: CE + this x NTL-WAS (ntloss package) instead of SMMD; full logits only")
    smmd.add_argument("--framework_loss", action="store_true",
                      help="baseline for throughput comparisons: keep the model's own loss (HF's CE, or DeepSpeed's "
                      "vocab-parallel CE under AutoTP) instead of installing smmd_scale; no numeric metrics")

    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see ds_configs/)")
    if args.ntl_weight and args.smmd_weight:
        parser.error("--ntl_weight replaces SMMD: pass --smmd_weight 0 with it")
    if args.framework_loss and args.ntl_weight:
        parser.error("--framework_loss trains with the model's own loss: it cannot add --ntl_weight")
    args.tensorboard_dir = args.tensorboard_dir or str(Path(args.output_dir, "tensorboard"))
    args.cache_dir = args.cache_dir or str(Path(args.output_dir, "cache"))
    return args


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def log(*parts) -> None:
    if dist.get_rank() == 0:
        print("[train]", *parts, flush=True)


@torch.no_grad()
def evaluate(engine, installed, dataset, micro_batch_size: int, max_batches: int, dp_rank: int, dp_size: int,
             dp_group) -> dict:
    """CE and numeric metrics on held-out blocks, split across the data-parallel replicas."""
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)  # ce*tokens, tokens, correct, abs err, numeric
    for batch in itertools.islice(eval_batches(dataset, micro_batch_size, max_batches), dp_rank, None, dp_size):
        input_ids = batch["input_ids"].to(engine.device)
        engine(input_ids=input_ids, labels=input_ids)
        stats, (_, ce, _) = installed.last_stats, installed.hook.last_losses
        numeric = stats["numeric_tokens"]
        sums += torch.tensor([float(ce) * stats["tokens"], stats["tokens"], stats["numeric_accuracy"] * numeric,
                              stats["numeric_mae"] * numeric, numeric], dtype=torch.float64, device=engine.device)
    engine.train()
    if dp_size > 1:
        dist.all_reduce(sums, group=dp_group)
    ce_sum, tokens, correct, abs_error, numeric = sums.tolist()
    return {"eval/ce": ce_sum / max(tokens, 1), "eval/perplexity": math.exp(min(ce_sum / max(tokens, 1), 50)),
            "eval/numeric_accuracy": correct / max(numeric, 1), "eval/numeric_mae": abs_error / max(numeric, 1),
            "eval/numeric_tokens": numeric}


def main(argv=None) -> None:
    args = parse_args(argv)
    launch = init_distributed(args.process_group_timeout_minutes)
    seed_everything(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)

    # 1. Tokenizer and architecture; a vocabulary the model cannot score fails before any heavy work.
    if args.model in PRESETS and not args.tokenizer:
        raise ValueError(f"--model {args.model} is a preset (training from scratch): pass --tokenizer DIR")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    raw_config = load_config(args.deepspeed_config)
    tp_size = int((raw_config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    config = model_config(args.model, tokenizer, tp_size, args.seq_len, args.trust_remote_code)
    warning = check_tokenizer_fits_model(tokenizer, config.vocab_size)
    if warning:
        log(f"warning: {warning}")

    # 2. DeepSpeed config: "auto" values from the flags; bad combinations fail here, on every rank.
    accelerator = get_accelerator()
    ds_config, topology = resolve_config(
        raw_config, world_size=launch.world_size, micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.lr,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
        tensorboard_dir=args.tensorboard_dir, job_name=Path(args.output_dir).name,
        bf16_supported=accelerator.device_name() != "cpu" and accelerator.is_bf16_supported(),
        hidden_size=config.hidden_size, accelerator=accelerator.device_name())
    if topology.tp_size > 1:
        # The data-parallel groups must exist before the model is partitioned over them.
        groups._init_tp_mesh_device(tensor_model_parallel_size=topology.tp_size)
    log(f"world {topology.world_size} = {topology.dp_size} data-parallel x {topology.tp_size} tensor-parallel "
        f"({launch.launcher})")
    pretrained_dir = None if args.model in PRESETS else args.model
    model, zero_init = build_model(config, zero_init_config(ds_config), pretrained_dir, args.trust_remote_code,
                                   args.gradient_checkpointing)
    model_flops_per_token = flops_per_token(model, args.seq_len)

    # 3. Data: rank 0 tokenizes and packs into the cache first, the others then read the cache; a
    # data error on rank 0 is raised on every rank.
    def packed(paths):
        return rank_zero_first(lambda: tokenize_and_pack(load_text_dataset(paths, args.text_field), tokenizer,
                                                         args.seq_len, text_field=args.text_field,
                                                         num_proc=args.num_proc, cache_dir=args.cache_dir))

    train_blocks = packed(args.data)
    eval_blocks = packed(args.eval_data) if args.eval_data else None

    # 4. Engine (AutoTP shards the model and makes the LM head vocabulary-parallel if configured).
    # model.parameters() stays lazy so the optimizer sees the parameters after AutoTP replaced the
    # modules, in module order (launch/export_hf.py rebuilds the engine the same way to load it).
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           mpu=groups if topology.tp_size > 1 else None)
    del zero_init
    dp_rank = groups.get_data_parallel_rank() if topology.tp_size > 1 else dist.get_rank()
    dp_group = groups.get_data_parallel_group() if topology.tp_size > 1 else None
    micro_batch_size = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    batches = PackedBatches(train_blocks, micro_batch_size, dp_rank, topology.dp_size, args.seed)

    # 5. The loss: CE + weight * SMMD on the LM head's (vocabulary-parallel) logits.
    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy=args.smmd_policy,
                                                   max_value=args.smmd_max_value,
                                                   vocab_size=model.config.vocab_size)
    installed = None
    if not args.framework_loss:
        installed = smmd_scale.install(engine, vocab, weight=args.smmd_weight, mode=args.smmd_mode,
                                       kernel=args.smmd_kernel, sigmas=tuple(args.smmd_sigmas))
        if args.ntl_weight:
            install_ntl(installed, tokenizer, args.ntl_weight)
    log(f"loss: {installed.hook!r} ({'vocab-parallel' if installed.vocab_parallel else 'full logits'})"
        if installed else f"loss: the model's own ({type(engine.module.loss_function).__name__}), no SMMD")

    # 6. Resume: model/optimizer/scheduler from DeepSpeed, then step, data position and RNG.
    start_step, skipped_steps = 0, 0
    resume_tag = checkpoint.find_resume_tag(args.output_dir) if args.resume else None
    if resume_tag is not None:
        client_state = checkpoint.load(engine, args.output_dir, resume_tag)
        start_step, skipped_steps = client_state["step"], client_state.get("skipped_steps", 0)
        batches.load_state_dict(client_state["data"])
        log(f"resumed from {resume_tag} at step {start_step}")
    elif args.resume:
        log(f"no committed checkpoint in {args.output_dir}; starting from step 0")

    monitor = TrainingMonitor(engine, world_size=topology.world_size, tp_size=topology.tp_size,
                              dp_size=topology.dp_size, dp_group=dp_group, flops_per_token=model_flops_per_token,
                              metrics_path=str(Path(args.output_dir, "metrics.jsonl")))
    if dist.get_rank() == 0:
        Path(args.output_dir, "run_config.json").write_text(json.dumps(
            {"args": vars(args), "deepspeed_config": ds_config, "world_size": topology.world_size,
             "tp_size": topology.tp_size, "dp_size": topology.dp_size, "launcher": launch.launcher,
             "model_config": model.config.to_dict(), "numeric_vocab": repr(vocab)}, indent=1, default=str))
    if start_step == 0:
        monitor.log_run_shape()

    # 7. Train. A step whose loss is NaN/inf on any rank is skipped on every rank (NonFiniteGuard).
    guard = NonFiniteGuard(args.max_skipped_steps, total_skips=skipped_steps)
    last_checkpoint = resume_tag
    tokens_per_step = micro_batch_size * accumulation * topology.dp_size * args.seq_len
    progress = tqdm(total=args.max_steps, initial=start_step, disable=dist.get_rank() != 0, desc="train",
                    dynamic_ncols=True)
    for step in range(start_step + 1, args.max_steps + 1):
        began, learning_rate = time.perf_counter(), engine.get_lr()[0]  # the rate this step's update uses
        for _ in range(accumulation):
            input_ids = next(batches)["input_ids"].to(engine.device)
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(guard.checked(loss))
            engine.step()
            if installed is None:
                monitor.record_micro_batch((loss.detach(), loss.detach(), 0.0), None)
            else:
                monitor.record_micro_batch(installed.hook.last_losses, installed.last_stats)
        guard.end_step(engine.was_step_applied())
        metrics = monitor.end_step(step, time.perf_counter() - began, tokens_per_step, learning_rate,
                                   skipped_steps=guard.total_skips)
        guard.raise_if_exhausted(last_checkpoint)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss/total']:.4f}", smmd=f"{metrics['loss/smmd']:.4f}",
                             tok_s=f"{metrics['perf/tokens_per_second']:.0f}")
        if eval_blocks is not None and installed is not None and args.eval_steps and step % args.eval_steps == 0:
            monitor.write_eval(step, evaluate(engine, installed, eval_blocks, micro_batch_size, args.eval_batches,
                                              dp_rank, topology.dp_size, dp_group))
        if args.save_steps and (step % args.save_steps == 0 or step == args.max_steps):
            last_checkpoint = checkpoint.save(engine, args.output_dir, step, {"data": batches.state_dict(),
                                                                              "skipped_steps": guard.total_skips})
    progress.close()

    # 8. Final evaluation and export.
    if eval_blocks is not None and installed is not None:
        final = evaluate(engine, installed, eval_blocks, micro_batch_size, args.eval_batches, dp_rank,
                         topology.dp_size, dp_group)
        monitor.write_eval(args.max_steps, final)
        log("eval " + " ".join(f"{key}={value:.4g}" for key, value in final.items()))
    if args.export_hf:
        export_hf(engine, args.export_hf, tokenizer)
        log(f"exported a Hugging Face model to {args.export_hf}")
    dist.barrier()
    dist.destroy_process_group()  # gloo can abort at interpreter exit otherwise


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NonFiniteLossError as error:
        print(f"[train] stopped: {error}", file=sys.stderr, flush=True)
        sys.exit(3)
