"""smmd_scale.install on a plain Hugging Face causal LM (TP=1) and with transformers.Trainer."""

import pytest
import torch
from helpers import models
from helpers.reference import reference_total
from transformers import Trainer, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss

import smmd_scale
from smmd_scale import NumericVocab, SMMDLoss

VOCAB_SIZE = 96
NUMERIC_IDS = list(range(20, 30))  # ten "digit" tokens with values 0..9


def tiny_llama(seed=0):
    return models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=seed)


def numeric_vocab():
    return NumericVocab(NUMERIC_IDS, list(range(10)), VOCAB_SIZE)


def batch(generator, rows=2, length=12):
    ids = torch.randint(0, VOCAB_SIZE, (rows, length), generator=generator)
    ids[:, 2:8] = torch.randint(20, 30, (rows, 6), generator=generator)
    labels = ids.clone()
    labels[:, :1] = -100
    return ids, labels


def test_install_and_restore():
    model = tiny_llama()
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=0.5)
    assert model.loss_function is installed.hook and not installed.vocab_parallel
    installed.restore()
    assert model.loss_function is ForCausalLMLoss
    custom = lambda **kwargs: torch.tensor(0.0)  # noqa: E731  (a user's own hook is put back too)
    model.loss_function = custom
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()))
    installed.restore()
    assert model.loss_function is custom


@pytest.mark.parametrize("num_items", [None, 37])
def test_weight_zero_equals_hf_loss_and_gradients(generator, num_items):
    ids, labels = batch(generator)
    reference_model, model = tiny_llama(), tiny_llama()
    reference_loss = reference_model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
    reference_loss.backward()
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=0.0)
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
    loss.backward()
    # fp32 model, and HF's CE (ForCausalLMLoss upcasts to fp32) and ours in fp32: a few fp32 ulp (1.2e-7) apart.
    assert loss.item() == pytest.approx(reference_loss.item(), rel=1e-6)
    # The logits' gradients a few fp32 ulp apart, carried back through the fp32 layers (measured <= 0.22 of this).
    for (name, ours), theirs in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, rtol=1e-4, atol=1e-7), name
    assert installed.last_stats["numeric_tokens"] > 0


def test_hook_computes_ce_plus_smmd_on_shifted_labels(generator):
    ids, labels = batch(generator)
    model = tiny_llama().double()
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=0.3)
    output = model(input_ids=ids, labels=labels)
    shifted = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], dim=1)
    total, ce, smmd = reference_total(output.logits.detach(), shifted, NUMERIC_IDS, list(range(10)), weight=0.3)
    # float64 model and reference on the same logits, the same math in another order: a few ulp of a loss ~ 5.
    assert output.loss.item() == pytest.approx(total.item(), abs=1e-10)
    assert installed.hook.last_losses[1].item() == pytest.approx(ce.item(), abs=1e-10)
    # shift_labels given explicitly are used as they are.
    explicit = model.loss_function(output.logits, None, VOCAB_SIZE, shift_labels=shifted)
    assert explicit.item() == pytest.approx(total.item(), abs=1e-10)


def test_gradient_accumulation_keeps_smmd_at_its_mean_scale(generator):
    """Two micro-batches that are copies of one batch, with HF's num_items_in_batch over both,
    sum to exactly the one-batch loss: SMMD is not counted twice."""
    ids, labels = batch(generator)
    model = tiny_llama().double()
    smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=2.0)
    single = model(input_ids=ids, labels=labels).loss
    items = int((labels[:, 1:] != -100).sum())
    accumulated = sum(model(input_ids=ids, labels=labels, num_items_in_batch=2 * items).loss for _ in range(2))
    # float64: each copy gives half of the same sums (over twice the count), a few ulp apart at most.
    assert accumulated.item() == pytest.approx(single.item(), rel=1e-12)


def test_install_rejects_a_vocab_built_for_another_width():
    with pytest.raises(ValueError, match="logits have 96 columns .* vocab_size=100"):
        smmd_scale.install(tiny_llama(), SMMDLoss(NumericVocab([1, 2], [1.0, 2.0], vocab_size=100)))


def test_ignore_index_mismatch_is_named(generator):
    model = tiny_llama()
    smmd_scale.install(model, SMMDLoss(numeric_vocab()))
    ids, labels = batch(generator)
    logits = model(input_ids=ids).logits
    with pytest.raises(ValueError, match="ignore_index=-1 .* ignore_index=-100"):
        model.loss_function(logits, labels, VOCAB_SIZE, ignore_index=-1)


def test_trainer_trains_with_the_hook(tmp_path, generator):
    """transformers.Trainer with gradient accumulation: the hook is what it optimises, the loss
    falls on a fixed batch, and the last step's statistics are exposed."""
    ids, labels = batch(generator, rows=4, length=16)

    model = tiny_llama()
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=1.0)
    calls = []
    hook_call = installed.hook.__call__

    def recording_hook(*args, **kwargs):
        loss = hook_call(*args, **kwargs)
        calls.append((loss.item(), kwargs.get("num_items_in_batch")))
        return loss

    model.loss_function = recording_hook
    arguments = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=2,
                                  gradient_accumulation_steps=2, learning_rate=3e-3, report_to=[], use_cpu=True,
                                  save_strategy="no", logging_steps=1, seed=0)
    Trainer(model=model, args=arguments, train_dataset=models.token_rows(ids, labels, 8)).train()
    assert len(calls) == 24
    assert all(num_items is not None for _, num_items in calls)  # HF passes its token count
    first, last = sum(loss for loss, _ in calls[:4]), sum(loss for loss, _ in calls[-4:])
    assert last < first
    assert installed.last_stats["numeric_tokens"] > 0 and 0 <= installed.last_stats["numeric_accuracy"] <= 1


def test_installed_ntl_is_ce_plus_the_ntloss_package(generator):
    """install(model, NTLoss(vocab), ...) trains on CE + weight x NTL-WAS: the same value as the
    ntloss package's NTL-WAS on the model's logits (its float32 distance table: parity near 1e-7)."""
    from ntloss import NTLoss as PackageNTLoss
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    for index, token_id in enumerate(NUMERIC_IDS):
        vocab[str(index)] = token_id
        del vocab[f"w{token_id}"]
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)

    ids, labels = batch(generator)
    model = tiny_llama().double()
    numeric_vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=VOCAB_SIZE)
    installed = smmd_scale.install(model, smmd_scale.NTLoss(numeric_vocab, squash_factor=9.0), weight=0.4)
    output = model(input_ids=ids, labels=labels)
    shifted = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], dim=1)
    ce = torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB_SIZE), shifted.reshape(-1))
    ntl = PackageNTLoss(tokenizer, vocab_size=VOCAB_SIZE, digit_level=False, squash_factor=9.0)(output.logits, shifted)
    assert output.loss.item() == pytest.approx((ce + 0.4 * ntl).item(), rel=1e-6)
    assert installed.hook.last_losses[2].item() == pytest.approx(ntl.item(), rel=1e-6) and ntl.item() > 0
    assert installed.last_stats["numeric_tokens"] > 0
    assert installed.last_stats["ntl_was"] == pytest.approx(ntl.item(), rel=1e-6)
    # The second-round call (a vocabulary, numeric_loss=...) was removed in 0.3.0: refused, naming its replacement.
    with pytest.raises(TypeError, match=r"install\(model, vocab, \.\.\.\) was removed in 0\.3\.0"):
        smmd_scale.install(model, numeric_vocab, 0.4)


def _trainer_weights(tmp_path, rows, accumulation, attach):
    """Weights after 3 SGD steps of 4 sequences each (micro-batch 4 / accumulation) with the hook."""
    ids, labels = rows
    model = tiny_llama(seed=3)
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=1.0)
    arguments = TrainingArguments(output_dir=str(tmp_path / f"ga{accumulation}{attach}"), max_steps=3,
                                  per_device_train_batch_size=4 // accumulation,
                                  gradient_accumulation_steps=accumulation, learning_rate=0.5, optim="sgd",
                                  lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                                  seed=0, data_seed=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=models.token_rows(ids, labels))
    if attach:
        installed.attach_to_trainer(trainer)
    trainer.train()
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def test_trainer_gradient_accumulation_trains_the_same_objective(tmp_path, generator):
    """With attach_to_trainer the Trainer's steps are the same for accumulation 1, 2 and 4, numeric
    term included, although the numbers sit in a few sequences; without it they are not."""
    ids, labels = batch(generator, rows=12, length=16)
    numeric = torch.isin(labels, torch.tensor(NUMERIC_IDS))
    labels[3:] = torch.where(numeric[3:], NUMERIC_IDS[0] - 1, labels[3:])  # numbers only in the first 3 rows
    ids[3:] = torch.where(numeric[3:], NUMERIC_IDS[0] - 1, ids[3:])
    assert torch.isin(labels[:3, 1:], torch.tensor(NUMERIC_IDS)).any()
    start = torch.cat([parameter.detach().reshape(-1) for parameter in tiny_llama(seed=3).parameters()])
    reference = _trainer_weights(tmp_path, (ids, labels), 1, attach=True)
    assert (reference - start).abs().max() > 1e-3  # the steps train
    for accumulation in (2, 4):
        weights = _trainer_weights(tmp_path, (ids, labels), accumulation, attach=True)
        # fp32 model: the micro-batches add the same gradient in other groupings (~1e-7 relative), over 3 SGD steps.
        assert (weights - reference).abs().max().item() <= 1e-5 * reference.abs().max().item(), accumulation
    unattached = _trainer_weights(tmp_path, (ids, labels), 4, attach=False)
    assert (unattached - reference).abs().max().item() > 1e-4  # per-micro-batch numeric means train another thing


@pytest.mark.parametrize("arguments, message", [
    ({"label_smoothing_factor": 0.1},
     r"label_smoothing_factor=0.1: .* pass ce_options=\{'label_smoothing': 0.1\} to smmd_scale.install"),
    ({"use_liger_kernel": True}, r"use_liger_kernel=True: Liger's fused linear cross-entropy replaces"),
])
def test_attach_refuses_a_trainer_whose_loss_skips_the_hook(tmp_path, generator, arguments, message):
    """The Trainer's label smoother and Liger's fused linear CE compute the loss without the model's
    loss_function: attach_to_trainer refuses them before it changes anything. Liger without its fused
    head keeps the model's loss and is accepted."""
    ids, labels = batch(generator)
    model = tiny_llama()
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()))

    def trainer(**extra):
        return Trainer(model=model, train_dataset=models.token_rows(ids, labels), args=TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", **extra))

    refused = trainer(**arguments)
    with pytest.raises(ValueError, match=message):
        installed.attach_to_trainer(refused)
    assert "get_batch_samples" not in vars(refused)
    if "use_liger_kernel" in arguments:
        installed.attach_to_trainer(trainer(use_liger_kernel=True,
                                            liger_kernel_config={"fused_linear_cross_entropy": False}))


def test_the_hook_records_its_losses_by_name_and_how_it_ran(generator):
    from smmd_scale.integrations import NumericCausalLMLoss

    vocab = NumericVocab(list(range(3, 13)), list(range(10)), 24)
    logits = torch.randn(2, 5, 24, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 24, (2, 5), generator=generator)
    targets[0, :3] = torch.tensor([4, 7, 12])
    hook = NumericCausalLMLoss(SMMDLoss(vocab), weight=0.5)
    assert hook.last_path is None
    total = hook(logits, labels=targets)
    losses = hook.last_losses
    assert hook.last_path == "logits"
    assert losses.total.item() == total.item()
    # float64: the total is ce + 0.5 x numeric, up to the order of the op's own additions (a few ulp).
    assert losses.total.item() == pytest.approx(losses.ce.item() + 0.5 * losses.numeric.item(), rel=1e-12)
    total_, ce_, numeric_ = losses  # still unpacks as the (total, ce, numeric) triple
    assert numeric_ is losses.numeric
