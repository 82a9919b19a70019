"""A numeric loss called on its own, ``NTLoss(vocab)(logits, targets)``: before / after / ntloss, side by
side in one run.

Contenders on the same fp32 ``logits [tokens, V]`` and ``targets [tokens]`` (numbers spelled digit by
digit as ``12.345``, as ntloss's own timing test does; the rest random word ids):
  ntloss   the ntloss package (0.3.2): NTLoss / NTLossDotProduct / NumberLevelLoss, ``reweigh=True``
  before   benchmarks.contenders.standalone_before: the standalone path before this change, which ran the
           CE op (a full softmax of every row) to get the mass
  after    ``loss(logits, targets)``: reads the numeric slice and, for the mass, the numeric-target rows
for NTL-WAS, NTL-MSE and number-level NTL (``before`` has no number-level mean over numbers: not run).

Time: a warm-up call each, then ``--repeats`` rounds in which every contender runs once in a rotated
order; the median (and spread, (max - min) / median) of the forward alone (what ntloss's suite times)
and of forward + backward. Memory (``--memory``): a fresh subprocess per contender runs one forward +
backward on resident inputs and reports its peak RSS (VmHWM, reset through /proc/self/clear_refs)
above the RSS before the call, after the forward (what it keeps for backward and its working memory)
and after the backward (the gradient included).

    python -m benchmarks.bench_ntl_standalone                 # 16,000 tokens x V 10,000, 1% and 50%
    python -m benchmarks.bench_ntl_standalone --memory
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from smmd_cli.options import option, parse_options  # noqa: E402
from smmd_cli.tables import markdown_table  # noqa: E402

from benchmarks.common import median_and_spread, write_results  # noqa: E402
from benchmarks.contenders.standalone_before import numeric_loss_mean  # noqa: E402
from smmd_scale import NTLoss, NumberLevelNTLoss, NumericVocab  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KINDS = ("was", "mse", "number")
CONTENDERS = ("ntloss", "before", "after")
DOT = 10  # token ids: digits 0..9, "." 10, words from 11


def tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {**{str(d): d for d in range(10)}, ".": DOT, **{f"w{k}": k for k in range(11, vocab_size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w11")))


def inputs(tokens: int, vocab_size: int, share: float, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(11, vocab_size, (tokens, ), generator=generator)
    numbers = int(tokens * share) // 6
    starts = torch.randperm(tokens // 6, generator=generator)[:numbers] * 6
    for offset in range(6):  # "12.345": two digits, a dot, three digits
        targets[starts + offset] = DOT if offset == 2 else torch.randint(0, 10, (numbers, ), generator=generator)
    logits = torch.randn(tokens, vocab_size, generator=generator)
    return logits, targets


def contender(name: str, kind: str, vocab_size: int):
    """``fn(logits, targets) -> loss`` or None where the contender has no such loss."""
    vocab = NumericVocab(list(range(10)), list(range(10)), vocab_size)
    if name == "ntloss":
        import ntloss

        built = {"was": lambda: ntloss.NTLoss(tokenizer(vocab_size), reweigh=True),
                 "mse": lambda: ntloss.NTLossDotProduct(tokenizer(vocab_size), reweigh=True),
                 "number": lambda: ntloss.NumberLevelLoss(tokenizer(vocab_size), reweigh=True)}[kind]()
        return lambda logits, targets: built(logits[None], targets[None])
    ours = NumberLevelNTLoss(vocab) if kind == "number" else NTLoss(vocab, kind=kind)
    if name == "before":
        return None if kind == "number" else (lambda logits, targets: numeric_loss_mean(ours, logits, targets))
    return lambda logits, targets: ours(logits, targets)


def timed(fn, logits, targets, backward: bool) -> float:
    leaf = logits.requires_grad_(backward)
    began = time.perf_counter()
    value = fn(leaf, targets)
    if backward:
        value.backward()
        leaf.grad = None
    return time.perf_counter() - began


def measure_times(tokens, vocab_size, share, repeats) -> list:
    logits, targets = inputs(tokens, vocab_size, share)
    functions = {(kind, name): contender(name, kind, vocab_size) for kind in KINDS for name in CONTENDERS}
    functions = {key: fn for key, fn in functions.items() if fn is not None}
    values = {key: float(fn(logits, targets)) for key, fn in functions.items()}  # warm-up, and the values
    samples = {(key, backward): [] for key in functions for backward in (False, True)}
    order = list(samples)
    for round_index in range(repeats):
        for key, backward in order[round_index % len(order):] + order[:round_index % len(order)]:
            samples[(key, backward)].append(timed(functions[key], logits, targets, backward))
    rows = []
    for kind in KINDS:
        base = {backward: median_and_spread(samples[((kind, "ntloss"), backward)])[0] for backward in (False, True)}
        for name in CONTENDERS:
            if (kind, name) not in functions:
                continue
            forward, forward_spread = median_and_spread(samples[((kind, name), False)])
            both, both_spread = median_and_spread(samples[((kind, name), True)])
            rows.append(dict(tokens=tokens, vocab_size=vocab_size, numeric_share=share, kind=kind, contender=name,
                             forward_ms=forward * 1e3, forward_spread=forward_spread,
                             forward_vs_ntloss=forward / base[False], forward_backward_ms=both * 1e3,
                             forward_backward_spread=both_spread, forward_backward_vs_ntloss=both / base[True],
                             value=values[(kind, name)]))
    return rows


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) * 1024


def measure_memory_here(kind, name, tokens, vocab_size, share) -> int:
    fn = contender(name, kind, vocab_size)
    small_logits, small_targets = inputs(256, vocab_size, 0.5)
    fn(small_logits.requires_grad_(True), small_targets).backward()  # warm up
    logits, targets = inputs(tokens, vocab_size, share)
    logits.requires_grad_(True)
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss()
    value = fn(logits, targets)
    forward = _peak_rss() - before
    value.backward()
    return [forward, _peak_rss() - before]


def measure_memory(tokens, vocab_size, share) -> list:
    rows = []
    for kind in KINDS:
        for name in CONTENDERS:
            if contender(name, kind, vocab_size) is None:
                continue
            child = subprocess.run([sys.executable, "-m", "benchmarks.bench_ntl_standalone", "--child", kind, name,
                                    str(tokens), str(vocab_size), str(share)], cwd=REPO, capture_output=True,
                                   text=True, check=True,
                                   env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
            forward, both = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append(dict(tokens=tokens, vocab_size=vocab_size, numeric_share=share, kind=kind, contender=name,
                             forward_peak_mib=forward / 2**20, peak_mib=both / 2**20))
    return rows


@dataclass(frozen=True)
class StandaloneOptions:
    tokens: int = option("--tokens", type=int, default=16000)
    vocab_size: int = option("--vocab_size", type=int, default=10000)
    shares: tuple = option("--shares", type=float, nargs="+", default=(0.01, 0.5))
    repeats: int = option("--repeats", type=int, default=5)
    threads: int = option("--threads", type=int, default=2)
    memory: bool = option("--memory", action="store_true", default=False,
                          help="also peak memory, a subprocess per contender")
    results_dir: Optional[str] = option("--results_dir", default=None)
    child: Optional[list] = option("--child", default=None, nargs=5, help=argparse.SUPPRESS)


def main(argv=None):
    args, _ = parse_options(StandaloneOptions, argv, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    torch.set_num_threads(args.threads)
    if args.child:
        kind, name, tokens, vocab_size, share = args.child
        print(json.dumps(measure_memory_here(kind, name, int(tokens), int(vocab_size), float(share))))
        return
    rows = [row for share in args.shares for row in measure_times(args.tokens, args.vocab_size, share, args.repeats)]
    print(markdown_table(rows, [("numeric_share", "numbers", ".0%"), ("kind", "loss", ""), ("contender", "", ""),
                                ("forward_ms", "forward ms", ".1f"), ("forward_vs_ntloss", "x ntloss", ".2f"),
                                ("forward_backward_ms", "fwd+bwd ms", ".1f"),
                                ("forward_backward_vs_ntloss", "x ntloss", ".2f"), ("value", "loss", ".6g")]))
    memory = []
    if args.memory:
        memory = [row for share in args.shares for row in measure_memory(args.tokens, args.vocab_size, share)]
        print(markdown_table(memory, [("numeric_share", "numbers", ".0%"), ("kind", "loss", ""),
                                      ("contender", "", ""), ("forward_peak_mib", "forward peak MiB", ".0f"),
                                      ("peak_mib", "fwd+bwd peak MiB", ".0f")]))
    path = write_results("bench_ntl_standalone", rows, args.results_dir, memory=memory, threads=args.threads,
                         repeats=args.repeats)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
