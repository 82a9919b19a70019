"""What a training run will be, decided before any weight or batch exists: the tokenizer, the model
architecture, the resolved DeepSpeed config, the parallel layout, the numeric vocabulary, the
numeric loss, and whether the DeepSpeed ops the config needs can be compiled
(``smmd_train.distributed.preflight``). Every rank computes the same plan from the same arguments, so a bad combination
(a layout the model cannot split, a bad loss option such as ``--smmd_sigmas -1``, a loss that reads
digits on a tokenizer that writes numbers as multi-digit tokens: ``smmd_train.data.numeric_targets``)
raises the same error on every rank, before the model is built, and it can be checked in a single
process without a launcher.

    plan = plan_run(RunConfig.from_args(parse_args(argv)), world_size=8, accelerator="cuda", bf16_supported=True)
    plan.topology.tp_size, plan.ds_config["train_batch_size"], plan.numeric_loss
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from smmd_scale.refusal import Refusal
from smmd_scale.registry import LossOptionError

from .components.loss_reporter import LossReporter, loss_reporter
from .components.schedule import MAX_WARMUP_FRACTION, Schedule, warmup_steps_for
from .config.arguments import VOCAB_FLAGS
from .config.deepspeed import Topology, check_tensor_parallel_world, resolve_config
from .config.run_config import RunConfig
from .data.numeric_targets import check_digit_losses
from .data.packing import check_tokenizer_fits_model
from .distributed.preflight import BuildEnvironment, check_ops, ops_to_compile
from .distributed.sequence_parallel import check_sequence_parallel
from .model.autotp import check_tensor_parallel_split
from .model.build import check_local_sources, model_config
from .model.presets import PRESETS


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
    loss: LossReporter  # the loss the run trains on (smmd_train.components.loss_reporter), its numeric loss built
    warnings: list = field(default_factory=list)

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used (``smmd_train.components.schedule.warmup_steps_for``)."""
        return self.schedule.warmup_steps

    @property
    def numeric_loss(self):
        """The smmd_scale numeric loss on ``numeric_vocab`` that the run installs (None: the model's own loss)."""
        return self.loss.numeric_loss


def refuse_together(*checks) -> None:
    """Run every check (a callable that raises ValueError, one line per problem) and raise one
    ValueError with all their lines: a layout with two problems names both at once."""
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("\n".join(problems))


def context_warning(config, seq_len: int) -> Optional[str]:
    """A warning when ``--seq_len`` is longer than the positions the model ``config`` was built for."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        return (f"--seq_len {seq_len} is longer than the model's max_position_embeddings={limit}: it was not trained "
                f"on positions past {limit} (rotary positions extrapolate poorly, learned ones fail); use --seq_len "
                f"{limit} or less, or a model (or rope_scaling in its config.json) with a longer context")
    return None


def plan_run(config: RunConfig, world_size: int, accelerator: str, bf16_supported: bool) -> RunPlan:
    """The plan for ``config`` (``smmd_train.config.run_config.RunConfig``) on ``world_size`` ranks of
    ``accelerator`` (DeepSpeed's device name: "cuda", "cpu", ...)."""
    from transformers import AutoTokenizer

    import smmd_scale
    from smmd_scale.vocab import dot_token_ids

    inputs, optimization, loss_settings = config.model_data, config.optimization, config.loss
    check_local_sources(inputs.model, inputs.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(inputs.tokenizer or inputs.model,
                                              trust_remote_code=inputs.trust_remote_code)
    model = model_config(inputs.model, tokenizer, inputs.seq_len, inputs.trust_remote_code)
    tp_size, sp_size = config.layout.tp, config.layout.sp
    refuse_together(lambda: check_tensor_parallel_split(model, tp_size),
                    lambda: check_tensor_parallel_world(tp_size, world_size),
                    lambda: check_sequence_parallel(model, sp_size, inputs.seq_len, tp_size, world_size))
    warnings = [check_tokenizer_fits_model(tokenizer, model.vocab_size),
                context_warning(model, inputs.seq_len)]
    ds_config, topology = resolve_config(
        config.deepspeed_dict(), world_size=world_size, micro_batch_size=optimization.micro_batch_size,
        gradient_accumulation_steps=optimization.gradient_accumulation_steps, learning_rate=optimization.lr,
        weight_decay=optimization.weight_decay, bf16_supported=bf16_supported, hidden_size=model.hidden_size,
        accelerator=accelerator, sp_size=sp_size)
    compiled = ops_to_compile(ds_config, accelerator)
    build_notes, build_problems = check_ops(compiled, BuildEnvironment.detect()) if compiled else ([], [])
    if build_problems:  # else deepspeed.initialize would fail on every rank, after the model was built
        raise ValueError("\n".join(build_problems))
    warnings += build_notes
    warmup_steps = warmup_steps_for(optimization.warmup_steps, optimization.max_steps)
    if optimization.warmup_steps is not None and warmup_steps != optimization.warmup_steps:  # asked for, and changed
        warnings.append(f"--warmup_steps {optimization.warmup_steps} -> {warmup_steps}: warmup is at least one step "
                        f"and at most {MAX_WARMUP_FRACTION:.0%} of --max_steps {optimization.max_steps}")
    loss = loss_reporter(config)
    # before the vocabulary: under --numeric_policy integers the loss would refuse a Llama-3-style tokenizer's
    # 0..999 without saying that --numeric_policy digits leaves it (nearly) no target there
    warnings += check_digit_losses(loss.terms(), tokenizer, loss_settings.numeric_policy)
    try:
        vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer, policy=loss_settings.numeric_policy,
                                                       max_value=loss_settings.numeric_max_value,
                                                       vocab_size=model.vocab_size)
        if loss_settings.numeric_values == "shuffled":  # the value-structure control
            vocab = vocab.shuffled(loss_settings.numeric_values_seed)
        warnings += loss.plan(vocab, dot_token_ids(tokenizer), model.vocab_size)
    except ValueError as error:  # the vocabulary's refusal, or a loss's, in the words of train.py's flags
        raise ValueError(error.worded(VOCAB_FLAGS) if isinstance(error, (Refusal, LossOptionError)) else str(error)) \
            from None
    return RunPlan(tokenizer=tokenizer, model_config=model, ds_config=ds_config, topology=topology,
                   pretrained_dir=None if inputs.model in PRESETS else inputs.model,
                   tensorboard=config.logging.tensorboard, tensorboard_dir=config.logging.tensorboard_dir,
                   schedule=Schedule(optimization.lr, warmup_steps, optimization.max_steps, optimization.min_lr_ratio),
                   numeric_vocab=vocab, loss=loss, warnings=[warning for warning in warnings if warning])
