"""What crosses the wire per loss call: collectives, bytes and time at TP = 1, 2, 4 (gloo ranks).

Contenders on the same logits shard and targets:
  ours          numeric_cross_entropy (CE + SMMD): one packed integer all-reduce per forward
  ntl_was       the same with NTLoss(vocab, "was") (CE + NTL-WAS): the same exchange
  ntl_mse       the same with NTLoss(vocab, "mse")
  smmd+ntl_was  the same with SMMDLoss(vocab) + 0.3 * NTLoss(vocab): two numeric losses, one exchange
  deepspeed_ce  deepspeed.sequence.cross_entropy.vocab_parallel_cross_entropy (CE only), with the
                shard layout resolved once as DeepSpeed's VocabParallelCausalLMLoss does
  allgather     all-gathering the logits (what a naive vocab-parallel SMMD would have to do)

Collectives and bytes are counted by wrapping torch.distributed's collectives (the real calls
run); bytes are the payload each rank hands to the collective. Times are medians of forward +
backward, interleaved, and are reported as ratios to deepspeed_ce in the same run.

    python -m benchmarks.bench_comm            # tokens 2048, V in {32000, 128256}, N in {10, 1000}
    python -m benchmarks.bench_comm --quick    # a small shape, for a smoke run
"""

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.common import median_and_spread, results_dir_option, write_results
from smmd_train.distributed.launcher import free_port

# collective -> (position, keyword) of the tensor this rank hands in
COLLECTIVES = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "all_gather": (1, "tensor"),
               "all_gather_into_tensor": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input"),
               "all_to_all_single": (1, "input")}


class Counter:
    """Counts collectives and the bytes handed to them while active; the real collectives run."""

    def __init__(self):
        self.calls = self.bytes = 0
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def __enter__(self):
        for name, original in self.originals.items():
            position, keyword = COLLECTIVES[name]

            def counted(*args, _original=original, _position=position, _keyword=keyword, **kwargs):
                self.calls += 1
                tensor = args[_position] if len(args) > _position else kwargs[_keyword]
                self.bytes += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _problem(tokens, vocab_size, numeric_size, share, seed=0):
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randperm(vocab_size, generator=generator)[:numeric_size]
    logits = torch.randn(tokens, vocab_size, generator=generator) * 2
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    numeric = torch.rand(tokens, generator=generator) < share
    targets[numeric] = token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ), generator=generator)]
    return token_ids, logits, targets


def _worker(rank, world_size, port, configs, repeats, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import deepspeed
    import deepspeed.comm
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

    from smmd_train.distributed.groups import release_cpu_allreduce_segment
    deepspeed.comm.init_distributed("gloo", verbose=False)
    release_cpu_allreduce_segment()
    rows = _measure(rank, world_size, configs, repeats, vocab_parallel_cross_entropy)
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))
    dist.barrier()
    # Leave without interpreter finalization: here a process group stays referenced from outside
    # Python's reach after shutdown_distributed() (it warns), and a gloo thread that runs into
    # finalization can abort the process (smmd_train.distributed.groups.shutdown_distributed explains why),
    # which would make mp.spawn discard the written results.
    os._exit(0)


def _measure(rank, world_size, configs, repeats, vocab_parallel_cross_entropy) -> list:
    """Rows of every contender at every config on this rank (its locals, groups included, go on return)."""
    import smmd_scale

    group = dist.group.WORLD if world_size > 1 else None
    rows = []
    for tokens, vocab_size, numeric_size, share in configs:
        token_ids, logits, targets = _problem(tokens, vocab_size, numeric_size, share)
        start, end = vocab_size * rank // world_size, vocab_size * (rank + 1) // world_size
        shard_source = logits[:, start:end].contiguous()
        vocab = smmd_scale.NumericVocab(token_ids.tolist(), list(range(numeric_size)), vocab_size)
        numeric_losses = {"ours": smmd_scale.SMMDLoss(vocab), "ntl_was": smmd_scale.NTLoss(vocab, kind="was"),
                          "ntl_mse": smmd_scale.NTLoss(vocab, kind="mse"),
                          "smmd+ntl_was": smmd_scale.SMMDLoss(vocab) + 0.3 * smmd_scale.NTLoss(vocab, kind="was")}

        def ours_with(numeric_loss):
            def run():
                shard = shard_source.clone().requires_grad_(True)
                out = smmd_scale.numeric_cross_entropy(shard, targets, numeric_loss, tp_group=group,
                                                    vocab_start_index=start)
                out.total.backward()
            return run

        def deepspeed_ce():
            shard = shard_source.clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(shard, targets, tp_group=group, vocab_start_index=start,
                                                vocab_end_index=end, global_vocab_size=vocab_size)
            loss.backward()

        def allgather():
            shard = shard_source.clone()
            if world_size > 1:
                parts = [torch.empty(tokens, vocab_size * (k + 1) // world_size - vocab_size * k // world_size)
                         for k in range(world_size)]
                dist.all_gather(parts, shard)

        contenders = {**{name: ours_with(loss) for name, loss in numeric_losses.items()},
                      "deepspeed_ce": deepspeed_ce, "allgather": allgather}
        counts = {}
        for name, run in contenders.items():
            run()  # warm-up; for ours this also grows the numeric capacity once
            with Counter() as counter:
                run()
            counts[name] = (counter.calls, counter.bytes)
        times = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, run in contenders.items():
                if world_size > 1:
                    dist.barrier()
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        for name in contenders:
            seconds, spread = median_and_spread(times[name])
            rows.append({"tp": world_size, "tokens": tokens, "vocab_size": vocab_size, "numeric_size": numeric_size,
                         "numeric_share": share, "contender": name, "collectives": counts[name][0],
                         "bytes": counts[name][1], "logits_bytes": tokens * vocab_size * 4, "seconds": seconds,
                         "spread": spread})
        if rank == 0:
            print(f"TP={world_size} tokens={tokens} V={vocab_size} N={numeric_size} share={share}: done", flush=True)
    return rows


@dataclass(frozen=True)
class CommOptions:
    quick: bool = option("--quick", action="store_true", help="one small shape")
    tp: tuple = option("--tp", type=int, nargs="+", default=(1, 2, 4))
    repeats: int = option("--repeats", type=int, default=5)
    results_dir: Optional[str] = results_dir_option()


def main():
    args, _ = parse_options(CommOptions, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.quick:
        configs = [(256, 4096, 100, 0.3)]
    else:
        configs = [(2048, 32000, 10, 0.3), (2048, 32000, 1000, 0.3), (2048, 128256, 1000, 0.3),
                   (2048, 128256, 1000, 0.05)]
    rows = []
    for world_size in args.tp:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_worker, args=(world_size, free_port(), configs, args.repeats, out_dir), nprocs=world_size)
            rows += json.loads(Path(out_dir, "rows.json").read_text())
    baseline = {(r["tp"], r["tokens"], r["vocab_size"], r["numeric_size"], r["numeric_share"]): r["seconds"]
                for r in rows if r["contender"] == "deepspeed_ce"}
    for row in rows:
        key = (row["tp"], row["tokens"], row["vocab_size"], row["numeric_size"], row["numeric_share"])
        row["time_vs_deepspeed_ce"] = row["seconds"] / baseline[key]
        row["bytes_vs_logits"] = row["bytes"] / row["logits_bytes"]
    columns = [("tp", "TP", "d"), ("tokens", "tokens", "d"), ("vocab_size", "V", "d"), ("numeric_size", "N", "d"),
               ("numeric_share", "numeric", ".0%"), ("contender", "loss", "s"), ("collectives", "collectives", "d"),
               ("bytes", "bytes/rank", ",d"), ("bytes_vs_logits", "bytes / (4·tokens·V)", ".3%"),
               ("time_vs_deepspeed_ce", "time vs DeepSpeed CE", ".2f"), ("spread", "spread", ".0%")]
    print(markdown_table(rows, columns))
    print("wrote", write_results("bench_comm" + ("_quick" if args.quick else ""), rows, results_dir=args.results_dir,
                                 note="forward+backward; bytes = payload handed to collectives per rank per call"))


if __name__ == "__main__":
    main()
