"""launch/export_hf.py loads a checkpoint with the layout that checkpoint was written with, from its
own commit marker, not run_config.json's (the run's latest launch, which may have resumed under
another --tp or world size). The markers here are written by the checkpointer's own writer
(``checkpoint.commit``); tests/launch/test_resume_changes.py exports an older tag of a real run
resumed at another --tp."""

import json

from helpers.launching import REPO

from smmd_train.checkpoint.commits import commit
from smmd_train.checkpoint.export import checkpoint_layout, layout_config
from smmd_train.checkpoint.saving import commit_record, run_record, tag_for_step
from smmd_train.config.deepspeed import Topology, load_config, resolve_config, set_tensor_parallel

SCHEDULE = {"lr": 3e-3, "warmup_steps": 1, "max_steps": 6, "min_lr_ratio": 0.1}


def resolved(world_size, tp_size, micro_batch_size):
    return resolve_config(set_tensor_parallel(load_config(REPO / "ds_configs" / "zero3.json"), tp_size),
                          world_size=world_size, micro_batch_size=micro_batch_size, gradient_accumulation_steps=1,
                          learning_rate=3e-3, weight_decay=0.1, bf16_supported=False, hidden_size=64,
                          accelerator="cpu")


def write_checkpoint(output_dir, step, world_size, tp_size, global_batch_size) -> str:
    tag = tag_for_step(step)
    (output_dir / tag).mkdir(parents=True)
    topology = Topology(world_size=world_size, tp_size=tp_size, dp_size=world_size // tp_size)
    commit(str(output_dir), tag, commit_record(step, world_size, 3, {"data": {"global_batch_size": global_batch_size}},
                                               run_record(topology, SCHEDULE)))
    return tag


def test_an_older_tag_is_exported_with_its_own_layout_not_the_latest_launch_s(tmp_path):
    # Written at --tp 1 on 2 ranks (micro-batch 2), then resumed at --tp 2 on 2 ranks (micro-batch 4,
    # the same global batch), whose launch wrote run_config.json.
    output = tmp_path / "run"
    older = write_checkpoint(output, 2, world_size=2, tp_size=1, global_batch_size=4)
    newer = write_checkpoint(output, 4, world_size=2, tp_size=2, global_batch_size=4)
    latest_config, _ = resolved(2, 2, micro_batch_size=4)
    run = {"world_size": 2, "tp_size": 2, "deepspeed_config": latest_config}
    (output / "run_config.json").write_text(json.dumps(run))
    assert checkpoint_layout(output, older, run) == (2, 1)  # offline: no shards to merge
    assert checkpoint_layout(output, newer, run) == (2, 2)
    # An AutoTP tag's engine gets the config of its own layout: the config its run resolved then.
    tp2_on_4, _ = resolved(4, 2, micro_batch_size=4)
    assert layout_config(tp2_on_4, 2, 1) == resolved(2, 1, micro_batch_size=4)[0]
    assert layout_config(latest_config, 4, 2) == tp2_on_4
    # A marker written before it recorded --tp: the ZeRO-3 model-state files say it (one per TP rank).
    old = output / tag_for_step(6)
    old.mkdir()
    (old / "commit.json").write_text(json.dumps({"step": 6, "world_size": 2}))
    for tp_rank in range(2):
        (old / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt").write_bytes(b"")
    assert checkpoint_layout(output, old.name, {**run, "tp_size": 1}) == (2, 2)
