"""Value-distance kernels over the numeric sub-vocabulary (docs/objective.md).

Everything here is built once per (vocabulary, options) in float64 on the CPU and is tiny:
``K`` is ``[N, N]`` with N ~ 10 (digit tokenizers) to ~1100 (tokenizers with 0..999 tokens).

Kernels are defined in a canonical order — tokens sorted by (value, token id) — and then
returned in the order of the ``values`` given, so the seeded ablation kernels do not depend on
how the caller happened to order the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .refusal import Named, Refusal, literal

KERNELS = ("gaussian", "laplace", "random", "shuffled")
MODES = ("mmd", "smooth", "smmd")

# The paper's ablations: a seeded value-agnostic PSD kernel from Rademacher features of this
# dimension (Gram matrix raised elementwise to the 5th power), and a seeded value permutation.
RANDOM_KERNEL_FEATURE_DIM = 4
RANDOM_KERNEL_POWER = 5


@dataclass(frozen=True)
class KernelMatrices:
    """The precomputed pieces of the objective, float64, in the caller's token order.

    kernel: ``[N, N]`` K
    degree: ``[N]``   deg_i = sum_j K_ij (the Laplacian is ``diag(degree) - kernel``)
    alpha:  the smoothness weight actually used (resolved from ``"auto"`` if asked)
    """

    kernel: torch.Tensor
    degree: torch.Tensor
    alpha: float


def validate_kernel_options(mode: str, kernel: str, sigmas: Sequence[float], squash_factor: float,
                            alpha: Union[str, float]) -> tuple:
    """Check the options and return ``sigmas`` as a tuple of floats; raise naming the bad one."""
    if mode not in MODES:
        raise Refusal("{mode} is not one of " + literal(MODES), mode=Named("mode", mode))
    if kernel not in KERNELS:
        raise Refusal("{kernel} is not one of " + literal(KERNELS), kernel=Named("kernel", kernel))
    if isinstance(sigmas, (int, float)):
        sigmas = (sigmas, )
    try:
        sigmas = tuple(float(s) for s in sigmas)
    except (TypeError, ValueError):
        raise TypeError(f"sigmas={sigmas!r} must be a number or a sequence of numbers") from None
    if not sigmas or not all(math.isfinite(s) and s > 0 for s in sigmas):
        raise Refusal("{sigmas} must be a non-empty sequence of finite positive numbers",
                      sigmas=Named("sigmas", sigmas))
    if isinstance(squash_factor, bool) or not isinstance(squash_factor, (int, float)) \
            or not math.isfinite(squash_factor) or squash_factor < 0:
        raise Refusal("{squash_factor} must be a finite number >= 0 (<= 1 disables squashing)",
                      squash_factor=Named("squash_factor", squash_factor))
    if isinstance(alpha, str):
        if alpha != "auto":
            raise ValueError(f"alpha={alpha!r} must be 'auto' or a finite number >= 0")
    elif isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha={alpha!r} must be 'auto' or a finite number >= 0")
    return sigmas


def squash_distances(distances: torch.Tensor, squash_factor: float) -> torch.Tensor:
    """Map non-zero distances affinely onto [1, squash_factor]; zero stays zero.

    When every non-zero distance is the same (e.g. two distinct values) the map is undefined
    and the distances are left as they are, as in the paper's implementation.
    """
    nonzero = distances > 0
    if squash_factor <= 1.0 or not bool(nonzero.any()):
        return distances
    smallest = distances[nonzero].min()
    largest = distances.max()
    if largest <= smallest:
        return distances
    scale = (squash_factor - 1.0) / (largest - smallest)
    return torch.where(nonzero, 1.0 + (distances - smallest) * scale, distances)


def value_distance_kernel(values: torch.Tensor, kernel: str, sigmas: Sequence[float],
                          squash_factor: float) -> torch.Tensor:
    """K_ij = mean over sigmas of k_sigma(|v_i - v_j|) after squashing, clamped to [0, 1]."""
    distances = squash_distances((values[:, None] - values[None, :]).abs(), squash_factor)
    per_sigma = []
    for sigma in sigmas:
        if kernel == "gaussian":
            per_sigma.append(torch.exp(-distances.square() / (2.0 * sigma * sigma)))
        else:
            per_sigma.append(torch.exp(-distances / sigma))
    return torch.stack(per_sigma).mean(dim=0).clamp(0.0, 1.0)


def random_psd_kernel(size: int, seed: int) -> torch.Tensor:
    """The paper's value-agnostic control: unit-norm Rademacher features, Gram matrix ** 5."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    signs = torch.randint(0, 2, (size, RANDOM_KERNEL_FEATURE_DIM), generator=generator).to(torch.float64) * 2 - 1
    features = signs / math.sqrt(RANDOM_KERNEL_FEATURE_DIM)
    return (features @ features.T).pow(RANDOM_KERNEL_POWER)


def build_kernel(values: torch.Tensor, *, mode: str = "smmd", kernel: str = "gaussian",
                 sigmas: Sequence[float] = (2.0, ), squash_factor: float = 9.0,
                 alpha: Union[str, float] = "auto", seed: int = 42) -> KernelMatrices:
    """Build K, its degrees and alpha for numeric values ``[N]`` (any order)."""
    sigmas = validate_kernel_options(mode, kernel, sigmas, squash_factor, alpha)
    values = torch.as_tensor(values, dtype=torch.float64).cpu()
    # Canonical order: by value, ties by position (positions are sorted token ids in NumericVocab).
    canonical = torch.argsort(values, stable=True)
    canonical_values = values[canonical]
    if kernel == "random":
        canonical_kernel = random_psd_kernel(len(values), seed)
    else:
        distance_kernel = kernel
        if kernel == "shuffled":
            # The paper's mapping ablation: the gaussian value-distance kernel after the values
            # are permuted across tokens, so it keeps the kernel's shape but not its meaning.
            generator = torch.Generator(device="cpu").manual_seed(int(seed))
            canonical_values = canonical_values[torch.randperm(len(values), generator=generator)]
            distance_kernel = "gaussian"
        canonical_kernel = value_distance_kernel(canonical_values, distance_kernel, sigmas, squash_factor)
    back = torch.empty_like(canonical)
    back[canonical] = torch.arange(len(values))
    kernel_matrix = canonical_kernel[back][:, back].contiguous()
    degree = kernel_matrix.sum(dim=1)
    if alpha == "auto":
        mean_degree = float(degree.mean())
        if not mean_degree > 0:
            raise ValueError(f"alpha='auto' needs a positive mean kernel degree, got {mean_degree:.3g} "
                             f"(kernel={kernel!r}); pass a number for alpha")
        alpha = 1.0 / (2.0 * mean_degree)
    return KernelMatrices(kernel=kernel_matrix, degree=degree, alpha=float(alpha))
