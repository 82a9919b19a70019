"""A training run's settings, typed: train.py's flags and the DeepSpeed JSON values they may come
from, resolved once (:meth:`RunConfig.from_args`) into frozen sections that the rest of the trainer
reads.

    config = RunConfig.from_args(parse_args(argv))       # one line per problem: RunRefused
    config.optimization.lr, config.layout.tp, config.loss.numeric_loss, config.checkpointing.output_dir

Every field says, next to it (:func:`setting`), where its value comes from: its train.py flags
(``flags``), the DeepSpeed config keys that may give it (``json``, dotted paths), and the HParams
column that shows it (``hparam``; ``smmd_train.monitor.dashboards``). A setting is added in one place: a field
with its flag is filled from the parsed flags by name; one with a single JSON key also takes the
config's number where it gives one, and a flag given on the command line that contradicts it is
refused (``smmd_train.config.deepspeed.check_flags_agree``).

Like ``smmd_train.config.arguments`` this module imports neither DeepSpeed nor transformers: a bad
DeepSpeed config is refused before they load.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from smmd_scale.registry import all_options, note_reader

from .deepspeed import (
    AUTO,
    check_flags_agree,
    load_config,
    set_tensor_parallel,
    tensor_parallel_size,
    tensorboard_dir,
)


class RunRefused(ValueError):
    """The options, the DeepSpeed config or the data cannot make a run; one line per problem."""


def setting(*flags: str, json: tuple = (), hparam=None):
    """A field of the run's configuration: the train.py ``flags`` that set it (the first is its own;
    another spelling may follow), the DeepSpeed config ``json`` keys that may give it (dotted paths), the
    HParams column(s) ``hparam`` that show it."""
    return field(metadata={"flags": flags, "json": json, "hparam": hparam})


SECTION = dict(frozen=True, slots=True, kw_only=True)


@dataclass(**SECTION)
class ModelData:
    """The model, its tokenizer, and the data it trains and is evaluated on."""

    model: str = setting("--model", hparam="model")  # a local HF model dir, or a preset (smmd_train.model.presets)
    tokenizer: Optional[str] = setting("--tokenizer")  # None: the model dir's
    trust_remote_code: bool = setting("--trust_remote_code")
    data: tuple = setting("--data")
    text_field: str = setting("--text_field")
    seq_len: int = setting("--seq_len", hparam="seq_len")
    eval_data: Optional[tuple] = setting("--eval_data")
    eval_steps: int = setting("--eval_steps")
    eval_batches: int = setting("--eval_batches")
    cache_dir: str = setting("--cache_dir")  # parse_args defaults it to <output_dir>/cache
    num_proc: int = setting("--num_proc")


@dataclass(**SECTION)
class Optimization:
    """The optimizer's numbers, the batch and the learning-rate schedule's flags."""

    max_steps: int = setting("--max_steps", hparam="max_steps")
    micro_batch_size: int = setting("--micro_batch_size", json=("train_micro_batch_size_per_gpu", ),
                                    hparam="micro_batch")
    gradient_accumulation_steps: int = setting("--gradient_accumulation_steps", json=("gradient_accumulation_steps", ),
                                               hparam="grad_accum")
    lr: float = setting("--lr", json=("optimizer.params.lr", ), hparam="lr")
    weight_decay: float = setting("--weight_decay", json=("optimizer.params.weight_decay", ))
    warmup_steps: Optional[int] = setting("--warmup_steps", hparam="warmup_steps")  # as asked (the plan clamps it)
    min_lr_ratio: float = setting("--min_lr_ratio")
    seed: int = setting("--seed")
    gradient_checkpointing: bool = setting("--gradient_checkpointing")
    max_skipped_steps: int = setting("--max_skipped_steps")


@dataclass(**SECTION)
class Layout:
    """How the ranks share the work (the world size is the launch's: ``smmd_train.plan`` checks the fit)."""

    tp: int = setting("--tp", json=("tensor_parallel.autotp_size", ), hparam="tp_size")  # the AutoTP degree
    sp: int = setting("--sp", hparam="sp_size")  # the Ulysses sequence-parallel degree
    process_group_timeout_minutes: float = setting("--process_group_timeout_minutes")


@dataclass(**SECTION)
class Loss:
    """What the run trains on: CE, the numeric loss(es) and their options, or the model's own loss."""

    loss_module: tuple = setting("--loss_module")  # modules that register losses of the user's own
    numeric_loss: tuple = setting("--numeric_loss", hparam="numeric_loss")  # ((name, weight), ...)
    numeric_policy: str = setting("--numeric_policy")
    numeric_max_value: float = setting("--numeric_max_value")
    numeric_values: str = setting("--numeric_values", hparam="numeric_values")  # parsed, or shuffled (a control)
    numeric_values_seed: int = setting("--numeric_values_seed")
    # Each registered loss option (smmd_scale.registry.all_options) by its column: {"smmd_sigmas": (2.0,), ...}
    note_reader(__name__)  # (the field's flags and HParams columns copy the registry's options)
    options: Mapping = setting(*(option.flag for option in all_options()),
                               hparam=tuple(option.column for option in all_options()))
    fused_linear: bool = setting("--fused_linear", hparam="fused_linear")
    z_loss: float = setting("--z_loss", hparam="z_loss")
    label_smoothing: float = setting("--label_smoothing", hparam="label_smoothing")
    tp_exchange_capacity: str = setting("--tp_exchange_capacity")  # not the objective: how the exchange is sized
    framework_loss: bool = setting("--framework_loss")

    @property
    def numeric_values_label(self) -> str:
        """``parsed``, or ``shuffled (seed S)``: --numeric_values as the resume record and HParams show it."""
        if self.numeric_values == "parsed":
            return "parsed"
        return f"{self.numeric_values} (seed {self.numeric_values_seed})"


@dataclass(**SECTION)
class Checkpointing:
    """Where the run writes, and how it continues or replaces an earlier one."""

    output_dir: str = setting("--output_dir")
    save_steps: int = setting("--save_steps")
    resume: bool = setting("--resume")
    overwrite_output_dir: bool = setting("--overwrite_output_dir")
    allow_objective_change: bool = setting("--allow_objective_change")
    export_hf: Optional[str] = setting("--export_hf")


@dataclass(**SECTION)
class Logging:
    """TensorBoard: whether the run writes its events (metrics.jsonl is always written), and where."""

    tensorboard: bool = setting(json=("tensorboard.enabled", ))
    tensorboard_dir: str = setting("--tensorboard_dir", json=("tensorboard.output_path", "tensorboard.job_name"))


@dataclass(**SECTION)
class Target:
    """The job a dry run (``--dry_run``: ``smmd_train.tools.dry_run``) checks the start of, from one process: its
    ranks, ranks per node and GPU memory. A launched run's world is its launcher's."""

    dry_run: bool = setting("--dry_run")
    world_size: int = setting("--world_size")
    gpus_per_node: int = setting("--gpus_per_node")  # parse_args defaults it to min(8, world_size)
    gpu_memory_gib: float = setting("--gpu_memory_gib")


SECTIONS = {"model_data": ModelData, "optimization": Optimization, "layout": Layout, "loss": Loss,
            "checkpointing": Checkpointing, "logging": Logging, "target": Target}

# Flags the parser takes that set no field, and why.
PARSER_ONLY = {
    "--help": "argparse's own",
    "--local_rank": "the deepspeed launcher passes it; smmd_train.distributed.groups reads the rank from the "
                     "environment",
    "--deepspeed": "accepted as DeepSpeed's own scripts take it; train.py always runs DeepSpeed",
}


@dataclass(**SECTION)
class RunConfig:
    """train.py's settings, resolved (:meth:`from_args`)."""

    model_data: ModelData
    optimization: Optimization
    layout: Layout
    loss: Loss
    checkpointing: Checkpointing
    logging: Logging
    target: Target
    deepspeed_config: str = setting("--deepspeed_config")  # the file
    deepspeed: Mapping  # the file's JSON, with --tp's AutoTP degree; its "auto" values resolved by the plan
    command_line: Mapping  # the flags as parsed (flag name -> value), for run_config.json

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The configuration of ``args`` (``smmd_train.config.arguments.parse_args``) and the DeepSpeed config
        it names. Raises :class:`RunRefused`, one line per problem, for a config that is missing or not
        JSON, or that a flag given on the command line contradicts."""
        try:
            json_config = load_config(args.deepspeed_config)
            explicit = {name: getattr(args, name) for name in args.explicit}
            check_flags_agree(json_config, explicit, agreeing_keys())
            deepspeed = set_tensor_parallel(json_config, args.tp)
            resolved = {"tp": tensor_parallel_size(deepspeed),
                        "tensorboard": bool((deepspeed.get("tensorboard") or {}).get("enabled", False)),
                        "tensorboard_dir": tensorboard_dir(deepspeed, args.output_dir, explicit.get("tensorboard_dir")),
                        "options": MappingProxyType({option.column: _frozen(getattr(args, option.column))
                                                     for option in all_options()})}
        except (ValueError, FileNotFoundError) as error:
            raise RunRefused(str(error)) from error
        sections = {name: section(**{item.name: resolved[item.name] if item.name in resolved else
                                     _from_flag_or_json(item, args, deepspeed)
                                     for item in dataclasses.fields(section)})
                    for name, section in SECTIONS.items()}
        return cls(**sections, deepspeed_config=args.deepspeed_config, deepspeed=MappingProxyType(deepspeed),
                   command_line=MappingProxyType(dict(vars(args))))

    def deepspeed_dict(self) -> dict:
        """A plain copy of :attr:`deepspeed` (``smmd_train.config.deepspeed.resolve_config`` resolves it)."""
        return _thawed(self.deepspeed)


def agreeing_keys() -> dict:
    """flag name -> (section path, key) of the fields with one flag of their own and one DeepSpeed config key:
    where a flag given on the command line must agree with the config's number."""
    keys = {}
    for section in SECTIONS.values():
        for item in dataclasses.fields(section):
            flags, json = item.metadata["flags"], item.metadata["json"]
            if flags and len(json) == 1:
                *path, key = json[0].split(".")
                keys[item.name] = (tuple(path), key)
    return keys


def _from_flag_or_json(item: dataclasses.Field, args: argparse.Namespace, deepspeed: dict):
    """A field's value: the DeepSpeed config's where its one key gives a value (not "auto"), else its flag's."""
    for key in item.metadata["json"][:1]:
        section = deepspeed
        *path, name = key.split(".")
        for part in path:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and section.get(name, AUTO) != AUTO:
            return section[name]
    return _frozen(getattr(args, item.name))


def _frozen(value):
    """Lists (several values after one flag) as tuples, to the depth they nest."""
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


def _thawed(value):
    if isinstance(value, Mapping):
        return {key: _thawed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_thawed(item) for item in value]
    return value
