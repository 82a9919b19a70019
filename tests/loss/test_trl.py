"""TRL's SFTTrainer with attach_to_trainer (smmd_scale/integrations/trl.py): real SFTTrainer runs on a
tiny Llama and prompt/completion data train the HF Trainer's objective, CE + weight x numeric, with
one forward per micro-batch and TRL's own metrics; set-ups that would never call the hook are refused."""

import datasets
import pytest
import torch
import trl
from helpers import models
from helpers.style_tokenizers import qwen_style
from transformers import Trainer, TrainingArguments

import smmd_scale
from smmd_scale import NumericVocab, SMMDLoss, compat

WEIGHT = 0.5
# Per-step settings shared by SFTConfig and the Trainer's TrainingArguments (SFTConfig's own defaults
# differ: bf16, activation checkpointing, learning rate, logging steps).
ARGUMENTS = dict(max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                 learning_rate=3e-3, bf16=False, activation_checkpointing=False, use_cpu=True, report_to=[],
                 save_strategy="no", seed=0, disable_tqdm=True)


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_style()  # one token per digit: every completion digit is a numeric target


def pairs(generator, count=8) -> "datasets.Dataset":
    """Prompt/completion records (SFTTrainer's non-conversational format) with numbers in both."""
    numbers = torch.randint(0, 500, (count, 2), generator=generator).tolist()
    return datasets.Dataset.from_list([{"prompt": f"Add {a} and {b} to get the answer;", "completion": f" {a + b}"}
                                       for a, b in numbers])


def hooked_model(tokenizer, seed=0, **install_options):
    """(a tiny Llama for ``tokenizer`` with SMMD installed, its InstalledLoss, its backbone's forward count)."""
    model = models.tiny_llama(len(tokenizer), hidden_size=32, max_positions=64, seed=seed)
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=len(tokenizer))
    installed = smmd_scale.install(model, SMMDLoss(vocab), weight=WEIGHT, **install_options)
    forwards = []
    model.model.register_forward_hook(lambda *_: forwards.append(1))  # the backbone: once per forward of the LM
    return model, installed, forwards


def sft_trainer(tmp_path, tokenizer, data, model, **arguments):
    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), **{**ARGUMENTS, **arguments})
    return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)


def training_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.filterwarnings("ignore:`compute_loss_func` is deprecated:FutureWarning")
@pytest.mark.parametrize("with_compute_loss_func", [False, True])
def test_sft_trainer_trains_the_trainers_objective_in_one_forward(tmp_path, generator, tokenizer,
                                                                   with_compute_loss_func):
    """SFTTrainer + attach_to_trainer against transformers.Trainer + attach_to_trainer on SFTTrainer's
    own prepared rows and collator: the same per-step loss and parts, one forward per micro-batch
    (also with the report's workaround, a compute_loss_func calling the hook, which alone costs two)."""
    data = pairs(generator)
    model, installed, forwards = hooked_model(tokenizer)
    extra = {}
    if with_compute_loss_func:
        def call_the_hook(outputs, labels, num_items_in_batch=None):
            return installed.hook(outputs.logits, labels, num_items_in_batch=num_items_in_batch)
        extra["compute_loss_func"] = call_the_hook
    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), **ARGUMENTS)
    sft = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, **extra)
    installed.attach_to_trainer(sft)
    sft.train()

    reference_model, reference_installed, reference_forwards = hooked_model(tokenizer)
    reference = Trainer(model=reference_model, train_dataset=sft.train_dataset, data_collator=sft.data_collator,
                        args=TrainingArguments(output_dir=str(tmp_path / "hf"), **ARGUMENTS))
    reference_installed.attach_to_trainer(reference)
    reference.train()

    logs, expected = training_logs(sft), training_logs(reference)
    assert len(logs) == len(expected) == 3
    assert len(forwards) == len(reference_forwards) == 6  # 3 steps x 2 micro-batches: one forward each
    for log, reference_log in zip(logs, expected):
        for key in ("loss", "loss_ce", "loss_numeric", "loss_smmd", "loss_total", "numeric_positions"):
            assert log[key] == pytest.approx(reference_log[key], rel=1e-6, abs=1e-7), key
        assert log["loss_total"] == pytest.approx(log["loss"], rel=1e-5)  # the objective it trained
        assert log["numeric_positions"] > 0 and log["loss_smmd"] > 0
        assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(log)  # TRL's metrics are still there
    assert installed.last_stats["numeric_tokens"] > 0


def test_trls_metrics_are_its_own_and_evaluation_has_the_parts(tmp_path, generator, tokenizer):
    """entropy, mean_token_accuracy and num_tokens from the hook's logits equal what plain SFTTrainer
    computes with its fused head on the first step (same weights, same batches); an evaluation logs
    the trained objective as eval_loss and its CE part as eval_loss_ce, with TRL's eval metrics."""
    data = pairs(generator)
    plain = sft_trainer(tmp_path / "plain", tokenizer, data, models.tiny_llama(len(tokenizer), hidden_size=32,
                                                                               max_positions=64, seed=0), max_steps=1)
    plain.train()
    model, installed, _ = hooked_model(tokenizer)
    sft = sft_trainer(tmp_path / "hooked", tokenizer, data, model, max_steps=1)
    sft.eval_dataset = sft.train_dataset
    installed.attach_to_trainer(sft)
    sft.train()
    (first_plain, ), (first, ) = training_logs(plain), training_logs(sft)
    assert first["entropy"] == pytest.approx(first_plain["entropy"], rel=1e-5)
    assert first["mean_token_accuracy"] == pytest.approx(first_plain["mean_token_accuracy"], abs=1e-6)
    assert first["num_tokens"] == first_plain["num_tokens"]
    assert first["loss_ce"] == pytest.approx(first_plain["loss"], rel=1e-5)  # TRL's NLL is the CE part

    metrics = sft.evaluate()
    assert {"eval_entropy", "eval_mean_token_accuracy", "eval_loss_ce", "eval_loss_smmd"} <= set(metrics)
    assert metrics["eval_loss_ce"] < metrics["eval_loss"]  # eval_loss holds the numeric term too
    evaluation = [entry for entry in sft.state.log_history if "eval_loss" in entry]
    assert evaluation[-1]["eval_loss_ce"] == metrics["eval_loss_ce"]


def test_a_fused_linear_head_trains_the_same_loss_without_logits(tmp_path, generator, tokenizer):
    """install(..., fused_linear=True) under SFTTrainer: the same per-step loss from the head's input,
    one forward per micro-batch; with no logits, TRL's entropy and token accuracy are left out."""
    data = pairs(generator)
    logs = {}
    for fused in (False, True):
        model, installed, forwards = hooked_model(tokenizer, fused_linear=fused)
        trainer = sft_trainer(tmp_path / str(fused), tokenizer, data, model)
        installed.attach_to_trainer(trainer)
        trainer.train()
        logs[fused] = training_logs(trainer)
        assert len(forwards) == 6
    assert installed.last_path == "fused_linear"
    for log, reference in zip(logs[True], logs[False]):
        for key in ("loss", "loss_ce", "loss_smmd"):
            assert log[key] == pytest.approx(reference[key], rel=1e-5), key
        assert "entropy" not in log and "mean_token_accuracy" not in log and log["num_tokens"] > 0


def test_trl_private_apis_in_compat(tmp_path, generator, tokenizer):
    """compat.sft_metrics and compat.sft_train_tokens reach what SFTTrainer keeps in the installed TRL."""
    trainer = sft_trainer(tmp_path, tokenizer, pairs(generator), models.tiny_llama(len(tokenizer), hidden_size=32,
                                                                                    max_positions=64, seed=0))
    metrics = compat.sft_metrics(trainer)
    assert set(metrics) == {"train", "eval"} and not metrics["train"]
    assert compat.sft_train_tokens(trainer, 0) == 0
    assert compat.sft_train_tokens(trainer, 17) == 17 and compat.sft_train_tokens(trainer, 3) == 20


def test_a_loss_type_the_hook_cannot_compute_is_refused(tmp_path, generator, tokenizer):
    model, installed, _ = hooked_model(tokenizer)
    trainer = sft_trainer(tmp_path, tokenizer, pairs(generator), model, loss_type="dft")
    with pytest.raises(ValueError, match=r"loss_type='dft'.* use loss_type='nll'"):
        installed.attach_to_trainer(trainer)
    # refused before anything changed
    assert "compute_loss" not in vars(trainer) and "get_batch_samples" not in vars(trainer)
    assert not any(isinstance(callback, smmd_scale.NumericLossCallback)
                   for callback in trainer.callback_handler.callbacks)


def test_a_trainer_of_another_model_is_refused(tmp_path, generator, tokenizer):
    """SFTTrainer built with a model that is not the one install() hooked (e.g. loaded from a name)."""
    _, installed, _ = hooked_model(tokenizer)
    other = models.tiny_llama(len(tokenizer), hidden_size=32, max_positions=64, seed=1)
    with pytest.raises(ValueError, match="not .* the LlamaForCausalLM smmd_scale.install hooked"):
        installed.attach_to_trainer(sft_trainer(tmp_path, tokenizer, pairs(generator), other))


def test_a_subclass_that_keeps_trls_loss_is_stopped_before_its_first_update(tmp_path, generator, tokenizer):
    """An SFTTrainer subclass whose compute_loss goes to SFTTrainer's (TRL's fused NLL) never calls the
    hook: the first step raises, naming the classes, before the optimizer changes a weight."""

    class LoggingSFTTrainer(trl.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    model, installed, _ = hooked_model(tokenizer)
    config = trl.SFTConfig(output_dir=str(tmp_path), **ARGUMENTS)
    trainer = LoggingSFTTrainer(model=model, args=config, train_dataset=pairs(generator), processing_class=tokenizer)
    installed.attach_to_trainer(trainer)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(RuntimeError, match="LoggingSFTTrainer ran its first training step on LlamaForCausalLM "
                                           "without calling the smmd_scale loss hook"):
        trainer.train()
    assert all(torch.equal(parameter, start) for parameter, start in zip(model.parameters(), before))
