"""bf16 inputs: the running (max, sum) — the log-sum-exp —, CE and the gradient accumulate in fp32 by
default; ``accum_dtype=torch.bfloat16`` follows the input instead. Each one's error against float64
on the same bf16 values, for both ops, side by side."""

import pytest
import torch
from helpers.reference import reference_with_options

from smmd_scale import NumericVocab, SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy

Z_COEFFICIENT = 1e-3  # the z-loss reports lse itself: lse = sqrt(z / coefficient)


def bf16_errors(fused: bool, accum_dtype, seed: int, tokens: int = 256, hidden_size: int = 64,
                vocab_size: int = 4000) -> dict:
    """Max |error| of the per-token log-sum-exp and CE, and the max error of d hidden relative to its
    largest element, of one op on bf16 inputs (the fused head in 8 blocks), against float64 on the
    very bf16 logits the op scores (the bf16 product of the bf16 inputs)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator).bfloat16()
    head = (torch.randn(vocab_size, hidden_size, generator=generator) * 0.5).bfloat16()
    vocab = NumericVocab(list(range(100, 120)), list(range(20)), vocab_size)
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::3] = torch.randint(100, 120, (len(targets[::3]), ), generator=generator)
    smmd = SMMDLoss(vocab)
    h = hidden.clone().requires_grad_(True)
    options = dict(reduction="none", z_loss=Z_COEFFICIENT, accum_dtype=accum_dtype)
    if fused:
        out = linear_numeric_cross_entropy(h, head, targets, smmd, chunk_size=vocab_size // 8, **options)
    else:
        out = numeric_cross_entropy(h @ head.T, targets, smmd, **options)
    out.ce.sum().backward()

    logits = (hidden @ head.T).double().requires_grad_(True)  # the bf16 product, exactly
    _, exact_ce, _, exact_z = reference_with_options(logits, targets, lambda *_: torch.zeros(()), [],
                                                     z_loss=Z_COEFFICIENT, reduction="none")
    exact_ce.sum().backward()
    exact_grad = logits.grad @ head.double()  # d sum(CE) / d hidden at those logits
    lse = (out.z.double() / Z_COEFFICIENT).sqrt()
    return {"lse": (lse - (exact_z.detach() / Z_COEFFICIENT).sqrt()).abs().max().item(),
            "ce": (out.ce.double() - exact_ce.detach()).abs().max().item(),
            "grad": ((h.grad.double() - exact_grad).abs().max() / exact_grad.abs().max()).item(),
            "ce_dtype": out.ce.dtype, "grad_dtype": h.grad.dtype}


@pytest.mark.parametrize("fused", [False, True], ids=["materialized", "fused"])
def test_bf16_inputs_accumulate_in_fp32_by_default(fused):
    seed = int(torch.randint(0, 2**31, (1, )))
    fp32 = bf16_errors(fused, None, seed)
    bf16 = bf16_errors(fused, torch.bfloat16, seed)
    assert fp32["ce_dtype"] == torch.float32 and bf16["ce_dtype"] == torch.bfloat16
    assert fp32["grad_dtype"] == bf16["grad_dtype"] == torch.bfloat16
    # fp32 accumulation: log-sum-exp and CE to fp32 rounding at |lse| ~ 10, the gradient to about the
    # rounding of its bf16 output (2^-8 relative)
    assert fp32["lse"] < 2e-5 and fp32["ce"] < 2e-5, fp32
    assert fp32["grad"] < 2**-7, fp32
    # following bf16 costs orders of magnitude (bf16 keeps 8 bits). The materialized op's d hidden is
    # torch's bf16 GEMM of a bf16 d logits either way (its output rounding dominates: within 2^-7 both
    # ways); the fused head's, summed over its blocks in bf16, loses more than its output rounding
    assert bf16["lse"] > 100 * fp32["lse"] and bf16["ce"] > 100 * fp32["ce"], (fp32, bf16)
    if fused:
        assert bf16["grad"] > 1.2 * fp32["grad"], (fp32, bf16)
    else:
        assert bf16["grad"] < 2**-7, bf16
