"""The run's loss is one :class:`~smmd_train.components.loss_reporter.LossReporter`, chosen once from the command
line: what the sweep, the HParams, the resume record and the train loop ask of it for our numeric loss
and for the model's own (``--framework_loss``), and, in the code, no other module deciding between the
two (no ``installed is None`` branch, no other reader of ``--framework_loss``).
tests/launch/test_launch_launchers.py trains a --framework_loss run end to end."""

import ast

import pytest
from helpers.launching import REPO, train_flags

from smmd_train.components.loss_reporter import ModelLossReporter, NumericLossReporter, loss_reporter
from smmd_train.config.arguments import parse_args
from smmd_train.config.run_config import RunConfig

ZERO3 = REPO / "ds_configs" / "zero3.json"
# The modules that may read --framework_loss: the parser (its checks) and the one choice of reporter.
CHOOSERS = {"plugin/smmd_train/config/arguments.py", "plugin/smmd_train/components/loss_reporter.py"}


def reporter_of(tmp_path, **options):
    return loss_reporter(RunConfig.from_args(parse_args(train_flags(
        deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1, output_dir=tmp_path,
        **options))))


def test_the_numeric_loss_and_the_model_s_own_answer_alike(tmp_path):
    mixed = reporter_of(tmp_path, numeric_loss=["smmd", "ntl-was:0.3"])
    assert isinstance(mixed, NumericLossReporter) and mixed.evaluates and mixed.numeric_loss is None  # not planned
    assert (mixed.label, mixed.hparams(), mixed.terms()) == (
        "smmd+ntl-was", {"numeric_loss": "1 smmd + 0.3 ntl-was"}, (("smmd", 1.0), ("ntl-was", 0.3)))
    assert mixed.counts_steps(tp_size=1) and mixed.counts_steps(tp_size=2)
    assert reporter_of(tmp_path, numeric_loss=["smmd:0"]).label == "ce"  # CE only, the numeric metrics still logged

    framework = reporter_of(tmp_path, framework_loss=True)
    assert isinstance(framework, ModelLossReporter) and not framework.evaluates and framework.numeric_loss is None
    assert (framework.label, framework.hparams(), framework.terms()) == (
        "ce", {"numeric_loss": "none (framework loss)"}, ())
    assert framework.objective_record(vocab=None) == {"--framework_loss": True}
    assert framework.numeric_token_ids(vocab=None) is None
    # DeepSpeed's vocabulary-parallel CE (the model's own loss under AutoTP) takes no step counts.
    assert framework.counts_steps(tp_size=1) and not framework.counts_steps(tp_size=2)
    assert framework.plan(None, (), 64) == []
    assert reporter_of(tmp_path, framework_loss=True, eval_data=["y"]).plan(None, (), 64) == [
        "--eval_data is not evaluated with --framework_loss: the held-out metrics come from the installed numeric "
        "loss, which a --framework_loss run does not have"]


def choice_sites(source: str) -> list:
    """Where ``source`` decides between the two losses itself: a comparison of something named
    ``installed`` with None, or a read of ``framework_loss`` (an attribute, or a getattr of the name)."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            named = [getattr(operand, "attr", getattr(operand, "id", None)) for operand in operands]
            if "installed" in named and any(isinstance(operand, ast.Constant) and operand.value is None
                                            for operand in operands):
                sites.append(f"line {node.lineno}: installed compared with None")
        elif isinstance(node, ast.Attribute) and node.attr == "framework_loss":
            sites.append(f"line {node.lineno}: reads .framework_loss")
        elif isinstance(node, ast.Constant) and node.value == "framework_loss":
            sites.append(f"line {node.lineno}: names 'framework_loss'")
    return sites


def test_no_module_but_the_reporter_chooses_between_the_losses():
    planted = "if run.installed is None:\n    pass\nif args.framework_loss:\n    pass\ngetattr(a, 'framework_loss')\n"
    assert choice_sites(planted) == ["line 1: installed compared with None", "line 3: reads .framework_loss",
                                     "line 5: names 'framework_loss'"]
    assert choice_sites("if installed is not None and x:\n    pass\n") == ["line 1: installed compared with None"]
    offenders = []
    for path in sorted([*(REPO / "plugin").rglob("*.py"), *(REPO / "launch").rglob("*.py")]):
        relative = path.relative_to(REPO).as_posix()
        if relative not in CHOOSERS:
            offenders += [f"{relative} {site}" for site in choice_sites(path.read_text())]
    assert not offenders, offenders


def test_counted_exchange_bounds_reach_each_call_and_are_checked(tmp_path):
    """``--tp_exchange_capacity counted``: each micro-batch's numeric targets (this rank's, read once per
    step) bound its call's exchange through the installed hook's options, then the bound is lifted (an
    evaluation's forward is not a training micro-batch's); a micro-batch whose loss saw more numbers than
    its bound fails naming both (on a GPU the device asserts it; here the reporter checks the statistics).
    Without tensor parallelism, or with another setting, nothing is counted."""
    import torch
    from helpers import models

    import smmd_scale
    from smmd_scale import NumericVocab, SMMDLoss

    vocab = NumericVocab(list(range(20, 30)), list(range(10)), 96)
    labels = [torch.randint(0, 96, (2, 12)) for _ in range(2)]
    labels[0][:, 3:6] = 25  # (at least 6 numeric targets in the first micro-batch)
    micro_batches = [{"input_ids": ids, "labels": ids} for ids in labels]
    expected = [int(((ids[:, 1:] >= 20) & (ids[:, 1:] < 30)).sum()) for ids in labels]
    reporter = reporter_of(tmp_path, numeric_loss=["smmd"], tp_exchange_capacity="counted")
    assert reporter.exchange_bounds(micro_batches, 2, vocab) == expected
    assert reporter.exchange_bounds(micro_batches, 1, vocab) == [None, None]
    assert reporter_of(tmp_path, numeric_loss=["smmd"]).exchange_bounds(micro_batches, 2, vocab) == [None, None]

    model = models.tiny_llama(96, hidden_size=32, max_positions=64, seed=0)
    reporter.installed = smmd_scale.install(model, SMMDLoss(vocab))

    class Monitor:
        def record_micro_batch(self, losses, stats, z=None):
            self.positions = stats["numeric_tokens"]

    monitor = Monitor()
    for inputs, bound in zip(micro_batches, expected):
        reporter.bound_next_exchange(bound)
        assert reporter.installed.hook.ce_options["numeric_capacity"] == max(bound, 1)
        reporter.record_micro_batch(monitor, model(**inputs).loss)
        assert monitor.positions == bound
    reporter.bound_next_exchange(None)
    assert "numeric_capacity" not in reporter.installed.hook.ce_options
    reporter.bound_next_exchange(expected[0] - 1)
    model(**micro_batches[0])
    with pytest.raises(RuntimeError, match=rf"saw {expected[0]} numeric-target positions, more than the "
                                           rf"{expected[0] - 1} counted for it"):
        reporter.record_micro_batch(monitor, None)
