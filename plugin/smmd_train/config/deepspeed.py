"""DeepSpeed config for a training run: read it, set the tensor-parallel degree from ``--tp``,
resolve its ``"auto"`` values from the run's flags, adapt it to the CPU accelerator, and reject
combinations that cannot work — before any model is built.

Resolved like the HF Trainer resolves them: batch sizes from the micro batch, gradient
accumulation and the data-parallel size (world / autotp_size); optimizer and scheduler numbers
from the learning-rate flags; bf16 on when the accelerator supports it; TensorBoard into the
run's directory. The same ``ds_configs/*.json`` serve GPUs and the CPU: :data:`CPU_SETTINGS` is
the one place where the two differ.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

AUTO = "auto"

# What a run on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, gloo) changes in any config, and why:
# (section path, key, value).
CPU_SETTINGS = (
    # DeepSpeed's own Adam ops (FusedAdam, CPUAdam) are compiled extensions; torch's AdamW needs no build.
    (("optimizer", "params"), "torch_adam", True),
    # Overlapping ZeRO's reduce-scatter with backward needs accelerator streams; the CPU has none.
    (("zero_optimization", ), "overlap_comm", False),
)


@dataclass(frozen=True)
class Topology:
    world_size: int
    tp_size: int
    dp_size: int
    sp_size: int = 1  # Ulysses sequence-parallel degree: world = dp x tp x sp


def load_config(path: str) -> dict:
    """The JSON at ``path``; errors name the file and the problem."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--deepspeed_config {path}: no such file (see ds_configs/ for ready-made ones)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--deepspeed_config {path} is not valid JSON: {error}") from None


def set_tensor_parallel(config: dict, tp_size: Optional[int]) -> dict:
    """A copy of ``config`` whose AutoTP degree is ``tp_size`` (``train.py --tp``), with the LM head
    vocabulary-parallel; ``None`` keeps what the config says (no ``tensor_parallel``: TP 1)."""
    config = copy.deepcopy(config)
    if tp_size is None:
        return config
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"--tp {tp_size!r} must be a positive int (the AutoTP degree)")
    if tp_size == 1:
        config.pop("tensor_parallel", None)
    else:
        config["tensor_parallel"] = {**(config.get("tensor_parallel") or {}), "autotp_size": tp_size,
                                     "vocab_parallel_lm_head": True}
    return config


def tensor_parallel_size(config: dict) -> int:
    """The AutoTP degree a config asks for (1 without a ``tensor_parallel`` section)."""
    return int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def _section(config: dict, path: tuple) -> Optional[dict]:
    for name in path:
        config = config.get(name)
        if not isinstance(config, dict):
            return None
    return config


def flag_sources() -> dict:
    """flag -> the launcher variable that gave it, from ``SMMD_FLAG_SOURCES`` ("micro_batch_size=MICRO_BATCH
    lr=LR"), which launch/deepspeed_train.sh exports with the variables that are set."""
    return dict(pair.split("=", 1) for pair in os.environ.get("SMMD_FLAG_SOURCES", "").split())


def check_flags_agree(config: dict, explicit: dict, flag_keys: dict) -> None:
    """Refuse a flag given on the command line (``explicit``: flag -> value) that contradicts a number
    the DeepSpeed ``config`` sets (``flag_keys``: flag -> (section path, key), from
    ``smmd_train.config.run_config.agreeing_keys``), naming both, and the launcher variable that gave
    the flag (:func:`flag_sources`), one line per conflict: one of them would be silently ignored, and
    the run's records would show a number it did not use."""
    conflicts, sources = [], flag_sources()
    for flag, (path, key) in flag_keys.items():
        section = _section(config, path)
        if flag not in explicit or section is None or section.get(key, AUTO) == AUTO:
            continue
        value = section[key]
        if value != explicit[flag]:
            where = ".".join((*path, key))
            given, drop = ((f" (set by {sources[flag]})", f"unset {sources[flag]}") if flag in sources else
                           ("", "drop the flag"))
            conflicts.append(f"--{flag} {explicit[flag]}{given} but the DeepSpeed config says {where}={value}: "
                             f"{drop}, or make them agree, or set {where} to \"auto\"")
    if conflicts:
        raise ValueError("\n".join(conflicts))  # one line per problem


def tensorboard_dir(config: dict, output_dir: str, flag: Optional[str] = None) -> str:
    """The run's TensorBoard directory: ``--tensorboard_dir`` (``flag``), else the config's
    ``tensorboard`` section as DeepSpeed reads it (``output_path/job_name``; ``output_path`` defaults
    to ``output_dir``, ``job_name`` to "tensorboard"), so the default is ``<output_dir>/tensorboard``.
    Both given and different is an error naming both."""
    section = config.get("tensorboard") or {}
    output_path, job_name = section.get("output_path") or None, section.get("job_name") or None
    from_config = str(Path(output_path or output_dir, job_name or "tensorboard"))
    if flag is None:
        return from_config
    if (output_path or job_name) and Path(flag) != Path(from_config):
        raise ValueError(f"--tensorboard_dir {flag} but the DeepSpeed config's tensorboard section says "
                         f"output_path={output_path!r}, job_name={job_name!r} (= {from_config}); drop one")
    return str(flag)


def _resolve(section: dict, key: str, value) -> None:
    """Fill ``key`` when it is missing or "auto"."""
    if section.get(key, AUTO) == AUTO:
        section[key] = value


def _resolve_auto(section: dict, key: str, value) -> None:
    """Fill ``key`` only where the config says "auto" (other schedulers take other keys)."""
    if section.get(key) == AUTO:
        section[key] = value


def check_tensor_parallel_world(tp_size: int, world_size: int) -> None:
    """Refuse an AutoTP degree that does not divide the world size."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} (--tp) must divide the world size {world_size} (the "
                         f"ranks are split into world/autotp_size data-parallel groups of autotp_size ranks)")


def resolve_config(config: dict, *, world_size: int, micro_batch_size: int, gradient_accumulation_steps: int,
                   learning_rate: float, weight_decay: float, bf16_supported: bool, hidden_size: int,
                   accelerator: str = "cuda", sp_size: int = 1) -> tuple:
    """Return (resolved copy of ``config``, :class:`Topology`); raise ValueError on bad combinations.

    ``hidden_size`` sizes the ZeRO-3 buckets left "auto" as the HF integration does (hidden^2 for
    reduce, 0.9 hidden^2 for prefetch, 10 hidden for the persistence threshold). ``sp_size`` (``--sp``,
    checked by ``smmd_train.distributed.sequence_parallel``): the ranks of a sequence-parallel group share their
    micro-batches, so the data-parallel size is world / (autotp_size x sp_size). The copy has no
    ``tensorboard`` section: train.py writes TensorBoard itself (``smmd_train.monitor.training``), and
    DeepSpeed's own writer would add a second set of scalars (``Train/Samples/*``) to the same run.
    The learning-rate schedule is train.py's too (``smmd_train.components.schedule``), so a ``scheduler``
    section is refused.
    """
    config = copy.deepcopy(config)
    if "scheduler" in config:
        raise ValueError("the DeepSpeed config has a \"scheduler\" section, but train.py schedules the learning rate "
                         "itself (--lr, --warmup_steps, --min_lr_ratio: linear warmup whose first step already trains, "
                         "then cosine); remove the section")
    config.pop("tensorboard", None)
    tensor_parallel = config.get("tensor_parallel") or {}
    tp_size = tensor_parallel_size(config)
    check_tensor_parallel_world(tp_size, world_size)
    if tp_size > 1 and not tensor_parallel.get("vocab_parallel_lm_head", False):
        raise ValueError("tensor_parallel.autotp_size > 1 needs \"vocab_parallel_lm_head\": true so the LM head "
                         "stays vocabulary-sharded and the SMMD loss runs on the shards (gathering full logits "
                         "on every rank defeats the purpose)")
    if world_size % (tp_size * sp_size):
        raise ValueError(f"autotp_size {tp_size} x --sp {sp_size} must divide the world size {world_size}")
    dp_size = world_size // (tp_size * sp_size)

    _resolve(config, "train_micro_batch_size_per_gpu", micro_batch_size)
    _resolve(config, "gradient_accumulation_steps", gradient_accumulation_steps)
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    _resolve(config, "train_batch_size", micro * accumulation * dp_size)
    if config["train_batch_size"] != micro * accumulation * dp_size:
        raise ValueError(f"train_batch_size={config['train_batch_size']} but train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={accumulation} x data-parallel size {dp_size} (world "
                         f"{world_size} / autotp_size {tp_size} / sp {sp_size}) = {micro * accumulation * dp_size}; "
                         f"set it to \"auto\" or make the three multiply out")

    optimizer = config.get("optimizer")
    if optimizer is not None:
        params = optimizer.setdefault("params", {})
        _resolve(params, "lr", learning_rate)
        _resolve(params, "weight_decay", weight_decay)
    if accelerator == "cpu":
        for path, key, value in CPU_SETTINGS:
            section = config
            for name in path:
                section = section.get(name)
                if section is None:
                    break
            if section is not None:
                section[key] = value
    for precision in ("bf16", "fp16"):
        section = config.get(precision)
        if section is not None and section.get("enabled") == AUTO:
            # On the CPU accelerator "auto" means off: CPU bf16 GEMMs are far slower than fp32 ones.
            section["enabled"] = precision == "bf16" and bf16_supported and accelerator != "cpu"
    if config.get("gradient_clipping") == AUTO:
        config["gradient_clipping"] = 1.0

    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ValueError(f"zero_optimization.stage={stage}: train.py runs ZeRO stage 3 (models are partitioned as "
                         "they are built, and steps with a non-finite loss are discarded by ZeRO-3's gradient-norm "
                         "check); use ds_configs/zero3.json or ds_configs/zero3_offload.json")
    offloaded = [key for key in ("offload_param", "offload_optimizer")
                 if (zero.get(key) or {}).get("device", "none") != "none"]
    if offloaded and accelerator == "cpu":
        raise ValueError(f"zero_optimization.{offloaded[0]} offloads to the CPU, but this run already trains on the "
                         "CPU accelerator (DS_ACCELERATOR=cpu); use ds_configs/zero3.json")
    for key in offloaded:
        if zero[key].get("device") == "nvme" and not zero[key].get("nvme_path"):
            raise ValueError(f"zero_optimization.{key}.device is nvme but nvme_path is not set")
    _resolve_auto(zero, "reduce_bucket_size", hidden_size * hidden_size)
    _resolve_auto(zero, "stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size))
    _resolve_auto(zero, "stage3_param_persistence_threshold", 10 * hidden_size)
    zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)  # export needs the gathered weights
    leftover = [path for path, value in _walk(config) if value == AUTO]
    if leftover:
        raise ValueError(f"these config values are \"auto\" but train.py has no flag to resolve them: {leftover}; "
                         "give them numbers")
    return config, Topology(world_size=world_size, tp_size=tp_size, dp_size=dp_size, sp_size=sp_size)


def _walk(value, path=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}" if path else key)
    else:
        yield path, value
