"""The second-round names, kept through 0.2.0 with a warning, were removed in 0.3.0: each use is
refused by name, saying what replaced it (``smmd_scale.removed``)."""

import pytest
import torch
from helpers import models

import smmd_scale
from smmd_scale import NTLoss, NumericVocab, SMMDLoss
from smmd_scale.integrations import NumericCausalLMLoss


@pytest.mark.parametrize("module, name, replacement", [
    ("smmd_scale", "smmd_cross_entropy", "numeric_cross_entropy"),
    ("smmd_scale", "linear_smmd_cross_entropy", "linear_numeric_cross_entropy"),
    ("smmd_scale", "vocab_parallel_smmd_cross_entropy", "vocab_parallel_numeric_cross_entropy"),
    ("smmd_scale", "SMMDOutput", "NumericOutput"),
    ("smmd_scale.loss", "smmd_cross_entropy", "numeric_cross_entropy"),
    ("smmd_scale.loss", "SMMDOutput", "NumericOutput"),
    ("smmd_scale.fused_linear", "linear_smmd_cross_entropy", "linear_numeric_cross_entropy"),
    ("smmd_scale.integrations", "SMMDCausalLMLoss", "NumericCausalLMLoss"),
    ("smmd_scale.integrations", "vocab_parallel_smmd_cross_entropy", "vocab_parallel_numeric_cross_entropy"),
    ("smmd_scale.integrations.hf", "SMMDCausalLMLoss", "NumericCausalLMLoss"),
    ("smmd_scale.integrations.megatron", "vocab_parallel_smmd_cross_entropy", "vocab_parallel_numeric_cross_entropy"),
])
def test_a_removed_name_is_refused_naming_its_replacement(module, name, replacement):
    import importlib

    imported = importlib.import_module(module)
    with pytest.raises(AttributeError, match=rf"{name} was removed in 0\.3\.0; use {replacement}"):
        getattr(imported, name)
    with pytest.raises(ImportError, match=rf"cannot import name '{name}'"):  # (Python words this one itself)
        exec(f"from {module} import {name}", {})
    assert name not in getattr(imported, "__all__", ())
    assert hasattr(imported, replacement.split(" ")[0]) or hasattr(smmd_scale, replacement.split(" ")[0])
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):  # other names as before
        imported.no_such_name  # noqa: B018


def test_removed_attributes_are_refused_naming_their_replacement(generator):
    vocab = NumericVocab(list(range(3, 13)), list(range(10)), 24)
    logits = torch.randn(2, 5, 24, generator=generator, dtype=torch.float64)
    output = smmd_scale.numeric_cross_entropy(logits, torch.randint(0, 24, (2, 5), generator=generator),
                                              SMMDLoss(vocab))
    with pytest.raises(AttributeError, match=r"NumericOutput\.smmd was removed in 0\.3\.0; use NumericOutput\.numeric"):
        output.smmd  # noqa: B018
    hook = NumericCausalLMLoss(SMMDLoss(vocab), weight=0.5)
    with pytest.raises(AttributeError, match=r"NumericCausalLMLoss\.smmd was removed.*use NumericCausalLMLoss\."
                                             r"numeric_loss"):
        hook.smmd  # noqa: B018


def test_install_of_a_vocabulary_is_refused_naming_the_call_that_replaced_it():
    vocab = NumericVocab(list(range(3, 13)), list(range(10)), 24)
    model = models.tiny_llama(24, hidden_size=16, max_positions=16, seed=0)
    with pytest.raises(TypeError, match=r"install\(model, vocab, \.\.\.\) was removed in 0\.3\.0; use install\(model, "
                                        r"numeric_loss, \.\.\.\).*install\(model, SMMDLoss\(vocab\)\)"):
        smmd_scale.install(model, vocab, 0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mode'"):  # a loss's options go to the loss
        smmd_scale.install(model, NTLoss(vocab), mode="mmd")
    assert model.loss_function.__class__.__name__ != "NumericCausalLMLoss"  # nothing was installed


def test_the_version_is_the_one_that_removed_them():
    assert smmd_scale.__version__ == "0.3.0"
