"""What a training run will be, decided before any weight or batch exists: the tokenizer, the model
architecture, the resolved DeepSpeed config, the parallel layout, the numeric vocabulary, the
numeric loss, and whether the DeepSpeed ops the config needs can be compiled
(``smmd_train.preflight``). Every rank computes the same plan from the same arguments, so a bad combination
(a flag that contradicts the DeepSpeed config, a bad loss option such as ``--smmd_sigmas -1``)
raises the same error on every rank, before the model is built, and it can be checked in a single
process without a launcher.

    plan = plan_run(parse_args(argv), world_size=8, accelerator="cuda", bf16_supported=True)
    plan.topology.tp_size, plan.ds_config["train_batch_size"], plan.numeric_loss
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .autotp import check_tensor_parallel_split
from .config import (
    Topology,
    check_flags_agree,
    load_config,
    resolve_config,
    set_tensor_parallel,
    tensor_parallel_size,
    tensorboard_dir,
)
from .data import check_tokenizer_fits_model
from .model import check_local_sources, model_config
from .preflight import BuildEnvironment, check_ops, ops_to_compile
from .presets import PRESETS
from .schedule import MAX_WARMUP_FRACTION, Schedule, warmup_steps_for
from .sequence_parallel import check_sequence_parallel


@dataclass
class RunPlan:
    tokenizer: object
    model_config: object  # a transformers PretrainedConfig
    ds_config: dict  # resolved: no "auto" left
    topology: Topology
    pretrained_dir: Optional[str]  # None: a preset trained from scratch
    tensorboard: bool  # the config's tensorboard.enabled: train.py writes the run's TensorBoard events
    tensorboard_dir: str  # where (--tensorboard_dir, or the config's tensorboard output_path/job_name)
    schedule: Schedule  # the learning-rate schedule (a resumed run's: its checkpoint's, smmd_train.run)
    numeric_vocab: object  # smmd_scale.NumericVocab for the model's (padded) vocabulary
    numeric_loss: object  # the smmd_scale numeric loss on numeric_vocab (None with --framework_loss)
    numeric_weight: float  # multiplies the numeric loss (1; the deprecated --smmd_weight changes it)
    warnings: list = field(default_factory=list)

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used (``smmd_train.schedule.warmup_steps_for``)."""
        return self.schedule.warmup_steps


def numeric_loss(args, vocab):
    """The run's numeric loss from ``--numeric_loss`` (and the SMMD / NTL options), on ``vocab``:
    one loss, or their weighted sum (``smmd_scale.WeightedNumericLosses``)."""
    from smmd_scale.registry import build_numeric_loss

    return build_numeric_loss(vocab, args.numeric_loss, {
        "smmd": {"mode": args.smmd_mode, "kernel": args.smmd_kernel, "sigmas": tuple(args.smmd_sigmas),
                 "squash_factor": args.smmd_squash_factor},
        "ntl": {"reweigh": args.ntl_reweigh, "squash_factor": args.ntl_squash_factor}})


def plan_run(args, world_size: int, accelerator: str, bf16_supported: bool) -> RunPlan:
    """The plan for ``args`` (``smmd_train.arguments.parse_args``) on ``world_size`` ranks of
    ``accelerator`` (DeepSpeed's device name: "cuda", "cpu", ...)."""
    from transformers import AutoTokenizer

    import smmd_scale

    check_local_sources(args.model, args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    explicit = {name: getattr(args, name) for name in args.explicit}
    json_config = load_config(args.deepspeed_config)
    check_flags_agree(json_config, explicit)
    raw_config = set_tensor_parallel(json_config, args.tp)
    config = model_config(args.model, tokenizer, args.seq_len, args.trust_remote_code)
    check_tensor_parallel_split(config, tensor_parallel_size(raw_config))
    check_sequence_parallel(config, args.sp, args.seq_len, tensor_parallel_size(raw_config), world_size)
    warnings = [*args.deprecated, check_tokenizer_fits_model(tokenizer, config.vocab_size)]
    if args.framework_loss and args.eval_data:
        warnings.append("--eval_data is not evaluated with --framework_loss: the held-out metrics come from the "
                        "installed numeric loss, which a --framework_loss run does not have")
    ds_config, topology = resolve_config(
        raw_config, world_size=world_size, micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.lr,
        weight_decay=args.weight_decay, bf16_supported=bf16_supported, hidden_size=config.hidden_size,
        accelerator=accelerator, sp_size=args.sp)
    compiled = ops_to_compile(ds_config, accelerator)
    build_notes, build_problems = check_ops(compiled, BuildEnvironment.detect()) if compiled else ([], [])
    if build_problems:  # else deepspeed.initialize would fail on every rank, after the model was built
        raise ValueError("\n".join(build_problems))
    warnings += build_notes
    warmup_steps = warmup_steps_for(args.warmup_steps, args.max_steps)
    if args.warmup_steps is not None and warmup_steps != args.warmup_steps:  # asked for, and changed
        warnings.append(f"--warmup_steps {args.warmup_steps} -> {warmup_steps}: warmup is at least one step and at "
                        f"most {MAX_WARMUP_FRACTION:.0%} of --max_steps {args.max_steps}")
    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy=args.numeric_policy,
                                                   max_value=args.numeric_max_value, vocab_size=config.vocab_size)
    return RunPlan(tokenizer=tokenizer, model_config=config, ds_config=ds_config, topology=topology,
                   pretrained_dir=None if args.model in PRESETS else args.model,
                   tensorboard=bool((raw_config.get("tensorboard") or {}).get("enabled", False)),
                   tensorboard_dir=tensorboard_dir(raw_config, args.output_dir, explicit.get("tensorboard_dir")),
                   schedule=Schedule(ds_config.get("optimizer", {}).get("params", {}).get("lr", args.lr), warmup_steps,
                                     args.max_steps, args.min_lr_ratio), numeric_vocab=vocab,
                   numeric_loss=None if args.framework_loss else numeric_loss(args, vocab),
                   numeric_weight=args.smmd_weight, warnings=[warning for warning in warnings if warning])
