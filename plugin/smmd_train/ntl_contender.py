"""CE + NTL-WAS (Number Token Loss, the ``ntloss`` package) as a Hugging Face loss hook, for
comparisons with SMMD under the same launch path and the same numeric statistics.

NTL has only a full-logits implementation, so it is refused on a vocabulary-parallel head. Our
fused CE (SMMD weight 0) provides CE and the numeric statistics; the NTL term is added on top and
reported where SMMD's would be (``loss/smmd`` holds the auxiliary loss of the run).
"""

from __future__ import annotations

import torch

from smmd_scale import SMMDOutput
from smmd_scale.integrations.hf import SMMDCausalLMLoss


class NTLCausalLMLoss(SMMDCausalLMLoss):
    """``loss_function`` hook computing CE + weight * NTL-WAS on full logits.

    NTL is built over every single-token number of the tokenizer (``digit_level=False``: with
    Llama-3-style tokenizers the numbers 0..999 are tokens) with ``squash_factor`` mapping value
    distances onto [1, squash_factor], as SMMD's default does.
    """

    def __init__(self, smmd, tokenizer, weight: float, vocab_size: int, squash_factor: float = 9.0):
        super().__init__(smmd, weight=0.0)
        from ntloss import NTLoss

        self.ntl = NTLoss(tokenizer, vocab_size=vocab_size, digit_level=False, squash_factor=squash_factor)
        self.ntl_weight = weight

    def compute(self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None) -> SMMDOutput:
        output = super().compute(logits, shift_labels, num_items_in_batch)
        batched_logits = logits if logits.dim() == 3 else logits.reshape(1, -1, logits.shape[-1])
        if batched_logits.dtype in (torch.bfloat16, torch.float16):  # at least float32, as our loss computes
            batched_logits = batched_logits.float()
        ntl = self.ntl(batched_logits, shift_labels.reshape(batched_logits.shape[:2]),
                       ignore_index=self.smmd.ignore_index)
        total = output.ce + self.ntl_weight * ntl
        self.last_losses = (total.detach(), output.ce.detach(), ntl.detach())
        return SMMDOutput(total=total, ce=output.ce, smmd=ntl, stats=output.stats)


def install_ntl(installed, tokenizer, weight: float) -> None:
    """Swap an :class:`InstalledLoss`'s hook (SMMD) for CE + weight * NTL on the same model."""
    if installed.vocab_parallel:
        raise ValueError("--ntl_weight needs full logits (the ntloss package has no vocab-parallel version); "
                         "use a config without tensor_parallel")
    hook = NTLCausalLMLoss(installed.hook.smmd, tokenizer, weight, installed.hook.smmd.vocab.vocab_size)
    installed.hook = hook
    installed.model.loss_function = hook
