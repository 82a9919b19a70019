"""What each LM head + loss would launch on a GPU: ATen ops (about one kernel each), GEMMs and host
syncs of one forward and one backward, counted on the CPU under the accelerator's block plan.

    python -m benchmarks.op_counts            # 4,096 x 1,024 x 32,000 and 16,384 x 4,096 x 128,256, bf16
    python -m benchmarks.op_counts --quick    # one small shape

On a GPU each op costs ~5-30 us of host time before its kernel runs, so a head of 1,000 ops is
launch-bound at any arithmetic speed, and each host sync stalls the host until the device catches up.
Both are properties of the code path: ``smmd_scale.op_count.count_ops`` counts them while
``smmd_scale.block_plan.plan_as`` makes our ops plan for a GPU with ``--free_gib`` of free memory
(an H200's by default). The blocks are planned at the real shape; the ops are counted on
``--count_tokens`` tokens with that plan's block size (the counts do not depend on the token count,
only on the blocks), so the largest shape needs no 8 GB of logits here. torch's chunked CE is one ATen
op from the dispatcher's side: its inner kernels run below what a dispatch mode sees. Contenders: torch's CE on
materialized logits, torch's chunked ``linear_cross_entropy``, DeepSpeed's fused linear CE, and ours
(materialized; fused CE + SMMD with N = 1,000; fused with z-loss and soft-cap), all as
``bench_fused_linear`` builds them.
"""

import argparse
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported

from smmd_cli.options import option, parse_options  # noqa: E402
from smmd_cli.tables import markdown_table  # noqa: E402

from benchmarks import bench_fused_linear as bench  # noqa: E402
from benchmarks.common import results_dir_option, write_results  # noqa: E402
from smmd_scale.block_plan import DeviceProperties, fused_head_plan, plan_as  # noqa: E402
from smmd_scale.op_count import count_ops  # noqa: E402

CONTENDERS = ("torch_ce", "torch_linear_ce", "deepspeed_fused", "ours_materialized", "ours_fused", "ours_fused_zcap")
SHAPES = {"gpu": [bench.Shape(4096, 1024, 32_000, "bf16"), bench.Shape(16_384, 4096, 128_256, "bf16")],
          "quick": [bench.Shape(512, 64, 4096, "fp32")]}


@dataclass(frozen=True)
class OpCountOptions:
    quick: bool = option("--quick", action="store_true", help="one small shape")
    free_gib: float = option("--free_gib", type=float, default=139.0,
                             help="the planned GPU's free memory (default: an H200's)")
    count_tokens: int = option("--count_tokens", type=int, default=256,
                               help="tokens the ops are counted on, with the real shape's blocks")
    contenders: tuple = option("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    results_dir: Optional[str] = results_dir_option()


def ours_blocks(shape: bench.Shape, device: DeviceProperties) -> tuple:
    """(blocks, head rows per block) of our fused head at ``shape`` on ``device``."""
    plan = fused_head_plan(shape.tokens, shape.hidden_size, shape.vocab_size, bench.DTYPES[shape.dtype],
                           torch.float32, device)
    return plan.blocks, plan.chunk_size


def count_one(name: str, shape: bench.Shape, tokens: int, chunk_size: Optional[int]) -> dict:
    """One forward and one backward of ``name`` on ``tokens`` tokens of ``shape``, counted."""
    torch.manual_seed(bench.SEED)
    loss_fn = bench.build(name, shape, bench.numeric_token_ids(shape),
                          chunk_size=chunk_size if name.startswith("ours_fused") else None)
    hidden, weight, targets = bench.make_inputs(shape, tokens)
    loss_fn(hidden, weight, targets).backward()  # a training step's view: per-device caches already filled
    for tensor in (hidden, weight):
        tensor.grad = None
    with count_ops() as forward:
        loss = loss_fn(hidden, weight, targets)
    with count_ops() as backward:
        loss.backward()
    return {"ops_forward": forward.ops, "ops_backward": backward.ops, "launches_forward": forward.launches,
            "launches_backward": backward.launches, "gemms_forward": forward.gemms,
            "gemms_backward": backward.gemms, "syncs_forward": forward.sync_count,
            "syncs_backward": backward.sync_count, "sync_sites": forward.sync_sites + backward.sync_sites}


def main(argv=None) -> int:
    args, _ = parse_options(OpCountOptions, argv, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    device = DeviceProperties("cuda", free_bytes=int(args.free_gib * (1 << 30)))
    began, rows = time.perf_counter(), []
    for shape in SHAPES["quick" if args.quick else "gpu"]:
        blocks, chunk_size = ours_blocks(shape, device)
        for name in args.contenders:
            try:
                with plan_as(device):
                    counted = count_one(name, shape, min(args.count_tokens, shape.tokens), chunk_size)
            except bench.Unavailable as why:
                rows.append({"shape": str(shape), "contender": name, "unavailable": str(why)})
                continue
            ours_fused = name.startswith("ours_fused")
            rows.append({"shape": str(shape), "contender": name, "blocks": blocks if ours_fused else None,
                         **counted})
    table = markdown_table([{**row, "ops": "not measured" if "unavailable" in row else
                             f"{row['ops_forward']} / {row['ops_backward']}",
                             "launches": None if "unavailable" in row else
                             f"{row['launches_forward']} / {row['launches_backward']}",
                             "gemms": None if "unavailable" in row else
                             f"{row['gemms_forward']} / {row['gemms_backward']}",
                             "syncs": row.get("unavailable") or f"{row['syncs_forward']} / {row['syncs_backward']}"}
                            for row in rows],
                           [("shape", "shape", ""), ("contender", "contender", ""), ("blocks", "blocks", ""),
                            ("ops", "ATen ops fwd / bwd", ""), ("launches", "of them kernels fwd / bwd", ""),
                            ("gemms", "GEMMs fwd / bwd", ""),
                            ("syncs", "host syncs fwd / bwd", "")])
    print(table)
    path = write_results(f"op_counts{'_quick' if args.quick else ''}", rows, results_dir=args.results_dir,
                         planned_for={"type": device.type, "free_bytes": device.free_bytes},
                         count_tokens=args.count_tokens, wall_seconds=time.perf_counter() - began,
                         note="one forward and one backward after an uncounted one, counted with "
                              "smmd_scale.op_count under the accelerator's block plan; ours' blocks planned at the "
                              "real shape")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
