"""The fused LM heads on a GPU, side by side in one process: where the time goes and what would cut it.

    python -m benchmarks.gpu_heads --device cuda           # on a lent GPU (about 3 minutes on an H200)
    python -m benchmarks.gpu_heads --device cpu --quick    # the same code paths at a toy size

For each shape (tokens x H x V, dtype) and contender (torch's CE on materialized logits, torch's chunked
linear CE, DeepSpeed's fused linear CE, Liger-Kernel's where it installs, ours fused with CE only, with
CE + SMMD, and with z-loss 1e-4 + soft-cap 30 on, under the accelerator's block plan of
``smmd_scale.block_plan``; ``+plan=cpu`` the CPU's blocks), one forward + backward of head matmul + loss:

* time: the median of ``--repeats`` calls timed with device events, after two warm-ups, the
  contenders interleaved call by call (so a clock or thermal drift hits all alike);
* peak: the allocator's high-water mark above the inputs, in a call of its own (CUDA only);
* host share (``--profile``): one call under torch.profiler, the sum of the device's kernel times
  against the call's wall time, and the number of kernels: a head whose wall time is far above its
  kernels' is launch-bound (too many small operations), not arithmetic-bound;
* variants of ours, to measure before changing the default: ``chunk=N`` (head rows per block),
  ``rowblock=off`` (the soft-capped backward's row blocks, a CPU cache choice, as one pass on the whole
  block) and ``mixed_gemm`` (bf16 GEMMs that write fp32 blocks, as DeepSpeed does where the device
  has them, instead of a bf16 block and an upcast).

Accuracy beside the speed: each of ours against the same loss on float64 logits of the same
(rounded) inputs, relative error of the loss and of d hidden.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks import bench_fused_linear as bench
from benchmarks.common import write_results


@contextlib.contextmanager
def variant(name: str):
    """Patch the plugin for one variant of ours (``base`` changes nothing)."""
    from smmd_scale import block_plan, fused_linear

    saved = (block_plan.ROW_BLOCK_ELEMENTS, fused_linear.block_logits)
    planned = contextlib.nullcontext()
    if "plan=cpu" in name:  # the CPU's block plan on the device: today's GPU plan against the old one
        planned = block_plan.plan_as(block_plan.DeviceProperties("cpu"))
    if "rowblock=off" in name:
        block_plan.ROW_BLOCK_ELEMENTS = 1 << 62
    if "mixed_gemm" in name:
        plain = fused_linear.block_logits

        def mixed(hidden, head_rows, bias_rows, compute_dtype):
            head_rows = head_rows.to(hidden.dtype)
            if hidden.dtype == compute_dtype:
                return plain(hidden, head_rows, bias_rows, compute_dtype)
            if bias_rows is None:
                return torch.mm(hidden, head_rows.T, out_dtype=compute_dtype)
            return torch.addmm(bias_rows.to(compute_dtype), hidden, head_rows.T, out_dtype=compute_dtype)

        fused_linear.block_logits = mixed
    try:
        with planned:
            yield
    finally:
        block_plan.ROW_BLOCK_ELEMENTS, fused_linear.block_logits = saved


def contender(name: str, shape: bench.Shape, device_type: str):
    """``loss(hidden, weight, targets)`` of a contender name like ``ours_fused_zcap+chunk=4096+mixed_gemm``
    (the variants of :func:`variant` applied around each call)."""
    from smmd_scale.compat import has_mixed_precision_gemm

    base, *extras = name.split("+")
    if base == "liger_fused":
        return liger_fused(device_type)
    if "mixed_gemm" in extras and shape.dtype == "bf16" and not has_mixed_precision_gemm(device_type):
        raise bench.Unavailable("no fp32-output bf16 GEMM (aten::mm.dtype) on this device")
    chunk = next((int(extra.split("=")[1]) for extra in extras if extra.startswith("chunk=")), None)
    return bench.build(base, shape, bench.numeric_token_ids(shape), chunk_size=chunk)


def liger_fused(device_type: str):
    """Liger-Kernel's fused linear CE (its Triton kernels, CE only): the reference users pick on GPUs."""
    if device_type != "cuda":
        raise bench.Unavailable("Liger-Kernel's Triton kernels need a CUDA device")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as error:
        raise bench.Unavailable(f"liger-kernel not installed ({error}); pip install liger-kernel") from error
    return lambda hidden, weight, targets: liger_fused_linear_cross_entropy(hidden, weight, targets)


def timed_call(device, loss, inputs) -> float:
    hidden, weight, targets = inputs
    hidden.grad = weight.grad = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss(hidden, weight, targets).backward()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    loss(hidden, weight, targets).backward()
    return time.perf_counter() - began


def peak_of(device, loss, inputs):
    if device.type != "cuda":
        return None
    hidden, weight, targets = inputs
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss(hidden, weight, targets).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def profile_of(device, loss, inputs) -> dict:
    """One call under torch.profiler: wall ms, the kernels' summed device ms and their count."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, targets = inputs
    hidden.grad = weight.grad = None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        loss(hidden, weight, targets).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
    events = prof.events()
    kernels = [event for event in events if event.device_type.name == "CUDA"]
    device_ms = sum(getattr(event, "device_time", 0.0) for event in kernels) / 1e3 if kernels else None
    if device_ms is None and device.type == "cuda":  # the averages' self device time, where events lack it
        device_ms = sum(getattr(entry, "self_device_time_total", 0.0) for entry in prof.key_averages()) / 1e3
    ops = sum(1 for event in events if event.device_type.name == "CPU" and event.name.startswith("aten::"))
    return {"wall_ms": wall * 1e3, "kernel_ms": device_ms, "kernels": len(kernels), "aten_ops": ops}


def accuracy_of(device, loss, inputs, reference) -> dict:
    hidden, weight, targets = inputs
    hidden.grad = weight.grad = None
    value = loss(hidden, weight, targets)
    value.backward()
    expected, expected_grad = reference
    return {"loss_rel": abs(value.item() - expected) / abs(expected),
            "grad_rel": ((hidden.grad.double() - expected_grad).norm() / expected_grad.norm()).item()}


def float64_reference(shape, inputs, name: str):
    """CE + SMMD (+ z-loss and soft-cap for the zcap contenders) on float64 logits of the same inputs."""
    import smmd_scale

    hidden, weight, targets = inputs
    leaf = hidden.detach().double().requires_grad_(True)
    smmd_weight, options = bench.ours_options(name.split("+")[0])
    total = smmd_scale.numeric_cross_entropy(leaf @ weight.detach().double().T, targets,
                                             bench.smmd_of(shape, bench.numeric_token_ids(shape)), smmd_weight,
                                             **options).total
    total.backward()
    return total.item(), leaf.grad


SHAPES = {"quick": [bench.Shape(512, 128, 4000, "fp32"), bench.Shape(512, 128, 4000, "bf16")],
          "gpu": [bench.Shape(4096, 1024, 32000, "fp32"), bench.Shape(4096, 1024, 32000, "bf16"),
                  bench.Shape(16384, 4096, 128256, "fp32"), bench.Shape(16384, 4096, 128256, "bf16")]}
# Ours run the accelerator's block plan (smmd_scale.block_plan); +plan=cpu the CPU's blocks, as before it.
DEFAULT_CONTENDERS = ("torch_ce", "torch_linear_ce", "deepspeed_fused", "liger_fused", "ours_fused_w0", "ours_fused",
                      "ours_fused_zcap", "ours_fused+plan=cpu", "ours_fused+mixed_gemm", "ours_fused_zcap+mixed_gemm")


@dataclass(frozen=True)
class HeadsOptions:
    device: str = option("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    quick: bool = option("--quick", action="store_true", default=False, help="toy shapes (a check on CPU)")
    repeats: int = option("--repeats", type=int, default=20)
    contenders: tuple = option("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    profile: bool = option("--profile", action="store_true", default=False, help="the host-share rows")
    accuracy: bool = option("--accuracy", action="store_true", default=False,
                            help="each of ours against float64 logits (the shapes with V <= 32,000)")
    out: str = option("--out", default=None, help="the JSON's folder (default benchmarks/results)")


def measure_shape(device, shape, names, args) -> list:
    inputs = tuple(tensor.detach().to(device) for tensor in bench.make_inputs(shape, shape.tokens))
    inputs[0].requires_grad_(True)
    inputs[1].requires_grad_(True)
    losses, rows = {}, {}
    for name in names:
        try:
            losses[name] = contender(name, shape, device.type)
        except (bench.Unavailable, ImportError) as error:
            print(f"[heads] {shape} {name}: skipped ({str(error)[:80]})", flush=True)
    times = {name: [] for name in losses}
    for attempt in range(args.repeats + 2):  # interleaved: every contender once per round
        for name, loss in losses.items():
            with variant(name):
                seconds = timed_call(device, loss, inputs)
            if attempt >= 2:
                times[name].append(seconds)
    for name, loss in losses.items():
        with variant(name):
            entry = {"shape": str(shape), "contender": name, "ms": statistics.median(times[name]) * 1e3,
                     "ms_min": min(times[name]) * 1e3, "ms_max": max(times[name]) * 1e3,
                     "peak_mib": None}
            peak = peak_of(device, loss, inputs)
            entry["peak_mib"] = None if peak is None else peak / 2**20
            if args.profile:
                entry.update(profile_of(device, loss, inputs))
            if args.accuracy and name.startswith("ours") and shape.vocab_size <= 32000:
                reference = float64_reference(shape, inputs, name)
                entry.update(accuracy_of(device, loss, inputs, reference))
        rows[name] = entry
    reference = rows.get("deepspeed_fused")
    for entry in rows.values():
        if reference is not None:
            entry["time_vs_deepspeed"] = entry["ms"] / reference["ms"]
            if entry["peak_mib"] and reference["peak_mib"]:
                entry["peak_vs_deepspeed"] = entry["peak_mib"] / reference["peak_mib"]
        print("[heads] " + json.dumps(entry), flush=True)
    return list(rows.values())


def main(argv=None) -> int:
    args, parser = parse_options(HeadsOptions, argv, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    began = time.perf_counter()
    rows = []
    for shape in SHAPES["quick" if args.quick else "gpu"]:
        rows += measure_shape(device, shape, args.contenders, args)
    columns = [("shape", "shape", ""), ("contender", "contender", ""), ("ms", "ms", ".2f"),
               ("ms_min", "min", ".2f"), ("ms_max", "max", ".2f"), ("peak_mib", "peak MiB", ".0f"),
               ("time_vs_deepspeed", "vs DS time", ".2f"), ("peak_vs_deepspeed", "vs DS peak", ".2f")]
    if args.profile:
        columns += [("kernel_ms", "kernel ms", ".2f"), ("kernels", "kernels", ""), ("aten_ops", "aten ops", "")]
    if args.accuracy:
        columns += [("loss_rel", "loss rel err", ".1e"), ("grad_rel", "d hidden rel err", ".1e")]
    print(markdown_table(rows, columns))
    path = write_results(f"gpu_heads_{device.type}" + ("_quick" if args.quick else ""), rows, args.out,
                         device=str(device), repeats=args.repeats)
    print(f"{len(rows)} rows in {time.perf_counter() - began:.0f} s; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
