"""The loss plugin installs and imports alone, and every private upstream API in smmd_scale/compat.py
still exists in the installed DeepSpeed / transformers (an upgrade that breaks one fails here); the
trainer's inventory is tested in tests/train/test_trainer_compat.py."""

import configparser
import inspect
import json
import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO
from helpers.models import MOE_FAMILIES, tiny_causal_lm, tiny_llama

from smmd_scale import compat

HEAVY = ("deepspeed", "transformers", "datasets", "tensorboard", "mpi4py", "accelerate", "tokenizers")


def test_import_smmd_scale_pulls_no_heavy_package():
    code = ("import json, sys, smmd_scale; "
            "vocab = smmd_scale.NumericVocab([1, 2], [1.0, 2.0], 4); smmd_scale.SMMDLoss(vocab); "
            f"print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_guard(120))
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


def test_deepspeed_vocab_parallel_linear_has_what_the_loss_reads():
    head_class = compat.vocab_parallel_linear_class()
    assert head_class.__name__ == "VocabParallelLinear"
    source = "".join(inspect.getsource(cls) for cls in head_class.__mro__ if cls.__module__.startswith("deepspeed"))
    for attribute in ("mp_group", "vocab_start_index", "vocab_end_index", "vocab_size"):
        assert f"self.{attribute}" in source, attribute


def test_a_missing_private_api_is_named_with_the_version_it_was_checked_against():
    from types import SimpleNamespace

    with pytest.raises(compat.UpstreamChanged, match=r"^transformers \S+ has no .*\._convert_token_to_id, which "
                                                     r"smmd-scale uses to tell .*; it was checked against "
                                                     r"transformers 5\.24 "):
        compat.model_token_to_id(SimpleNamespace())
    with pytest.raises(compat.UpstreamChanged, match=r"^python 3\.\S+ has no .*\.absent, which smmd-scale uses to "
                                                     r"test; it was checked against python 3\.11 "):
        compat.private(SimpleNamespace(), "absent", package="python", checked="3.11", purpose="test")


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
