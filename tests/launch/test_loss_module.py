"""A numeric loss of a user's own, written by this test alone into a module of its own, runs through
train.py like a built-in one: ``--loss_module`` imports it (it registers itself), ``--numeric_loss`` names it,
its option is a train.py flag, its statistic is a TensorBoard tag and an HParams column, and a resumed
run holds its option in the resume record (a changed option is refused as a changed objective).

What the docs (docs/objective.md, "Adding a numeric loss") say a user writes, and nothing else: one
module with the loss class and its registry entry."""

import os
import textwrap

import pytest
from helpers.launching import environment, metrics, run
from helpers.train_runs import corpus_fixture, deepspeed_command, tensorboard_run, train_args

pytestmark = pytest.mark.slow
corpus = corpus_fixture()

TOY_MODULE = '''
    """A toy numeric loss: |expected value - target value| x scale, its gradient by autograd."""
    import torch

    from smmd_scale.numeric_loss import NumericLoss
    from smmd_scale.registry import LossOption, NumericLossEntry, register_numeric_loss


    class ToyAbsLoss(NumericLoss):
        name = "toy_abs"

        def __init__(self, vocab, scale=1.0, ignore_index=-100):
            super().__init__(vocab, ignore_index)
            self.scale = float(scale)

        def options(self):
            return (self.scale, )

        def numeric_value(self, plan, numeric):
            values = self.vocab.on(numeric.q.device, torch.float64)[1]
            return self.scale * (numeric.q @ values - values[plan.numeric_targets]).abs()


    register_numeric_loss(NumericLossEntry(
        "toy-abs", "toy_abs", (), "toy", ToyAbsLoss, "a toy: |expected value - target value| x scale",
        options=(LossOption("scale", "--toy_scale", float, 1.0, "the toy's scale",
                            check=lambda value: None if value > 0 else "must be > 0"), )))
'''


def test_a_loss_written_by_a_user_trains_logs_and_resumes(tmp_path, corpus):
    (tmp_path / "toy_loss.py").write_text(textwrap.dedent(TOY_MODULE))
    env = environment(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    output = tmp_path / "run"

    def command(steps, scale, **options):
        return deepspeed_command(1, *train_args(corpus, output, steps=steps, save_steps=2, loss_module=["toy_loss"],
                                                numeric_loss=["smmd:0.5", "toy-abs:0.01"], **options),
                                 "--toy_scale", str(scale))

    completed = run(command(2, 3.0), timeout=600, env=env)
    log = completed.stdout + completed.stderr
    assert "[train] done: 2 step(s)" in log, log[-3000:]
    logged = metrics(output)
    first = logged[1]
    # the toy's statistic is logged next to SMMD's, and the total holds its weighted mean
    assert first["loss/toy_abs"] > 0 and first["loss/smmd"] > 0
    assert first["loss/numeric"] == pytest.approx(0.5 * first["loss/smmd"] + 0.01 * first["loss/toy_abs"], rel=1e-5)
    scalars, hparams = tensorboard_run(output)
    assert {"loss/toy_abs", "loss/smmd"} <= scalars
    assert hparams["toy_scale"] == "3" and hparams["numeric_loss"] == "0.5 smmd + 0.01 toy-abs"
    # Resumed with the same option: it continues; with another: refused as a changed objective.
    completed = run(command(4, 3.0, resume=True), timeout=600, env=env)
    assert "resumed from step00000002 at step 2" in completed.stdout, completed.stdout[-3000:]
    assert sorted(step for step in metrics(output) if step) == [1, 2, 3, 4]
    with pytest.raises(AssertionError) as refused:
        run(command(6, 5.0, resume=True), timeout=300, env=env)
    assert "--toy_scale 3 -> 5" in str(refused.value), str(refused.value)[-3000:]


def test_a_loss_module_that_cannot_be_imported_is_named(tmp_path, corpus):
    with pytest.raises(AssertionError) as refused:
        run(deepspeed_command(1, *train_args(corpus, tmp_path / "run", steps=1, loss_module=["no_such_loss_module"])),
            timeout=300)
    assert "--loss_module no_such_loss_module: cannot import it" in str(refused.value), str(refused.value)[-3000:]
