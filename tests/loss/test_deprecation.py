"""The second-round names stay one release: each warns (FutureWarning, naming the new name) and
gives exactly what the new name gives."""

import pytest
import torch

import smmd_scale
from smmd_scale import NTLoss, NumericVocab, SMMDLoss
from smmd_scale.integrations import NumericCausalLMLoss, SMMDCausalLMLoss


@pytest.fixture
def problem(generator):
    vocab = NumericVocab(list(range(3, 13)), list(range(10)), 24)
    logits = torch.randn(2, 5, 24, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 24, (2, 5), generator=generator)
    targets[0, :3] = torch.tensor([4, 7, 12])
    return vocab, logits, targets


def test_renamed_functions_warn_and_agree(problem):
    vocab, logits, targets = problem
    loss = SMMDLoss(vocab) + 0.3 * NTLoss(vocab)
    new = smmd_scale.numeric_cross_entropy(logits, targets, loss, weight=0.5)
    with pytest.warns(FutureWarning, match="smmd_cross_entropy is deprecated.*use numeric_cross_entropy"):
        old = smmd_scale.smmd_cross_entropy(logits, targets, smmd=loss, weight=0.5)
    assert old.total.item() == new.total.item() and old.stats == new.stats
    with pytest.warns(FutureWarning, match="NumericOutput.smmd is deprecated.*NumericOutput.numeric"):
        assert old.smmd is old.numeric

    hidden, head = torch.randn(10, 6, dtype=torch.float64), torch.randn(24, 6, dtype=torch.float64)
    fused = smmd_scale.linear_numeric_cross_entropy(hidden, head, targets.reshape(-1), loss)
    with pytest.warns(FutureWarning, match="use linear_numeric_cross_entropy"):
        old_fused = smmd_scale.linear_smmd_cross_entropy(hidden, head, targets.reshape(-1), loss)
    assert old_fused.total.item() == fused.total.item()

    ce, numeric = smmd_scale.vocab_parallel_numeric_cross_entropy(logits, targets, loss)
    with pytest.warns(FutureWarning, match="use vocab_parallel_numeric_cross_entropy"):
        old_ce, old_numeric = smmd_scale.vocab_parallel_smmd_cross_entropy(logits, targets, smmd=loss)
    assert torch.equal(ce, old_ce) and torch.equal(numeric, old_numeric)


def test_renamed_classes_warn_and_are_the_new_ones(problem):
    vocab, logits, targets = problem
    with pytest.warns(FutureWarning, match="SMMDCausalLMLoss is deprecated.*use NumericCausalLMLoss"):
        hook = SMMDCausalLMLoss(SMMDLoss(vocab), weight=0.5)
    assert isinstance(hook, NumericCausalLMLoss)
    with pytest.warns(FutureWarning, match="SMMDCausalLMLoss.smmd is deprecated"):
        assert hook.smmd is hook.numeric_loss
    with pytest.warns(FutureWarning, match="SMMDOutput is deprecated.*use NumericOutput"):
        output = smmd_scale.SMMDOutput(total=torch.zeros(()), ce=torch.zeros(()), numeric=torch.zeros(()), stats={})
    assert isinstance(output, smmd_scale.NumericOutput)


def test_the_hook_records_its_losses_by_name_and_how_it_ran(problem):
    vocab, logits, targets = problem
    hook = NumericCausalLMLoss(SMMDLoss(vocab), weight=0.5)
    assert hook.last_path is None
    total = hook(logits, labels=targets)
    losses = hook.last_losses
    assert hook.last_path == "logits"
    assert losses.total.item() == total.item()
    assert losses.total.item() == pytest.approx(losses.ce.item() + 0.5 * losses.numeric.item(), rel=1e-12)
    total_, ce_, numeric_ = losses  # still unpacks as the (total, ce, numeric) triple
    assert numeric_ is losses.numeric


def test_install_of_a_vocabulary_warns_and_trains_what_install_of_its_loss_trains(problem, generator):
    """The second-round ``install(model, vocab, weight, numeric_loss=None, **smmd_options)``: SMMD with the
    options by default, or the ``numeric_loss`` given (built on that vocabulary); install now takes the loss."""
    from helpers import models

    vocab, _, _ = problem
    ids = torch.randint(0, 24, (2, 9), generator=generator)
    ids[:, 2:6] = torch.randint(3, 13, (2, 4), generator=generator)

    def trained_loss(*args, **kwargs):
        model = models.tiny_llama(24, hidden_size=16, max_positions=16, seed=0)
        installed = smmd_scale.install(model, *args, **kwargs)
        total = model(input_ids=ids, labels=ids).loss.item()
        installed.restore()
        return total, type(installed.hook.numeric_loss), installed.hook.weight

    new = trained_loss(SMMDLoss(vocab, mode="mmd"), 0.5)
    with pytest.warns(FutureWarning, match=r"install\(model, vocab, \.\.\.\) is deprecated.*use install\(model, "
                                           r"numeric_loss, \.\.\.\), the loss built on the vocab"):
        assert trained_loss(vocab, 0.5, mode="mmd") == new
    ntl = NTLoss(vocab)
    with pytest.warns(FutureWarning, match="install"):
        assert trained_loss(vocab, weight=0.5, numeric_loss=ntl) == trained_loss(ntl, weight=0.5)
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="pass SMMD options"):
        smmd_scale.install(models.tiny_llama(24, hidden_size=16, max_positions=16), vocab, numeric_loss=ntl,
                           mode="mmd")
    with pytest.raises(TypeError, match=r"install\(\) takes no mode: pass a loss's options to the loss"):
        smmd_scale.install(models.tiny_llama(24, hidden_size=16, max_positions=16), ntl, mode="mmd")
