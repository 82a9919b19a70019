"""A plain float64 reference of the objective in docs/objective.md, written for clarity, not speed.

It shares no code with the package: full-row copies, an explicit Laplacian matrix, autograd
for the gradient. Tests compare the fast paths against it on fresh random inputs.
"""

import math

import torch
import torch.nn.functional as F


def reference_kernel(values, kernel="gaussian", sigmas=(2.0, ), squash_factor=9.0, alpha="auto"):
    """(K [N, N], L [N, N], alpha) in float64 for values in the given order."""
    values = torch.as_tensor(values, dtype=torch.float64)
    distances = (values[:, None] - values[None, :]).abs()
    nonzero = distances[distances > 0]
    if squash_factor > 1 and nonzero.numel() and nonzero.max() > nonzero.min():
        low, high = nonzero.min(), nonzero.max()
        mapped = 1 + (distances - low) / (high - low) * (squash_factor - 1)
        distances = torch.where(distances > 0, mapped, distances)
    total = torch.zeros_like(distances)
    for sigma in sigmas:
        if kernel == "gaussian":
            total += torch.exp(-distances**2 / (2 * sigma**2))
        else:
            total += torch.exp(-distances / sigma)
    K = (total / len(sigmas)).clamp(0, 1)
    degree = K.sum(dim=1)
    L = torch.diag(degree) - K
    if alpha == "auto":
        alpha = 1 / (2 * degree.mean().item())
    return K, L, alpha


def reference_smmd(logits, targets, token_ids, values, mode="smmd", kernel="gaussian", sigmas=(2.0, ),
                   squash_factor=9.0, alpha="auto", ignore_index=-100, K=None, L=None):
    """Mean SMMD over numeric-target positions of ``logits [..., V]`` (float64, autograd)."""
    if K is None:
        K, L, alpha = reference_kernel(values, kernel, sigmas, squash_factor, alpha)
    token_ids = [int(t) for t in token_ids]
    width = logits.shape[-1]
    flat_logits = logits.reshape(-1, width).double()
    flat_targets = targets.reshape(-1).tolist()
    per_position = []
    for row, target in enumerate(flat_targets):
        if target == ignore_index or target not in token_ids:
            continue
        p = torch.softmax(flat_logits[row][token_ids], dim=0)
        q = torch.zeros_like(p)
        q[token_ids.index(target)] = 1.0
        r = p - q
        mmd = r @ K @ r
        smooth = alpha * (r @ L @ r)
        value = {"mmd": mmd, "smooth": smooth, "smmd": mmd + smooth}[mode]
        per_position.append(torch.relu(value))
    if not per_position:
        return flat_logits.sum() * 0.0
    return torch.stack(per_position).mean()


def reference_total(logits, targets, token_ids, values, weight=1.0, num_items_in_batch=None, ignore_index=-100,
                    **options):
    """(total, ce, smmd) as docs/objective.md defines them, on a float64 copy of the logits."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).double()
    flat_targets = targets.reshape(-1)
    smmd = reference_smmd(logits, targets, token_ids, values, ignore_index=ignore_index, **options)
    if num_items_in_batch is None:
        valid = (flat_targets != ignore_index).sum()
        if valid == 0:
            ce = flat_logits.sum() * 0.0
        else:
            ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index)
    else:
        ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
        count = max(num_items_in_batch, 1)  # docs/objective.md: a count of 0 divides as 1
        ce = ce / count
        smmd = smmd * (flat_targets != ignore_index).sum() / count
    return ce + weight * smmd, ce, smmd


def relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-30) if scale else (actual.abs().max().item())


def is_close(actual, expected, rtol):
    return math.isclose(float(actual), float(expected), rel_tol=rtol, abs_tol=rtol * 1e-3)


# The fp32 accuracy the vocab-parallel CE must keep at any logit magnitude (Megatron-core's level):
# per-token CE and its gradient against float64 on the same fp32 logits, N(0, 3) + offset.
FP32_OFFSETS = (0.0, 30.0, 300.0, 1000.0)
FP32_CE_TOLERANCE, FP32_GRAD_TOLERANCE = 4e-6, 6e-7


def fp32_ce_errors(per_token_ce, offset: float, seed: int, tokens: int = 96, vocab_size: int = 3000,
                   start: int = 0, end=None, device="cpu") -> tuple:
    """(max |CE error|, max |gradient error|) of ``per_token_ce(shard, targets) -> [tokens]`` on
    ``logits[:, start:end]`` of fp32 logits N(0, 3) + ``offset``, against float64 on the same values
    (d sum(CE) / d logits)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab_size, generator=generator, dtype=torch.float64) * 3 + offset).float()
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::7] = -100
    reference_logits = logits.double().requires_grad_(True)
    reference = F.cross_entropy(reference_logits, targets, reduction="none")
    reference.sum().backward()
    end = vocab_size if end is None else end
    shard = logits[:, start:end].to(device, copy=True).requires_grad_(True)
    ce = per_token_ce(shard, targets.to(device))
    ce.sum().backward()
    assert ce.dtype == torch.float32
    return ((ce.double().cpu() - reference).abs().max().item(),
            (shard.grad.double().cpu() - reference_logits.grad[:, start:end]).abs().max().item())


def reference_ntl(logits, targets, token_ids, values, kind="was", reweigh=True, squash_factor=None, ignore_index=-100):
    """Mean NTL (the ntloss package's definitions) over numeric-target positions of ``logits [..., V]``
    (float64, autograd, one position at a time)."""
    token_ids = [int(t) for t in token_ids]
    values = torch.as_tensor(values, dtype=torch.float64)
    distances = (values[:, None] - values[None, :]).abs()
    nonzero = distances[distances > 0]
    if squash_factor is not None and nonzero.max() > nonzero.min():  # one non-zero distance: nothing to map
        low, high = nonzero.min(), nonzero.max()
        distances = torch.where(distances > 0, 1 + (distances - low) * (squash_factor - 1) / (high - low), distances)
    max_distance = distances.max() if kind == "was" else (values.max() - values.min()) ** 2
    flat_logits = logits.reshape(-1, logits.shape[-1]).double()
    per_position = []
    for row, target in enumerate(targets.reshape(-1).tolist()):
        if target == ignore_index or target not in token_ids:
            continue
        index = token_ids.index(target)
        q = torch.softmax(flat_logits[row][token_ids], dim=0)
        if kind == "was":
            value = (distances[index] * q).sum()
        else:
            value = ((q * values).sum() - values[index]) ** 2
        if reweigh:
            mass = torch.softmax(flat_logits[row], dim=0)[token_ids].sum()
            value = value * mass + 1.01 * max_distance * (1 - mass)
        per_position.append(value)
    if not per_position:
        return flat_logits.sum() * 0.0
    return torch.stack(per_position).mean()


def reference_transformed_logits(logits, logit_scale=None, logit_softcap=None):
    """``cap * tanh(scale * logits / cap)`` in float64 (each step only when its option is set)."""
    transformed = logits.double()
    if logit_scale is not None:
        transformed = transformed * logit_scale
    if logit_softcap is not None:
        transformed = logit_softcap * torch.tanh(transformed / logit_softcap)
    return transformed


def reference_with_options(logits, targets, numeric_reference, token_ids, weight=1.0, logit_scale=None,
                           logit_softcap=None, z_loss=0.0, label_smoothing=0.0, reduction="mean", ignore_index=-100):
    """(total, ce, numeric, z) of CE + z-loss + weight * a numeric loss on the transformed logits, in
    float64 with autograd: CE is ``F.cross_entropy(..., label_smoothing=)``, the z-loss ``z_loss *
    logsumexp^2`` at non-ignored positions, and ``numeric_reference(logits_row [1, V], target [1])`` the
    numeric loss of one position, called at each non-ignored position whose target is in ``token_ids``
    (0 elsewhere). ``reduction`` as in the op."""
    transformed = reference_transformed_logits(logits, logit_scale, logit_softcap).reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    ce = F.cross_entropy(transformed, flat_targets, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         reduction="none")
    lse = torch.logsumexp(transformed, dim=-1)
    z = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    token_ids = {int(token) for token in token_ids}
    numeric_rows = [row for row, target in enumerate(flat_targets.tolist())
                    if target != ignore_index and target in token_ids]
    numeric = torch.zeros_like(lse)
    for row in numeric_rows:
        numeric = numeric.index_add(0, torch.tensor([row]),
                                    numeric_reference(transformed[row:row + 1], flat_targets[row:row + 1]).view(1))
    if reduction == "none":
        shape = targets.shape
        return (ce + z + weight * numeric).view(shape), ce.view(shape), numeric.view(shape), z.view(shape)
    if reduction == "sum":
        return ce.sum() + z.sum() + weight * numeric.sum(), ce.sum(), numeric.sum(), z.sum()
    tokens = max(int(valid.sum()), 1)
    numeric_positions = max(len(numeric_rows), 1)
    mean_ce, mean_z, mean_numeric = ce.sum() / tokens, z.sum() / tokens, numeric.sum() / numeric_positions
    return mean_ce + mean_z + weight * mean_numeric, mean_ce, mean_numeric, mean_z


def reference_ntl_per_position(logits, targets, token_ids, values, ignore_index=-100, **options):
    """``targets``-shaped float64 NTL per position (0 where the target is not numeric or ignored):
    :func:`reference_ntl` one position at a time."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    rows = []
    for row in range(flat_targets.numel()):
        rows.append(reference_ntl(flat_logits[row:row + 1], flat_targets[row:row + 1], token_ids, values,
                                  ignore_index=ignore_index, **options))
    return torch.stack(rows).view(targets.shape)


def reference_number_level(logits, targets, token_ids, values, reweigh=True, dot_ids=(), ignore_index=-100,
                           max_number_length=20):
    """Number-level NTL (ntloss's NumberLevelLoss) per position of ``targets [B, T]`` (or ``[T]``), float64,
    autograd: each run of digit targets along the last dim is one number (a dot target between two
    digits joins two runs when ``dot_ids`` is given); its symmetric relative error sits at its first digit."""
    token_ids = [int(t) for t in token_ids]
    values = torch.as_tensor(values, dtype=torch.float64)
    width = logits.shape[-1]
    rows_targets = targets.reshape(-1, targets.shape[-1]).tolist() if targets.dim() else [[int(targets)]]
    rows_logits = logits.reshape(-1, targets.shape[-1] if targets.dim() else 1, width).double()
    out = [[logits.sum().double() * 0.0 for _ in row] for row in rows_targets]
    eps = float(torch.finfo(torch.float32).eps)
    for b, row in enumerate(rows_targets):
        is_digit = [target != ignore_index and target in token_ids for target in row]
        numbers, current, t = [], [], 0
        while t < len(row):
            if is_digit[t]:
                current.append(t)
            elif (current and row[t] in dot_ids and t + 1 < len(row) and is_digit[t + 1]):
                pass  # a dot between digits: the number goes on
            elif current:
                numbers.append(current)
                current = []
            t += 1
        if current:
            numbers.append(current)
        for digits in numbers:
            y = yhat = 0.0
            for index, t in enumerate(digits):
                power = 10.0 ** min(len(digits) - 1 - index, max_number_length - 1)
                q = torch.softmax(rows_logits[b, t][token_ids], dim=0)
                y = y + values[token_ids.index(row[t])] * power
                yhat = yhat + (q * values).sum() * power
            loss = (yhat - y).abs() / (yhat.abs() + abs(y) + eps)
            if reweigh:
                mass = torch.softmax(rows_logits[b, digits[0]], dim=0)[token_ids].sum()
                loss = loss * mass + 1.01 * (1 - mass)
            out[b][digits[0]] = loss
    return torch.stack([torch.stack(row) for row in out]).view(targets.shape)
