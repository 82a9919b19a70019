"""Forward + backward time and peak memory of the loss, every contender on the same logits.

Contenders, all on one ``logits [tokens, V]`` (requires grad) and ``targets [tokens]``:
  torch_ce      F.cross_entropy(logits.float(), targets): what HF's ForCausalLMLoss does
  deepspeed_ce  deepspeed.sequence.cross_entropy.vocab_parallel_cross_entropy at TP = 1 (CE only)
  paper_way     torch_ce + SMMD computed the way the paper's implementation does (contenders/paper_way.py)
  ntloss        torch_ce + NTLoss (NTL-WAS) from the ``ntloss`` package, called as its README does
  ours_ce       smmd_scale.numeric_cross_entropy(logits, targets, SMMDLoss(vocab), weight=0.0).total: our CE
                alone (the numeric statistics are still computed, as in a CE-only training run)
  ntl_was       smmd_scale.numeric_cross_entropy(logits, targets, NTLoss(vocab, "was"), weight=1.0).total
  ntl_mse       the same with NTLoss(vocab, "mse")
  dist2         the same with DIST2Loss(vocab) (KL to soft targets over the numeric slice)
  gauss_ls      the same with GaussianLabelSmoothingLoss(vocab) (soft targets, full-vocabulary softmax)
  del           the same with DigitEntropyLoss on the numeric tokens read as digits (token k has the
                digit k mod 10: DEL needs the ten digits; every run of numeric targets is one number)
  ours          smmd_scale.numeric_cross_entropy(logits, targets, SMMDLoss(vocab), weight=1.0).total

Inputs: N numeric tokens at random distinct ids with values 0..N-1; a share of the targets is
numeric, the rest are random non-numeric ids, ~5% of all targets ignore_index.

Time: one warm-up call each, then ``--repeats`` rounds in which every contender runs once, the
order rotated each round so none is always first; median and spread ((max - min) / median) of
forward + backward (CUDA: synchronised around the timed region). Reported as ratios to torch_ce
measured in the same run, never as a lone absolute time.

Peak memory: the loss's own working memory, inputs excluded, the gradient it produces included.
  CUDA  max_memory_allocated() after reset_peak_memory_stats(), minus what was allocated before.
  CPU   a fresh subprocess per (contender, shape) (``--measure-memory``): it warms the contender
        up on a few tokens, builds the inputs (written in place, so resident), resets its peak
        RSS, runs one forward + backward, and reports the peak RSS minus the RSS at the reset.
        The peak is the kernel's VmHWM, reset through /proc/self/clear_refs, rather than
        ru_maxrss: Linux carries ru_maxrss across fork + exec, so a child's ru_maxrss starts at
        its parent's peak and would hide everything below it. glibc's mmap threshold is pinned
        in the child so every large block is fresh pages from the OS: a block freed earlier and
        reused from the heap could otherwise hide an allocation.

    python -m benchmarks.bench_loss --quick   # one tiny shape, a smoke run (~30 s)
    python -m benchmarks.bench_loss --cpu     # default on CPU: 10 shapes, ~10 min on 2 quiet cores
    python -m benchmarks.bench_loss --full    # default on CUDA: the whole grid (48 shapes)

The JSON (benchmarks/results/bench_loss_{quick,cpu,full}.json) holds every row and a "targets"
section: each target of the issue with its measured value and pass/fail, computed, not asserted.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported

from smmd_cli.options import option, parse_options  # noqa: E402
from smmd_cli.tables import markdown_table  # noqa: E402

import smmd_scale  # noqa: E402  (after DS_ACCELERATOR is set)
from benchmarks.common import REPO, machine, median_and_spread, results_dir_option, write_results  # noqa: E402
from benchmarks.contenders.ntloss_package import Unavailable, build_ntloss  # noqa: E402
from benchmarks.contenders.paper_way import PaperWaySMMD  # noqa: E402

CONTENDERS = ("torch_ce", "deepspeed_ce", "paper_way", "ntloss", "ours_ce", "ntl_was", "ntl_mse", "dist2", "gauss_ls",
              "del", "ours")
# CE + one of the soft-target losses or DEL: set up from its vocabulary (values 0..N-1), compared with our CE alone
SOFT_TARGET_AND_DEL = {
    "dist2": lambda vocab: smmd_scale.DIST2Loss(vocab),
    "gauss_ls": lambda vocab: smmd_scale.GaussianLabelSmoothingLoss(vocab),
    "del": lambda vocab: smmd_scale.DigitEntropyLoss(smmd_scale.NumericVocab(
        vocab.token_id_list, [int(value) % 10 for value in vocab.values.tolist()], vocab.vocab_size))}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORE_SHARE = 0.05
SEED = 0
MEMORY_WARMUP_TOKENS = 64
# glibc: a fixed mmap threshold (which also turns off its dynamic growth) for the memory child
CHILD_MALLOC_MMAP_THRESHOLD_BYTES = 64 * 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class Shape:
    tokens: int
    vocab_size: int
    numeric_size: int
    numeric_share: float
    dtype: str

    def cli_args(self) -> list:
        return [str(value) for value in asdict(self).values()]

    def __str__(self):
        return (f"tokens={self.tokens} V={self.vocab_size} N={self.numeric_size} "
                f"numeric={self.numeric_share:.0%} {self.dtype}")


def shape_grid(tokens, vocab_size, numeric_size=(10, 1000), numeric_share=(0.05, 0.3), dtype=("fp32", "bf16")) -> list:
    return [Shape(*values) for values in itertools.product(tokens, vocab_size, numeric_size, numeric_share, dtype)]


GRIDS = {
    "quick": shape_grid([256], [8192], [100], [0.3], ["fp32"]),
    # ~100 s a shape at V=32000 and ~4x that at V=128256 on 2 busy cores (5 repeats + 5 memory
    # children each), so V=128256 only at the headline N=1000, 30% numeric: ~25 min in all.
    "cpu": shape_grid([2048], [32000]) + shape_grid([2048], [128256], [1000], [0.3]),
    "full": shape_grid([2048, 8192], [32000, 128256, 151936]),
}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def numeric_token_ids(shape: Shape) -> torch.Tensor:
    """``[N]`` distinct random token ids; token ``k`` of this list has the value ``k``."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randperm(shape.vocab_size, generator=generator)[:shape.numeric_size]


def make_inputs(shape: Shape, token_ids: torch.Tensor, device: torch.device) -> tuple:
    """``logits [tokens, V]`` (requires grad) and ``targets [tokens]`` on ``device``.

    The logits are drawn in place: no temporary copy, and every page is written (resident).
    """
    logits = torch.empty(shape.tokens, shape.vocab_size, dtype=DTYPES[shape.dtype], device=device)
    logits.normal_(0.0, 2.0, generator=torch.Generator(device=device).manual_seed(SEED))
    generator = torch.Generator().manual_seed(SEED + 1)
    is_numeric = torch.zeros(shape.vocab_size, dtype=torch.bool)
    is_numeric[token_ids] = True
    other_ids = (~is_numeric).nonzero().squeeze(1)
    targets = other_ids[torch.randint(len(other_ids), (shape.tokens, ), generator=generator)]
    order = torch.randperm(shape.tokens, generator=generator)
    numeric_count, ignore_count = round(shape.numeric_share * shape.tokens), round(IGNORE_SHARE * shape.tokens)
    targets[order[:numeric_count]] = token_ids[torch.randint(shape.numeric_size, (numeric_count, ),
                                                             generator=generator)]
    targets[order[numeric_count:numeric_count + ignore_count]] = -100
    return logits.requires_grad_(True), targets.to(device)


# --------------------------------------------------------------------------------------------
# Contenders: each is set up outside the timed region and returns ``loss(logits, targets)``
# --------------------------------------------------------------------------------------------


def torch_ce(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def build_loss(name: str, shape: Shape, token_ids: torch.Tensor):
    """Set up contender ``name`` for this shape; raises Unavailable for a missing optional one."""
    vocab_size, values = shape.vocab_size, list(range(shape.numeric_size))
    if name == "torch_ce":
        return torch_ce
    if name == "deepspeed_ce":
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

        # Explicit shard bounds and global_vocab_size skip its per-call validation collective.
        return lambda logits, targets: vocab_parallel_cross_entropy(
            logits, targets, tp_group=None, vocab_start_index=0, vocab_end_index=vocab_size,
            global_vocab_size=vocab_size)
    if name == "paper_way":
        smmd = PaperWaySMMD(token_ids, values, vocab_size)
        return lambda logits, targets: torch_ce(logits, targets) + smmd(logits, targets)
    if name == "ntloss":
        return build_ntloss(shape.vocab_size, shape.numeric_size, token_ids, torch_ce)
    vocab = smmd_scale.NumericVocab(token_ids.tolist(), values, vocab_size)
    if name in ("ours", "ours_ce"):
        smmd, weight = smmd_scale.SMMDLoss(vocab), 1.0 if name == "ours" else 0.0
        return lambda logits, targets: smmd_scale.numeric_cross_entropy(logits, targets, smmd, weight=weight).total
    if name in ("ntl_was", "ntl_mse"):
        ntl = smmd_scale.NTLoss(vocab, kind=name.split("_")[1])
        return lambda logits, targets: smmd_scale.numeric_cross_entropy(logits, targets, ntl, weight=1.0).total
    if name in SOFT_TARGET_AND_DEL:
        numeric = SOFT_TARGET_AND_DEL[name](vocab)
        return lambda logits, targets: smmd_scale.numeric_cross_entropy(logits, targets, numeric, weight=1.0).total
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def forward_backward(loss_fn, logits, targets) -> torch.Tensor:
    logits.grad = None
    loss = loss_fn(logits, targets)
    loss.backward()
    return loss.detach()


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_contenders(losses: dict, logits, targets, repeats: int, device: torch.device) -> tuple:
    """({name: loss value of the warm-up call}, {name: [seconds per forward + backward]})."""
    values = {name: float(forward_backward(loss_fn, logits, targets)) for name, loss_fn in losses.items()}
    names = list(losses)
    samples = {name: [] for name in names}
    for round_index in range(repeats):
        first = round_index % len(names)
        for name in names[first:] + names[:first]:
            logits.grad = None
            synchronize(device)
            began = time.perf_counter()
            forward_backward(losses[name], logits, targets)
            synchronize(device)
            samples[name].append(time.perf_counter() - began)
    logits.grad = None
    return values, samples


def cuda_peak_bytes(loss_fn, logits, targets) -> int:
    logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward_backward(loss_fn, logits, targets)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    logits.grad = None
    return peak


def reset_peak_rss_bytes() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS and return that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) * 1024  # kB


def measure_memory_here(name: str, shape: Shape) -> int:
    """In the fresh child: the rise of peak RSS over one forward + backward on resident inputs."""
    cpu = torch.device("cpu")
    token_ids = numeric_token_ids(shape)
    loss_fn = build_loss(name, shape, token_ids)
    # Thread pools, cached kernel tensors and other one-time setup are not the loss's working memory.
    forward_backward(loss_fn, *make_inputs(replace(shape, tokens=MEMORY_WARMUP_TOKENS), token_ids, cpu))
    logits, targets = make_inputs(shape, token_ids, cpu)
    before = reset_peak_rss_bytes()
    forward_backward(loss_fn, logits, targets)
    return peak_rss_bytes() - before


def cpu_peak_bytes(name: str, shape: Shape) -> int:
    """Run :func:`measure_memory_here` in a fresh interpreter, so no earlier allocation is reused."""
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(CHILD_MALLOC_MMAP_THRESHOLD_BYTES))
    command = [sys.executable, "-m", "benchmarks.bench_loss", "--measure-memory", name, *shape.cli_args()]
    child = subprocess.run(command, capture_output=True, text=True, env=environment, check=False, cwd=REPO)
    if child.returncode != 0:
        raise RuntimeError(f"memory measurement of {name} at {shape} failed (exit {child.returncode}):\n"
                           f"{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])["peak_bytes"]


def measure_shape(shape: Shape, device: torch.device, repeats: int) -> list:
    """One row per contender for this shape (time, peak memory, loss value, or why it could not run)."""
    token_ids = numeric_token_ids(shape)
    losses, unavailable = {}, {}
    for name in CONTENDERS:
        try:
            losses[name] = build_loss(name, shape, token_ids)
        except Unavailable as reason:
            unavailable[name] = str(reason)
    logits, targets = make_inputs(shape, token_ids, device)
    values, samples = time_contenders(losses, logits, targets, repeats, device)
    if device.type == "cuda":
        peaks = {name: cuda_peak_bytes(loss_fn, logits, targets) for name, loss_fn in losses.items()}
    else:
        del logits, targets  # the children build their own; leave them the memory
        peaks = {name: cpu_peak_bytes(name, shape) for name in losses}
    rows = []
    for name in CONTENDERS:
        row = {**asdict(shape), "contender": name}
        if name in unavailable:
            row["unavailable"] = unavailable[name]
        else:
            seconds, spread = median_and_spread(samples[name])
            row.update(seconds=seconds, spread=spread, samples_seconds=samples[name], peak_bytes=peaks[name],
                       loss=values[name])
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Ratios and the targets
# --------------------------------------------------------------------------------------------


def shape_of(row: dict) -> Shape:
    return Shape(*(row[field] for field in Shape.__annotations__))


def add_ratios(rows: list) -> None:
    """Ratios to torch_ce for every row; for ours also to deepspeed_ce and paper_way; for ours' NTL to our
    CE alone and to the ntloss package; for DIST2, Gaussian label smoothing and DEL to our CE alone."""
    measured = {(shape_of(row), row["contender"]): row for row in rows if "seconds" in row}
    for row in rows:
        if "seconds" not in row:
            continue
        shape = shape_of(row)
        others = {"ours": ("torch_ce", "deepspeed_ce", "paper_way"), "ntl_was": ("torch_ce", "ours_ce", "ntloss"),
                  "ntl_mse": ("torch_ce", "ours_ce", "ntloss"),
                  **dict.fromkeys(SOFT_TARGET_AND_DEL, ("torch_ce", "ours_ce"))}.get(row["contender"], ("torch_ce", ))
        for other in others:
            if (shape, other) in measured:
                reference = measured[shape, other]
                row[f"time_vs_{other}"] = row["seconds"] / reference["seconds"]
                row[f"peak_vs_{other}"] = row["peak_bytes"] / max(reference["peak_bytes"], 1)
        if row["contender"] == "ours" and (shape, "paper_way") in measured:
            paper_loss = measured[shape, "paper_way"]["loss"]
            row["loss_rel_diff_vs_paper_way"] = abs(row["loss"] - paper_loss) / abs(paper_loss)


# The time target of the issue is stated at one shape per device: (tokens, V, N, numeric share).
HEADLINE = {"cuda": ((8192, 128256, 1000, 0.3), 1.05), "cpu": ((2048, 32000, 1000, 0.3), 1.15)}


def _verdict(target: str, measured, limit: float, direction: str, where: str) -> dict:
    passed = {"<=": measured <= limit, "<": measured < limit, ">=": measured >= limit}[direction]
    return {"target": target, "measured": round(measured, 4), "limit": f"{direction} {limit}", "where": where,
            "result": "pass" if passed else "fail"}


def _not_measured(target: str, limit: float, direction: str, why: str) -> dict:
    return {"target": target, "measured": None, "limit": f"{direction} {limit}", "where": why,
            "result": "not measured"}


def check_targets(rows: list, device_type: str) -> list:
    """Each target of the issue with its measured value and pass/fail (worst shape where it spans all)."""
    ours = [row for row in rows if row["contender"] == "ours" and "seconds" in row]
    targets = []
    for kind, ((tokens, vocab_size, numeric_size, share), limit) in HEADLINE.items():
        target = (f"ours time <= {limit}x torch_ce at V={vocab_size}, {tokens} tokens, N={numeric_size}, "
                  f"{share:.0%} numeric ({kind})")
        at_headline = [row for row in ours if (row["tokens"], row["vocab_size"], row["numeric_size"],
                                               row["numeric_share"]) == (tokens, vocab_size, numeric_size, share)]
        if kind != device_type:
            targets.append(_not_measured(target, limit, "<=", f"needs --device {kind}"))
        elif not at_headline:
            targets.append(_not_measured(target, limit, "<=", "shape not in this grid"))
        for row in at_headline if kind == device_type else []:
            targets.append(_verdict(f"{target} [{row['dtype']}]", row["time_vs_torch_ce"], limit, "<=",
                                    str(shape_of(row))))

    worst_cases = [  # (target, per-row value, limit, direction)
        ("ours time <= deepspeed_ce", lambda row: row.get("time_vs_deepspeed_ce"), 1.0, "<="),
        ("ours peak memory <= deepspeed_ce", lambda row: row.get("peak_vs_deepspeed_ce"), 1.0, "<="),
        ("ours >= 2x faster than paper_way (paper_way time / ours)", lambda row: 1.0 / row["time_vs_paper_way"],
         2.0, ">="),
        ("ours peak memory <= 0.6x paper_way", lambda row: row.get("peak_vs_paper_way"), 0.6, "<="),
    ]
    ntl = {name: [row for row in rows if row["contender"] == name and "seconds" in row] for name in ("ntl_was",
                                                                                                 "ntl_mse")}
    for name in ("ntl_was", "ntl_mse"):
        worst_cases += [
            (f"{name} (CE + NTL) time <= 1.05x ours_ce (our CE alone)", lambda row: row.get("time_vs_ours_ce"), 1.05,
             "<=", name),
            (f"{name} time < ntloss package (CE + NTL-WAS)", lambda row: row.get("time_vs_ntloss"), 1.0, "<", name),
            (f"{name} peak memory < ntloss package", lambda row: row.get("peak_vs_ntloss"), 1.0, "<", name)]
    for target, value, limit, direction, *contender in worst_cases:
        target += " (every shape; worst shown)"
        candidates = ntl[contender[0]] if contender else ours
        candidates = [row for row in candidates if value(row) is not None]
        if not candidates:
            targets.append(_not_measured(target, limit, direction, "not measured (or no reference row)"))
            continue
        pick = min if direction == ">=" else max
        worst = pick(candidates, key=value)
        targets.append(_verdict(target, value(worst), limit, direction, str(shape_of(worst))))
    return targets


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

SHAPE_COLUMNS = [("tokens", "tokens", "d"), ("vocab_size", "V", "d"), ("numeric_size", "N", "d"),
                 ("numeric_share", "numeric", ".0%"), ("dtype", "dtype", "s")]


def report(rows: list, targets: list) -> str:
    display = [dict(row, milliseconds=row["seconds"] * 1e3, peak_mib=row["peak_bytes"] / MIB)
               if "seconds" in row else dict(row, note=row["unavailable"]) for row in rows]
    everything = markdown_table(display, SHAPE_COLUMNS + [
        ("contender", "loss", "s"), ("milliseconds", "fwd+bwd ms (median)", ".1f"), ("spread", "spread", ".0%"),
        ("time_vs_torch_ce", "time vs torch_ce", ".2f"), ("peak_mib", "peak MiB", ".1f"),
        ("peak_vs_torch_ce", "peak vs torch_ce", ".2f"), ("note", "note", "s")])
    ours = markdown_table([row for row in rows if row["contender"] == "ours" and "seconds" in row], SHAPE_COLUMNS + [
        ("time_vs_deepspeed_ce", "ours time vs deepspeed_ce", ".2f"),
        ("peak_vs_deepspeed_ce", "ours peak vs deepspeed_ce", ".2f"),
        ("time_vs_paper_way", "ours time vs paper_way", ".2f"), ("peak_vs_paper_way", "ours peak vs paper_way", ".2f"),
        ("loss_rel_diff_vs_paper_way", "loss rel. diff vs paper_way", ".1e")])
    ntl = markdown_table([row for row in rows if row["contender"] in ("ntl_was", "ntl_mse") and "seconds" in row],
                         SHAPE_COLUMNS + [("contender", "loss", "s"),
                                          ("time_vs_ours_ce", "time vs our CE alone", ".2f"),
                                          ("peak_vs_ours_ce", "peak vs our CE alone", ".2f"),
                                          ("time_vs_ntloss", "time vs ntloss package", ".2f"),
                                          ("peak_vs_ntloss", "peak vs ntloss package", ".2f")])
    soft_target_and_del = markdown_table(
        [row for row in rows if row["contender"] in SOFT_TARGET_AND_DEL and "seconds" in row],
        SHAPE_COLUMNS + [("contender", "loss", "s"), ("time_vs_ours_ce", "time vs our CE alone", ".2f"),
                         ("peak_vs_ours_ce", "peak vs our CE alone", ".2f"),
                         ("time_vs_torch_ce", "time vs torch_ce", ".2f"),
                         ("peak_vs_torch_ce", "peak vs torch_ce", ".2f")])
    checks = markdown_table(targets, [("target", "target", "s"), ("measured", "measured", ".3f"),
                                      ("limit", "limit", "s"), ("result", "result", "s"), ("where", "where", "s")])
    return (f"{everything}\n\nours vs the other SMMD/CE implementations:\n\n{ours}\n\nCE + NTL (ours) vs our CE "
            f"alone and the ntloss package:\n\n{ntl}\n\nCE + DIST2, Gaussian label smoothing or DEL (ours) vs our CE "
            f"alone:\n\n{soft_target_and_del}\n\ntargets:\n\n{checks}")


@dataclass(frozen=True)
class LossOptions:
    """The grid (at most one of ``--quick``, ``--cpu``, ``--full``: :attr:`grid`), device and repeats."""

    quick: bool = option("--quick", at_most_one_of="grid", action="store_true", help="one tiny shape (smoke run)")
    cpu: bool = option("--cpu", at_most_one_of="grid", action="store_true",
                       help="tokens 2048, V=32000 (and V=128256 at N=1000, 30%%): fits a small CPU box "
                            "(default on CPU)")
    full: bool = option("--full", at_most_one_of="grid", action="store_true",
                        help="the whole grid, meant for a GPU (default on CUDA)")
    device: str = option("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    repeats: Optional[int] = option("--repeats", type=int, default=None,
                                    help="timed rounds per shape (default 5; 3 for --quick)")
    results_dir: Optional[str] = results_dir_option()
    measure_memory: Optional[list] = option("--measure-memory", default=None, nargs=6, metavar="ARG",
                                            help=argparse.SUPPRESS)

    @property
    def grid(self) -> Optional[str]:
        """The grid flag given, if any."""
        return next((name for name in ("quick", "cpu", "full") if getattr(self, name)), None)


def main():
    args, _ = parse_options(LossOptions, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    if args.measure_memory:  # the fresh child of cpu_peak_bytes: CONTENDER TOKENS V N SHARE DTYPE
        name, tokens, vocab_size, numeric_size, share, dtype = args.measure_memory
        shape = Shape(int(tokens), int(vocab_size), int(numeric_size), float(share), dtype)
        print(json.dumps({"peak_bytes": measure_memory_here(name, shape)}))
        return

    device = torch.device(args.device)
    grid_name = args.grid or ("full" if device.type == "cuda" else "cpu")
    repeats = args.repeats or (3 if grid_name == "quick" else 5)
    rows = []
    began = time.perf_counter()
    for shape in GRIDS[grid_name]:
        rows += measure_shape(shape, device, repeats)
        print(f"{shape}: done ({time.perf_counter() - began:.0f} s)", flush=True)
    add_ratios(rows)
    targets = check_targets(rows, device.type)
    print(report(rows, targets))
    try:
        ntloss_version = metadata.version("ntloss")
    except metadata.PackageNotFoundError:
        ntloss_version = None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["cpu"]
    path = write_results(f"bench_loss_{grid_name}", rows, results_dir=args.results_dir, device=device.type,
                         device_name=device_name, grid=grid_name, repeats=repeats, threads=torch.get_num_threads(),
                         ntloss_version=ntloss_version, wall_seconds=time.perf_counter() - began,
                         note="forward+backward of the loss on the same logits; peak = the loss's own working "
                              "memory incl. the logits gradient (CPU: peak RSS rise in a fresh process)",
                         targets=targets)
    print("wrote", path)


if __name__ == "__main__":
    main()
