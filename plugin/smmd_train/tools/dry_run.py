r"""A dry run (``train.py --dry_run``): the start of a job at its real world size, checked in one process
on one machine before the cluster is booked, and what each of its ranks will hold and send.

    python launch/train.py --dry_run --world_size 512 --gpus_per_node 8 --deepspeed_config ds_configs/zero3.json \
        --tp 8 --model 70b --tokenizer /data/tok --data /data/corpus.jsonl --seq_len 4096 --max_steps 10000 ...
    NUM_NODES=64 GPUS_PER_NODE=8 MODEL=70b TP=8 ... bash launch/pretrain.sh --dry_run

What runs is what a real start runs before its first step, less what needs the GPUs' memory or the
network (``smmd_train.train.dry_run`` reads top to bottom):

* the plan and the data, by the real start's own code (``smmd_train.run.prepare_run(until="data")``) for
  ``--world_size`` ranks: every refusal of a real start (batch arithmetic, TP x SP x DP = world, heads,
  the DeepSpeed config, the tokenizer, the data in the user's files, the resume plan against
  ``--output_dir``) in the same words, and the same warnings. The data are packed into the cache the
  job then reads, as rank 0 of a real start packs them;
* the world: torch's fake process group (``init_process_group("fake")``, public in torch 2.13: it takes
  every collective and sends nothing) with this process as rank 0; DeepSpeed builds AutoTP's tensor-
  and data-parallel groups (a device mesh) or Ulysses' sequence-parallel groups on it as a real start
  does;
* the model on the meta device: the architecture the job builds (``from_config``: a preset's config, or
  the local model's), shapes without storage.

Then, for rank 0, which holds the largest share where heads, widths or the vocabulary split unevenly:

* parameters after AutoTP and in the ZeRO-3 partition, exactly: ``smmd_train.model.presets.rank_numel`` on
  the meta model's parameters, each split by ZeRO-3 into equal parts (the last padded) over the world /
  TP data-parallel ranks, or over the world for one AutoTP leaves whole; a real run logs and records the
  same two numbers (``smmd_train.model.build.rank_parameters``);
* memory: the planner's estimate (``smmd_train.tools.memory.estimate``: ZeRO-3 model states, activations,
  logits and loss buffers) against ``--gpu_memory_gib``, and the largest micro-batch that fits with and
  without ``--fused_linear``; a micro-batch that does not fit is refused;
* what it sends per optimizer step. The loss: one packed all-reduce per micro-batch over its TP group
  (``smmd_scale.parallel``: a header, per-token log-sum-exp pieces and target logits, ``[capacity, N]``
  numeric rows; a second round when a micro-batch has more numeric positions than the capacity, which
  then grows), counted on the micro-batches rank 0 trains in the first :data:`COUNTED_STEPS` steps of
  the data order, so it equals what the job logs as ``comm/loss_bytes`` (an evaluation in between
  may grow the capacity earlier); with ``--fused_linear`` also the head's ``d hidden`` all-reduce in
  backward (``comm/loss_backward_bytes``). The step's count all-reduce (two int64). ZeRO-3, from the
  parameter counts, per micro-batch: the all-gather of the parameters in forward and backward (and in
  the recomputation with ``--gradient_checkpointing``; parameters up to the persistence threshold stay
  gathered), an upper bound (ZeRO-3 keeps a parameter between its forward and backward use when its
  reuse distance allows), and the reduce-scatter of the gradients;
* the checkpoint: per rank and for the job, the optimizer states (fp32 master weights and Adam's two
  moments of each partition; the model-state files of ZeRO-3 hold no weights), and the universal
  checkpoint that a resume under another layout converts it into (the same per parameter, whole).

The report is one table on rank 0 and ``<output_dir>/dry_run.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from smmd_cli.tables import markdown_table

from smmd_scale.parallel import CAPACITY_HEADROOM, CAPACITY_ROUNDING, HEADER_FIELDS, WORD_BYTES

from ..config.run_config import Target
from ..distributed.groups import Launch, destroy_at_shutdown

REPORT_FILE = "dry_run.json"
COUNTED_STEPS = 20  # the first optimizer steps whose loss exchange the report counts on the data
OPTIMIZER_STATE_BYTES = 12  # per partitioned element: the fp32 master weight and Adam's two fp32 moments
COUNTS_BYTES = 16  # the step's count all-reduce: valid and numeric targets, two int64
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed 0.19's default stage3_param_persistence_threshold
GIB, MIB, KIB = 2**30, 2**20, 2**10


def dry_run_launch(target: Target) -> Launch:
    """Rank 0 of the job that ``target`` (``--world_size``, ``--gpus_per_node``) describes."""
    return Launch(rank=0, world_size=target.world_size, local_rank=0, local_size=target.gpus_per_node,
                  launcher="dry run")


def planned_accelerator() -> tuple:
    """(DeepSpeed's device name, native bf16) of the job's GPUs: DeepSpeed's accelerator as a real start
    detects it (``DS_ACCELERATOR`` chooses it; on a machine without GPUs, such as a login node, DeepSpeed
    picks the CPU: set ``DS_ACCELERATOR=cuda`` there), with bf16 decided as a real start decides it
    where such a device is present here, else assumed native (Ampere or newer)."""
    from deepspeed.accelerator import get_accelerator

    from ..run import native_bf16

    accelerator = get_accelerator()
    name = accelerator.device_name()
    if name == "cpu" or accelerator.is_available():
        return name, native_bf16(accelerator)
    return name, True


def start_fake_world(launch: Launch) -> None:
    """The default process group as rank 0 of ``launch.world_size`` on torch's fake backend, and DeepSpeed's
    communication on it: every collective returns at once and sends nothing."""
    import deepspeed

    from ..distributed.groups import load_backends

    load_backends()  # as a real start: torch._dynamo imported before the default group exists
    dist.init_process_group(dist.Backend.FAKE, rank=launch.rank, world_size=launch.world_size)
    deepspeed.init_distributed(dist_backend=dist.Backend.FAKE, auto_mpi_discovery=False)


def meta_model(run):
    """The model ``run`` (``smmd_train.run.PreparedRun``) builds, on the meta device (no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(run.plan.model_config, dtype=torch.float32,
                                                trust_remote_code=run.config.model_data.trust_remote_code)


def build_parallel_groups(run, model) -> dict:
    """DeepSpeed's groups of the job on the fake world, made as a real start makes them
    (``smmd_train.run.build_engine``): AutoTP's tensor- and data-parallel groups, or Ulysses'
    sequence-parallel groups around ``model``'s attention; returns their sizes as DeepSpeed gives them."""
    topology = run.plan.topology
    sizes = {"tensor_parallel": 1, "data_parallel": topology.world_size // topology.sp_size, "sequence_parallel": 1}
    if topology.tp_size > 1:
        from deepspeed.utils import groups

        from .. import compat

        compat.init_tensor_parallel_groups(topology.tp_size)
        sizes.update(tensor_parallel=dist.get_world_size(groups.get_tensor_model_parallel_group()),
                     data_parallel=dist.get_world_size(groups.get_data_parallel_group()))
    if topology.sp_size > 1:
        from ..distributed.sequence_parallel import UlyssesAttention

        ulysses = destroy_at_shutdown(UlyssesAttention(model, topology.sp_size, run.micro_batch_size,
                                                       run.config.model_data.seq_len))
        sizes["sequence_parallel"] = dist.get_world_size(ulysses.group)
    return sizes


def report(run, model, groups: dict, accelerator: tuple) -> dict:
    """What rank 0 of ``run`` (``smmd_train.run.PreparedRun``, its plan and data) will hold and send, from
    ``model`` (:func:`meta_model`); ``groups``: :func:`build_parallel_groups`; ``accelerator``: what the plan
    was made for (:func:`planned_accelerator`). Sizes in bytes."""
    plan, topology, target = run.plan, run.plan.topology, run.config.target
    record = {"world_size": topology.world_size, "tp_size": topology.tp_size, "dp_size": topology.dp_size,
              "sp_size": topology.sp_size, "nodes": topology.world_size // target.gpus_per_node,
              "gpus_per_node": target.gpus_per_node, "gpu_memory_gib": target.gpu_memory_gib,
              "accelerator": accelerator[0], "bf16": model_dtype(plan.ds_config) == torch.bfloat16,
              "groups": groups,
              "micro_batch_size": run.micro_batch_size, "gradient_accumulation_steps": run.accumulation,
              "global_batch_size": plan.ds_config["train_batch_size"], "tokens_per_step": run.tokens_per_step,
              "seq_len": run.config.model_data.seq_len, "max_steps": run.config.optimization.max_steps,
              "packed_blocks": len(run.train_blocks), "resume_tag": run.resume_tag,
              "deepspeed_config": plan.ds_config, "warnings": list(plan.warnings)}
    try:
        layout = partitioned_parameters(model, plan.model_config, topology)
    except ValueError as error:  # a model type whose AutoTP split is not known here
        layout, record["not_counted"] = None, str(error)
    record["parameters"] = parameters(model, layout)
    record["memory"] = memory(run)
    record["loss_exchange"] = loss_exchange(run)
    record["step_counts"] = ({"calls_per_step": 1, "bytes_per_step": COUNTS_BYTES,
                              "ranks": topology.dp_size * topology.sp_size}
                             if plan.loss.counts_steps(topology.tp_size) else None)
    record["zero3"] = zero3_traffic(run, layout) if layout else None
    record["checkpoint"] = checkpoint_sizes(layout, record["parameters"], topology.world_size) if layout else None
    return record


def partitioned_parameters(model, config, topology) -> list:
    """Per parameter of ``model`` (a tied head once): (its elements on each tensor-parallel rank after AutoTP,
    ``smmd_train.model.presets.rank_numel``; the ranks ZeRO-3 splits it over). A parameter AutoTP shards is split
    over its world / TP data-parallel ranks; one it leaves whole (norms, an untied embedding) keeps the
    split ``zero.Init`` gave it as the model was built, over the whole world
    (``smmd_train.model.build.rank_parameters``). ValueError for a model whose modules the AutoTP split is not
    known for."""
    from ..model.presets import rank_numel

    tp_size, world_size = topology.tp_size, topology.world_size
    layout = []
    for name, parameter in model.named_parameters():
        shares = tuple(rank_numel(name, tuple(parameter.shape), config, tp_size, rank) for rank in range(tp_size))
        layout.append((shares, world_size // tp_size if shares[0] != parameter.numel() else world_size))
    return layout


def parameters(model, layout: Optional[list]) -> dict:
    """The model's parameters and, from ``layout`` (:func:`partitioned_parameters`; None: not known), rank 0's
    ``tensor_parallel`` and ``zero_partition`` elements: :func:`smmd_train.model.build.rank_parameters`' numbers."""
    counts = {"model": sum(parameter.numel() for parameter in model.parameters())}
    if layout is not None:
        counts.update(tensor_parallel=sum(shares[0] for shares, _ in layout),
                      zero_partition=sum(-(-shares[0] // ranks) for shares, ranks in layout))
    return counts


def memory(run) -> dict:
    """The memory planner's estimate for rank 0 of ``run`` (``smmd_train.tools.memory.estimate``) and the largest
    micro-batch that fits with materialized logits and with ``--fused_linear``; ``not_estimated`` (the
    reason) for a model the planner does not count."""
    from .memory import estimate, largest_micro_batch

    plan, topology, target, config = run.plan, run.plan.topology, run.config.target, run.config
    zero = plan.ds_config.get("zero_optimization") or {}
    setup = dict(nodes=topology.world_size // target.gpus_per_node, gpus_per_node=target.gpus_per_node,
                 tp_size=topology.tp_size, sp_size=topology.sp_size, seq_len=config.model_data.seq_len,
                 offload=any(str((zero.get(key) or {}).get("device", "none")) != "none"
                             for key in ("offload_param", "offload_optimizer")),
                 micro_batch=run.micro_batch_size, gradient_checkpointing=config.optimization.gradient_checkpointing,
                 flash_attention=True, gpu_memory_gib=target.gpu_memory_gib, fused_linear=config.loss.fused_linear)
    try:
        estimated = estimate(plan.model_config, **setup)
        largest = {key: largest_micro_batch(plan.model_config, **{**setup, "fused_linear": key == "fused_linear"})
                   for key in ("materialized", "fused_linear")}
    except ValueError as error:
        return {"not_estimated": str(error)}
    return {**estimated, "largest_micro_batch": largest}


def model_dtype(ds_config: dict) -> torch.dtype:
    """The dtype the engine trains the model in (its parameters, activations and logits)."""
    for section, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds_config.get(section) or {}).get("enabled"):
            return dtype
    return torch.float32


def _words(numel: int, dtype: torch.dtype) -> int:
    """int32 words of a section of the exchange's packed buffer (``smmd_scale.parallel``): on 8 bytes."""
    words = -(-numel * dtype.itemsize // WORD_BYTES)
    return words + words % 2


def exchange_bytes(tokens: int, tp_size: int, numeric_size: int, capacity: int, logits_dtype: torch.dtype,
                   lse_slots: int = 2) -> int:
    """Bytes of the loss's packed all-reduce for one micro-batch of ``tokens`` positions (``smmd_scale.
    parallel.exchange``): the int64 header ``[TP, HEADER_FIELDS]``, the fp32 log-sum-exp slots ``[tokens,
    TP, lse_slots]`` (3 with label smoothing), the target logits ``[tokens]`` and ``capacity`` numeric rows
    ``[capacity, N]`` in the logits' dtype."""
    words = (_words(tp_size * HEADER_FIELDS, torch.int64) + _words(tokens * tp_size * lse_slots, torch.float32)
             + _words(tokens, logits_dtype) + _words(capacity * numeric_size, logits_dtype))
    return words * WORD_BYTES


def grown_capacity(numeric_positions: int) -> int:
    """The exchange's numeric rows after a micro-batch with ``numeric_positions`` more than it had
    (``smmd_scale.parallel``: 1/8 headroom, rounded up to a multiple of 8)."""
    rows = math.ceil(numeric_positions * CAPACITY_HEADROOM)
    return -(-rows // CAPACITY_ROUNDING) * CAPACITY_ROUNDING


def loss_exchange(run, steps: int = COUNTED_STEPS) -> Optional[dict]:
    """The loss's collectives of rank 0 in the first ``steps`` optimizer steps (at most ``--max_steps``),
    on the micro-batches it trains (``smmd_train.data.batches.PackedBatches`` of its data-parallel rank 0):
    ``bytes_per_step`` (the forward exchange: ``comm/loss_bytes``), ``backward_bytes_per_step`` (the fused
    head's, ``comm/loss_backward_bytes``), ``calls_per_step`` and the final ``capacity``. None for the
    model's own loss (``--framework_loss``, not counted). Without tensor parallelism the loss sends nothing
    (0 bytes), but a number-level loss under ``--sp`` sums the numbers that a shard boundary cuts over the
    sequence-parallel group (``not_counted``)."""
    from ..data.batches import PackedBatches
    from ..distributed.sequence_parallel import local_target_counts, micro_batch_inputs, step_targets

    plan, topology, config = run.plan, run.plan.topology, run.config
    if plan.numeric_loss is None:
        return None
    steps = min(steps, config.optimization.max_steps)
    record = {"steps": steps, "calls_per_step": 0, "bytes_per_step": [0] * steps,
              "backward_bytes_per_step": [0] * steps, "capacity": 0, "numeric_size": len(plan.numeric_vocab),
              "tokens_per_micro_batch": 0}
    if topology.tp_size == 1:
        if topology.sp_size > 1 and any(name == "ntl-number" for name, _ in plan.loss.terms()):
            record["not_counted"] = "ntl-number's sums over the sequence-parallel group of the numbers a shard cuts"
        return record
    dtype, tokens = model_dtype(plan.ds_config), run.micro_batch_size * config.model_data.seq_len
    lse_slots = 3 if config.loss.label_smoothing else 2
    backward = tokens * plan.model_config.hidden_size * torch.float32.itemsize if config.loss.fused_linear else 0
    batches = PackedBatches(run.train_blocks, run.micro_batch_size, 0, topology.dp_size, config.optimization.seed,
                            accumulation=run.accumulation)
    capacity, calls, per_step = 0, [], []
    for _ in range(steps):
        sent, rounds = 0, 0
        for _ in range(run.accumulation):
            targets = step_targets(micro_batch_inputs(next(batches), "cpu"))
            positions = int(local_target_counts(targets, plan.numeric_vocab.token_ids)[1])
            sent += exchange_bytes(tokens, topology.tp_size, len(plan.numeric_vocab), capacity, dtype, lse_slots)
            rounds += 1
            if positions > capacity:  # every rank of the group learns it from the header: a second round
                capacity = grown_capacity(positions)
                sent += _words(capacity * len(plan.numeric_vocab), dtype) * WORD_BYTES
                rounds += 1
        per_step.append(sent)
        calls.append(rounds)
    record.update(calls_per_step=max(calls), bytes_per_step=per_step, capacity=capacity,
                  backward_bytes_per_step=[backward * run.accumulation] * steps, tokens_per_micro_batch=tokens)
    return record


def zero3_traffic(run, layout: list) -> dict:
    """ZeRO-3's collectives per optimizer step on rank 0, from ``layout`` (:func:`partitioned_parameters`):
    per micro-batch, the all-gather of every parameter above the persistence threshold in forward and
    backward (and in the recomputation with gradient checkpointing), an upper bound, and the reduce-scatter
    of every gradient, in the config's ``communication_data_type`` (else the model's dtype). Bytes are what
    rank 0 receives (all-gather) and sends (reduce-scatter): (ranks - 1) / ranks of each parameter, padded
    to its ranks."""
    plan = run.plan
    zero = plan.ds_config.get("zero_optimization") or {}
    threshold = int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))
    passes = 3 if run.config.optimization.gradient_checkpointing else 2

    def moved(numel: int, ranks: int) -> float:
        return -(-numel // ranks) * (ranks - 1)

    gathered = sum(moved(shares[0], ranks) for shares, ranks in layout if shares[0] > threshold)
    reduced = sum(moved(shares[0], ranks) for shares, ranks in layout)
    parameter_bytes = model_dtype(plan.ds_config).itemsize
    communication = {"fp32": 4, "fp16": 2, "bf16": 2}.get(str(plan.ds_config.get("communication_data_type")).lower(),
                                                          parameter_bytes)
    return {"passes_per_micro_batch": passes, "persistence_threshold": threshold,
            "all_gather_bytes": run.accumulation * passes * gathered * parameter_bytes,
            "reduce_scatter_bytes": run.accumulation * reduced * communication,
            "gradient_bytes_per_element": communication}


def checkpoint_sizes(layout: list, counts: dict, world_size: int) -> dict:
    """The checkpoint's optimizer states (:data:`OPTIMIZER_STATE_BYTES` per element of each ZeRO-3 partition)
    on rank 0 and over the job (every partition of every TP rank's share; a parameter AutoTP leaves whole
    is split over the world once), from ``layout`` (:func:`partitioned_parameters`) and ``counts``
    (:func:`parameters`), and the universal checkpoint's (the same per element of each whole parameter)."""
    job = 0
    for shares, ranks in layout:
        held = shares if ranks < world_size else shares[:1]
        job += sum(-(-numel // ranks) * ranks for numel in held)
    return {"rank_bytes": OPTIMIZER_STATE_BYTES * counts["zero_partition"], "job_bytes": OPTIMIZER_STATE_BYTES * job,
            "universal_bytes": OPTIMIZER_STATE_BYTES * counts["model"]}


def unfit(record: dict) -> Optional[str]:
    """The refusal of a micro-batch that does not fit the GPUs (``record``: :func:`report`), else None."""
    estimated = record["memory"]
    if estimated.get("verdict") != "does not fit":
        return None
    largest = estimated["largest_micro_batch"]
    fitting = (f"the largest that fits is {largest['materialized']} ({largest['fused_linear']} with --fused_linear)"
               if any(largest.values()) else "not even 1 sequence fits, with --fused_linear either: see "
               "launch/estimate.py (smmd-estimate) for what would (--gradient_checkpointing, more --tp, offload)")
    return (f"--micro_batch_size {record['micro_batch_size']} does not fit in {record['gpu_memory_gib']:g} GiB GPUs "
            f"(--gpu_memory_gib): an estimated {_gib(estimated['total_gpu_bytes'])} per GPU (model states "
            f"{_gib(estimated['model_states_gpu_bytes'])}, activations {_gib(estimated['activation_bytes'])}, "
            f"logits and loss {_gib(estimated['logits_and_loss_bytes'])}); {fitting}")


def write_report(record: dict, output_dir: str) -> Path:
    """``<output_dir>/dry_run.json``: ``record`` with a rounded ``*_gib`` beside every ``*_bytes``."""
    from .memory import with_gib

    path = Path(output_dir, REPORT_FILE)
    path.write_text(json.dumps(with_gib(record), indent=1, default=str))
    return path


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def _size(num_bytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _count(number: int) -> str:
    return f"{number / 1e9:.2f} B" if number >= 1e9 else f"{number / 1e6:.2f} M" if number >= 1e6 else f"{number:,}"


def format_report(record: dict) -> str:
    """The dry run's table (Markdown, ``smmd_cli.tables``) and the line above it."""
    sequences = record["global_batch_size"]
    epochs = sequences / record["packed_blocks"] * record["max_steps"]
    lines = [f"{record['nodes']} node{'s' * (record['nodes'] > 1)} x {record['gpus_per_node']} GPUs of "
             f"{record['gpu_memory_gib']:g} GiB ({record['accelerator']}, {'bf16' if record['bf16'] else 'fp32'}); "
             f"micro-batch {record['micro_batch_size']} x accumulation {record['gradient_accumulation_steps']} x "
             f"DP {record['dp_size']} = {sequences:,} sequence{'s' * (sequences > 1)} of {record['seq_len']:,} "
             f"tokens ({record['tokens_per_step']:,} tokens) per step; {record['max_steps']:,} steps = "
             f"{epochs:,.{2 if epochs < 10 else 0}f} epochs of {record['packed_blocks']:,} packed blocks; "
             + (f"resumes {record['resume_tag']}" if record["resume_tag"] else "starts at step 0"), ""]
    rows = [_parameters_row(record), *_memory_rows(record["memory"], record["micro_batch_size"], record["seq_len"]),
            *_traffic_rows(record)]
    if record["checkpoint"]:
        checkpoint = record["checkpoint"]
        rows.append({"what": "checkpoint (optimizer states: fp32 weights, Adam moments)",
                     "rank": _size(checkpoint["rank_bytes"]),
                     "job": f"{_size(checkpoint['job_bytes'])}; universal: {_size(checkpoint['universal_bytes'])}"})
    lines.append(markdown_table(rows, [("what", "", ""), ("rank", "rank 0", ""), ("job", "job", "")]))
    lines += ["", "not counted: AutoTP's all-reduces of the activations (each row-parallel projection's output in "
              "forward, each column-parallel one's input gradient in backward), Ulysses' all-to-alls, the "
              "optimizer step's gradient-norm all-reduce, the monitor's per-step metrics"]
    return "\n".join(lines)


def _parameters_row(record: dict) -> dict:
    counts, tp = record["parameters"], record["tp_size"]
    if "tensor_parallel" not in counts:
        return {"what": "parameters", "rank": f"not counted: {record['not_counted']}", "job": _count(counts["model"])}
    held = f"after AutoTP (TP {tp})" if tp > 1 else "(no AutoTP)"
    return {"what": "parameters", "job": _count(counts["model"]),
            "rank": f"{_count(counts['tensor_parallel'])} {held}, {_count(counts['zero_partition'])} in its ZeRO-3 "
                    "partition"}


def _memory_rows(estimated: dict, micro_batch: int, seq_len: int) -> list:
    if "not_estimated" in estimated:
        return [{"what": "memory", "rank": f"not estimated: {estimated['not_estimated']}"}]
    largest = estimated["largest_micro_batch"]
    return [{"what": "model states (ZeRO-3, DeepSpeed's estimator)", "rank": _gib(estimated["model_states_gpu_bytes"]),
             "job": f"{_gib(estimated['model_states_cpu_per_node_bytes'])} CPU memory per node"},
            {"what": f"activations (micro-batch {micro_batch} x {seq_len:,} tokens)",
             "rank": _gib(estimated["activation_bytes"])},
            {"what": "logits + loss buffers", "rank": _gib(estimated["logits_and_loss_bytes"])},
            {"what": "GPU memory", "rank": f"{_gib(estimated['total_gpu_bytes'])}: {estimated['verdict']} in "
             f"{estimated['setup']['gpu_memory_gib']:g} GiB"},
            {"what": "largest micro-batch that fits", "rank": f"{largest['materialized']}; {largest['fused_linear']} "
             "with --fused_linear"}]


def _traffic_rows(record: dict) -> list:
    rows, exchange = [], record["loss_exchange"]
    if exchange is None:
        rows.append({"what": "loss exchange", "rank": "the model's own loss (--framework_loss): not counted"})
    elif record["tp_size"] == 1:
        rows.append({"what": "loss exchange", "rank": "none: no tensor parallelism, each rank has whole logits"
                     + (f" (not counted: {exchange['not_counted']})" if "not_counted" in exchange else "")})
    else:
        sent = sorted(exchange["bytes_per_step"])
        rows.append({"what": f"loss exchange (1 all-reduce per micro-batch, 2 where the numeric rows grow; "
                             f"{record['tp_size']} TP ranks)",
                     "rank": f"{_size(sent[len(sent) // 2])} per step (median of steps 1-{exchange['steps']}, most "
                             f"{_size(sent[-1])}; numeric rows {exchange['capacity']:,} x "
                             f"{exchange['numeric_size']:,})"})
        if any(exchange["backward_bytes_per_step"]):
            rows.append({"what": "fused head's backward all-reduce (d hidden)",
                         "rank": f"{_size(exchange['backward_bytes_per_step'][0])} per step"})
    if record["step_counts"]:
        rows.append({"what": "step counts all-reduce (2 x int64)",
                     "rank": f"{record['step_counts']['bytes_per_step']} B per step over "
                             f"{record['step_counts']['ranks']:,} rank{'s' * (record['step_counts']['ranks'] > 1)}"})
    if record["zero3"]:
        zero3 = record["zero3"]
        passes = "forward + backward" + (" + recomputation" if zero3["passes_per_micro_batch"] == 3 else "")
        rows += [{"what": f"ZeRO-3 all-gather of parameters ({passes}, at most)",
                  "rank": f"{_size(zero3['all_gather_bytes'])} per step"},
                 {"what": f"ZeRO-3 reduce-scatter of gradients ({zero3['gradient_bytes_per_element']} B each)",
                  "rank": f"{_size(zero3['reduce_scatter_bytes'])} per step"}]
    return rows
