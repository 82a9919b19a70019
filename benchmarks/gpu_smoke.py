"""The first thing to run on a lent GPU (about 10 minutes on one H100): does smmd-scale build, compute
the right numbers and train there? One command, one table at the end, JSON beside it.

    python -m benchmarks.gpu_smoke --device cuda          # on the GPU machine
    python -m benchmarks.gpu_smoke --device cpu --quick   # the same checks on CPU (CI runs this)

Checks, each a row (ok / FAILED / skipped, with the measured number and its limit):

* environment: torch, the device, DeepSpeed's accelerator, which of its ops are prebuilt or can be
  compiled here (nvcc / a C++ compiler), bf16 support;
* accuracy on the device against float64 on the CPU: fp32 CE and its gradient at logits around
  0 and +300 (Megatron-core's accuracy: CE 4e-6, gradient 6e-7), bf16 and fp16 logits (CE + SMMD
  within the half dtype's rounding), NTL-WAS, the fused linear head against the materialized loss;
* one bf16 forward + backward of CE + SMMD at ``--tokens`` x ``--vocab`` (8,192 x 128,256 on a GPU):
  time, peak memory against the memory planner's estimate, and the host syncs it made (CUDA's
  sync debug mode; not measurable on CPU);
* the fused LM heads against DeepSpeed's fused linear CE and torch's CE (time, peak memory): measured;
* train.py on the tiny preset under ZeRO-3 (bf16 where the device supports it): 4 steps with a
  checkpoint, a resumed run that repeats the last steps' losses, ``--fused_linear``, the HF export
  and its evaluation.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.common import write_results

FP32_CE, FP32_GRAD = 4e-6, 6e-7


def row(check: str, ok, measured="", limit="", note="") -> dict:
    status = "skipped" if ok is None else ("ok" if ok else "FAILED")
    return {"check": check, "status": status, "measured": measured, "limit": limit, "note": note}


def environment(device: torch.device) -> list:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    rows = [row("torch and device", True, f"torch {torch.__version__}",
                note=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
            row("DeepSpeed accelerator", True, f"deepspeed {deepspeed.__version__}",
                note=get_accelerator().device_name())]
    compilers = {name: shutil.which(name) for name in ("nvcc", "c++")}
    rows.append(row("op build tools", True, ", ".join(f"{name}: {'yes' if path else 'no'}"
                                                     for name, path in compilers.items())))
    if device.type == "cuda":
        from deepspeed.ops.op_builder import FusedAdamBuilder

        builder = FusedAdamBuilder()
        rows.append(row("FusedAdam buildable", builder.is_compatible(), note="prebuilt or JIT with nvcc"))
        rows.append(row("bf16 supported", torch.cuda.is_bf16_supported()))
    return rows


def problem(tokens: int, vocab_size: int, numeric_size: int, seed: int, offset: float = 0.0):
    import smmd_scale

    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randperm(vocab_size, generator=generator)[:numeric_size]
    vocab = smmd_scale.NumericVocab(token_ids.tolist(), list(range(numeric_size)), vocab_size)
    logits = torch.randn(tokens, vocab_size, generator=generator, dtype=torch.float64) * 3 + offset
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    numeric = torch.rand(tokens, generator=generator) < 0.3
    targets[numeric] = token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ), generator=generator)]
    targets[::11] = -100
    return vocab, logits, targets


def loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, numeric_loss, weight: float) -> tuple:
    import smmd_scale

    leaf = logits.detach().clone().requires_grad_(True)
    out = smmd_scale.numeric_cross_entropy(leaf, targets, numeric_loss, weight=weight)
    out.total.backward()
    return out.total.detach().double().cpu(), leaf.grad.double().cpu()


def accuracy(device: torch.device, seed: int) -> list:
    import smmd_scale

    rows = []
    for offset in (0.0, 300.0):  # CE alone (weight 0) in fp32 against float64 CE, as Megatron-core's test
        vocab, logits, targets = problem(96, 3000, 20, seed, offset)
        logits = logits.float().double()  # the fp32 values themselves are the reference's input
        reference = logits.clone().requires_grad_(True)
        per_token = F.cross_entropy(reference, targets, reduction="none")
        per_token.sum().backward()
        leaf = logits.float().to(device).requires_grad_(True)
        out = smmd_scale.numeric_cross_entropy(leaf, targets.to(device), smmd_scale.SMMDLoss(vocab), weight=0.0)
        (out.ce * out.stats["tokens"]).backward()
        ce_error = abs(out.ce.item() - per_token.sum().item() / out.stats["tokens"])
        grad_error = (leaf.grad.double().cpu() - reference.grad).abs().max().item()
        rows.append(row(f"fp32 CE at logits + {offset:g}", ce_error <= FP32_CE, f"{ce_error:.1e}", f"{FP32_CE:.0e}"))
        rows.append(row(f"fp32 CE gradient at logits + {offset:g}", grad_error <= FP32_GRAD, f"{grad_error:.1e}",
                        f"{FP32_GRAD:.0e}"))
    vocab, logits, targets = problem(256, 4000, 30, seed + 1)
    for name, numeric_loss in (("SMMD", smmd_scale.SMMDLoss(vocab)),
                               ("NTL-WAS", smmd_scale.NTLoss(vocab, squash_factor=9.0))):
        expected, expected_grad = loss_and_grad(logits, targets, numeric_loss, 1.0)
        for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            # The same rounded logits in float64 are the reference: the error is the loss's own.
            rounded = logits.to(dtype)
            reference, reference_grad = loss_and_grad(rounded.double(), targets, numeric_loss, 1.0)
            total, grad = loss_and_grad(rounded.to(device), targets.to(device), numeric_loss, 1.0)
            error = abs(total.item() - reference.item()) / abs(reference.item())
            grad_error = ((grad - reference_grad).abs().max() / reference_grad.abs().max()).item()
            rows.append(row(f"CE + {name}, {str(dtype)[6:]} logits", max(error, grad_error) <= limit,
                            f"{error:.1e} / {grad_error:.1e}", f"{limit:.0e}", "loss / gradient, relative"))
    hidden = torch.randn(256, 64, dtype=torch.float64)
    head = torch.randn(4000, 64, dtype=torch.float64) * 0.2
    smmd = smmd_scale.SMMDLoss(vocab)
    materialized, _ = loss_and_grad((hidden @ head.T).float().to(device), targets.to(device), smmd, 1.0)
    fused = smmd_scale.linear_numeric_cross_entropy(hidden.float().to(device), head.float().to(device),
                                                    targets.to(device), smmd, 1.0)
    error = abs(fused.total.item() - materialized.item()) / abs(materialized.item())
    rows.append(row("fused linear vs materialized, fp32", error <= 1e-5, f"{error:.1e}", "1e-05"))
    return rows


def large_step(device: torch.device, tokens: int, vocab_size: int, seed: int) -> list:
    """One bf16 forward + backward of CE + SMMD at [tokens, vocab]: time, peak memory, host syncs."""
    import smmd_scale
    from smmd_train.tools.memory import logits_and_loss_bytes

    generator = torch.Generator().manual_seed(seed)
    vocab = smmd_scale.NumericVocab(list(range(1000)), list(range(1000)), vocab_size)
    logits = (torch.randn(tokens, vocab_size, generator=generator) * 3).to(torch.bfloat16).to(device)
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator).to(device)
    smmd = smmd_scale.SMMDLoss(vocab)
    logits.requires_grad_(True)
    syncs = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    began = time.perf_counter()
    if device.type == "cuda":
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            smmd_scale.numeric_cross_entropy(logits, targets, smmd).total.backward()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(warning.message) for warning in caught)
        torch.cuda.synchronize()
        working = torch.cuda.max_memory_allocated() - start_bytes
    else:
        smmd_scale.numeric_cross_entropy(logits, targets, smmd).total.backward()
        working = None
    seconds = time.perf_counter() - began
    planned = logits_and_loss_bytes(vocab_size, tokens, 1)
    rows = [row(f"bf16 CE + SMMD fwd+bwd at {tokens} x {vocab_size}", True, f"{seconds:.3f} s")]
    if working is None:
        rows.append(row("peak memory against the planner", None, note="CUDA only (the planner counts GPU bytes)"))
        rows.append(row("host syncs in one step", None, note="CUDA only"))
    else:
        rows.append(row("peak memory against the planner", working <= 1.1 * planned,
                        f"{working / 2**30:.2f} GiB", f"{1.1 * planned / 2**30:.2f} GiB"))
        rows.append(row("host syncs in one step", True, str(syncs)))
    return rows


def fused_heads(device: torch.device, quick: bool, repeats: int = 5) -> list:
    """The LM head + loss, forward + backward, on the device: bench_fused_linear's contenders (ours fused
    with and without z-loss + soft-cap, DeepSpeed's fused linear CE, torch's CE on materialized logits) at
    4,096 x 1,024 x 32,000 in fp32 and bf16 (--quick: 512 x 128 x 4,000 fp32). Time: the median of
    ``repeats`` after two warm-ups, synchronized; peak: the allocator's high-water mark above the inputs
    (CUDA only). Measurements, not checks: a speed target lives in the table's ratios, not in a test."""
    from benchmarks import bench_fused_linear as bench

    shapes = [bench.Shape(512, 128, 4000, "fp32")] if quick else [
        bench.Shape(4096, 1024, 32000, "fp32"), bench.Shape(4096, 1024, 32000, "bf16")]
    names = ("torch_ce", "ours_fused_w0", "ours_fused", "ours_fused_zcap", "deepspeed_fused", "torch_linear_ce")
    rows = []
    for shape in shapes:
        measured = {}
        for name in names:
            try:
                loss = bench.build(name, shape, bench.numeric_token_ids(shape))
            except (bench.Unavailable, ImportError) as error:
                rows.append(row(f"head {name}, {shape}", None, note=str(error)[:80]))
                continue
            hidden, weight, targets = (tensor.detach().to(device) for tensor in bench.make_inputs(shape, shape.tokens))
            hidden.requires_grad_(True)
            weight.requires_grad_(True)
            times, peak = [], None
            for attempt in range(repeats + 2):
                hidden.grad = weight.grad = None
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                began = time.perf_counter()
                loss(hidden, weight, targets).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - base
                if attempt >= 2:
                    times.append(time.perf_counter() - began)
            measured[name] = (statistics.median(times), peak)
            del hidden, weight, targets
        reference = measured.get("deepspeed_fused")
        for name, (seconds, peak) in measured.items():
            ratio = "" if reference is None else f"{seconds / reference[0]:.2f}x DeepSpeed's time"
            if peak is not None and reference is not None and reference[1]:
                ratio += f", {peak / reference[1]:.2f}x its peak"
            rows.append(row(f"head {name}, {shape}", True, f"{seconds * 1e3:.2f} ms"
                            + (f", {peak / 2**20:.0f} MiB" if peak is not None else ""), note=ratio))
    return rows


def training(device: torch.device, work: Path, quick: bool) -> list:
    """train.py on the tiny preset: 4 steps with checkpoints, a resume that repeats steps 3-4, the
    fused head, the export and its evaluation."""
    from benchmarks.common import REPO
    from smmd_numeracy.tokenizer import train_numeric_tokenizer
    from smmd_train.checkpoint.saving import tag_for_step
    from smmd_train.config.arguments import TRAIN_SCRIPT, train_flags
    from smmd_train.distributed.launcher import launch_command
    from smmd_train.monitor.metrics_file import read_metrics

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    texts = [f"Q: {a} + {b} = ? A: {a + b}." for a in range(0, 400, 7) for b in range(3, 60, 11)]
    (work / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    train_numeric_tokenizer(texts).save_pretrained(work / "tokenizer")
    environment_variables = {"DS_ACCELERATOR": device.type}

    def train(name: str, steps: int, **options):
        flags = train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny",
                            tokenizer=work / "tokenizer", data=[work / "train.jsonl"], seq_len=32, micro_batch_size=2,
                            max_steps=steps, warmup_steps=1, lr=3e-3, output_dir=work / name, **options)
        import os

        command = launch_command(TRAIN_SCRIPT, *flags, processes=1)
        try:  # a hung run becomes a failed row, not a lost table (a first CUDA run may build DeepSpeed's Adam)
            completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300,
                                       env={**os.environ, **environment_variables})
        except subprocess.TimeoutExpired as expired:
            text = [part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                    for part in (expired.stdout, expired.stderr)]
            completed = subprocess.CompletedProcess(command, -9, text[0], text[1] + "\ntimed out after 300 s")
        records = {record["step"]: record for record in read_metrics(work / name) if "loss/total" in record} \
            if (work / name / "metrics.jsonl").exists() else {}
        return completed, records

    rows = []
    completed, full = train("full", 4, save_steps=2, export_hf=work / "full" / "hf")
    rows.append(row("train.py, ZeRO-3, 4 steps", completed.returncode == 0 and sorted(full) == [1, 2, 3, 4],
                    f"loss {full[4]['loss/total']:.4f}" if 4 in full else completed.stderr[-200:]))
    checkpoint = work / "resumed"  # the full run as it stood after step 2's checkpoint
    shutil.copytree(work / "full", checkpoint, ignore=shutil.ignore_patterns(tag_for_step(4), "hf", "metrics.jsonl"))
    (checkpoint / "latest").write_text(tag_for_step(2))
    completed, resumed = train("resumed", 4, save_steps=2, resume=True)
    same = completed.returncode == 0 and all(abs(resumed[step]["loss/total"] - full[step]["loss/total"]) <= 1e-5
                                             * abs(full[step]["loss/total"]) for step in (3, 4) if step in full)
    rows.append(row("resume repeats steps 3-4", same and sorted(resumed) == [3, 4], "", "1e-05 relative"))
    completed, fused = train("fused", 2, fused_linear=True)
    rows.append(row("--fused_linear trains", completed.returncode == 0 and sorted(fused) == [1, 2],
                    f"loss {fused[2]['loss/total']:.4f}" if 2 in fused else completed.stderr[-200:]))
    exported = work / "full" / "hf"
    if exported.is_dir():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(exported)
        ids = torch.tensor([[5, 6, 7, 8]])
        rows.append(row("export loads and runs", bool(torch.isfinite(model(input_ids=ids).logits).all())))
    else:
        rows.append(row("export loads and runs", False, note="no export"))
    return rows


@dataclass(frozen=True)
class SmokeOptions:
    device: str = option("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    quick: bool = option("--quick", action="store_true", default=False, help="a small large-step shape (CI on CPU)")
    tokens: Optional[int] = option("--tokens", type=int, default=None,
                                   help="the large step's tokens (default 8192; --quick 512)")
    vocab: Optional[int] = option("--vocab", type=int, default=None,
                                  help="the large step's vocabulary (default 128256; --quick 8192)")
    work_dir: str = option("--work_dir", default="benchmarks/runs/gpu_smoke")
    seed: int = option("--seed", type=int, default=0)


def main(argv=None) -> int:
    args, parser = parse_options(SmokeOptions, argv, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    tokens = args.tokens or (512 if args.quick else 8192)
    vocab_size = args.vocab or (8192 if args.quick else 128256)
    began = time.perf_counter()
    rows = []
    sections = (lambda: environment(device), lambda: accuracy(device, args.seed),
                lambda: large_step(device, tokens, vocab_size, args.seed), lambda: fused_heads(device, args.quick),
                lambda: training(device, Path(args.work_dir), args.quick))
    for section in sections:  # each section's rows as it ends, so a run stopped by a time limit still tells
        done = section()
        rows += done
        for entry in done:
            print(f"[smoke] {entry['check']}: {entry['status']} {entry['measured']} {entry['note']}", flush=True)
    print(markdown_table(rows, [("check", "check", ""), ("status", "status", ""), ("measured", "measured", ""),
                                ("limit", "limit", ""), ("note", "note", "")]))
    failed = [r["check"] for r in rows if r["status"] == "FAILED"]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok or skipped in {time.perf_counter() - began:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    path = write_results(f"gpu_smoke_{device.type}" + ("_quick" if args.quick else ""), rows, device=str(device),
                         tokens=tokens, vocab_size=vocab_size)
    print(f"results: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
