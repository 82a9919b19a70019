"""launch/train.py end to end on CPU across layouts: ZeRO-3 + AutoTP continued pretraining from a Hugging
Face dir with HF export round trips, a TP=2 checkpoint resumed at TP=1 and on one rank (universal
checkpoint), a two-node run simulated on loopback, and Ulysses SP=2 against SP=1."""

import functools
import json
import subprocess
import sys

import pytest
import torch
from helpers.host_probe import hang_guard
from helpers.launching import REPO, TRAIN, environment, metrics, run, run_many
from helpers.train_runs import (
    EXPORT,
    adam_step_bound,
    assert_steps_5_and_6_continue,
    corpus_fixture,
    cut_back_to_step_4,
    deepspeed_command,
    eval_ce_of_hf_model,
    local_hf_checkpoint,
    train_args,
)

from smmd_train.distributed.launcher import free_port

pytestmark = pytest.mark.slow
corpus = corpus_fixture()  # the module's corpus on disk (a module-scoped fixture)


def test_autotp_tp2_continued_pretraining_moves_the_weights_and_export_round_trips(tmp_path, corpus):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    # A 2-step continued-pretraining run of a local HF checkpoint with train.py's default schedule
    # (no --lr, no --warmup_steps): both steps train at a positive rate, and every weight moves. The
    # checkpoint splits unevenly over the 2 ranks: 9 heads over 3 KV heads, and a vocabulary one row
    # larger than the tokenizer's 1,512 (757 + 756 rows).
    start = local_hf_checkpoint(tmp_path / "start", corpus, extra_rows=1, hidden_size=72, heads=9, kv_heads=3)
    # With --tp_exchange_capacity counted: each call's exchange bounded by its micro-batch's numeric targets
    # (one micro-batch per step here, so the step's bound is its numeric positions, which the loss counted).
    output = tmp_path / "run"
    run(deepspeed_command(2, *train_args(corpus, output, steps=2, model=start, lr=None, warmup_steps=None,
                                         export_hf=output / "hf", save_steps=2, tp=2,
                                         tp_exchange_capacity="counted")), timeout=600)
    logged = metrics(output)
    assert logged[0]["run/tp_size"] == 2 and logged[0]["run/dp_size"] == 1
    assert logged[1]["train/lr"] > 0 and logged[2]["train/lr"] > 0
    assert all(logged[step]["comm/loss_bytes"] > 0 for step in (1, 2))  # the vocab-parallel exchange ran
    assert all(logged[step]["comm/exchange_rows"] == logged[step]["numeric/positions"] > 0 for step in (1, 2))
    base, trained = load_file(start / "model.safetensors"), load_file(output / "hf" / "model.safetensors")
    assert base.keys() == trained.keys() and not [key for key in base if torch.equal(base[key], trained[key])]
    assert all(base[key].shape == trained[key].shape for key in base)  # every shard gathered back whole
    assert AutoConfig.from_pretrained(output / "hf").vocab_size == 1513 == base["model.embed_tokens.weight"].shape[0]
    assert eval_ce_of_hf_model(output / "hf", corpus) == pytest.approx(logged[2]["eval/ce"], rel=1e-5)
    # launch/export_hf.py from the checkpoint gives the same weights as --export_hf from the live engine.
    run(deepspeed_command(2, EXPORT, output, tmp_path / "from_checkpoint"), timeout=600)
    offline = load_file(tmp_path / "from_checkpoint" / "model.safetensors")
    assert trained.keys() == offline.keys() and all(torch.equal(trained[k], offline[k]) for k in trained)



def test_a_tp2_checkpoint_resumes_at_tp1_and_on_one_rank_through_a_universal_checkpoint(tmp_path, corpus):
    # The uninterrupted reference: 2 ranks at --tp 2 (one data-parallel rank of 2 sequences), 6 steps.
    reference = tmp_path / "tp2"
    run(deepspeed_command(2, *train_args(corpus, reference, steps=6, save_steps=2, tp=2)), timeout=600)
    expected = metrics(reference)
    committed = json.loads((reference / "step00000004" / "commit.json").read_text())
    assert (committed["world_size"], committed["tp_size"], committed["zero_stage"],
            committed["global_batch_size"]) == (2, 2, 3, 2)

    cut_back = functools.partial(cut_back_to_step_4, reference)
    assert_continues = functools.partial(assert_steps_5_and_6_continue, expected)
    # (a) 2 ranks at --tp 1 (two data-parallel ranks of 1 sequence): rank 0 converts as the run resumes.
    output = tmp_path / "tp1"
    cut_back(output)
    completed = run(deepspeed_command(2, *train_args(corpus, output, steps=6, resume=True, tp=1,
                                                     micro_batch_size=1)), timeout=600)
    universal = output / "step00000004" / "universal"
    assert (f"[train] warning: checkpoint step00000004 was written by 2 ranks with --tp 2 and this run has 2 with "
            f"--tp 1: it is converted to a DeepSpeed universal checkpoint in {universal} by rank 0") in completed.stdout
    assert completed.stdout.count("step00000004: converted to a universal checkpoint in") == 1
    assert "resumed from step00000004 at step 4" in completed.stdout and (universal / "converted.json").is_file()
    assert_continues(output)

    # (b) 1 rank of 2 sequences, the checkpoint converted beforehand by the offline command.
    output = tmp_path / "one_rank"
    cut_back(output)
    converted = run([sys.executable, "-m", "smmd_train.checkpoint.saving", "convert", output], timeout=300)
    assert "step00000004: converted to a universal checkpoint" in converted.stdout
    completed = run(deepspeed_command(1, *train_args(corpus, output, steps=6, resume=True)), timeout=600)
    assert "the complete conversion there is reused" in completed.stdout
    assert "step00000004: loading its universal checkpoint" in completed.stdout
    assert_continues(output)



def test_two_nodes_simulated_on_loopback_continue_a_local_hf_checkpoint(tmp_path, corpus):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    output, port = tmp_path / "run", free_port()
    start = local_hf_checkpoint(tmp_path / "start", corpus)
    # Continued pretraining from a local HF dir, with lr 0: the weights must arrive intact through
    # the partitioned load, so the engine's eval equals the saved model's own. Also the one run
    # with activation checkpointing under ZeRO-3, and a fused linear head on a model that
    # from_pretrained hands over in eval mode (train.py stops if a training step made logits).
    launcher = deepspeed_command(1, *train_args(corpus, output, gradient_checkpointing=True, steps=2, model=start,
                                                lr=0.0, fused_linear=True), port=port)
    launcher = [launcher[0], "--hostfile", hostfile, "--no_ssh", "--master_addr", "127.0.0.1", "--master_port",
                port] + launcher[launcher.index(str(TRAIN)):]
    nodes = [subprocess.Popen([str(p) for p in launcher[:1] + ["--node_rank", str(rank)] + launcher[1:]],
                              env=environment(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=hang_guard(600))[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    logged = metrics(output)
    assert logged[0] == {"run/world_size": 2, "run/tp_size": 1, "run/dp_size": 2, "run/sp_size": 1}
    assert logged[2]["loss/ce"] > 0
    assert logged[2]["eval/ce"] == pytest.approx(eval_ce_of_hf_model(start, corpus), rel=1e-5)



def test_sequence_parallel_sp2_trains_the_sp1_model(tmp_path, corpus):
    """--sp 2 on 2 processes (one sequence-parallel group: each rank holds half of every sequence) trains
    the same model as one process on the same global batch, also with the fused linear head: per step
    loss/total, loss/ce, loss/numeric and the gradient norm, the evaluation, and the exported weights.
    SP changes only the order of fp32 sums (attention on the all-to-all'd heads, the loss in two
    shards): the float64 step on 2 ranks equals one device's exactly (tests/train/test_sequence_parallel.py)."""
    from safetensors.torch import load_file

    options = dict(steps=4, gradient_accumulation_steps=2, eval_steps=4)
    runs = {"sp1": (1, {}), "sp2": (2, {"sp": 2}), "sp2-fused": (2, {"sp": 2, "fused_linear": True})}
    run_many({name: deepspeed_command(processes, *train_args(corpus, tmp_path / name, export_hf=tmp_path / name / "hf",
                                                             **options, **flags))
              for name, (processes, flags) in runs.items()}, timeout=900)
    reference = metrics(tmp_path / "sp1")
    weights = load_file(tmp_path / "sp1" / "hf" / "model.safetensors")
    # How far AdamW can move one element in these 4 steps: lr_t * |m_hat / sqrt(v_hat)| each step,
    # with zero3.json's betas (0.9, 0.95); weight decay moves both runs alike.
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())["optimizer"]["params"]
    reach = sum(reference[step]["train/lr"] * adam_step_bound(step, *config["betas"]) for step in (1, 2, 3, 4))
    for name in ("sp2", "sp2-fused"):
        logged = metrics(tmp_path / name)
        assert logged[0] == {"run/world_size": 2, "run/tp_size": 1, "run/dp_size": 1, "run/sp_size": 2}
        for step in (1, 2, 3, 4):
            # fp32 sums over 2 x 2 x 48 tokens in another order: ~1e-7 relative; weights that differ by
            # rounding (below) change the later steps' losses by far less than 1e-5.
            for key in ("loss/total", "loss/ce", "loss/numeric", "numeric/positions", "train/grad_norm"):
                assert logged[step][key] == pytest.approx(reference[step][key], rel=1e-5), (name, step, key)
        assert logged[4]["eval/ce"] == pytest.approx(reference[4]["eval/ce"], rel=1e-5)
        exported = load_file(tmp_path / name / "hf" / "model.safetensors")
        assert exported.keys() == weights.keys()
        for key, tensor in weights.items():
            difference = (exported[key] - tensor).double()
            # Adam divides by sqrt(v): an element whose gradient is at rounding level, or whose steps
            # nearly cancel, may move anywhere within its reach, on any CPU (no relative bound holds:
            # 3e-5 of the norm in one run here, 2e-6 in another). What holds everywhere: no element
            # leaves twice the reach ...
            assert difference.abs().max() <= 2 * reach * (1 + 1e-6), (name, key)
            # ... and in root mean square the runs differ by under 1% of it. Training on other data (a
            # lost shard, a wrong label shift) changes Adam's direction in most elements: an RMS of the
            # order of the reach itself. (Measured here: at most 1.2e-5 of the reach; 1.7e-3 for the largest element.)
            assert difference.pow(2).mean().sqrt() <= 1e-2 * reach, (name, key, difference.pow(2).mean().sqrt() / reach)

