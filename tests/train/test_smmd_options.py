"""SMMD's kernel as train.py options (``--smmd_squash_factor``, ``--smmd_sigmas``): the flags reach the
planned loss's kernel, bad values are one line naming the flag, and the kernel values that
docs/objective.md's "Choosing a numeric loss for your tokenizer" table quotes are what the code builds."""

import math
import re

import pytest
import torch
from helpers.launching import REPO, train_flags

import smmd_scale
from smmd_scale.value_kernel import build_kernel
from smmd_train.components.loss_reporter import numeric_loss
from smmd_train.config.arguments import parse_args
from smmd_train.config.run_config import RunConfig

ZERO3 = REPO / "ds_configs" / "zero3.json"


def args_with(tmp_path, **options):
    return parse_args(train_flags(deepspeed_config=ZERO3, model="tiny", tokenizer=tmp_path, data=["x"], max_steps=1,
                                  output_dir=tmp_path, **options))


@pytest.mark.parametrize("squash_factor, sigma", [(None, None), (0, 20.0), (1, 5.0), (3.5, 1.5)])
def test_the_flags_set_the_planned_kernel(tmp_path, generator, squash_factor, sigma):
    values = torch.randperm(1000, generator=generator)[:int(torch.randint(3, 40, (1, ), generator=generator))]
    vocab = smmd_scale.NumericVocab(list(range(len(values))), values.tolist(), 1000)
    args = args_with(tmp_path, smmd_squash_factor=squash_factor, smmd_sigmas=None if sigma is None else [sigma])
    loss = numeric_loss(RunConfig.from_args(args).loss, vocab)
    squash, sigma = (9.0, 2.0) if squash_factor is None else (float(squash_factor), sigma)
    assert (loss.squash_factor, loss.sigmas) == (squash, (sigma, ))
    # The closed form: distances |v_i - v_j|, their non-zero ones mapped affinely onto [1, squash] when squash > 1.
    distances = (values[:, None] - values[None, :]).abs().double()
    if squash > 1:
        nonzero = distances > 0
        smallest, largest = distances[nonzero].min(), distances.max()
        distances = torch.where(nonzero, 1 + (distances - smallest) * (squash - 1) / (largest - smallest), distances)
    expected = torch.exp(-distances.square() / (2 * sigma * sigma))
    torch.testing.assert_close(loss.kernel_matrix, expected, rtol=1e-12, atol=1e-15)  # float64 both, same formula


@pytest.mark.parametrize("value", ["-1.0", "nan", "inf"])
def test_a_bad_squash_factor_is_one_line_naming_the_flag(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exited:
        args_with(tmp_path, smmd_squash_factor=value)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.count("\n") == 1
    assert re.search(rf"--smmd_squash_factor {value} must be a finite number >= 0 \(0 or 1: raw value distances", error)


def test_the_kernel_values_the_docs_quote():
    """docs/objective.md quotes K(off by k) between a target and a value k away, to 3 places."""
    quoted = {  # (N, squash_factor, sigma): {k: K}
        (1000, 9, 2.0): {1: 0.882, 10: 0.866, 50: 0.785, 100: 0.669, 500: 0.044},
        (1000, 0, 20.0): {1: 0.999, 10: 0.882, 20: 0.607, 50: 0.044},
        (1000, 0, 2.0): {5: 0.044},
        (10, 9, 2.0): {1: 0.882, 2: 0.607, 3: 0.325, 5: 0.044},
        (10, 9, 1.0): {1: 0.607, 2: 0.135},
    }
    for (size, squash_factor, sigma), kernel_values in quoted.items():
        kernel = build_kernel(torch.arange(size, dtype=torch.float64), sigmas=(sigma, ),
                              squash_factor=squash_factor).kernel
        for offset, value in kernel_values.items():
            assert math.isclose(round(float(kernel[0, offset]), 3), value), (size, squash_factor, sigma, offset)
    # On the values 0..9 the non-zero distances are 1..9 already: squashing onto [1, 9] changes nothing.
    digits = torch.arange(10, dtype=torch.float64)
    assert torch.equal(build_kernel(digits, squash_factor=9).kernel, build_kernel(digits, squash_factor=0).kernel)
    docs = (REPO / "docs" / "objective.md").read_text()
    assert "K(1) 0.882, K(10) 0.866, K(50) 0.785, K(100) 0.669, K(500) 0.044" in docs
