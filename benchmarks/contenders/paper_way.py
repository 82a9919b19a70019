"""SMMD computed the way the paper's public implementation does it: the benchmark's baseline.

Written by us from the objective in docs/objective.md (the kernel itself comes from smmd_scale: the
benchmark is about the *data flow* of the published implementation, which this follows):

  1. flatten logits to ``[T, V]`` and mask the rows whose target is a numeric token;
  2. index those full-vocabulary rows, ``logits[mask]``: a ``[P, V]`` copy;
  3. index the numeric columns of that copy, ``[P, N]``, and softmax them (in float32);
  4. with ``r = p - onehot(t)``:  ``r^T K r = p^T K p + K_tt - 2 K[t]·p`` and
     ``r^T L r = r^T D r - r^T K r`` with ``r^T D r = sum(deg p^2) - 2 deg_t p_t + deg_t``;
  5. ``relu``, mean over numeric positions; autograd does the backward (through the ``[P, V]``
     copy, so backward scatters a ``[P, V]`` gradient back into a ``[T, V]`` one).

    smmd = PaperWaySMMD(token_ids, values, vocab_size)
    loss = F.cross_entropy(logits.float(), targets) + smmd(logits, targets)
"""

import torch

from smmd_scale.value_kernel import build_kernel


class PaperWaySMMD:
    """SMMD (mode "smmd", gaussian, sigmas=(2.0,), squash_factor=9.0, alpha="auto") on full-vocab logits."""

    def __init__(self, token_ids, values, vocab_size: int, ignore_index: int = -100):
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        matrices = build_kernel(torch.as_tensor(values, dtype=torch.float64))
        self.kernel, self.degree, self.alpha = matrices.kernel, matrices.degree, matrices.alpha
        self.vocab_size, self.ignore_index = vocab_size, ignore_index
        # vocabulary id -> index in the numeric vocabulary, -1 for every other id
        self.numeric_index = torch.full((vocab_size, ), -1, dtype=torch.long)
        self.numeric_index[self.token_ids] = torch.arange(len(self.token_ids))
        self._on_device = {}

    def _tensors(self, device):
        if device not in self._on_device:
            self._on_device[device] = (self.token_ids.to(device), self.numeric_index.to(device),
                                       self.kernel.to(device, torch.float32), self.degree.to(device, torch.float32))
        return self._on_device[device]

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``logits [..., V]``, aligned ``targets [...]`` -> mean SMMD over numeric-target positions."""
        token_ids, numeric_index, kernel, degree = self._tensors(logits.device)
        logits = logits.reshape(-1, self.vocab_size)
        targets = targets.reshape(-1)
        numeric_targets = numeric_index[targets.clamp(min=0)]
        mask = (targets != self.ignore_index) & (numeric_targets >= 0)
        rows = logits[mask]  # [P, V]: the copy this baseline is about
        if rows.shape[0] == 0:
            return logits.sum() * 0.0
        probabilities = torch.softmax(rows[:, token_ids].float(), dim=-1)  # [P, N]
        t = numeric_targets[mask]
        p_t = probabilities.gather(1, t[:, None]).squeeze(1)
        kernel_p = probabilities @ kernel
        p_kernel_p = (probabilities * kernel_p).sum(dim=-1)
        mmd = p_kernel_p + kernel[t, t] - 2.0 * (kernel[t] * probabilities).sum(dim=-1)
        degree_term = (degree * probabilities.square()).sum(dim=-1) - 2.0 * degree[t] * p_t + degree[t]
        smooth = self.alpha * (degree_term - mmd)
        return torch.relu(mmd + smooth).mean()
