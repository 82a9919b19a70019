"""install(..., fused_linear=True) on plain Hugging Face models: a training forward with labels never
computes logits, and for every supported family (Llama, Mistral, Qwen2, Qwen3, Gemma-2 and Gemma-3 with
final logit soft-capping, Cohere with its logit scale, Mixtral, Qwen2-MoE and Qwen3-MoE with their router
auxiliary loss), tied and untied, gives the model's own loss (its CE, logit transform and router loss) +
our numeric term on its materialized logits, and the materialized hook's loss and gradients (float64);
evaluation and generation still return logits; models the fused path cannot reproduce are refused at
install with the reason; transformers.Trainer trains the same way."""

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.models import FAMILY_CONFIGS, MOE_FAMILIES, tiny_causal_lm, token_rows

import smmd_scale
from smmd_scale import NumericVocab, SMMDLoss, compat, numeric_cross_entropy

VOCAB_SIZE = 80
WEIGHT = 0.8


def tiny(family, tied, dtype=torch.float64, **config):
    return tiny_causal_lm(family, VOCAB_SIZE, tied=tied, dtype=dtype, **config)


def numeric_vocab():
    return NumericVocab(list(range(20, 35)), list(range(15)), VOCAB_SIZE)


def batch(generator, rows=3, length=11):
    """``ids`` and ``labels`` (some ignored)."""
    ids = torch.randint(0, VOCAB_SIZE, (rows, length), generator=generator)
    ids[:, 1::2] = torch.randint(20, 35, (rows, length // 2), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def padded_batch(generator):
    """A :func:`batch` and an ``attention_mask`` that pads row 1 on the right (left padding leaves a
    query with no key, which eager attention, Gemma-2's, turns into NaN)."""
    ids, labels = batch(generator)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -2:] = 0
    labels[1, -2:] = -100
    return ids, labels, attention_mask


def loss_and_grads(model, **inputs):
    model.zero_grad()
    output = model(**inputs)
    output.loss.backward()
    return output, {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers' causal-LM CE (shift, sum / num_items_in_batch or mean), without its float32 upcast."""
    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    ce = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=ignore_index,
                         reduction="mean" if num_items_in_batch is None else "sum")
    return ce if num_items_in_batch is None else ce / num_items_in_batch


def own_loss_plus_numeric_term(model, **inputs):
    """The reference: the model's own forward and loss (its logit transform, its router loss; its CE
    with float64 logits: transformers' CE upcasts only to float32), plus WEIGHT x our numeric term computed
    by ``numeric_cross_entropy`` on the logits that forward returns; with gradients."""
    model.zero_grad()
    model.loss_function = float64_causal_lm_loss
    own = model(**inputs)
    compat.forget_loss_function(model)
    shifted = F.pad(inputs["labels"], (0, 1), value=-100)[..., 1:]
    ours = numeric_cross_entropy(own.logits, shifted, SMMDLoss(numeric_vocab()), weight=WEIGHT,
                                 num_items_in_batch=inputs.get("num_items_in_batch"))
    total = own.loss + WEIGHT * ours.numeric
    total.backward()
    return own, total.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def assert_same(loss, grads, reference_loss, reference_grads):
    # float64 on both sides, the same terms summed in another order (the fused head's blocks, the shift, the
    # reduction): a few ulp (measured: loss 2.8e-16, gradients 5.4e-16 of the largest, relative).
    assert loss.item() == pytest.approx(reference_loss.item(), rel=1e-10)
    for name, grad in reference_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-10 * grad.abs().max().clamp_min(1e-30), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_fused_loss_is_the_models_own_loss_plus_our_numeric_term(generator, family, tied):
    """Fused and materialized (the installed hook on the model's logits) both equal the model's own
    loss + our numeric term on its logits: the soft-cap or scale is applied where the model applies it,
    and MoE families add the model's router auxiliary loss (attention mask included) and return it."""
    model = tiny(family, tied)
    model.train()
    ids, labels, attention_mask = padded_batch(generator)
    inputs = dict(input_ids=ids, labels=labels, attention_mask=attention_mask, num_items_in_batch=21)
    own, reference, reference_grads = own_loss_plus_numeric_term(model, **inputs)

    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=WEIGHT)
    materialized, materialized_grads = loss_and_grads(model, **inputs)
    materialized_stats = installed.last_stats
    installed.restore()
    fused_install = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=WEIGHT, fused_linear=True)
    fused, fused_grads = loss_and_grads(model, **inputs)

    assert fused.logits is None and materialized.logits is not None and fused_install.last_path == "fused_linear"
    assert_same(materialized.loss, materialized_grads, reference, reference_grads)
    assert_same(fused.loss, fused_grads, reference, reference_grads)
    for key in ("mmd", "smooth", "numeric_accuracy", "numeric_mae", "numeric_tokens", "tokens"):
        # float64 statistics of the same logits; only the grouping of the sums differs (measured 2.5e-16).
        assert fused_install.last_stats[key] == pytest.approx(materialized_stats[key], rel=1e-10)
    if family in MOE_FAMILIES:
        # The model's own router-loss function on the same float64 router logits (measured equal, both lines).
        assert own.aux_loss is not None and fused.aux_loss.item() == pytest.approx(own.aux_loss.item(), rel=1e-12)
        assert len(fused.router_logits) == model.config.num_hidden_layers
        assert (fused.loss - fused_install.hook.last_losses.total).item() == pytest.approx(
            model.config.router_aux_loss_coef * own.aux_loss.item(), rel=1e-10)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("in_config, in_call", [(True, None), (False, None), (False, True), (True, False)])
def test_the_router_loss_follows_output_router_logits_as_the_model_does(generator, family, in_config, in_call):
    """``output_router_logits`` of the call, else of the config, decides whether the router loss is
    added, in the fused forward as in the model's own."""
    model = tiny(family, tied=False, output_router_logits=in_config)
    model.train()
    ids, labels, attention_mask = padded_batch(generator)
    inputs = dict(input_ids=ids, labels=labels, attention_mask=attention_mask)
    if in_call is not None:
        inputs["output_router_logits"] = in_call
    own, reference, reference_grads = own_loss_plus_numeric_term(model, **inputs)
    smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=WEIGHT, fused_linear=True)
    fused, fused_grads = loss_and_grads(model, **inputs)
    assert_same(fused.loss, fused_grads, reference, reference_grads)
    routed = in_config if in_call is None else in_call
    assert (fused.aux_loss is not None) == (own.aux_loss is not None) == routed


@pytest.mark.parametrize("family", ["gemma2", "cohere", "mixtral"])
def test_the_hooks_ce_options_apply_on_top_of_the_familys_transform(generator, family):
    """z-loss and label smoothing set on the hook (``ce_options``) read the family's transformed logits
    in the fused op as on the model's logits; a second logit transform there is refused."""
    model = tiny(family, tied=True)
    model.train()
    ids, labels, attention_mask = padded_batch(generator)
    inputs = dict(input_ids=ids, labels=labels, attention_mask=attention_mask)
    results = []
    for fused in (False, True):
        installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=WEIGHT, fused_linear=fused)
        installed.hook.ce_options = {"z_loss": 0.01, "label_smoothing": 0.1}
        output, grads = loss_and_grads(model, **inputs)
        results.append((output.loss, grads, installed.hook.last_z))
        installed.restore()
    (materialized, materialized_grads, materialized_z), (fused, fused_grads, fused_z) = results
    assert_same(fused, fused_grads, materialized, materialized_grads)
    # float64 z-loss of the same transformed logits, summed in another order (measured 1.4e-16).
    assert fused_z.item() == pytest.approx(materialized_z.item(), rel=1e-10) and fused_z.item() > 0

    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), fused_linear=True)
    installed.hook.ce_options = {"logit_scale": 2.0}
    if family == "mixtral":  # no transform of its own: the hook's scale applies on both paths alike
        model(**inputs)
    else:
        with pytest.raises(ValueError, match=r"the model's forward already transforms its logits \(\{'logit_(softcap|"
                                             r"scale)': .*ce_options add \{'logit_scale': 2.0\}"):
            model(**inputs)


def test_evaluation_generation_and_explicit_logits_use_the_models_forward(generator):
    model = tiny("llama", tied=True)
    ids, labels = batch(generator)
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), fused_linear=True)
    model.train()
    assert model(input_ids=ids, labels=labels).logits is None
    kept = model(input_ids=ids, labels=labels, skip_logits=False)  # logits explicitly wanted
    assert kept.logits.shape == (3, 11, VOCAB_SIZE) and kept.loss is not None
    assert model(input_ids=ids).logits.shape == (3, 11, VOCAB_SIZE)  # no labels
    model.eval()
    evaluated = model(input_ids=ids, labels=labels)
    # The same materialized float64 forward in train and eval mode (no dropout here): measured equal.
    assert evaluated.logits is not None and evaluated.loss.item() == pytest.approx(kept.loss.item(), rel=1e-10)
    assert installed.last_stats["numeric_tokens"] > 0
    generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 7)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=ids, skip_logits=True)


def test_restore_puts_back_the_forward_and_the_loss_function(generator):
    model = tiny("qwen2", tied=False)
    original_forward = model.forward
    installed = smmd_scale.install(model, SMMDLoss(numeric_vocab()), fused_linear=True)
    assert "forward" in vars(model) and model.forward.__wrapped__ == original_forward
    installed.restore()
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)
    ids, labels = batch(generator)
    model.train()
    assert model(input_ids=ids, labels=labels).logits is not None


class LlamaWithItsOwnForward(transformers.LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.loss = 2 * output.loss
        return output


def granite():
    return transformers.AutoModelForCausalLM.from_config(transformers.GraniteConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logits_scaling=4.0))


@pytest.mark.parametrize("build, match", [
    (lambda: transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_embd=16, n_layer=1, n_head=2)),
     r"supports the model families \('llama', .*'qwen3_moe'\), whose forward it reproduces; GPT2LMHeadModel \(gpt2\) "
     "is not one of them"),
    (granite, r"GraniteForCausalLM \(granite\) is not one of them"),  # divides its logits by logits_scaling
    (lambda: LlamaWithItsOwnForward(tiny("llama", tied=False).config),
     r"reproduces LlamaForCausalLM.forward, but LlamaWithItsOwnForward \(llama\) has a forward of its own"),
])
def test_models_the_fused_forward_cannot_reproduce_are_refused(build, match):
    model = build()
    with pytest.raises(ValueError, match=match):
        smmd_scale.install(model, SMMDLoss(numeric_vocab()), fused_linear=True)
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)  # nothing was installed


@pytest.mark.parametrize("family, option", [("gemma2", "logit_softcap"), ("gemma3_text", "logit_softcap"),
                                            ("cohere", "logit_scale")])
def test_a_logit_transform_the_op_cannot_apply_is_refused(monkeypatch, family, option):
    """Without the op's soft-cap or scale option, the families that need it are refused at install."""
    def op_without_transforms(hidden, head_weight, targets, numeric_loss, weight=1.0, bias=None):
        raise AssertionError("never called")

    # (the package exports the function fused_forward under the module's name)
    module = importlib.import_module("smmd_scale.integrations.fused_forward")
    monkeypatch.setattr(module, "linear_numeric_cross_entropy", op_without_transforms)
    model = tiny(family, tied=True)
    with pytest.raises(ValueError, match=rf"cannot train \w+ \({family}\) exactly: its forward transforms the logits "
                                         rf"before the loss and this smmd_scale's linear_numeric_cross_entropy has no "
                                         rf"{option} option"):
        smmd_scale.install(model, SMMDLoss(numeric_vocab()), fused_linear=True)
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)


@pytest.mark.parametrize("family", ["llama", "gemma2", "cohere", "qwen3_moe"])
def test_trainer_fused_equals_materialized(tmp_path, generator, family):
    """transformers.Trainer with gradient accumulation (num_items_in_batch): the per-step losses of a
    fused run equal those of a materialized one (with a soft-cap, a logit scale, a router loss)."""
    ids, labels = batch(generator, rows=4, length=16)

    histories = {}
    for fused in (False, True):
        model = tiny(family, tied=True, dtype=torch.float32)
        smmd_scale.install(model, SMMDLoss(numeric_vocab()), weight=1.0, fused_linear=fused)
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(fused)), max_steps=6, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no",
            logging_steps=1, seed=0)
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=token_rows(ids, labels, 8))
        trainer.train()
        histories[fused] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(histories[True]) == 6
    # fp32: the paths round differently (~1e-7 per step) and 6 Adam steps carry it on (measured 1.9e-7).
    assert histories[True] == pytest.approx(histories[False], rel=1e-5)
    assert histories[True][-1] < histories[True][0]
