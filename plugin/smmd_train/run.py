"""A training run set up by one call, in the order that lets every bad option fail early:

    plan     tokenizer, architecture, resolved DeepSpeed config, parallel layout, numeric vocabulary
             and numeric loss (``smmd_train.plan``): no process group, no weights
    data     rank 0 tokenizes and packs into the cache first, the others then read the cache; a resume
             that would change the objective or the data is refused here (``smmd_train.checkpoint.experiment``), and
             so are data that hold no target of the numeric loss (``smmd_train.data.numeric_targets``)
    engine   the model (partitioned as it is built), ``deepspeed.initialize`` (AutoTP shards it and
             makes the LM head vocabulary-parallel), the planned numeric loss installed on the head

    launch = init_distributed()
    config = RunConfig.from_args(parse_args(argv))          # flags + DeepSpeed config (smmd_train.config.run_config)
    run = prepare_run(config, launch)                       # all of it: what launch/train.py trains
    run = prepare_run(config, Launch(0, 4, 0, 4, "single"), until="data")  # the checks alone: one process,
                                                            # no launcher (the sweep's pre-launch check, tests)

A bad option of the plan or the data raises :class:`RunRefused` (a ValueError, one line per problem)
on every rank, before any model exists. :func:`train_step` is one optimizer step of the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .checkpoint.commits import read_commit
from .checkpoint.experiment import check_resumed_experiment, experiment_record
from .checkpoint.resume import plan_resume
from .config.run_config import ModelData, RunConfig, RunRefused
from .data.numeric_targets import check_numeric_targets
from .data.packing import pack_files
from .distributed.groups import Launch, rank_zero_first
from .distributed.sequence_parallel import micro_batch_inputs, step_targets, target_counts
from .plan import RunPlan, plan_run

STAGES = ("plan", "data", "engine")


def log(*parts) -> None:
    """Print on rank 0 (or in a process without a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("[train]", *parts, flush=True)


@dataclass
class PreparedRun:
    """What :func:`prepare_run` built; the fields of the stages not run stay None."""

    config: RunConfig
    launch: Launch
    plan: RunPlan
    train_blocks: object = None  # datasets.Dataset of packed [seq_len] blocks
    eval_blocks: object = None  # the same for --eval_data, or None
    engine: object = None  # deepspeed.DeepSpeedEngine
    batches: object = None  # smmd_train.data.batches.PackedBatches: this data-parallel rank's micro-batches
    dp_rank: int = 0
    dp_group: object = None  # None: the world (with --sp: the dp x sp ranks, whose losses add up) reduces the metrics
    sp_size: int = 1  # Ulysses sequence parallelism (smmd_train.distributed.sequence_parallel): ranks per sequence
    sp_rank: int = 0  # which shard of each sequence this rank holds
    sp_group: object = None  # this rank's sequence-parallel group (None without --sp)
    sp_loss_scale: float = 1.0  # multiplies this rank's loss share before the backward (sequence_parallel)
    resume_tag: Optional[str] = None  # the committed checkpoint --resume continues (every rank's choice)
    experiment: Optional[dict] = None  # what the run trains on, for the commit markers (experiment_record)
    flops_per_token: float = 0.0  # training FLOPs per token (forward + backward)
    rank_parameters: Optional[dict] = None  # what this rank holds (smmd_train.model.build.rank_parameters)

    @property
    def micro_batch_size(self) -> int:
        return self.plan.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def accumulation(self) -> int:
        return self.plan.ds_config["gradient_accumulation_steps"]

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.accumulation * self.plan.topology.dp_size * self.config.model_data.seq_len


def prepare_run(config: RunConfig, launch: Launch, until: str = "engine", accelerator: Optional[tuple] = None
                ) -> PreparedRun:
    """Set up the run of ``config`` (``smmd_train.config.run_config.RunConfig``) on ``launch``'s ranks, up to
    and including the stage ``until`` (one of :data:`STAGES`). ``accelerator``: (DeepSpeed's device name,
    whether it computes bf16 natively) to plan for; default: this machine's (a dry run plans for the job's
    GPUs: ``smmd_train.tools.dry_run.planned_accelerator``)."""
    if until not in STAGES:
        raise ValueError(f"until={until!r} must be one of {STAGES}")
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator()
        accelerator = (device.device_name(), native_bf16(device))
    try:
        plan = plan_run(config, launch.world_size, *accelerator)
        check_tensor_parallel_within_node(plan.topology.tp_size, launch.local_size)
        run = PreparedRun(config=config, launch=launch, plan=plan, resume_tag=plan_resume(config.checkpointing, plan))
        if until == "plan":
            return run
        inputs, checkpointing = config.model_data, config.checkpointing
        run.train_blocks = _packed(inputs, plan, inputs.data)
        plan.warnings += check_numeric_targets(run.train_blocks, plan, config.optimization.seed,
                                               config.optimization.max_steps, resumed=run.resume_tag is not None)
        run.eval_blocks = _packed(inputs, plan, inputs.eval_data) if inputs.eval_data else None
        run.experiment = experiment_record(inputs, plan.loss, plan.numeric_vocab, run.train_blocks)
        if run.resume_tag is not None:
            plan.warnings += check_resumed_experiment(
                run.resume_tag, read_commit(checkpointing.output_dir, run.resume_tag), run.experiment,
                config.optimization.seed, len(run.train_blocks), checkpointing.allow_objective_change)
    except (ValueError, FileNotFoundError) as error:
        raise RunRefused(str(error)) from error
    if until == "engine":
        for warning in plan.warnings:  # before the model is built, which can take minutes
            log(f"warning: {warning}")
        _build_engine(run)
    return run


def native_bf16(accelerator) -> bool:
    """Whether the accelerator computes bf16 natively, which is when the DeepSpeed config's bf16
    ``"auto"`` turns it on. CUDA: compute capability 8.0 (Ampere) or newer; V100 and T4 report bf16 as
    supported but only emulate it, far slower than fp16 or fp32. Other accelerators: as they report."""
    if accelerator.device_name() == "cuda":
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    return bool(accelerator.is_bf16_supported())


def check_tensor_parallel_within_node(tp_size: int, ranks_per_node: int) -> None:
    """Refuse a TP degree larger than the ranks on one node: AutoTP all-reduces every layer's
    activations inside the TP group, twice per layer and direction, which across the network costs
    more than it saves."""
    if tp_size > ranks_per_node:
        raise ValueError(f"--tp {tp_size} spans nodes: this node runs {ranks_per_node} ranks, and tensor parallelism "
                         f"all-reduces every layer's activations inside its group; use --tp {ranks_per_node} or less "
                         "(data parallelism across the nodes)")


def _packed(inputs: ModelData, plan: RunPlan, paths):
    return rank_zero_first(lambda: pack_files(paths, plan.tokenizer, inputs.seq_len, text_field=inputs.text_field,
                                              num_proc=inputs.num_proc, cache_dir=inputs.cache_dir))


def build_engine(model_config, ds_config: dict, tp_size: int, seq_len: int, *, pretrained_dir: Optional[str] = None,
                 trust_remote_code: bool = False, gradient_checkpointing: bool = False, lr_scheduler=None,
                 sp_size: int = 1) -> tuple:
    """The model, partitioned over the data-parallel group as it is built or loaded, inside a
    DeepSpeed engine; returns (engine, training FLOPs per token at ``seq_len``, counted before AutoTP
    shards the model). Also what launch/export_hf.py loads an AutoTP checkpoint into. With ``sp_size``
    > 1 the model's attention runs through DeepSpeed Ulysses and ZeRO-3 gets its sequence-parallel
    layout (``smmd_train.distributed.sequence_parallel``).

    ``model.parameters()`` stays lazy so that the optimizer sees the parameters after AutoTP replaced
    the modules, in module order (an engine built the same way loads the run's checkpoints)."""
    import deepspeed
    from deepspeed.utils import groups

    from . import compat
    from .distributed.groups import destroy_at_shutdown
    from .model.build import build_model, flops_per_token, zero_init_config

    if tp_size > 1:
        compat.init_tensor_parallel_groups(tp_size)  # ZeRO-3 partitions over these groups
    model, zero_init = build_model(model_config, zero_init_config(ds_config), pretrained_dir, trust_remote_code,
                                   gradient_checkpointing)
    model_flops_per_token = flops_per_token(model, seq_len)
    mpu = groups if tp_size > 1 else None
    if sp_size > 1:
        from .distributed.sequence_parallel import UlyssesAttention

        ulysses = destroy_at_shutdown(UlyssesAttention(model, sp_size, ds_config["train_micro_batch_size_per_gpu"],
                                                       seq_len))
        mpu = ulysses.mpu
    with compat.muon_left_unimported(ds_config):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                               lr_scheduler=lr_scheduler, mpu=mpu)
    destroy_at_shutdown(engine)
    del zero_init
    return engine, model_flops_per_token


def _build_engine(run: PreparedRun) -> None:
    from deepspeed.utils import groups

    from .data.batches import PackedBatches
    from .model.build import rank_parameters

    inputs, plan, topology = run.config.model_data, run.plan, run.plan.topology
    log(layout_line(topology, run.launch.launcher))
    run.engine, run.flops_per_token = build_engine(
        plan.model_config, plan.ds_config, topology.tp_size, inputs.seq_len, pretrained_dir=plan.pretrained_dir,
        trust_remote_code=inputs.trust_remote_code,
        gradient_checkpointing=run.config.optimization.gradient_checkpointing,
        lr_scheduler=plan.schedule.scheduler(), sp_size=topology.sp_size)
    run.dp_rank = groups.get_data_parallel_rank() if topology.tp_size > 1 else dist.get_rank() // topology.sp_size
    run.dp_group = groups.get_data_parallel_group() if topology.tp_size > 1 else None
    if topology.sp_size > 1:  # the SP groups are consecutive ranks (DeepSpeed's parallel_state_sp)
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        from .distributed.sequence_parallel import shard_loss_scale

        run.sp_size, run.sp_group = topology.sp_size, parallel_state_sp.get_sequence_parallel_group()
        run.sp_rank, run.sp_loss_scale = dist.get_rank(run.sp_group), shard_loss_scale(run.engine, topology.sp_size)
    run.batches = PackedBatches(run.train_blocks, run.micro_batch_size, run.dp_rank, topology.dp_size,
                                run.config.optimization.seed, accumulation=run.accumulation)
    run.rank_parameters = rank_parameters(run.engine.module)
    log(parameters_line(run.rank_parameters, topology))
    log(f"loss: {plan.loss.install(run.engine)}")


def layout_line(topology, launcher: str) -> str:
    """The log line of the run's layout (a dry run logs the same one)."""
    return (f"world {topology.world_size} = {topology.dp_size} data-parallel x {topology.tp_size} tensor-parallel x "
            f"{topology.sp_size} sequence-parallel ({launcher})")


def parameters_line(parameters: dict, topology) -> str:
    """The log line of the parameters rank 0 holds (``smmd_train.model.build.rank_parameters``; a dry run counts the
    same two numbers)."""
    held = (f"{parameters['tensor_parallel']:,} after AutoTP (--tp {topology.tp_size})" if topology.tp_size > 1 else
            f"{parameters['tensor_parallel']:,} (no AutoTP)")
    return f"parameters on rank 0: {held}, {parameters['zero_partition']:,} in its ZeRO-3 partition"


def step_counts(run: PreparedRun, micro_batches: list) -> dict:
    """The optimizer step's counts as the loss's keyword arguments (int64 device tensors):
    ``num_items_in_batch`` (valid targets) and, where the run's loss counts numeric targets
    (``LossReporter.numeric_token_ids``), ``num_numeric_in_batch`` (numeric-target positions). The
    targets of this rank's micro-batches (``forward_inputs``: the whole micro-batch's, or this
    sequence-parallel rank's shard's) are counted before the first forward and summed over the data-
    and sequence-parallel ranks with one all-reduce of two numbers; tensor-parallel peers hold the
    same micro-batches and count the same."""
    import torch

    targets = torch.cat([step_targets(inputs).reshape(-1) for inputs in micro_batches])
    return target_counts(targets, run.plan.loss.numeric_token_ids(run.plan.numeric_vocab), run.dp_group)


def train_step(run: PreparedRun, step: int, guard, monitor) -> dict:
    """One optimizer step: its ``run.accumulation`` micro-batches fetched and counted first, then
    forward and backward (a non-finite loss on any rank is neutralised by ``guard``), the update, the
    step's metrics (``monitor``).

    Each micro-batch's loss (a sequence-parallel rank's: its shard's) is its share of the step's
    objective (``sum CE / n_valid + weight * sum numeric / n_numeric`` over the whole step on every
    DP and SP rank, :func:`step_counts`), so the step trains the same objective for any micro-batch,
    accumulation, DP, TP or SP layout. DeepSpeed divides what ``backward`` gets by the accumulation
    steps and averages gradients over the ranks it reduces over (DP, and SP on ZeRO-3's
    reduce-scatter path); the share is multiplied back so that the gradient is the objective's."""
    engine, loss_reporter = run.engine, run.plan.loss
    began, learning_rate = time.perf_counter(), engine.get_lr()[0]  # the rate this step's update uses
    micro_batches = [micro_batch_inputs(next(run.batches), engine.device, run.sp_rank, run.sp_size, run.sp_group)
                     for _ in range(run.accumulation)]
    counts = {}
    if loss_reporter.counts_steps(run.plan.topology.tp_size):
        counting = time.perf_counter()
        counts = step_counts(run, micro_batches)
        monitor.record_step_counts(int(counts["num_items_in_batch"]), int(counts.get("num_numeric_in_batch", 0)),
                                   time.perf_counter() - counting)
    # DeepSpeed divides by the accumulation steps and averages over the ranks it reduces over.
    unscale = run.accumulation * run.plan.topology.dp_size * run.sp_loss_scale if counts else 1
    bounds = loss_reporter.exchange_bounds(micro_batches, run.plan.topology.tp_size, run.plan.numeric_vocab)
    monitor.record_exchange_bounds(bounds)
    for inputs, bound in zip(micro_batches, bounds):
        loss_reporter.bound_next_exchange(bound)
        loss = engine(**inputs, **counts).loss
        engine.backward(guard.checked(loss) * unscale)
        engine.step()
        loss_reporter.record_micro_batch(monitor, loss)
    loss_reporter.bound_next_exchange(None)  # (an evaluation's forward is not bounded by a training micro-batch)
    guard.end_step(engine.was_step_applied())
    return monitor.end_step(step, time.perf_counter() - began, run.tokens_per_step, learning_rate,
                            skipped_steps=guard.total_skips)


def open_monitor(run: PreparedRun, start_step: int = 0):
    """The run's :class:`~smmd_train.monitor.training.TrainingMonitor` (metrics.jsonl, TensorBoard, HParams),
    for a run that continues from ``start_step`` (a resumed checkpoint's step; 0 from scratch)."""
    from .monitor.dashboards import run_hparams
    from .monitor.training import TrainingMonitor

    plan, topology = run.plan, run.plan.topology
    return TrainingMonitor(run.engine, world_size=topology.world_size, tp_size=topology.tp_size,
                           dp_size=topology.dp_size, sp_size=topology.sp_size, dp_group=run.dp_group,
                           flops_per_token=run.flops_per_token,
                           metrics_path=str(Path(run.config.checkpointing.output_dir, "metrics.jsonl")),
                           tensorboard_dir=plan.tensorboard_dir if plan.tensorboard else None,
                           hparams=run_hparams(run.config, plan, run.launch.launcher),
                           start_step=start_step)


def write_run_config(run: PreparedRun) -> None:
    """``<output_dir>/run_config.json`` on rank 0: how the run was built (launch/export_hf.py reads it)."""
    if dist.get_rank() != 0:
        return
    plan, topology = run.plan, run.plan.topology
    Path(run.config.checkpointing.output_dir, "run_config.json").write_text(json.dumps(
        {"args": dict(run.config.command_line), "deepspeed_config": plan.ds_config,
         "world_size": topology.world_size, "tp_size": topology.tp_size, "dp_size": topology.dp_size,
         "sp_size": topology.sp_size, "launcher": run.launch.launcher, "rank_parameters": run.rank_parameters,
         "tensorboard_dir": plan.tensorboard_dir, "model_config": run.engine.module.config.to_dict(),
         "numeric_vocab": repr(plan.numeric_vocab)}, indent=1, default=str))
