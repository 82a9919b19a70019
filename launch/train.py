"""Pretraining and continued pretraining with CE + SMMD under DeepSpeed ZeRO-3 (+ AutoTP).

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2 \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

Reads top to bottom: start the process group -> plan the run (tokenizer, architecture, resolved
DeepSpeed config, parallel layout) -> model (partitioned as it is created) -> data -> engine ->
install the SMMD loss on the (possibly vocabulary-parallel) LM head -> resume -> train, evaluate,
checkpoint -> export. Its pieces are the ``smmd_train`` package; its flags are in
``smmd_train/arguments.py``.
"""

from __future__ import annotations

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

import smmd_scale
from smmd_scale import compat
from smmd_train import checkpoint
from smmd_train.arguments import parse_args
from smmd_train.data import PackedBatches, eval_batches, pack_files
from smmd_train.distributed import destroy_at_shutdown, init_distributed, rank_zero_first, shutdown_distributed
from smmd_train.export import export_hf
from smmd_train.guard import NonFiniteGuard, NonFiniteLossError
from smmd_train.model import build_model, flops_per_token, zero_init_config
from smmd_train.monitor import TrainingMonitor
from smmd_train.plan import numeric_loss, plan_run
from smmd_train.schedule import warmup_cosine
from smmd_train.tensorboard import run_hparams


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def log(*parts) -> None:
    if dist.get_rank() == 0:
        print("[train]", *parts, flush=True)


@torch.no_grad()
def held_out_metrics(engine, installed, dataset, micro_batch_size: int, max_batches: int, dp_rank: int,
                     dp_size: int, dp_group) -> dict:
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
    args = parse_args(argv, description=__doc__)
    launch = init_distributed(args.process_group_timeout_minutes)
    seed_everything(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)

    # 1. The plan: tokenizer, architecture, DeepSpeed config with "auto" resolved from the flags and
    # --tp, the parallel layout. Bad combinations fail here, on every rank, before any heavy work.
    accelerator = get_accelerator()
    plan = plan_run(args, launch.world_size, accelerator.device_name(), accelerator.is_bf16_supported())
    tokenizer, ds_config, topology = plan.tokenizer, plan.ds_config, plan.topology
    for warning in plan.warnings:
        log(f"warning: {warning}")

    # 2. The model, partitioned over the data-parallel group as it is built or loaded.
    if topology.tp_size > 1:
        compat.init_tensor_parallel_groups(topology.tp_size)  # ZeRO-3 partitions over these groups
    log(f"world {topology.world_size} = {topology.dp_size} data-parallel x {topology.tp_size} tensor-parallel "
        f"({launch.launcher})")
    model, zero_init = build_model(plan.model_config, zero_init_config(ds_config), plan.pretrained_dir,
                                   args.trust_remote_code, args.gradient_checkpointing)
    model_flops_per_token = flops_per_token(model, args.seq_len)

    # 3. Data: rank 0 tokenizes and packs into the cache first, the others then read the cache; a
    # data error on rank 0 is raised on every rank.
    def packed(paths):
        return rank_zero_first(lambda: pack_files(paths, tokenizer, args.seq_len, text_field=args.text_field,
                                                  num_proc=args.num_proc, cache_dir=args.cache_dir))

    train_blocks = packed(args.data)
    eval_blocks = packed(args.eval_data) if args.eval_data else None

    # 4. Engine (AutoTP shards the model and makes the LM head vocabulary-parallel if configured).
    # model.parameters() stays lazy so the optimizer sees the parameters after AutoTP replaced the
    # modules, in module order (launch/export_hf.py rebuilds the engine the same way to load it).
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=warmup_cosine(plan.warmup_steps, args.max_steps,
                                                                      args.min_lr_ratio),
                                           mpu=groups if topology.tp_size > 1 else None)
    destroy_at_shutdown(engine)
    del zero_init
    dp_rank = groups.get_data_parallel_rank() if topology.tp_size > 1 else dist.get_rank()
    dp_group = groups.get_data_parallel_group() if topology.tp_size > 1 else None
    micro_batch_size = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    batches = PackedBatches(train_blocks, micro_batch_size, dp_rank, topology.dp_size, args.seed)

    # 5. The loss: CE + weight * SMMD (or --numeric_loss) on the LM head's (vocabulary-parallel) logits,
    # or from its input without logits (--fused_linear).
    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy=args.smmd_policy,
                                                   max_value=args.smmd_max_value,
                                                   vocab_size=model.config.vocab_size)
    installed = None
    if not args.framework_loss:
        installed = smmd_scale.install(engine, vocab, weight=args.smmd_weight, fused_linear=args.fused_linear,
                                       numeric_loss=numeric_loss(args, vocab))
    log(f"loss: {installed!r} ({'vocab-parallel' if installed.vocab_parallel else 'full logits'})"
        if installed else f"loss: the model's own ({type(engine.module.loss_function).__name__}), no SMMD")

    # 6. Resume: model/optimizer/scheduler from DeepSpeed, then step, data position and RNG.
    start_step, skipped_steps = 0, 0
    resume_tag = checkpoint.find_resume_tag(args.output_dir) if args.resume else None
    if resume_tag is not None:
        client_state = checkpoint.load(engine, args.output_dir, resume_tag)
        # (not "skipped_steps": DeepSpeed keeps its own key of that name and drops it from client_state)
        start_step, skipped_steps = client_state["step"], client_state.get("non_finite_skips", 0)
        batches.load_state_dict(client_state["data"])
        log(f"resumed from {resume_tag} at step {start_step}")
    elif args.resume:
        log(f"no committed checkpoint in {args.output_dir}; starting from step 0")

    monitor = TrainingMonitor(engine, world_size=topology.world_size, tp_size=topology.tp_size,
                              dp_size=topology.dp_size, dp_group=dp_group, flops_per_token=model_flops_per_token,
                              metrics_path=str(Path(args.output_dir, "metrics.jsonl")),
                              tensorboard_dir=args.tensorboard_dir if plan.tensorboard else None,
                              hparams=run_hparams(args, plan, launch.launcher, installed is None))
    if dist.get_rank() == 0:
        Path(args.output_dir, "run_config.json").write_text(json.dumps(
            {"args": vars(args), "deepspeed_config": ds_config, "world_size": topology.world_size,
             "tp_size": topology.tp_size, "dp_size": topology.dp_size, "launcher": launch.launcher,
             "model_config": model.config.to_dict(), "numeric_vocab": repr(vocab)}, indent=1, default=str))
    if start_step == 0:
        monitor.log_run_shape()

    # 7. Train. A step whose loss is NaN/inf on any rank is skipped on every rank (NonFiniteGuard).
    evaluation = None
    guard = NonFiniteGuard(args.max_skipped_steps, total_skips=skipped_steps)
    last_checkpoint = resume_tag
    tokens_per_step = micro_batch_size * accumulation * topology.dp_size * args.seq_len
    progress = tqdm(total=args.max_steps, initial=start_step, disable=dist.get_rank() != 0, desc="train",
                    dynamic_ncols=True)
    engine.train()  # from_pretrained returns a model in eval mode (no dropout, and no fused linear head)
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
                if args.fused_linear and "backward_comm_calls" not in installed.last_stats:
                    raise RuntimeError("--fused_linear is installed but this training step computed the logits (the "
                                       "fused path runs only for a training-mode forward with labels)")
                monitor.record_micro_batch(installed.hook.last_losses, installed.last_stats)
        guard.end_step(engine.was_step_applied())
        metrics = monitor.end_step(step, time.perf_counter() - began, tokens_per_step, learning_rate,
                                   skipped_steps=guard.total_skips)
        guard.raise_if_exhausted(last_checkpoint)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss/total']:.4f}", tok_s=f"{metrics['perf/tokens_per_second']:.0f}")
        evaluation = None  # the held-out metrics, when this step evaluates
        if eval_blocks is not None and installed is not None and args.eval_steps and step % args.eval_steps == 0:
            evaluation = held_out_metrics(engine, installed, eval_blocks, micro_batch_size, args.eval_batches,
                                          dp_rank, topology.dp_size, dp_group)
            monitor.write_eval(step, evaluation)
        if args.save_steps and (step % args.save_steps == 0 or step == args.max_steps):
            last_checkpoint = checkpoint.save(engine, args.output_dir, step, {"data": batches.state_dict(),
                                                                              "non_finite_skips": guard.total_skips})
    progress.close()

    # 8. Final evaluation (unless the last step just ran one), the run's summary, export.
    if eval_blocks is not None and installed is not None:
        if evaluation is None:
            evaluation = held_out_metrics(engine, installed, eval_blocks, micro_batch_size, args.eval_batches,
                                          dp_rank, topology.dp_size, dp_group)
            monitor.write_eval(args.max_steps, evaluation)
        log("eval " + " ".join(f"{key}={value:.4g}" for key, value in evaluation.items()))
    monitor.finish(args.max_steps)
    if args.export_hf:
        export_hf(engine, args.export_hf, tokenizer)
        log(f"exported a Hugging Face model to {args.export_hf}")


if __name__ == "__main__":
    exit_code = 0
    try:
        main()
    except NonFiniteLossError as error:  # raised on every rank at the same step
        print(f"[train] stopped: {error}", file=sys.stderr, flush=True)
        exit_code = 3
    finally:
        # On every exit path: a barrier (unless an error is in flight), then the engine and every
        # process group go, with their gloo threads, before interpreter shutdown; else a rank can
        # abort at exit after a job that did its work (see shutdown_distributed).
        shutdown_distributed()
    sys.exit(exit_code)
