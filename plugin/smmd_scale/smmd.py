"""The SMMD objective (docs/objective.md): a value-distance kernel MMD term plus a graph-Laplacian
smoothness term on the distribution over the numeric tokens."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .numeric_loss import IGNORE_INDEX, NumericLoss, NumericTerms, terms_from_q
from .value_kernel import build_kernel
from .vocab import NumericVocab


class SMMDLoss(NumericLoss):
    """The SMMD objective for one numeric vocabulary (docs/objective.md).

    ``loss = SMMDLoss(vocab)(logits, targets)`` with full-vocabulary logits ``[..., V]`` (any float
    dtype; computed in at least float32) and aligned (already shifted) targets ``[...]``; or, for a
    vocabulary-parallel shard ``[..., V/T]``, pass ``tp_group`` and ``vocab_start_index``. Returns
    the mean over numeric-target positions (an exact 0 that still backpropagates when there are
    none). For CE + SMMD in one pass use :func:`smmd_scale.numeric_cross_entropy` with this object.

    Options: ``mode`` in {"smmd", "mmd", "smooth"}; ``kernel`` in {"gaussian", "laplace"} or the
    paper's ablations {"random", "shuffled"} (seeded by ``seed``); ``sigmas`` (averaged);
    ``squash_factor`` (<= 1 disables); ``alpha`` ("auto" = 1 / (2 mean degree), or a number).
    """

    gradient = "hand-written"  # numeric_terms; numeric_value is its autograd reference

    def __init__(self, vocab: NumericVocab, mode: str = "smmd", kernel: str = "gaussian",
                 sigmas: Union[float, Sequence[float]] = (2.0, ), squash_factor: float = 9.0,
                 alpha: Union[str, float] = "auto", ignore_index: int = IGNORE_INDEX, seed: int = 42):
        super().__init__(vocab, ignore_index)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        distinct_values = int(torch.unique(vocab.values).numel())
        if distinct_values < 2:
            raise ValueError(f"the numeric vocabulary has {len(vocab)} token(s) but {distinct_values} distinct "
                             "value(s); SMMD compares values, so it needs at least two distinct ones (its MMD "
                             "term would be identically 0); check how the vocabulary was built")
        matrices = build_kernel(vocab.values, mode=mode, kernel=kernel, sigmas=sigmas, squash_factor=squash_factor,
                                alpha=alpha, seed=seed)
        self.mode, self.kernel, self.squash_factor, self.seed = mode, kernel, float(squash_factor), seed
        self.sigmas = tuple(float(s) for s in (sigmas if isinstance(sigmas, (tuple, list)) else (sigmas, )))
        self.alpha = matrices.alpha
        self.kernel_matrix, self.degree = matrices.kernel, matrices.degree
        self._matrices = {}

    def __repr__(self):
        return (f"SMMDLoss(mode={self.mode!r}, kernel={self.kernel!r}, sigmas={self.sigmas}, "
                f"squash_factor={self.squash_factor}, alpha={self.alpha:.6g}, ignore_index={self.ignore_index}, "
                f"vocab={self.vocab!r})")

    @property
    def name(self) -> str:
        return "smmd"

    @property
    def stat_names(self) -> tuple:
        return self.name, "mmd", "smooth"

    def options(self) -> tuple:
        return self.mode, self.kernel, self.sigmas, self.squash_factor, self.alpha, self.seed

    def _kernel_and_degree(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """(K, deg) on ``device`` in ``dtype``, copied once per (device, dtype)."""
        key = (device, dtype)
        if key not in self._matrices:
            matrices = (self.kernel_matrix.to(device=device, dtype=dtype), self.degree.to(device=device, dtype=dtype))
            if torch.compiler.is_compiling():
                return matrices  # (a cache filled from a compiled graph is a guard that fails on the next call)
            self._matrices[key] = matrices
        return self._matrices[key]

    def numeric_value(self, plan, numeric) -> torch.Tensor:
        """The objective written plainly, for autograd: the reference :meth:`numeric_terms` is tested
        against. ``r = q - onehot(target)``; MMD ``r^T K r``, smoothness ``alpha r^T L r`` with
        ``L = D - K``; their sum (``mode``), floored at 0."""
        q = numeric.q
        kernel, degree = (matrix.to(device=q.device, dtype=q.dtype) for matrix in (self.kernel_matrix, self.degree))
        residual = q - torch.nn.functional.one_hot(plan.numeric_targets, q.shape[-1]).to(q.dtype)
        mmd = torch.einsum("pi,ij,pj->p", residual, kernel, residual)
        laplacian = torch.diag(degree) - kernel
        smooth = self.alpha * torch.einsum("pi,ij,pj->p", residual, laplacian, residual)
        value = {"mmd": mmd, "smooth": smooth}.get(self.mode, mmd + smooth)
        return torch.relu(value)

    def numeric_terms(self, q: torch.Tensor, numeric_targets: torch.Tensor, mass: Optional[torch.Tensor],
                      compute_dtype: torch.dtype) -> NumericTerms:
        """The paper's objective at P positions, with its gradient w.r.t. q (chained into the numeric
        logits by :func:`~smmd_scale.numeric_loss.terms_from_q`).

        ``r = q - onehot(target)``. One ``[P, N] x [N, N]`` product gives everything: ``Kr``;
        ``r^T K r``; ``r^T L r = sum(deg * r^2) - r^T K r`` (L = D - K); and ``d/dq = 2 M r`` with
        ``M r = Kr`` (mmd), ``alpha (deg*r - Kr)`` (smooth) or their sum (smmd), which is
        ``(1 - alpha) Kr + alpha deg*r``: the value is then ``r^T M r`` and the smoothness term its
        difference from the MMD term (two ops fewer than forming ``deg*r - Kr`` first).
        """
        kernel, degree = self._kernel_and_degree(q.device, compute_dtype)
        # (the [P, N] x [N, N] product runs in the logits' precision; q - onehot(target) in one op)
        residual = q.to(compute_dtype).scatter(1, numeric_targets[:, None], -1.0, reduce="add")
        with torch.autocast(q.device.type, enabled=False):  # in compute_dtype under autocast too, not bf16
            kernel_residual = residual @ kernel
        mmd = (residual * kernel_residual).sum(dim=-1)
        if self.mode == "smmd":
            # (lerp: Kr + alpha (deg*r - Kr). Not torch.add(alpha * deg*r, Kr, alpha=1 - alpha), the same
            # value eagerly, which inductor (torch 2.13, CPU) compiled inside the op to a 7% larger loss)
            metric_residual = torch.lerp(kernel_residual, degree * residual, self.alpha)
            value = (residual * metric_residual).sum(dim=-1)
            smooth = value - mmd
        else:
            laplacian_residual = degree * residual - kernel_residual
            smooth = self.alpha * (residual * laplacian_residual).sum(dim=-1)
            value, metric_residual = ((mmd, kernel_residual) if self.mode == "mmd" else
                                      (smooth, self.alpha * laplacian_residual))
        # relu guards float error; its derivative is 0 where the value is <= 0, as torch.relu's (a bool
        # factor keeps the residual's dtype).
        grad_q = (metric_residual * (value > 0)[:, None]) * 2.0
        value = torch.relu(value)
        return terms_from_q(q, value, grad_q, {self.name: value, "mmd": mmd, "smooth": smooth})
