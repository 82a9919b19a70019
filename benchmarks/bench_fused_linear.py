"""The LM head + loss, forward + backward, with and without materialized logits: time and peak memory.

Contenders, all on the same ``hidden [tokens, H]`` and head ``weight [V, H]`` (both require grad):
  torch_ce          F.cross_entropy(hidden @ weight.T): what HF's ForCausalLMLoss does
  torch_linear_ce   F.linear_cross_entropy(hidden, weight, ..., options=LinearCrossEntropyOptions()):
                    torch 2.13's own chunked linear CE (CE only), its per-(device, dtype) defaults
  ours_materialized smmd_scale.numeric_cross_entropy(hidden @ weight.T, ...) with SMMD weight 1
  ours_fused_w0     smmd_scale.linear_numeric_cross_entropy(hidden, weight, ...), SMMD weight 0 (CE only)
  ours_fused        smmd_scale.linear_numeric_cross_entropy(hidden, weight, ...), SMMD weight 1
  ours_fused_zcap   the same with z_loss 1e-4 and logit_softcap 30 (Gemma-2's cap)
  deepspeed_fused   deepspeed.sequence.linear_cross_entropy.vocab_parallel_linear_cross_entropy, CE only
                    (DeepSpeed 0.19.8's fused linear CE; tp_group=None)
  liger_fallback    liger_kernel.ops.LigerFusedLinearScaledCrossEntropyFunction, CE only (its pure-torch
                    path, 512-token chunks; Liger's Triton kernels need a GPU)
  cce_compile       cut_cross_entropy.linear_cross_entropy(impl="torch_compile"), CE only (a compiled
                    materialized CE; importing it needs triton)
Peers are optional: a contender whose package is missing is reported as not measured, with why.

Method: every (contender, shape, repeat) runs in a fresh Python process, in an order rotated per
repeat. The child builds the inputs (written in place, so resident), runs a warm-up forward +
backward on 64 tokens, resets its peak RSS (VmHWM, through /proc/self/clear_refs), then runs and
times one forward + backward. Peak memory = VmHWM - RSS at the reset: inputs excluded, the
gradients it produces (d hidden, d weight) included. glibc's mmap threshold is pinned in the child
so large blocks are always fresh pages. Time and memory are medians over ``--repeats`` and are
reported as ratios to torch_ce and deepspeed_fused measured in the same run.

    python -m benchmarks.bench_fused_linear              # tokens 4096, H 1024, V 32000 and 128256, fp32
    python -m benchmarks.bench_fused_linear --quick      # one small shape (a smoke run)

Targets (fp32, CPU): peak of ours_fused <= 1.2x deepspeed_fused's plus one [tokens, N] fp32 block and
<= 0.35x ours_materialized's; time of ours_fused <= 1.35x torch_ce and below deepspeed_fused.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported

from smmd_cli.options import option, parse_options  # noqa: E402
from smmd_cli.tables import markdown_table  # noqa: E402

import smmd_scale  # noqa: E402  (after DS_ACCELERATOR is set)
from benchmarks.common import machine, results_dir_option, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("torch_ce", "torch_linear_ce", "ours_materialized", "ours_fused_w0", "ours_fused", "ours_fused_zcap",
              "deepspeed_fused", "liger_fallback", "cce_compile")
Z_LOSS, SOFTCAP = 1e-4, 30.0  # ours_fused_zcap: PaLM's z-loss coefficient, Gemma-2's final soft-cap
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NUMERIC_SIZE, NUMERIC_SHARE, IGNORE_SHARE, SEED = 1000, 0.3, 0.05, 0
WARMUP_TOKENS = 64
CHILD_MALLOC_MMAP_THRESHOLD_BYTES = 64 * 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden_size: int
    vocab_size: int
    dtype: str

    def cli_args(self) -> list:
        return [str(value) for value in asdict(self).values()]

    def __str__(self):
        return f"tokens={self.tokens} H={self.hidden_size} V={self.vocab_size} {self.dtype}"


GRIDS = {"quick": [Shape(512, 128, 4000, "fp32")],
         "cpu": [Shape(4096, 1024, 32000, "fp32"), Shape(4096, 1024, 128256, "fp32")]}


class Unavailable(Exception):
    """An optional peer cannot run here; the message says why."""


def make_inputs(shape: Shape, tokens: int) -> tuple:
    """hidden ``[tokens, H]`` ~ N(0, 1), weight ``[V, H]`` ~ N(0, (2/sqrt(H))^2), targets ``[tokens]``:
    30% of them among the N numeric ids, 5% ignore_index."""
    dtype = DTYPES[shape.dtype]
    numeric_ids = numeric_token_ids(shape)
    generator = torch.Generator().manual_seed(SEED)
    hidden = torch.empty(tokens, shape.hidden_size, dtype=dtype).normal_(0.0, 1.0, generator=generator)
    weight = torch.empty(shape.vocab_size, shape.hidden_size, dtype=dtype).normal_(
        0.0, 2.0 / shape.hidden_size ** 0.5, generator=generator)
    targets = torch.randint(0, shape.vocab_size, (tokens, ), generator=generator)
    order = torch.randperm(tokens, generator=generator)
    numeric, ignored = round(NUMERIC_SHARE * tokens), round(IGNORE_SHARE * tokens)
    targets[order[:numeric]] = numeric_ids[torch.randint(0, NUMERIC_SIZE, (numeric, ), generator=generator)]
    targets[order[numeric:numeric + ignored]] = -100
    return hidden.requires_grad_(True), weight.requires_grad_(True), targets


def numeric_token_ids(shape: Shape) -> torch.Tensor:
    """The N numeric token ids (value k for the k-th), the same for every input size of a shape."""
    return torch.randperm(shape.vocab_size, generator=torch.Generator().manual_seed(SEED + 1))[:NUMERIC_SIZE]


def smmd_of(shape: Shape, numeric_ids: torch.Tensor):
    """The benchmark's SMMD loss: the N numeric ids with the values 0..N-1."""
    return smmd_scale.SMMDLoss(smmd_scale.NumericVocab(numeric_ids.tolist(), list(range(NUMERIC_SIZE)),
                                                       shape.vocab_size))


def ours_options(name: str) -> tuple:
    """(SMMD's weight, the CE options) of one of our fused contenders."""
    options = {"z_loss": Z_LOSS, "logit_softcap": SOFTCAP} if name == "ours_fused_zcap" else {}
    return (0.0 if name == "ours_fused_w0" else 1.0), options


def build(name: str, shape: Shape, numeric_ids: torch.Tensor, chunk_size=None):
    """``loss(hidden, weight, targets)`` of contender ``name`` (ours fused: ``chunk_size`` head rows per
    block, default the op's); raises Unavailable for a missing peer."""
    if name == "torch_ce":
        return lambda hidden, weight, targets: F.cross_entropy((hidden @ weight.T).float(), targets)
    if name == "torch_linear_ce":
        if not hasattr(F, "linear_cross_entropy"):
            raise Unavailable(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (2.13+)")
        options = torch.nn.LinearCrossEntropyOptions()  # the chunked path, torch's per-(device, dtype) defaults
        return lambda hidden, weight, targets: F.linear_cross_entropy(hidden, weight, targets, ignore_index=-100,
                                                                      options=options)
    if name.startswith("ours"):
        smmd = smmd_of(shape, numeric_ids)
        if name == "ours_materialized":
            return lambda hidden, weight, targets: smmd_scale.numeric_cross_entropy(hidden @ weight.T, targets,
                                                                                 smmd).total
        smmd_weight, options = ours_options(name)
        return lambda hidden, weight, targets: smmd_scale.linear_numeric_cross_entropy(
            hidden, weight, targets, smmd, smmd_weight, chunk_size=chunk_size, **options).total
    if name == "deepspeed_fused":
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        return lambda hidden, weight, targets: vocab_parallel_linear_cross_entropy(hidden, weight, targets,
                                                                                   tp_group=None)
    if name == "liger_fallback":
        try:
            from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction
        except ImportError as error:
            raise Unavailable(f"liger-kernel not installed ({error}); pip install liger-kernel packaging") from error

        def liger(hidden, weight, targets):
            per_token = LigerFusedLinearScaledCrossEntropyFunction.apply(hidden, weight, targets)
            return per_token.sum() / (targets != -100).sum()

        return liger
    if name == "cce_compile":
        try:
            from cut_cross_entropy import linear_cross_entropy
        except ImportError as error:
            raise Unavailable(f"cut-cross-entropy not importable ({error}); pip install cut-cross-entropy "
                              "(it needs triton)") from error
        return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets, impl="torch_compile")
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def vm_hwm_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) * 1024


def measure_here(name: str, shape: Shape) -> dict:
    """In the fresh child: one timed forward + backward after a warm-up, and its peak RSS rise."""
    torch.manual_seed(SEED)
    try:
        loss_fn = build(name, shape, numeric_token_ids(shape))
    except Unavailable as why:
        return {"unavailable": str(why)}
    # Thread pools, compiled kernels and the loss's cached kernel matrices are not working memory.
    loss_fn(*make_inputs(shape, WARMUP_TOKENS)).backward()
    hidden, weight, targets = make_inputs(shape, shape.tokens)
    Path("/proc/self/clear_refs").write_text("5")
    before = vm_hwm_bytes()
    began = time.perf_counter()
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak_bytes": vm_hwm_bytes() - before, "loss": loss.item(),
            "grad_hidden_norm": hidden.grad.float().norm().item(),
            "grad_weight_norm": weight.grad.float().norm().item()}


def measure_in_child(name: str, shape: Shape) -> dict:
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(CHILD_MALLOC_MMAP_THRESHOLD_BYTES))
    command = [sys.executable, "-m", "benchmarks.bench_fused_linear", "--measure", name, *shape.cli_args()]
    child = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO, check=False)
    if child.returncode != 0:
        return {"failed": f"exit {child.returncode}: {child.stderr[-1500:]}"}
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure_shape(shape: Shape, contenders: list, repeats: int) -> list:
    samples = {name: [] for name in contenders}
    for repeat in range(repeats):
        first = repeat % len(contenders)
        for name in contenders[first:] + contenders[:first]:
            samples[name].append(measure_in_child(name, shape))
            print(f"  {shape} {name} repeat {repeat}: {samples[name][-1]}", flush=True)
    rows = []
    for name, results in samples.items():
        row = {"contender": name, **asdict(shape)}
        measured = [result for result in results if "seconds" in result]
        if len(measured) != len(results):
            row["not_measured"] = next(result.get("unavailable") or result.get("failed") for result in results
                                       if "seconds" not in result)
        else:
            row.update(seconds=statistics.median(r["seconds"] for r in measured),
                       peak_bytes=statistics.median(r["peak_bytes"] for r in measured),
                       samples_seconds=[r["seconds"] for r in measured],
                       samples_peak_bytes=[r["peak_bytes"] for r in measured],
                       loss=measured[0]["loss"], grad_hidden_norm=measured[0]["grad_hidden_norm"],
                       grad_weight_norm=measured[0]["grad_weight_norm"])
        rows.append(row)
    by_name = {row["contender"]: row for row in rows if "seconds" in row}
    for row in rows:
        for reference in ("torch_ce", "deepspeed_fused", "ours_materialized"):
            if "seconds" in row and reference in by_name:
                row[f"time_vs_{reference}"] = row["seconds"] / by_name[reference]["seconds"]
                row[f"peak_vs_{reference}"] = row["peak_bytes"] / by_name[reference]["peak_bytes"]
    return rows


def check_targets(rows: list) -> list:
    """The targets as measured, per shape: pass / fail / not measured."""
    targets = []
    shapes = sorted({(row["tokens"], row["hidden_size"], row["vocab_size"], row["dtype"]) for row in rows})
    for key in shapes:
        here = {row["contender"]: row for row in rows
                if (row["tokens"], row["hidden_size"], row["vocab_size"], row["dtype"]) == key and "seconds" in row}
        where = f"tokens={key[0]} H={key[1]} V={key[2]} {key[3]}"
        fused = here.get("ours_fused")

        def verdict(target, value, limit):
            targets.append({"target": target, "where": where, "measured": None if value is None else round(value, 4),
                            "limit": round(limit, 4) if limit is not None else None,
                            "result": "not measured" if value is None or limit is None else
                            "pass" if value <= limit else "fail"})

        deepspeed, materialized, torch_ce = here.get("deepspeed_fused"), here.get("ours_materialized"), \
            here.get("torch_ce")
        numeric_block_bytes = key[0] * NUMERIC_SIZE * 4
        verdict("peak(ours_fused) <= 1.2 x peak(deepspeed_fused) + one [tokens, N] fp32 block (MiB)",
                fused and fused["peak_bytes"] / MIB,
                deepspeed and (1.2 * deepspeed["peak_bytes"] + numeric_block_bytes) / MIB)
        verdict("peak(ours_fused) <= 0.35 x peak(ours_materialized)", fused and materialized and
                fused["peak_bytes"] / materialized["peak_bytes"], 0.35)
        verdict("time(ours_fused) <= 1.35 x time(torch_ce)", fused and torch_ce and
                fused["seconds"] / torch_ce["seconds"], 1.35)
        verdict("time(ours_fused) < time(deepspeed_fused) (ratio)", fused and deepspeed and
                fused["seconds"] / deepspeed["seconds"], 1.0)
    return targets


def report(rows: list, targets: list) -> str:
    table = [{**row, "peak_mib": row.get("peak_bytes", 0) / MIB} for row in rows]
    columns = [("contender", "contender", "s"), ("tokens", "tokens", "d"), ("hidden_size", "H", "d"),
               ("vocab_size", "V", "d"), ("dtype", "dtype", "s"), ("seconds", "seconds", ".2f"),
               ("peak_mib", "peak MiB", ".1f"), ("time_vs_torch_ce", "time vs torch CE", ".2f"),
               ("peak_vs_torch_ce", "peak vs torch CE", ".2f"), ("time_vs_deepspeed_fused", "time vs DeepSpeed", ".2f"),
               ("peak_vs_deepspeed_fused", "peak vs DeepSpeed", ".2f"), ("loss", "loss", ".6f"),
               ("not_measured", "not measured", "s")]
    checks = markdown_table(targets, [("target", "target", "s"), ("where", "where", "s"),
                                      ("measured", "measured", ".4f"), ("limit", "limit", ".4f"),
                                      ("result", "result", "s")])
    return markdown_table(table, columns) + "\n\ntargets:\n\n" + checks


@dataclass(frozen=True)
class FusedLinearOptions:
    quick: bool = option("--quick", action="store_true", help="one small shape")
    repeats: int = option("--repeats", type=int, default=3)
    contenders: tuple = option("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    results_dir: Optional[str] = results_dir_option()
    measure: Optional[list] = option("--measure", default=None, nargs=5, metavar="ARG", help=argparse.SUPPRESS)


def main():
    args, _ = parse_options(FusedLinearOptions, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    if args.measure:  # the fresh child: CONTENDER TOKENS H V DTYPE
        name, tokens, hidden_size, vocab_size, dtype = args.measure
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        print(json.dumps(measure_here(name, Shape(int(tokens), int(hidden_size), int(vocab_size), dtype))))
        return

    grid = "quick" if args.quick else "cpu"
    began, rows = time.perf_counter(), []
    for shape in GRIDS[grid]:
        rows += measure_shape(shape, args.contenders, args.repeats)
    targets = check_targets(rows)
    print(report(rows, targets))
    path = write_results(f"bench_fused_linear{'_quick' if args.quick else ''}", rows, results_dir=args.results_dir,
                         device="cpu", device_name=machine()["cpu"], repeats=args.repeats,
                         threads=torch.get_num_threads(), wall_seconds=time.perf_counter() - began, targets=targets,
                         note="head matmul + loss, forward + backward; peak = RSS high-water mark rise in a fresh "
                              "process (inputs excluded, d hidden and d weight included); medians")
    print("wrote", path)


if __name__ == "__main__":
    main()
