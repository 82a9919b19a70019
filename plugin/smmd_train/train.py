r"""Pretraining and continued pretraining with CE + a numeric loss (SMMD, NTL) under DeepSpeed ZeRO-3 (+ AutoTP).

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2 \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

Also ``smmd-train ...`` (a console command: one process, or a launcher that starts a command) and
``launch/train.py`` (the script path that the deepspeed launcher, mpirun and srun start). Reads top
to bottom: start the process group -> prepare the run (plan: tokenizer, architecture, resolved
DeepSpeed config, parallel layout, numeric vocabulary and loss, where every bad option fails; data;
model and engine; the numeric loss installed on the (possibly vocabulary-parallel) LM head) ->
resume -> train steps, with evaluation and checkpoints at their own cadence -> export. ``--dry_run``
runs :func:`dry_run` instead: the same start for ``--world_size`` ranks in one process, up to the
first step, without the hardware, and what each rank will hold and send. Its pieces are
the ``smmd_train`` package (``smmd_train.run`` sets the run up); its flags are in
``smmd_train/config/arguments.py``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

# Only the parser and the configuration at the top: cli() reads the command line and the DeepSpeed config
# before DeepSpeed and transformers load (seconds, on every rank), so a mistyped flag is refused at once;
# main() imports the rest.
from .config.arguments import parse_args
from .config.run_config import RunConfig, RunRefused


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(config: RunConfig) -> None:
    """Train the run of ``config`` (:class:`smmd_train.config.run_config.RunConfig`)."""
    from tqdm import tqdm

    from .checkpoint.export import export_hf
    from .checkpoint.resume import resume_or_start
    from .checkpoint.saving import Checkpointer, TrainState, run_record
    from .components.evaluation import Evaluator, describe
    from .components.guard import NonFiniteGuard
    from .distributed.groups import init_distributed
    from .run import log, open_monitor, prepare_run, train_step, write_run_config

    optimization, checkpointing, inputs = config.optimization, config.checkpointing, config.model_data
    output_dir = checkpointing.output_dir
    launch = init_distributed(config.layout.process_group_timeout_minutes)
    seed_everything(optimization.seed)
    Path(output_dir).mkdir(parents=True, exist_ok=True)

    # Plan, data, model, engine, numeric loss: a bad option or config fails (on every rank) before the model exists,
    # and the plan's warnings are logged before it is built.
    run = prepare_run(config, launch)

    # Resume (model/optimizer/scheduler from DeepSpeed, then step, data position, skip count and RNG),
    # overwrite an earlier run or start at step 0, as the plan decided.
    guard = NonFiniteGuard(optimization.max_skipped_steps)
    state = TrainState(run.batches, guard)
    checkpointer = Checkpointer(run.engine, output_dir, checkpointing.save_steps, optimization.max_steps,
                                run_record(run.plan.topology, run.plan.schedule.as_dict(), run.experiment))
    started = resume_or_start(run, checkpointer, state)
    if started:
        log(started)

    monitor = open_monitor(run, start_step=state.step)
    write_run_config(run)
    if state.step == 0:
        monitor.log_run_shape()
    evaluator = Evaluator(run, monitor, inputs.eval_steps, inputs.eval_batches)

    # Train. A step whose loss is NaN/inf on any rank is skipped on every rank (NonFiniteGuard).
    progress = tqdm(total=optimization.max_steps, initial=state.step, disable=launch.rank != 0, desc="train",
                    dynamic_ncols=True)
    note = (lambda text: progress.write(f"[train] {text}")) if launch.rank == 0 else (lambda text: None)
    began, first_step = time.monotonic(), state.step
    run.engine.train()  # from_pretrained returns a model in eval mode (no dropout, and no fused linear head)
    for step in range(state.step + 1, optimization.max_steps + 1):
        metrics = train_step(run, step, guard, monitor)
        state.step = step
        guard.raise_if_exhausted(checkpointer.last_tag)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss/total']:.4f}", tok_s=f"{metrics['perf/tokens_per_second']:.0f}")
        evaluation = evaluator.maybe_evaluate(step)
        if evaluation is not None:
            note(f"step {step}: {describe(evaluation)}")
        if checkpointer.maybe_save(state) is not None:
            note(f"step {step}: saved checkpoint {Path(output_dir, checkpointer.last_tag)}")
    progress.close()

    evaluation = evaluator.finish(optimization.max_steps)
    summary = monitor.finish(optimization.max_steps)
    if checkpointing.export_hf:
        export_hf(run.engine, checkpointing.export_hf, run.plan.tokenizer)
    for line in end_of_run(run, state.step - first_step, time.monotonic() - began, summary, evaluation,
                           checkpointer.last_tag):
        log(line)


def dry_run(config: RunConfig) -> None:
    """``--dry_run``: the start of the run of ``config`` checked for ``--world_size`` ranks in this one process,
    and what each rank will hold and send (``smmd_train.tools.dry_run``). Raises :class:`RunRefused` with the lines
    a real start would refuse with, or when the micro-batch does not fit the GPUs."""
    from .run import layout_line, log, parameters_line, prepare_run
    from .tools.dry_run import (
        build_parallel_groups,
        dry_run_launch,
        format_report,
        meta_model,
        planned_accelerator,
        report,
        start_fake_world,
        unfit,
        write_report,
    )

    Path(config.checkpointing.output_dir).mkdir(parents=True, exist_ok=True)
    launch, accelerator = dry_run_launch(config.target), planned_accelerator()

    # Plan and data as rank 0 of a real start makes them, for the job's GPUs: its refusals, in the same words.
    run = prepare_run(config, launch, until="data", accelerator=accelerator)
    for warning in run.plan.warnings:
        log(f"warning: {warning}")

    # The world on torch's fake backend (nothing is sent), the model on the meta device (no storage), and
    # DeepSpeed's process groups on them, as the engine makes them.
    start_fake_world(launch)
    model = meta_model(run)
    groups = build_parallel_groups(run, model)
    log(layout_line(run.plan.topology, launch.launcher))

    # What rank 0 holds and sends: one table, and dry_run.json.
    record = report(run, model, groups, accelerator)
    if "zero_partition" in record["parameters"]:
        log(parameters_line(record["parameters"], run.plan.topology))
    print(format_report(record), flush=True)
    log(f"report: {write_report(record, config.checkpointing.output_dir)}")
    refusal = unfit(record)
    if refusal:
        raise RunRefused(refusal)


def end_of_run(run, steps: int, seconds: float, summary: dict, evaluation, checkpoint_tag) -> list:
    """The console's end-of-run summary: what was trained, the final losses and throughput, the held-out
    metrics, and where the checkpoint, the metrics, TensorBoard and the export went."""
    from .components.evaluation import describe

    checkpointing, plan = run.config.checkpointing, run.plan
    lines = [f"done: {steps} step(s) in {seconds:.1f} s, to step {run.config.optimization.max_steps}"]
    losses = [f"{name} {summary[f'summary/final_loss_{name}']:.4f}" for name in ("total", "ce", "numeric")
              if f"summary/final_loss_{name}" in summary]
    if losses:
        lines.append("final loss: " + ", ".join(losses))
    if "summary/tokens_per_second" in summary:
        lines.append(f"throughput: {summary['summary/tokens_per_second']:,.0f} tokens/s "
                     f"({summary['summary/tokens_per_second_per_rank']:,.0f} per rank, median after warm-up); peak "
                     f"memory {summary['summary/peak_memory_gib']:.2f} GiB")
    if evaluation is not None:
        lines.append(describe(evaluation))
    if checkpoint_tag is not None:
        lines.append(f"checkpoint: {Path(checkpointing.output_dir, checkpoint_tag)} (continue with --resume)")
    lines.append(f"metrics: {Path(checkpointing.output_dir, 'metrics.jsonl')}" +
                 (f"; TensorBoard: tensorboard --logdir {plan.tensorboard_dir}" if plan.tensorboard else ""))
    if checkpointing.export_hf:
        lines.append(f"Hugging Face model: {checkpointing.export_hf}")
    return lines


def load_program() -> None:
    """Import what :func:`main` runs on: DeepSpeed, transformers, datasets and ``torch._dynamo`` with them
    (seconds, on every rank), before any process group exists."""
    from . import run  # noqa: F401
    from .distributed.groups import load_backends

    load_backends()


def cli(argv=None) -> None:
    """Run :func:`main` (:func:`dry_run` with ``--dry_run``), then shut the process group down in order; the
    exit code says how it ended (0 trained or checked, 2 refused: one line per problem on rank 0, 3 stopped
    for non-finite losses). A bad command line exits 2 from the parser, before anything heavy is imported."""
    args = parse_args(argv, description=__doc__)
    from .distributed.process_start import keep_imports, pause_collections

    # The collector off while the program imports, then what it imported frozen, here rather than inside
    # main(), whose frame holds the run (smmd_train.distributed.process_start).
    pause_collections()
    load_program()
    keep_imports()
    from .components.guard import NonFiniteLossError
    from .distributed.groups import shutdown_distributed
    from .distributed.process_end import skip_final_collections

    exit_code = 0
    try:
        config = RunConfig.from_args(args)
        if config.target.dry_run:
            dry_run(config)
        else:
            main(config)
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
        skip_final_collections()  # after the shutdown's own collection (smmd_train.distributed.process_end)
    sys.exit(exit_code)


if __name__ == "__main__":
    cli()
