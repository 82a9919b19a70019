"""The loss parts in a transformers.Trainer's logs (smmd_scale.NumericLossCallback, added by
attach_to_trainer): real tiny Trainer runs, each logging window's parts against a float64 reference
on the logits of the window's micro-batches, and the parts in the Trainer's TensorBoard events."""

import pytest
import torch
import torch.nn.functional as F
from helpers import models
from helpers.reference import reference_ntl, reference_smmd
from transformers import Trainer, TrainingArguments

import smmd_scale
from smmd_scale import NumericVocab, SMMDLoss

VOCAB_SIZE = 96
NUMERIC_IDS = list(range(20, 30))  # ten "digit" tokens with values 0..9
VALUES = list(range(10))


def rows(generator, count=8, length=16):
    ids = torch.randint(0, VOCAB_SIZE, (count, length), generator=generator)
    ids[:, 2:8] = torch.randint(20, 30, (count, 6), generator=generator)
    ids[count // 2:, 2:8] = torch.where(torch.rand(count - count // 2, 6, generator=generator) < 0.5, 5,
                                        ids[count // 2:, 2:8])  # the numbers per row vary
    labels = ids.clone()
    labels[:, :1] = -100
    return ids, labels


def train(tmp_path, generator, numeric_loss=None, weight=0.5, attach=True, **arguments):
    """A Trainer run with the hook and attach_to_trainer (or only the callback, ``attach=False``);
    returns (training logs, the float64 logits and shifted targets of every training micro-batch, in
    order)."""
    ids, labels = rows(generator)
    model = models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=0)
    vocab = NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)
    installed = smmd_scale.install(model, numeric_loss(vocab) if numeric_loss else SMMDLoss(vocab), weight=weight)
    calls, hook = [], installed.hook

    def recording_hook(logits, labels, **kwargs):
        calls.append((logits.detach().double(), F.pad(labels, (0, 1), value=-100)[..., 1:]))
        return hook(logits, labels, **kwargs)

    model.loss_function = recording_hook
    trainer = Trainer(model=model, train_dataset=models.token_rows(ids, labels), args=TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
        use_cpu=True, save_strategy="no", seed=0, **{"report_to": [], **arguments}))
    if attach:
        installed.attach_to_trainer(trainer)
    else:
        trainer.add_callback(smmd_scale.NumericLossCallback(installed))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry], calls


def window_reference(calls, parts) -> dict:
    """CE per target token, each numeric part per numeric position, over ``calls``; ``parts``: name ->
    (logits, targets) -> its mean over the numeric positions (float64)."""
    ce_sum = sum(F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum")
                 for logits, targets in calls)
    tokens = sum((targets != -100).sum() for _, targets in calls)
    positions = [torch.isin(targets, torch.tensor(NUMERIC_IDS)).sum() for _, targets in calls]
    reference = {"loss_ce": (ce_sum / tokens).item(), "positions": sum(positions).item()}
    for name, part in parts.items():
        reference[f"loss_{name}"] = (sum(part(*call) * count for call, count in zip(calls, positions) if count)
                                     / sum(positions)).item()
    return reference


def smmd(logits, targets):
    return reference_smmd(logits, targets, NUMERIC_IDS, VALUES)


def test_each_logging_step_logs_the_parts_of_its_micro_batches(tmp_path, generator):
    """Logging every step: the window is the step's two micro-batches, and its total is the Trainer's own loss."""
    logs, calls = train(tmp_path, generator, max_steps=3, logging_steps=1)
    assert len(logs) == 3 and len(calls) == 6
    for step, log in enumerate(logs):
        expected = window_reference(calls[2 * step: 2 * step + 2], {"smmd": smmd})
        # The parts: fp32 loss vs float64 on the same recorded logits: within fp32 rounding (1.2e-7; measured ~1e-8);
        # loss_numeric and loss_smmd: two fp32 roundings of one mean; the Trainer's loss: its own fp32 sum.
        assert log["loss_ce"] == pytest.approx(expected["loss_ce"], rel=1e-5)
        assert log["loss_smmd"] == pytest.approx(expected["loss_smmd"], rel=1e-5)
        assert log["loss_numeric"] == pytest.approx(log["loss_smmd"], rel=1e-6)  # SMMD alone is the numeric term
        assert log["loss_total"] == pytest.approx(expected["loss_ce"] + 0.5 * expected["loss_smmd"], rel=1e-5)
        assert log["loss_total"] == pytest.approx(log["loss"], rel=1e-4)  # the objective the Trainer trained
        assert log["numeric_positions"] == expected["positions"]
        assert {"loss_mmd", "loss_smooth"} <= set(log) and 0 <= log["numeric_accuracy"] <= 1
        assert log["numeric_mae"] >= 0
    assert logs[-1]["loss_total"] < logs[0]["loss_total"]


def test_without_the_steps_numeric_count_the_parts_are_still_per_position_means(tmp_path, generator):
    """Only the callback: the Trainer passes num_items_in_batch alone, which weighs each micro-batch's numeric
    mean by its tokens; the logged parts are still the window's means over its targets and numeric positions."""
    logs, calls = train(tmp_path, generator, attach=False, max_steps=2, logging_steps=2)
    (log, ) = logs
    expected = window_reference(calls, {"smmd": smmd})
    # fp32 loss vs float64 on the same recorded logits: within fp32 rounding (1.2e-7; measured ~1e-8);
    # loss_numeric and loss_smmd: two fp32 roundings of one mean.
    assert log["loss_ce"] == pytest.approx(expected["loss_ce"], rel=1e-5)
    assert log["loss_smmd"] == pytest.approx(expected["loss_smmd"], rel=1e-5)
    assert log["loss_numeric"] == pytest.approx(log["loss_smmd"], rel=1e-6)


def test_weighted_numeric_losses_reach_tensorboard_by_name(tmp_path, generator):
    """SMMD + 0.3 NTL-WAS, logging every 2 steps (4 micro-batches), reported to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def numeric_loss(vocab):
        return smmd_scale.SMMDLoss(vocab) + 0.3 * smmd_scale.NTLoss(vocab, squash_factor=9.0)

    logs, calls = train(tmp_path, generator, numeric_loss, weight=1.0, max_steps=4, logging_steps=2,
                        report_to=["tensorboard"])
    assert len(logs) == 2 and len(calls) == 8

    def ntl(logits, targets):
        return reference_ntl(logits, targets, NUMERIC_IDS, VALUES, squash_factor=9.0)

    for window, log in enumerate(logs):
        expected = window_reference(calls[4 * window: 4 * window + 4], {"smmd": smmd, "ntl_was": ntl})
        # fp32 loss vs float64 on the same recorded logits: within fp32 rounding (1.2e-7; measured ~1e-8);
        # loss_total is loss_ce + loss_numeric as the callback computes it in float64.
        for key in ("loss_ce", "loss_smmd", "loss_ntl_was"):
            assert log[key] == pytest.approx(expected[key], rel=1e-5), key
        assert log["loss_numeric"] == pytest.approx(expected["loss_smmd"] + 0.3 * expected["loss_ntl_was"], rel=1e-5)
        assert log["loss_total"] == pytest.approx(log["loss_ce"] + log["loss_numeric"], rel=1e-6)
        assert log["numeric_positions"] == expected["positions"] / 2  # per optimizer step
    (events_file, ) = tmp_path.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file))
    events.Reload()
    for key in ("loss_ce", "loss_numeric", "loss_smmd", "loss_ntl_was", "loss_total", "numeric_accuracy"):
        points = events.Scalars(f"train/{key}")
        assert [point.step for point in points] == [2, 4]
        # TensorBoard stores scalars in float32: a rounding of 6e-8 relative.
        assert [point.value for point in points] == pytest.approx([log[key] for log in logs], rel=1e-6)


def test_dist2_gaussian_label_smoothing_and_del_reach_the_logs_by_name(tmp_path, generator):
    """SMMD + DIST2 + Gaussian label smoothing + DEL (token 5, which rows() puts inside numbers, as the
    dot): each loss's window mean is the loss itself on the window's logits, and they add up."""
    dot = 5

    def numeric_loss(vocab):
        return (smmd_scale.SMMDLoss(vocab) + 0.3 * smmd_scale.DIST2Loss(vocab, place_weighted=True)
                + 0.2 * smmd_scale.GaussianLabelSmoothingLoss(vocab, sigma=0.7)
                + 0.1 * smmd_scale.DigitEntropyLoss(vocab, dot_token_ids=[dot]))

    logs, calls = train(tmp_path, generator, numeric_loss, weight=1.0, max_steps=2, logging_steps=2)
    (log, ) = logs
    vocab = NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)
    direct = {term.name: term for term, _ in numeric_loss(vocab).weighted_terms()}
    expected = window_reference(calls, direct)
    for key in ("loss_ce", "loss_smmd", "loss_dist2", "loss_gauss_ls", "loss_del"):
        # the Trainer's float32 model against the float64 losses on its recorded logits
        assert log[key] == pytest.approx(expected[key], rel=1e-5), key
    assert log["loss_del"] > 0 and log["loss_dist2"] > 0
    assert log["loss_numeric"] == pytest.approx(expected["loss_smmd"] + 0.3 * expected["loss_dist2"]
                                                + 0.2 * expected["loss_gauss_ls"] + 0.1 * expected["loss_del"],
                                                rel=1e-5)
    # loss_total is loss_ce + loss_numeric as the callback computes it in float64.
    assert log["loss_total"] == pytest.approx(log["loss_ce"] + log["loss_numeric"], rel=1e-6)


def test_evaluation_logs_are_left_alone_and_a_callback_alone_adds_to_log_history(tmp_path, generator):
    """Added by hand (Trainer(callbacks=...)), the callback still fills log_history; eval logs keep their keys."""
    ids, labels = rows(generator)
    model = models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=0)
    installed = smmd_scale.install(model, SMMDLoss(NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)))
    trainer = Trainer(model=model, train_dataset=models.token_rows(ids, labels), eval_dataset=models.token_rows(
        ids, labels), callbacks=[smmd_scale.NumericLossCallback(installed)], args=TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1, eval_strategy="steps",
        eval_steps=2, use_cpu=True, save_strategy="no", report_to=[]))
    trainer.train()
    training = [entry for entry in trainer.state.log_history if "loss" in entry]
    evaluation = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(training) == 2 and all("loss_total" in entry for entry in training)
    assert len(evaluation) == 1 and not any(key.startswith(("loss_", "numeric_")) for key in evaluation[0])


def _data_parallel_trainer(rank, world_size, tmp_path, ids, labels):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    model = models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=0)
    installed = smmd_scale.install(model, SMMDLoss(NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)), weight=0.5)
    calls, hook = [], installed.hook

    def recording_hook(logits, labels, **kwargs):
        targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
        logits64 = logits.detach().double()
        positions = torch.isin(targets, torch.tensor(NUMERIC_IDS)).sum().item()
        calls.append((F.cross_entropy(logits64.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum").item(),
                      (targets != -100).sum().item(), smmd(logits64, targets).item() * positions, positions))
        return hook(logits, labels, **kwargs)

    model.loss_function = recording_hook
    trainer = Trainer(model=model, train_dataset=models.token_rows(ids, labels), args=TrainingArguments(
        output_dir=str(tmp_path / f"rank{rank}"), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
        learning_rate=3e-3, use_cpu=True, save_strategy="no", seed=0, report_to=[]))
    installed.attach_to_trainer(trainer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry], calls


@pytest.mark.gloo
def test_on_two_processes_a_window_pools_both_processes_micro_batches(tmp_path, generator):
    from helpers.distributed import run_ranks, values_or_raise

    ids, labels = rows(generator)
    (logs0, calls0), (logs1, calls1) = values_or_raise(run_ranks(_data_parallel_trainer, 2, tmp_path, ids, labels,
                                                                 fresh=True))
    assert len(logs0) == len(logs1) == 2 and len(calls0) == len(calls1) == 2  # one micro-batch per step and rank
    for step in range(2):
        ce_sum, tokens, smmd_sum, positions = (sum(values) for values in zip(calls0[step], calls1[step]))
        for log in (logs0[step], logs1[step]):  # every process logs the pooled window
            # fp32 losses against float64 on the recorded logits, and the Trainer's own fp32 sums: ~1e-7 relative.
            assert log["loss_ce"] == pytest.approx(ce_sum / tokens, rel=1e-5)
            assert log["loss_smmd"] == pytest.approx(smmd_sum / positions, rel=1e-5)
            assert log["numeric_positions"] == positions
            assert log["loss_total"] == pytest.approx(log["loss"], rel=1e-4)  # the Trainer's loss over both


def evaluated_trainer(tmp_path, generator, weight=0.5, **arguments):
    """(a Trainer with SMMD attached, trained 2 steps on rows() and evaluated every ``eval_steps``, its
    model, the evaluation rows)."""
    ids, labels = rows(generator)
    eval_ids, eval_labels = rows(generator, count=6)
    model = models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=0)
    installed = smmd_scale.install(model, SMMDLoss(NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)), weight=weight)
    trainer = Trainer(model=model, train_dataset=models.token_rows(ids, labels), eval_dataset=models.token_rows(
        eval_ids, eval_labels), args=TrainingArguments(**{
            "output_dir": str(tmp_path), "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
            "max_steps": 2, "learning_rate": 3e-2, "use_cpu": True, "save_strategy": "no", "report_to": [],
            "seed": 0, **arguments}))
    installed.attach_to_trainer(trainer)
    return trainer, model, (eval_ids, eval_labels)


def test_evaluation_logs_the_ce_and_numeric_parts_of_the_evaluation_set(tmp_path, generator):
    """evaluate() over 3 batches: eval_loss_ce is the plain CE of the model on the whole set and each
    numeric part its reference (float64, computed apart from the hook); eval_loss is the trained
    objective, the batches' CE + weight x SMMD averaged over them; the parts reach the returned
    metrics and log_history."""
    trainer, model, (eval_ids, eval_labels) = evaluated_trainer(tmp_path, generator)
    trainer.train()
    metrics = trainer.evaluate()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=eval_ids).logits.double()  # no labels: the hook is not called
    targets = F.pad(eval_labels, (0, 1), value=-100)[..., 1:]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
    # fp32 model: the evaluation's batches of 2 and this forward of 6 rows give logits a few fp32 ulp apart, and
    # the hook's fp32 losses are a few fp32 ulp (1.2e-7 relative) from float64; eval_loss_numeric: one mean twice.
    assert metrics["eval_loss_ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert metrics["eval_loss_smmd"] == pytest.approx(smmd(logits, targets).item(), rel=1e-5)
    assert metrics["eval_loss_numeric"] == pytest.approx(metrics["eval_loss_smmd"], rel=1e-6)
    assert metrics["eval_loss_total"] == pytest.approx(metrics["eval_loss_ce"] + 0.5 * metrics["eval_loss_numeric"])
    assert metrics["eval_numeric_positions"] == torch.isin(targets, torch.tensor(NUMERIC_IDS)).sum().item()
    assert 0 <= metrics["eval_numeric_accuracy"] <= 1 and metrics["eval_numeric_mae"] >= 0
    batches = [(logits[start:start + 2], targets[start:start + 2]) for start in range(0, 6, 2)]
    objective = sum(F.cross_entropy(batch_logits.reshape(-1, VOCAB_SIZE), batch_targets.reshape(-1))
                    + 0.5 * smmd(batch_logits, batch_targets) for batch_logits, batch_targets in batches) / 3
    assert metrics["eval_loss"] == pytest.approx(objective.item(), rel=1e-5)  # fp32 model and loss, as above
    assert metrics["eval_loss"] > metrics["eval_loss_ce"]
    logged = [entry for entry in trainer.state.log_history if "eval_loss" in entry][-1]
    assert {key: logged[key] for key in metrics if key.startswith("eval_loss")} == \
        {key: value for key, value in metrics.items() if key.startswith("eval_loss")}


def test_metric_for_best_model_loss_ce_selects_and_stops_by_ce(tmp_path, generator):
    """metric_for_best_model="loss_ce" (the Trainer reads eval_loss_ce) picks the evaluation with the
    lowest CE part, and early stopping stops at the first evaluation whose CE part does not improve."""
    from transformers import EarlyStoppingCallback

    trainer, _, _ = evaluated_trainer(tmp_path, generator, weight=20.0, max_steps=6, learning_rate=5e-2,
                                      eval_strategy="steps", eval_steps=1, save_strategy="best",
                                      metric_for_best_model="loss_ce", greater_is_better=False)
    trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=1))
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    ce = [entry["eval_loss_ce"] for entry in evaluations]
    first_worse = next((index for index in range(1, len(ce)) if ce[index] >= min(ce[:index])), None)
    assert len(evaluations) == (6 if first_worse is None else first_worse + 1)
    best = min(evaluations, key=lambda entry: entry["eval_loss_ce"])
    assert trainer.state.best_metric == best["eval_loss_ce"] != best["eval_loss"]
    assert trainer.state.best_global_step == best["step"]


def _plain_ce(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func that trains plain CE: the hook is never called."""
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(outputs.logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum") / \
        num_items_in_batch


def _own_loss_llama():
    """A Llama whose forward computes its own CE instead of calling self.loss_function."""
    from transformers import LlamaForCausalLM

    class OwnLossLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
            output = super().forward(input_ids=input_ids, **kwargs)
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
            output.loss = F.cross_entropy(output.logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
            return output

    config = models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64, seed=0).config
    return OwnLossLlama(config)


@pytest.mark.parametrize("case", ["compute_loss_func", "model"])
def test_a_first_step_that_never_calls_the_hook_raises_before_the_update(tmp_path, generator, case):
    """Real trainers that train another loss than the installed one: a compute_loss_func of plain CE, a
    model whose forward computes its own loss. The first step raises, naming the classes, and leaves
    the weights as they were."""
    ids, labels = rows(generator)
    model = _own_loss_llama() if case == "model" else models.tiny_llama(VOCAB_SIZE, hidden_size=32, max_positions=64)
    installed = smmd_scale.install(model, SMMDLoss(NumericVocab(NUMERIC_IDS, VALUES, VOCAB_SIZE)))
    trainer = Trainer(model=model, train_dataset=models.token_rows(ids, labels),
                      compute_loss_func=_plain_ce if case == "compute_loss_func" else None,
                      args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                             gradient_accumulation_steps=2, max_steps=2, use_cpu=True,
                                             save_strategy="no", report_to=[]))
    installed.attach_to_trainer(trainer)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    name = type(model).__name__
    with pytest.raises(RuntimeError, match=f"^Trainer ran its first training step on {name} without calling the "
                                           "smmd_scale loss hook"):
        trainer.train()
    assert all(torch.equal(parameter, start) for parameter, start in zip(model.parameters(), before))
    assert installed.last_stats is None
