"""``launch/train.py``'s command line: the parser, and the one builder of train.py command lines
that the demo, the benchmarks, the numeracy study and the tests use.

    args = parse_args(["--deepspeed_config", "ds_configs/zero3.json", "--model", "tiny", ...])
    command = train_command(processes=2, deepspeed_config="ds_configs/zero3.json", model="tiny", tp=2,
                            data=["train.jsonl"], max_steps=10, output_dir="runs/a")
    subprocess.run(command, check=True)   # deepspeed --num_gpus 2 ... launch/train.py --deepspeed_config ...

The builder takes train.py options as keyword arguments named like the flags, checks every name
against the parser (a typo fails here, not after a launch), and writes them the way argparse reads
them back: ``True`` is a bare switch, ``False``/``None`` leave the flag out (``False`` gives
``--no-<flag>`` for a ``--flag/--no-flag`` pair), a list or tuple gives several values after one flag.

This module imports neither DeepSpeed nor transformers (nor anything that does): train.py reads its
command line before those load, so a mistyped flag is refused in about a second.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from smmd_scale.registry import NUMERIC_LOSSES, all_options, parse_terms

from .. import compat
from ..distributed.launcher import launch_command
from ..loss_modules import FLAG as LOSS_MODULE_FLAG
from ..loss_modules import import_loss_modules
from ..model.presets import PRESETS

# train.py of the source checkout this package is installed from (an editable install), for the
# commands the trainer's tools build (train_command, the scaling sweep).
TRAIN_SCRIPT = Path(__file__).resolve().parents[3] / "launch" / "train.py"  # plugin/smmd_train/config/ -> the checkout


# Spellings removed in 0.3.0 (kept through 0.2.0 with a warning): refused by name, with what replaced them.
REMOVED_FLAGS = {
    "--smmd_weight": "the weights in --numeric_loss (smmd:0.5 ntl-was:0.3; smmd:0 trains on CE only)",
    "--smmd_policy": "--numeric_policy",
    "--smmd_max_value": "--numeric_max_value",
}


class TrainArgumentParser(argparse.ArgumentParser):
    """argparse as a launched job wants it: a bad command line is one line on rank 0 (every rank of a
    launch parses the same arguments; the others exit quietly with the same code), no 40-line usage,
    and an unknown flag names the close ones. Abbreviations are off: ``--max_step`` is a typo, not
    ``--max_steps``."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=compat.DefaultsHelpFormatter, **kwargs)

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")
        self.exit(2)

    def check_known(self, argv: Sequence[str]) -> None:
        """Refuse flags the parser does not have, each with its close matches (before argparse's own
        error, which would first complain about a required flag that the typo was meant to be)."""
        known = [option for action in compat.parser_actions(self) for option in action.option_strings]
        for token in argv:
            name = token.split("=", 1)[0]
            if name in REMOVED_FLAGS:
                self.error(f"{name} was removed in 0.3.0; use {REMOVED_FLAGS[name]}")
            if name.startswith("--") and name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                self.error(f"unknown option {name}" + (f"; did you mean {' or '.join(close)}?" if close else ""))


# The keyword arguments of NumericVocab.from_tokenizer that train.py's flags set: the library refuses in
# its own words (``policy='digits'``), which the plan words as the flags the user typed (``--numeric_policy
# digits``: smmd_scale.refusal.Refusal.worded). A loss's keywords and flags come from its registry entry.
VOCAB_FLAGS = {"policy": "--numeric_policy", "max_value": "--numeric_max_value"}


def add_loss_options(group) -> None:
    """One flag per option of the registered numeric losses (``smmd_scale.registry.all_options``):
    a bool is a ``--flag`` / ``--no-flag`` pair, ``several`` takes one or more values."""
    for option in all_options():
        settings = dict(default=option.default, help=option.help)
        if option.kind is bool:
            settings["action"] = argparse.BooleanOptionalAction
        else:
            settings["type"] = option.kind
        if option.choices:
            settings["choices"] = list(option.choices)
        if option.several:
            settings.update(nargs="+", default=list(option.default))
        group.add_argument(option.flag, **settings)


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = TrainArgumentParser(description=description)
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", required=True, help=f"a local HF model dir (continued pretraining) or a preset "
                       f"to pretrain from scratch: {', '.join(PRESETS)}")
    model.add_argument("--tokenizer", help="tokenizer dir (default: the model dir; required with a preset)")
    model.add_argument("--trust_remote_code", action="store_true",
                       help="allow model/tokenizer code shipped inside the model dir to run (off by default)")
    model.add_argument("--data", nargs="+", required=True, help=".jsonl/.json/.txt/.parquet files or "
                       "datasets.save_to_disk dirs")
    model.add_argument("--text_field", default="text", help="the column (JSON key) holding the text")
    model.add_argument("--seq_len", type=int, default=1024, help="tokens per packed training sequence")
    model.add_argument("--eval_data", nargs="+", help="held-out data, packed like --data")
    model.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    model.add_argument("--eval_batches", type=int, default=50, help="micro-batches per evaluation")
    model.add_argument("--cache_dir", help="where tokenized/packed data is cached (default <output_dir>/cache)")
    model.add_argument("--num_proc", type=int, default=1, help="processes for tokenization")

    train = parser.add_argument_group("training")
    train.add_argument("--tp", type=int, help="AutoTP degree, with a vocabulary-parallel LM head (default: the "
                       "config's tensor_parallel.autotp_size, else 1); must divide the world size")
    train.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (DeepSpeed ALST): each "
                       "sequence is split over this many consecutive ranks, attention exchanges heads with an "
                       "all-to-all; must divide the world size, --seq_len and the attention heads; not with --tp > 1")
    train.add_argument("--max_steps", type=int, required=True, help="optimizer steps")
    train.add_argument("--micro_batch_size", type=int, default=1, help="resolves train_micro_batch_size_per_gpu")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    train.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay")
    train.add_argument("--warmup_steps", type=int,
                       help="linear warmup steps, then cosine decay (default 100; at most 10%% of --max_steps; "
                       "step 1 already trains at lr / warmup_steps)")
    train.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decay to this fraction of --lr")
    train.add_argument("--seed", type=int, default=1234, help="initialisation and data order")
    train.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in the backward")
    train.add_argument("--output_dir", required=True, help="checkpoints, metrics.jsonl, run_config.json, TensorBoard")
    train.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps and at the end (0: never)")
    train.add_argument("--resume", action="store_true", help="continue from the latest committed checkpoint in "
                       "--output_dir (starts fresh if there is none, so restart loops can always pass it); without "
                       "it, a committed checkpoint there is refused")
    train.add_argument("--overwrite_output_dir", action="store_true", help="start a new run in an --output_dir that "
                       "holds an earlier run's checkpoints: they, its metrics.jsonl and its TensorBoard events are "
                       "removed first")
    train.add_argument("--allow_objective_change", action="store_true", help="with --resume: continue a checkpoint "
                       "although this run's objective (--numeric_loss and its options, the numeric vocabulary, "
                       "--z_loss, --label_smoothing, --framework_loss) or training data differ from its own, saying "
                       "each change in a warning; without it such a resume is refused, one line per change")
    train.add_argument("--export_hf", help="write a Hugging Face model dir here at the end")
    train.add_argument("--tensorboard_dir", help="default: the DeepSpeed config's tensorboard output_path/job_name, "
                       "else <output_dir>/tensorboard")
    train.add_argument("--process_group_timeout_minutes", type=float, default=30.0,
                       help="how long a collective waits for a lost rank before the job fails")
    train.add_argument("--max_skipped_steps", type=int, default=10,
                       help="stop after this many consecutive steps with a NaN/inf loss (each is skipped on every "
                       "rank)")

    smmd = parser.add_argument_group("numeric loss")
    smmd.add_argument("--numeric_loss", nargs="+", default=["smmd"], metavar="NAME[:WEIGHT]",
                      help="the numeric loss, or a weighted sum of several, each with an optional weight (default 1): "
                      "total = CE + sum of weight x loss, e.g. --numeric_loss smmd ntl-was:0.3; weight 0 (smmd:0) "
                      "trains on CE only and still logs the numeric metrics. Losses: " +
                      "; ".join(f"{entry.name}: {entry.summary}" for entry in NUMERIC_LOSSES.values()))
    smmd.add_argument(LOSS_MODULE_FLAG, nargs="+", default=[], metavar="MODULE",
                      help="import these Python modules first: each registers numeric losses of its own "
                      "(smmd_scale.registry.register_numeric_loss), which --numeric_loss then names like the "
                      "built-in ones, with their option flags (docs/objective.md, 'Adding a numeric loss')")
    smmd.add_argument("--numeric_policy", default="integers", choices=["integers", "digits", "floats"],
                      help="which tokens are numeric (NumericVocab.from_tokenizer), for every numeric loss")
    smmd.add_argument("--numeric_max_value", type=float, default=999,
                      help="the largest value a numeric token may have (policy 'integers')")
    smmd.add_argument("--numeric_values", default="parsed", choices=["parsed", "shuffled"],
                      help="the numeric tokens' values: as parsed, or shuffled (the distinct values permuted among the "
                      "tokens by --numeric_values_seed, NumericVocab.shuffled): the control that tells whether a "
                      "numeric loss's effect comes from the values; the logged numeric MAE and expected values are "
                      "then in the shuffled values")
    smmd.add_argument("--numeric_values_seed", type=int, default=0,
                      help="the permutation of --numeric_values shuffled (the same for every --seed)")
    add_loss_options(smmd)
    smmd.add_argument("--fused_linear", action="store_true",
                      help="compute CE + the numeric loss from the LM head's input without materializing the logits "
                      "(Llama, Mistral, Qwen2/3, Gemma-2/3, Cohere, Mixtral, Qwen2/3-MoE); evaluation uses logits")
    smmd.add_argument("--z_loss", type=float, default=0.0, help="adds this x lse^2 per token (PaLM's z-loss; "
                      "1e-4 is PaLM's), logged as loss/z; the model's soft-capping and logit scale are read from "
                      "its config")
    smmd.add_argument("--label_smoothing", type=float, default=0.0,
                      help="CE's label smoothing, as torch.nn.functional.cross_entropy's; in [0, 1)")
    smmd.add_argument("--tp_exchange_capacity", choices=["grown", "tokens", "counted"], default="grown",
                      help="vocabulary-parallel on a GPU (--tp with vocab_parallel_lm_head): the numeric rows the "
                      "loss's one exchange carries. grown (default): a capacity grown from the counts it reads back, "
                      "one host read per call; tokens: the micro-batch's tokens, no host read, T x N numeric rows "
                      "sent; counted: each micro-batch's numeric targets, counted with the step's counts (one host "
                      "read per step), no host read per call, no row beyond the count")
    smmd.add_argument("--framework_loss", action="store_true",
                      help="baseline for throughput comparisons: keep the model's own loss (HF's CE, or DeepSpeed's "
                      "vocab-parallel CE under AutoTP) instead of installing smmd_scale; no numeric metrics")

    dry = parser.add_argument_group("dry run (before booking the cluster)")
    dry.add_argument("--dry_run", action="store_true",
                     help="check the start for --world_size ranks in this one process (the plan and every refusal of "
                     "a real start, the data, the resume, DeepSpeed's process groups on torch's fake backend, the "
                     "model on the meta device) and print what each rank will hold and send; no weight is "
                     "allocated, nothing is sent, no step runs (exit 0; 2 with a real start's refusals, or when the "
                     "micro-batch does not fit the GPUs)")
    dry.add_argument("--world_size", type=int, default=1, help="with --dry_run: the ranks of the job (nodes x GPUs "
                     "per node)")
    dry.add_argument("--gpus_per_node", type=int, help="with --dry_run: ranks per node (default: 8, or --world_size "
                     "when smaller)")
    dry.add_argument("--gpu_memory_gib", type=float, default=80.0, help="with --dry_run: each GPU's memory, for "
                     "the memory verdict")

    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--deepspeed_config", help="the DeepSpeed JSON config (required; see ds_configs/)")
    parser.add_argument("--deepspeed", action="store_true",
                        help="accepted as DeepSpeed's own scripts take it; train.py always runs DeepSpeed")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> argparse.Namespace:
    """train.py's arguments, with the checks that need no file, model or process group."""
    import_loss_modules(sys.argv[1:] if argv is None else [str(token) for token in argv])
    parser = build_parser(description)
    parser.check_known(sys.argv[1:] if argv is None else [str(token) for token in argv])
    args = parser.parse_args(argv)
    args.explicit = explicit_flags(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see ds_configs/)")
    if args.model in PRESETS and not args.tokenizer:
        parser.error(f"--model {args.model} is a preset (training from scratch): pass --tokenizer DIR")
    if args.tp is not None and args.tp < 1:
        parser.error(f"--tp {args.tp} must be >= 1")
    if args.sp < 1:
        parser.error(f"--sp {args.sp} must be >= 1")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup_steps {args.warmup_steps} must be >= 0")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        parser.error(f"--min_lr_ratio {args.min_lr_ratio} must be in [0, 1]")
    try:
        args.numeric_loss = parse_terms(args.numeric_loss)
    except ValueError as error:
        parser.error(str(error))
    for option in all_options():
        problem = option.problem(getattr(args, option.column))
        if problem:
            parser.error(problem)
    if args.numeric_values_seed < 0:
        parser.error(f"--numeric_values_seed {args.numeric_values_seed} must be >= 0")
    if not (math.isfinite(args.numeric_max_value) and args.numeric_max_value >= 0):
        parser.error(f"--numeric_max_value {args.numeric_max_value:g} must be a finite number >= 0")
    if not (math.isfinite(args.z_loss) and args.z_loss >= 0):
        parser.error(f"--z_loss {args.z_loss} must be a finite number >= 0")
    if not 0.0 <= args.label_smoothing < 1.0:
        parser.error(f"--label_smoothing {args.label_smoothing} must be in [0, 1)")
    if args.framework_loss and (args.z_loss or args.label_smoothing):
        parser.error("--z_loss and --label_smoothing are options of smmd_scale's loss: not with --framework_loss")
    if args.resume and args.overwrite_output_dir:
        parser.error("--resume continues the run in --output_dir and --overwrite_output_dir removes it: pass one")
    if args.fused_linear and args.framework_loss:
        parser.error("--fused_linear is smmd_scale's fused head + loss: it cannot be combined with --framework_loss")
    check_dry_run_options(parser, args)
    args.cache_dir = args.cache_dir or str(Path(args.output_dir, "cache"))
    return args


DRY_RUN_OPTIONS = ("world_size", "gpus_per_node", "gpu_memory_gib")


def check_dry_run_options(parser: TrainArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the dry run's options without ``--dry_run`` (a launched run's world is its launcher's) and a world
    that is not whole nodes; fill in the default ``--gpus_per_node``."""
    given = [name for name in DRY_RUN_OPTIONS if name in args.explicit]
    if given and not args.dry_run:
        parser.error(f"--{given[0]} is an option of --dry_run; a launched run's world is the ranks its launcher "
                     "starts")
    if args.world_size < 1:
        parser.error(f"--world_size {args.world_size} must be >= 1")
    if args.gpus_per_node is None:
        args.gpus_per_node = min(8, args.world_size)
    if args.gpus_per_node < 1 or args.world_size % args.gpus_per_node:
        parser.error(f"--world_size {args.world_size} is not a whole number of nodes of --gpus_per_node "
                     f"{args.gpus_per_node}; give the ranks per node with --gpus_per_node")
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        parser.error(f"--gpu_memory_gib {args.gpu_memory_gib:g} must be a positive number")


def explicit_flags(argv: Optional[Sequence[str]] = None) -> tuple:
    """The destinations of the flags ``argv`` gives (not left to their defaults), e.g. ``("lr", "model")``:
    where a flag and the DeepSpeed config both set a number, only an explicit flag can contradict it."""
    parser = build_parser()
    for action in compat.parser_actions(parser):
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return tuple(sorted(vars(given)))


def train_flags(**options) -> list:
    """train.py flags for ``options`` (keyword arguments named like the flags, without ``--``)."""
    actions = {option[2:]: action for action in compat.parser_actions(build_parser())
               for option in action.option_strings
               if option.startswith("--") and not option.startswith("--no-")}
    flags = []
    for name, value in options.items():
        action = actions.get(name)
        if action is None:
            close = difflib.get_close_matches(name, actions, n=3)
            raise ValueError(f"train.py has no option --{name}" + (f"; did you mean {close}?" if close else ""))
        flag = f"--{name}"
        if isinstance(action, argparse.BooleanOptionalAction) and value is not None:
            flags.append(flag if value else f"--no-{name}")
            continue
        if value is None or value is False:
            continue
        if value is True:
            if action.nargs != 0:
                raise ValueError(f"--{name} takes a value, got True")
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def train_command(*, processes: int = 1, launcher="deepspeed", master_port: Optional[int] = None,
                  **options) -> list:
    """The command that runs ``launch/train.py`` with ``options`` (see :func:`train_flags`)."""
    if not TRAIN_SCRIPT.is_file():
        raise FileNotFoundError(f"{TRAIN_SCRIPT} not found: train_command needs smmd_train installed from a source "
                                "checkout (pip install -e .)")
    return launch_command(TRAIN_SCRIPT, *train_flags(**options), processes=processes, launcher=launcher,
                          master_port=master_port)
