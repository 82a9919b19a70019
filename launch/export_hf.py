"""Export a training checkpoint as a Hugging Face model directory.

    python launch/export_hf.py OUTPUT_DIR[/TAG] HF_DIR                      # ZeRO-3, no tensor parallelism
    deepspeed --num_gpus W launch/export_hf.py OUTPUT_DIR[/TAG] HF_DIR      # AutoTP checkpoints

OUTPUT_DIR is a run's --output_dir (its run_config.json says how the run was built); without a
tag the latest committed checkpoint is exported. The layout is the checkpoint's own, from its
commit marker (a later resume may have changed the run's --tp or world size). A ZeRO-3 checkpoint
without tensor parallelism is consolidated offline in one process (DeepSpeed's zero_to_fp32). An
AutoTP checkpoint holds tensor-parallel shards that DeepSpeed's offline tools cannot merge; it is
loaded back into an engine of the world size and --tp it was written with and consolidated like
``train.py --export_hf`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from smmd_cli.options import option, parse_options


def _locate(checkpoint: str) -> tuple:
    """(run output dir, tag) from OUTPUT_DIR or OUTPUT_DIR/TAG."""
    from smmd_train.checkpoint.commits import find_resume_tag, is_committed

    path = Path(checkpoint)
    if (path / "run_config.json").is_file():
        tag = find_resume_tag(str(path))
        if tag is None:
            raise FileNotFoundError(f"no committed checkpoint in {path}")
        return path, tag
    if (path.parent / "run_config.json").is_file() and is_committed(str(path.parent), path.name):
        return path.parent, path.name
    raise FileNotFoundError(f"{checkpoint} is neither a run's --output_dir (with run_config.json) nor a committed "
                            "checkpoint inside one")


def export_offline(run_dir: Path, tag: str, run: dict, target: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smmd_train.model.build import config_from_dict

    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(run_dir), tag=tag)
    config = config_from_dict(run["model_config"])
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.save_pretrained(target)
    arguments = run["args"]
    AutoTokenizer.from_pretrained(arguments["tokenizer"] or arguments["model"]).save_pretrained(target)


def export_distributed(run_dir: Path, tag: str, run: dict, target: str) -> None:
    from transformers import AutoTokenizer

    from smmd_train.checkpoint.export import checkpoint_layout, export_hf, layout_config
    from smmd_train.distributed.groups import init_distributed
    from smmd_train.model.build import config_from_dict
    from smmd_train.run import build_engine

    world_size, tp_size = checkpoint_layout(run_dir, tag, run)
    launch = init_distributed()
    if launch.world_size != world_size:
        raise SystemExit(f"{run_dir}/{tag} was written by {world_size} ranks with autotp_size {tp_size}; "
                         f"run: deepspeed --num_gpus {world_size} launch/export_hf.py {run_dir}/{tag} {target}")
    # The engine train.py built (smmd_train.run.build_engine), from the run's recorded config at the
    # checkpoint's layout. The optimizer stays: DeepSpeed reads ZeRO-3 module weights back through the
    # optimizer's partitions (loading the module alone goes through zero_to_fp32, which cannot merge TP shards).
    arguments = run["args"]
    engine, _ = build_engine(config_from_dict(run["model_config"]),
                             layout_config(run["deepspeed_config"], world_size, tp_size), tp_size,
                             arguments["seq_len"])
    load_path, _ = engine.load_checkpoint(str(run_dir), tag=tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {run_dir}")
    export_hf(engine, target, AutoTokenizer.from_pretrained(arguments["tokenizer"] or arguments["model"]))


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    checkpoint: str = option(help="a run's --output_dir, or OUTPUT_DIR/TAG")
    target: str = option(help="where to write the Hugging Face model")
    local_rank: int = option("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")


def main(argv=None) -> None:
    options, _ = parse_options(ExportOptions, argv, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from smmd_train.checkpoint.export import checkpoint_layout

    run_dir, tag = _locate(options.checkpoint)
    run = json.loads((run_dir / "run_config.json").read_text())
    if checkpoint_layout(run_dir, tag, run)[1] == 1 and "RANK" not in os.environ:
        export_offline(run_dir, tag, run, options.target)
    else:
        export_distributed(run_dir, tag, run, options.target)
    print(f"exported {run_dir}/{tag} -> {options.target}")


if __name__ == "__main__":
    from smmd_train.distributed.groups import load_backends, shutdown_distributed
    from smmd_train.distributed.process_start import keep_imports, pause_collections

    # The collector off while the export imports what it runs on, then that frozen, at the top level
    # rather than in a function whose frame holds the engine (smmd_train.distributed.process_start).
    pause_collections()
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import transformers  # noqa: F401

    import smmd_train.checkpoint.export  # noqa: F401
    import smmd_train.run  # noqa: F401

    load_backends()
    keep_imports()
    from smmd_train.distributed.process_end import skip_final_collections

    try:
        sys.exit(main())
    finally:
        shutdown_distributed()  # ordered, on every exit path (see there)
        skip_final_collections()  # then no collection at exit (smmd_train.distributed.process_end)
