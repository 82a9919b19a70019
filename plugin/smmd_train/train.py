"""Pretraining and continued pretraining with CE + a numeric loss (SMMD, NTL) under DeepSpeed ZeRO-3 (+ AutoTP).

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2 \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

Also ``smmd-train ...`` (a console command: one process, or a launcher that starts a command) and
``launch/train.py`` (the script path that the deepspeed launcher, mpirun and srun start). Reads top
to bottom: start the process
group -> prepare the run (plan: tokenizer, architecture, resolved DeepSpeed config, parallel layout,
numeric vocabulary and loss, where every bad option fails; data; model and engine; the numeric loss
installed on the (possibly vocabulary-parallel) LM head) -> resume -> train steps, with evaluation and
checkpoints at their own cadence -> export. Its pieces are the ``smmd_train`` package
(``smmd_train.run`` sets the run up); its flags are in ``smmd_train/arguments.py``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .arguments import parse_args
from .checkpoint import Checkpointer, TrainState
from .distributed import init_distributed, shutdown_distributed
from .evaluation import Evaluator
from .export import export_hf
from .guard import NonFiniteGuard, NonFiniteLossError
from .run import RunRefused, log, open_monitor, prepare_run, train_step, write_run_config


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv=None) -> None:
    args = parse_args(argv, description=__doc__)
    launch = init_distributed(args.process_group_timeout_minutes)
    seed_everything(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)

    # Plan, data, model, engine, numeric loss: a bad option or config fails (on every rank) before the model exists.
    run = prepare_run(args, launch)
    for warning in run.plan.warnings:
        log(f"warning: {warning}")

    # Resume: model/optimizer/scheduler from DeepSpeed, then step, data position, skip count and RNG.
    guard = NonFiniteGuard(args.max_skipped_steps)
    state = TrainState(run.batches, guard)
    checkpointer = Checkpointer(run.engine, args.output_dir, args.save_steps, args.max_steps)
    if args.resume:
        tag = checkpointer.resume(state)
        log(f"resumed from {tag} at step {state.step}" if tag else
            f"no committed checkpoint in {args.output_dir}; starting from step 0")

    monitor = open_monitor(run)
    write_run_config(run)
    if state.step == 0:
        monitor.log_run_shape()
    evaluator = Evaluator(run, monitor, args.eval_steps, args.eval_batches)

    # Train. A step whose loss is NaN/inf on any rank is skipped on every rank (NonFiniteGuard).
    progress = tqdm(total=args.max_steps, initial=state.step, disable=launch.rank != 0, desc="train",
                    dynamic_ncols=True)
    run.engine.train()  # from_pretrained returns a model in eval mode (no dropout, and no fused linear head)
    for step in range(state.step + 1, args.max_steps + 1):
        metrics = train_step(run, step, guard, monitor)
        state.step = step
        guard.raise_if_exhausted(checkpointer.last_tag)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss/total']:.4f}", tok_s=f"{metrics['perf/tokens_per_second']:.0f}")
        evaluator.maybe_evaluate(step)
        checkpointer.maybe_save(state)
    progress.close()

    evaluation = evaluator.finish(args.max_steps)
    if evaluation is not None:
        log("eval " + " ".join(f"{key}={value:.4g}" for key, value in evaluation.items()))
    monitor.finish(args.max_steps)
    if args.export_hf:
        export_hf(run.engine, args.export_hf, run.plan.tokenizer)
        log(f"exported a Hugging Face model to {args.export_hf}")


def cli(argv=None) -> None:
    """Run :func:`main`, then shut the process group down in order; the exit code says how it ended
    (0 trained, 2 refused: one line per problem on rank 0, 3 stopped for non-finite losses)."""
    exit_code = 0
    try:
        main(argv)
    except RunRefused as error:  # raised on every rank, before the model was built
        if os.environ.get("RANK", "0") == "0":
            for problem in str(error).splitlines():
                print(f"[train] refused: {problem}", file=sys.stderr, flush=True)
        exit_code = 2
    except NonFiniteLossError as error:  # raised on every rank at the same step
        print(f"[train] stopped: {error}", file=sys.stderr, flush=True)
        exit_code = 3
    finally:
        # On every exit path: a barrier (unless an error is in flight), then the engine and every
        # process group go, with their gloo threads, before interpreter shutdown; else a rank can
        # abort at exit after a job that did its work (see shutdown_distributed).
        shutdown_distributed()
    sys.exit(exit_code)


if __name__ == "__main__":
    cli()
