"""Every private upstream API in smmd_train/compat.py (the trainer's inventory) still exists in the
installed DeepSpeed / torch / datasets / transformers / Python, and does what the trainer uses it for
(an upgrade that breaks one fails here)."""

import argparse
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.distributed import run_ranks, values_or_raise
from helpers.host_probe import hang_guard
from helpers.models import tiny_llama

from smmd_scale.compat import UpstreamChanged
from smmd_train import compat


def test_deepspeed_private_apis_exist():
    from deepspeed import DeepSpeedEngine
    from deepspeed.utils import groups

    assert "tensor_model_parallel_size" in inspect.signature(groups._init_tp_mesh_device).parameters
    for name in ("_zero3_consolidated_16bit_state_dict", "_consolidated_16bit_state_dict"):
        assert callable(getattr(DeepSpeedEngine, name)), name
    # What the ordered shutdown releases: ZeRO-3's module stack is a module-level list.
    from deepspeed.runtime.zero import parameter_offload
    assert isinstance(parameter_offload.FWD_MODULE_STACK, list)


def test_cpu_allreduce_segment_is_named_as_deepspeed_names_it(monkeypatch):
    import deepspeed

    # The installed DeepSpeed's own C++ source is the reference.
    source = (Path(inspect.getfile(deepspeed)).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp").read_text()
    assert '#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"' in source
    assert '"%s_%d_%s_%s",\n             SHM_BUFFER_NAME,\n             getuid(),' in source
    assert 'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank);' in source
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert compat.cpu_allreduce_segment(3) == f"deepspeed_allreduce_buffer_{os.getuid()}_10.0.0.1_29500_3"


def test_a_missing_private_api_is_named():
    class Engine:
        def zero_optimization_partition_weights(self):
            return True

    with pytest.raises(UpstreamChanged, match=r"deepspeed .* has no .*_zero3_consolidated_16bit_state_dict, "
                                                     r"which smmd-scale uses to gather a ZeRO-3 model for export"):
        compat.consolidated_state_dict(Engine())


def test_ds_to_universal_gets_every_argument_its_command_line_gives(monkeypatch):
    from deepspeed.checkpoint import ds_to_universal

    # What the converter's own parser makes of a minimal command line: the same names as ours.
    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", "in", "--output_folder", "out"])
    parsed = vars(ds_to_universal.parse_arguments())
    passed = {}
    monkeypatch.setattr(ds_to_universal, "main", lambda args: passed.update(vars(args)))
    compat.ds_to_universal("in", "out")
    assert passed.keys() == parsed.keys()
    assert {**parsed, "num_extract_workers": 1, "num_merge_workers": 1} == passed  # its defaults, one worker


def test_universal_checkpoint_loading_switches_deepspeed_s_own_flag_for_one_block():
    from types import SimpleNamespace

    from deepspeed import DeepSpeedEngine

    # DeepSpeed's loader asks the engine, which reads this config attribute.
    assert "self._config.load_universal_checkpoint" in inspect.getsource(DeepSpeedEngine.load_universal_checkpoint)
    engine = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False))
    engine.load_universal_checkpoint = lambda: DeepSpeedEngine.load_universal_checkpoint(engine)
    with compat.universal_checkpoint_loading(engine):
        assert engine.load_universal_checkpoint() is True
    assert engine.load_universal_checkpoint() is False
    with pytest.raises(KeyError), compat.universal_checkpoint_loading(engine):
        raise KeyError("a failed load")
    assert engine.load_universal_checkpoint() is False
    with pytest.raises(UpstreamChanged, match="has no .*load_universal_checkpoint, which smmd-scale uses to "
                                                     "load a universal checkpoint"):
        with compat.universal_checkpoint_loading(SimpleNamespace(_config=SimpleNamespace())):
            pass


def _tensor_parallel_groups(rank, world_size):
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group run_ranks started
    compat.init_tensor_parallel_groups(world_size)
    # Every group c10d made, for the ordered shutdown: the default one and DeepSpeed's TP and DP groups.
    made = compat.process_groups()
    assert dist.group.WORLD in made and groups.get_tensor_model_parallel_group() in made
    # Each rank made its one-rank data-parallel group through rank 0's store: none leaves (rank 0 taking
    # the store with it) before every rank has made its groups.
    dist.barrier()
    return groups.get_tensor_model_parallel_world_size(), dist.get_world_size(groups.get_data_parallel_group())


# slow: on a fresh machine DeepSpeed's first init compiles its CPU shared-memory op (~30 s on 2 cores)
@pytest.mark.gloo
@pytest.mark.slow
def test_init_tensor_parallel_groups_on_two_gloo_ranks():
    assert values_or_raise(run_ranks(_tensor_parallel_groups, 2, fresh=True)) == [(2, 1), (2, 1)]


def test_release_sequence_parallel_groups_drops_deepspeed_s_references():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.sequence import layer

    # What register_with_transformers hands back as the mpu is this module.
    assert "import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu" in inspect.getsource(
        UlyssesSPAttentionHF.register_with_transformers)
    layer._all_to_all_groups["a group"] = object()
    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = object()
    compat.release_sequence_parallel_groups(parallel_state_sp, "a group")
    assert "a group" not in layer._all_to_all_groups
    assert parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None
    compat.release_sequence_parallel_groups(parallel_state_sp, "a group")  # twice is harmless


def test_process_groups_without_a_process_group_is_empty():
    assert not dist.is_initialized()
    assert compat.process_groups() == []


def test_import_torch_dynamo():
    compat.import_torch_dynamo()
    assert "torch._dynamo" in sys.modules


def test_tensorboard_file_writer_writes_into_the_run_itself(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    file_writer = compat.tensorboard_file_writer(writer)
    assert file_writer.get_logdir() == str(tmp_path)
    writer.close()


def test_attention_implementation_follows_the_public_setter():
    model = tiny_llama(32, hidden_size=16, layers=1, heads=2, kv_heads=2, seed=None)
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        assert compat.attention_implementation(model) == implementation


def test_dataset_fingerprint_follows_the_content():
    import datasets

    first = datasets.Dataset.from_dict({"text": ["1 + 1 = 2"]})
    same = datasets.Dataset.from_dict({"text": ["1 + 1 = 2"]})
    assert compat.dataset_fingerprint(first) == compat.dataset_fingerprint(same)
    assert compat.dataset_fingerprint(first) != compat.dataset_fingerprint(datasets.Dataset.from_dict({"text": ["2"]}))
    mapped = first.map(lambda record: {"text": record["text"] + "."})
    assert compat.dataset_fingerprint(mapped) != compat.dataset_fingerprint(first)


def test_parser_actions_and_the_defaults_help_formatter():
    parser = argparse.ArgumentParser(formatter_class=compat.DefaultsHelpFormatter, description="line one\n  line two")
    parser.add_argument("--steps", type=int, default=3, help="how many")
    parser.add_argument("--name", default=None, help="a name")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--lr", type=float, default=0.1, help="the rate (%(default)s)")
    assert [action.option_strings for action in compat.parser_actions(parser)] == [
        ["-h", "--help"], ["--steps"], ["--name"], ["--flag"], ["--lr"]]
    text = " ".join(parser.format_help().split())
    assert "line one\n  line two" in parser.format_help()  # the description as written
    assert "how many (default: 3)" in text
    assert "a name --flag" in text and "a switch --lr" in text  # no default shown for None / False
    assert "the rate (0.1)" in text and "(default: 0.1)" not in text
    assert "show this help message and exit --steps" in text


def test_a_missing_trainer_private_api_names_its_package_and_checked_version():
    with pytest.raises(UpstreamChanged, match=r"^python \S+ has no .*\._actions, which smmd-scale uses to list the "
                                              r"trainer's flags; it was checked against python 3\.11 "):
        compat.parser_actions(object())


def test_supports_sdpa_reads_the_model_class_flag():
    import transformers

    from smmd_train.compat import supports_sdpa

    assert supports_sdpa(transformers.LlamaForCausalLM) is True
    assert supports_sdpa(transformers.Gemma2ForCausalLM) is False  # soft-capped attention runs eager


MUON_CHECK = r"""
import json, os, sys
import torch
import deepspeed
from smmd_train import compat

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
model = torch.nn.Linear(4, 4)
with compat.muon_left_unimported(config):
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inside = {"stand_in": MUON in sys.modules and not hasattr(sys.modules[MUON], "__file__")}
seen = {"kernels_compiled": "deepspeed.runtime.zero.muon.original_muon" in sys.modules,
        "left_after": MUON in sys.modules, "steps": type(engine.optimizer).__name__, **inside}
with compat.muon_left_unimported({"optimizer": {"type": "Muon"}}):
    seen["stand_in_for_muon"] = MUON in sys.modules
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
seen["real_after"] = issubclass(MuonWithAuxAdam, torch.optim.Optimizer)
engine.destroy()
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_zero3_engine_builds_without_compiling_deepspeed_s_muon_kernels():
    # A fresh interpreter: the suite's own process may have imported Muon already.
    import json
    import subprocess

    from smmd_train.distributed.launcher import free_port

    completed = subprocess.run([sys.executable, "-c", MUON_CHECK, str(free_port())], capture_output=True, text=True,
                               timeout=hang_guard(300), env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    seen = json.loads(completed.stdout.strip().splitlines()[-1])
    assert seen == {"stand_in": True, "kernels_compiled": False, "left_after": False,
                    "steps": "DeepSpeedZeroOptimizer_Stage3", "stand_in_for_muon": False, "real_after": True}, seen
