"""The loss plugin installs and imports alone, and every private upstream API in smmd_scale/compat.py
still exists in the installed DeepSpeed / transformers (an upgrade that breaks one fails here)."""

import configparser
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.distributed import run_ranks, values_or_raise
from helpers.launching import REPO
from helpers.models import MOE_FAMILIES, tiny_causal_lm, tiny_llama

from smmd_scale import compat

HEAVY = ("deepspeed", "transformers", "datasets", "tensorboard", "mpi4py", "accelerate", "tokenizers")


def test_import_smmd_scale_pulls_no_heavy_package():
    code = ("import json, sys, smmd_scale; "
            "vocab = smmd_scale.NumericVocab([1, 2], [1.0, 2.0], 4); smmd_scale.SMMDLoss(vocab); "
            f"print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout.splitlines()[-1]) == []


def test_the_loss_plugin_requires_only_torch_and_numpy():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    required = [line.split(">")[0].split("=")[0].strip() for line in
                setup["options"]["install_requires"].strip().splitlines()]
    assert required == ["torch", "numpy"]
    extras = setup["options.extras_require"]
    assert {"train", "mpi", "bench", "test"} <= set(extras)
    for package in ("deepspeed", "transformers", "datasets", "tensorboard", "mpi4py", "tqdm", "accelerate"):
        assert package in extras["train"], package


def test_model_token_to_id_of_fast_and_python_tokenizers():
    from helpers.style_tokenizers import llama3_style
    from transformers import ByT5Tokenizer

    fast = llama3_style()
    assert compat.model_token_to_id(fast)("42") == fast.convert_tokens_to_ids("42")
    slow = ByT5Tokenizer()
    assert compat.model_token_to_id(slow)("a") == slow.convert_tokens_to_ids("a")


def test_assigned_loss_function_of_an_hf_model():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = tiny_llama(32, hidden_size=16, layers=1, heads=2, kv_heads=2, seed=None)
    assert compat.assigned_loss_function(model) == (False, None)

    def hook(**kwargs):
        return None

    model.loss_function = hook
    assert compat.assigned_loss_function(model) == (True, hook) and model.loss_function is hook
    compat.forget_loss_function(model)
    assert model.loss_function is ForCausalLMLoss


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_load_balancing_loss_of_each_moe_family(family):
    """The fused forward calls it positionally, as the MoE forwards do."""
    model = tiny_causal_lm(family, 32, tied=False, layers=1)
    function = compat.router_load_balancing_loss(model)
    assert function.__module__ == type(model).__module__
    assert list(inspect.signature(function).parameters) == ["gate_logits", "num_experts", "top_k", "attention_mask"]


def test_deepspeed_private_apis_exist():
    from deepspeed import DeepSpeedEngine
    from deepspeed.utils import groups

    head_class = compat.vocab_parallel_linear_class()
    assert head_class.__name__ == "VocabParallelLinear"
    source = "".join(inspect.getsource(cls) for cls in head_class.__mro__ if cls.__module__.startswith("deepspeed"))
    for attribute in ("mp_group", "vocab_start_index", "vocab_end_index", "vocab_size"):
        assert f"self.{attribute}" in source, attribute
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

    with pytest.raises(compat.UpstreamChanged, match=r"deepspeed .* has no .*_zero3_consolidated_16bit_state_dict, "
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
    with pytest.raises(compat.UpstreamChanged, match="has no .*load_universal_checkpoint, which smmd-scale uses to "
                                                     "load a universal checkpoint"):
        with compat.universal_checkpoint_loading(SimpleNamespace(_config=SimpleNamespace())):
            pass


def _tensor_parallel_groups(rank, world_size):
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group run_ranks started
    compat.init_tensor_parallel_groups(world_size)
    return groups.get_tensor_model_parallel_world_size(), dist.get_world_size(groups.get_data_parallel_group())


# slow: on a fresh machine DeepSpeed's first init compiles its CPU shared-memory op (~30 s on 2 cores)
@pytest.mark.gloo
@pytest.mark.slow
def test_init_tensor_parallel_groups_on_two_gloo_ranks():
    assert values_or_raise(run_ranks(_tensor_parallel_groups, 2, fresh=True)) == [(2, 1), (2, 1)]


def test_trainer_count_items_is_the_trainers_own_token_count(tmp_path):
    import torch
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(32, hidden_size=16, layers=1, heads=2, kv_heads=2, seed=None)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    labels = torch.tensor([[-100, 3, 4, -100, 5], [1, 2, -100, 7, 8]])
    batches = [{"input_ids": labels.clamp_min(0), "labels": labels}, {"input_ids": labels[:1].clamp_min(0),
                                                                        "labels": labels[:1]}]
    # Causal LMs shift: position 0's label is never a target, so it is not counted.
    assert int(compat.trainer_count_items(trainer, batches, torch.device("cpu"))) == 3 + 3 + 3
