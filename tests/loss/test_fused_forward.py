"""install(..., fused_linear=True) on plain Hugging Face models: a training forward with labels never
computes logits and gives the materialized hook's loss and gradients (tiny Llama, Mistral, Qwen2 and
Qwen3, tied and untied, float64); evaluation and generation still return logits; models whose head
or loss is more than linear + CE are refused; transformers.Trainer trains the same way."""

import pytest
import torch
import transformers
from helpers.models import token_rows

import smmd_scale
from smmd_scale import NumericVocab

VOCAB_SIZE = 80
FAMILIES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}


def tiny(family, tied, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    config = FAMILIES[family](vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                              tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def numeric_vocab():
    return NumericVocab(list(range(20, 35)), list(range(15)), VOCAB_SIZE)


def batch(generator, rows=3, length=11):
    ids = torch.randint(0, VOCAB_SIZE, (rows, length), generator=generator)
    ids[:, 1::2] = torch.randint(20, 35, (rows, length // 2), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad()
    output = model(input_ids=ids, labels=labels, **kwargs)
    output.loss.backward()
    return output, {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_training_forward_equals_the_materialized_hook(generator, family, tied):
    model = tiny(family, tied)
    ids, labels = batch(generator)
    installed = smmd_scale.install(model, numeric_vocab(), weight=0.8)
    model.train()
    reference, reference_grads = loss_and_grads(model, ids, labels, num_items_in_batch=21)
    reference_stats = installed.last_stats
    installed.restore()

    fused_install = smmd_scale.install(model, numeric_vocab(), weight=0.8, fused_linear=True)
    fused, fused_grads = loss_and_grads(model, ids, labels, num_items_in_batch=21)
    assert fused.logits is None and reference.logits is not None
    assert fused.loss.item() == pytest.approx(reference.loss.item(), rel=1e-10)
    for name, grad in reference_grads.items():
        assert (fused_grads[name] - grad).abs().max() <= 1e-10 * grad.abs().max().clamp_min(1e-30), name
    for key in ("mmd", "smooth", "numeric_accuracy", "numeric_mae", "numeric_tokens", "tokens"):
        assert fused_install.last_stats[key] == pytest.approx(reference_stats[key], rel=1e-10)


def test_evaluation_generation_and_explicit_logits_use_the_models_forward(generator):
    model = tiny("llama", tied=True)
    ids, labels = batch(generator)
    installed = smmd_scale.install(model, numeric_vocab(), fused_linear=True)
    model.train()
    assert model(input_ids=ids, labels=labels).logits is None
    kept = model(input_ids=ids, labels=labels, skip_logits=False)  # logits explicitly wanted
    assert kept.logits.shape == (3, 11, VOCAB_SIZE) and kept.loss is not None
    assert model(input_ids=ids).logits.shape == (3, 11, VOCAB_SIZE)  # no labels
    model.eval()
    evaluated = model(input_ids=ids, labels=labels)
    assert evaluated.logits is not None and evaluated.loss.item() == pytest.approx(kept.loss.item(), rel=1e-10)
    assert installed.last_stats["numeric_tokens"] > 0
    generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 7)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=ids, skip_logits=True)


def test_restore_puts_back_the_forward_and_the_loss_function(generator):
    model = tiny("qwen2", tied=False)
    original_forward = model.forward
    installed = smmd_scale.install(model, numeric_vocab(), fused_linear=True)
    assert "forward" in vars(model) and model.forward.__wrapped__ == original_forward
    installed.restore()
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)
    ids, labels = batch(generator)
    model.train()
    assert model(input_ids=ids, labels=labels).logits is not None


@pytest.mark.parametrize("config, match", [
    (lambda: transformers.Gemma2Config(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=8),
     r"Gemma2ForCausalLM \(gemma2\) exactly: .*final logit soft-capping"),
    (lambda: transformers.MixtralConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        num_local_experts=2), r"MixtralForCausalLM \(mixtral\).*router auxiliary loss"),
    (lambda: transformers.CohereConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2),
     r"CohereForCausalLM \(cohere\).*a scale on the logits"),
    (lambda: transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_embd=16, n_layer=1, n_head=2),
     r"supports the model families .* GPT2LMHeadModel \(gpt2\) is not one of them"),
])
def test_models_whose_head_or_loss_is_more_than_linear_ce_are_refused(config, match):
    model = transformers.AutoModelForCausalLM.from_config(config())
    with pytest.raises(ValueError, match=match):
        smmd_scale.install(model, numeric_vocab(), fused_linear=True)
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)  # nothing was installed


def test_trainer_fused_equals_materialized(tmp_path, generator):
    """transformers.Trainer with gradient accumulation (num_items_in_batch): the per-step losses of a
    fused run equal those of a materialized one."""
    ids, labels = batch(generator, rows=4, length=16)

    histories = {}
    for fused in (False, True):
        model = tiny("llama", tied=True, dtype=torch.float32)
        smmd_scale.install(model, numeric_vocab(), weight=1.0, fused_linear=fused)
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(fused)), max_steps=6, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no",
            logging_steps=1, seed=0)
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=token_rows(ids, labels, 8))
        trainer.train()
        histories[fused] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(histories[True]) == 6
    assert histories[True] == pytest.approx(histories[False], rel=1e-5)
    assert histories[True][-1] < histories[True][0]
