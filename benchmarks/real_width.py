r"""A model at a real width, trained on one machine: a 7B-shaped Llama cut to two layers trains under ZeRO-3 +
AutoTP TP 2 with ``--fused_linear`` and SMMD for a few steps and saves, resumes at TP 1 through the
universal checkpoint, and exports a Hugging Face folder that loads and answers; each rank's resident
memory is measured against the memory planner's estimate for the same settings, term by term.

The default shape is Llama-2-7B's width, MLP and vocabulary with 8 KV heads, cut to two layers (hidden
4,096, 32 heads of 128, 8 KV heads, MLP 11,008, vocabulary 32,000: 0.62 B parameters): by the planner's
terms and what hidden 1,024 measured beyond them, about 9.4 GiB per rank at its peak, 19 GiB for the two,
which leaves room in 24 GiB. Mistral-7B's MLP (``--intermediate_size 14336``, 0.70 B) would need about
10.5 GiB per rank: 21 GiB, too close to 24 GiB with the benchmark's own process and the system beside
it. The checkpoints, their universal conversion and the export take about 30 GB of disk under
``--work_dir``. Every stage runs as a user runs it, on two CPU ranks (``DS_ACCELERATOR=cpu``, fp32):

  1. train   ``deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2
             --fused_linear --numeric_loss smmd ...``: ``--steps`` steps of 2 sequences (micro-batch 1,
             2 accumulated), a checkpoint at the last;
  2. convert ``python -m smmd_train.checkpoint convert OUTPUT_DIR``: the universal checkpoint, in one
             process beforehand (docs/training.md's advice for big models; the resume reuses it);
  3. resume  the same launch with ``--tp 1 --resume``: ZeRO-3 over the 2 ranks, micro-batch 1 (the same
             global batch of 2), ``--resumed_steps`` more steps and a checkpoint;
  4. export  ``python launch/export_hf.py OUTPUT_DIR HF_DIR`` (a TP 1 checkpoint: consolidated offline);
  5. answer  ``AutoModelForCausalLM.from_pretrained(HF_DIR)`` generates from a held-out question.

Memory. While a launch runs, each rank's VmRSS and VmHWM are read from ``/proc`` every ``--poll_seconds``,
and the moments the trainer marks are noted (its log lines, its metrics.jsonl records), so each rank's
resident memory splits into the terms below. The ranks run with glibc's mmap threshold fixed at 128 KiB
(:data:`LIVE_MEMORY`): every tensor is then mapped on allocation and unmapped when freed, so RSS follows
the live tensors, which is what the planner counts (on a GPU the trainer reports ``max_memory_allocated``,
not what the caching allocator holds). With glibc's default the threshold rises to 32 MiB as large blocks
are freed, and freed tensors below it stay in the heap: at hidden 1,024 the peak was 0.2 GiB higher per
rank with it (1.95 against 1.74 GiB; ``mallinfo2`` in the ranks counted the heap's free blocks), and this
split would count that as model states.

  runtime       RSS before the model is built (the log's layout line): interpreter, torch, DeepSpeed,
                transformers, tokenizer, packed data. The planner does not count it (on a GPU it is host
                memory);
  model states  RSS once the launch has trained and saved (the log's ``done:`` line: every rank past the
                save's barriers, no step in flight) minus runtime: the ZeRO-3 partitions of the parameters,
                gradients, fp32 master weights and Adam moments (torch's AdamW creates those at the first
                step, so the engine as built holds 12 of their 20 bytes per parameter: ``engine_built_bytes``
                in the JSON), ZeRO's buffers, and what the allocator kept of freed memory;
  step          the peak through the training steps (VmHWM when the last step's record appears; see
                :meth:`LaunchMemory.split`) minus model states and runtime: gathered parameters,
                activations, logits and loss, gradients in flight, the optimizer step's temporaries.

The planner's terms for the same settings (``smmd_train.tools.memory``: ``nodes 1``, ``gpus_per_node 2``, the
run's ``--tp``, ``--seq_len``, micro-batch 1, ``fused_linear``) in fp32, the run's precision: model states
without the gathered largest layer (``model_states_bytes``' ``partitioned_bytes``) against the first;
the gathered largest layer, ``activation_bytes``, ``logits_and_loss_bytes`` and the optimizer step's
temporaries (``optimizer_step_bytes``: torch's AdamW on the CPU) against the second. Each
row gives planner, measured per rank and their ratio; the JSON also holds the planner in bf16 (what it
prints for a GPU), each rank's process-wide peak (saves and loads included), the trainer's own
``memory/peak_gib`` (max over ranks), and the converter's and exporter's peaks (``os.wait4``).

    python -m benchmarks.real_width                 # the 7B shape: minutes, ~19 GiB over the two ranks
    python -m benchmarks.real_width --hidden_size 1024 --num_attention_heads 8 --num_key_value_heads 2 \
        --intermediate_size 2816 --seq_len 256 --name real_width_h1024       # 0.09 B: 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.common import (
    REPO,  # noqa: E402
    results_dir_option,
    write_results,
)
from benchmarks.numeracy.runner import child_environment, run_watched
from smmd_train.config.arguments import train_command
from smmd_train.monitor.metrics_file import read_metrics

GIB = 2**30
PROCESSES = 2  # ranks of every launch: TP 2 x DP 1, then TP 1 x DP 2
TRAIN_TP, RESUME_TP = 2, 1
# glibc's malloc with its mmap threshold fixed (not raised as freed blocks come back): RSS is the live memory.
LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
# What the trainer logs at the moments the memory splits (smmd_train.run and smmd_train.train, rank 0).
MARKS = {"building": "[train] world ", "built": "[train] loss: ", "resumed": "[train] resumed from ",
         "done": "[train] done: "}


@dataclass(frozen=True)
class RealWidthOptions:
    hidden_size: int = option("--hidden_size", type=int, default=4096)
    num_attention_heads: int = option("--num_attention_heads", type=int, default=32)
    num_key_value_heads: int = option("--num_key_value_heads", type=int, default=8)
    intermediate_size: int = option("--intermediate_size", type=int, default=11008,
                                    help="11008 (Llama-2-7B) or 14336 (Mistral-7B, Llama-3-8B)")
    vocab_size: int = option("--vocab_size", type=int, default=32000,
                             help="the model's vocabulary (the tokenizer's tokens are its first rows)")
    num_hidden_layers: int = option("--num_hidden_layers", type=int, default=2)
    seq_len: int = option("--seq_len", type=int, default=512)
    steps: int = option("--steps", type=int, default=3, help="steps at TP 2 (the first is the warm-up)")
    resumed_steps: int = option("--resumed_steps", type=int, default=2, help="steps at TP 1 after the resume")
    resume_processes: int = option("--resume_processes", type=int, default=2, choices=(1, 2),
                                   help="ranks of the TP 1 resume (default 2, ZeRO-3 over both; 1: one process, "
                                        "2 accumulated micro-batches, where two ranks loading the universal "
                                        "checkpoint at once do not fit the host's memory, as at the 7B width "
                                        "in 24 GiB)")
    poll_seconds: float = option("--poll_seconds", type=float, default=0.05,
                                 help="how often the ranks' memory is read from /proc")
    work_dir: str = option("--work_dir", default=str(REPO / "benchmarks" / "runs" / "real_width"))
    name: str = option("--name", default="real_width", help="the results file: <results_dir>/<name>.json")
    results_dir: Optional[str] = results_dir_option()


def parse_args(argv=None) -> RealWidthOptions:
    options, parser = parse_options(RealWidthOptions, argv, description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    if options.steps < 2 or options.resumed_steps < 2:
        parser.error(f"--steps {options.steps} and --resumed_steps {options.resumed_steps} must be at least 2: the "
                     "first step of a launch is its warm-up, the peak is read after a second")
    return options


# ----------------------------------------------------------------------------------------------
# The model, its tokenizer and data
# ----------------------------------------------------------------------------------------------

def prepare_data(work: Path) -> dict:
    """Tier A's arithmetic and its Llama-3-style tokenizer (0..999 single tokens;
    ``smmd_numeracy.tier_a.data_and_tokenizer``), and its first held-out question."""
    from smmd_numeracy import tier_a

    data = tier_a.data_and_tokenizer(work)
    with open(data["qa_eval"]) as handle:
        question = json.loads(handle.readline())
    return {"train": data["train"], "tokenizer": Path(data["tokenizer"]), "question": question}


def model_config(args: RealWidthOptions, tokenizer):
    """The 7B preset's Llama with this run's width, heads, MLP, layers and vocabulary."""
    from smmd_train.model.presets import preset_config

    config = preset_config("7b", args.vocab_size, max_position_embeddings=max(args.seq_len, 128),
                           hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                           num_key_value_heads=args.num_key_value_heads, intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.num_hidden_layers)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    return config


def write_model(config, tokenizer, directory: Path) -> Path:
    """A freshly initialised model of ``config`` and the tokenizer as a Hugging Face folder (what a user's
    ``--model DIR`` is), reused when a complete one of this config is there (``built_from.json``, written
    last)."""
    from transformers import AutoModelForCausalLM

    marker = directory / "built_from.json"
    if marker.is_file() and marker.read_text() == config.to_json_string():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    marker.write_text(config.to_json_string())
    return directory


# ----------------------------------------------------------------------------------------------
# Memory of the ranks of a running launch
# ----------------------------------------------------------------------------------------------

def _children() -> dict:
    """{parent pid: [child pids]} of every process now."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    return children


def rank_processes(launcher_pid: int, script: str) -> dict:
    """{rank: pid} of the processes under ``launcher_pid`` that run ``script`` (their RANK variable)."""
    children, found, pending = _children(), {}, [launcher_pid]
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        try:
            command = (Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
            environment = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                               if b"=" in item)
        except OSError:
            continue
        if any(part.endswith(script.encode()) for part in command) and b"RANK" in environment:
            found[int(environment[b"RANK"])] = pid
    return found


def resident_bytes(pid: int) -> Optional[tuple]:
    """(VmRSS, VmHWM) of ``pid`` in bytes, or None once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return tuple(int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))
    except (OSError, KeyError):
        return None


@dataclass
class LaunchMemory:
    """Each rank's (VmRSS, VmHWM) at every poll of a running launch, and the poll at which each mark (a
    log line of :data:`MARKS`, a step's metrics record) was first seen. The memory is read before the
    log and the metrics at each poll, so the sample of the poll before a mark's precedes its moment."""

    log: Path
    metrics: Path
    ranks: int
    earlier_steps: frozenset = frozenset()  # steps metrics.jsonl held before the launch (a resume keeps them)
    script: str = "train.py"
    pids: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)  # per poll: {rank: (rss, hwm)}
    marks: dict = field(default_factory=dict)  # name -> poll
    steps: dict = field(default_factory=dict)  # step -> poll
    _read: dict = field(default_factory=lambda: {"log": 0, "metrics": 0})

    def __call__(self, launcher_pid: int) -> None:
        if len(self.pids) < self.ranks:
            self.pids = rank_processes(launcher_pid, self.script)
        sample = {rank: resident_bytes(pid) for rank, pid in self.pids.items()}
        self.samples.append({rank: value for rank, value in sample.items() if value is not None})
        poll = len(self.samples) - 1
        text = self._new_text(self.log, "log")
        for name, line in MARKS.items():
            if name not in self.marks and line in text:
                self.marks[name] = poll
        for line in self._new_text(self.metrics, "metrics").splitlines():
            record = json.loads(line)
            if "loss/total" in record and record["step"] not in self.earlier_steps:
                self.steps.setdefault(record["step"], poll)

    def _new_text(self, path: Path, key: str) -> str:
        """What ``path`` gained since the last poll, up to its last full line (all of it again after a
        rewrite that shortened it: a resume drops the records past its checkpoint)."""
        if not path.is_file():
            return ""
        with open(path, "rb") as handle:
            if handle.seek(0, os.SEEK_END) < self._read[key]:
                self._read[key] = 0
            handle.seek(self._read[key])
            text = handle.read()
        text = text[:text.rfind(b"\n") + 1]
        self._read[key] += len(text)
        return text.decode(errors="replace")

    def resident(self, rank: int, poll: int) -> int:
        return self.samples[poll][rank][0]

    def high_water(self, rank: int, poll: int) -> int:
        return self.samples[poll][rank][1]

    def split(self, rank: int) -> dict:
        """This rank's runtime, model-states and step bytes (see the module docstring), its peak through the
        training steps and over the whole process.

        The steps' peak is the high-water mark when the last step's record appears if the steps raised it;
        else an earlier moment (the build, a checkpoint's load) set the mark, and the steps' peak is the
        largest RSS sampled while they ran (``peak_from``: "high-water mark" or "samples")."""
        before, built = max(self.marks["building"] - 1, 0), self.marks["built"] - 1
        last = self.steps[max(self.steps)]
        first = max(self.marks["built"], self.marks.get("resumed", 0))  # the steps start after the resume's load
        done = self.marks["done"]
        if done + 1 < len(self.samples) and rank in self.samples[done + 1]:
            done += 1  # the first sample certainly after the line
        runtime, trained = self.resident(rank, before), self.resident(rank, done)
        if self.high_water(rank, last) > self.high_water(rank, first):
            peak, peak_from = self.high_water(rank, last), "high-water mark"
        else:
            peak, peak_from = max(self.resident(rank, poll) for poll in range(first, last + 1)), "samples"
        process_peak = max(sample[rank][1] for sample in self.samples if rank in sample)
        return {"runtime_bytes": runtime, "model_states_bytes": trained - runtime, "step_bytes": peak - trained,
                "engine_built_bytes": self.resident(rank, built) - runtime, "training_peak_bytes": peak,
                "peak_from": peak_from, "process_peak_bytes": process_peak}


def launch(command: list, output_dir: Path, env: dict, poll_seconds: float, log_name: str,
           processes: int = PROCESSES) -> LaunchMemory:
    """Run a train.py launch of ``processes`` ranks, reading their memory while it runs."""
    metrics = output_dir / "metrics.jsonl"
    earlier = frozenset(record["step"] for record in read_metrics(output_dir)) if metrics.is_file() else frozenset()
    memory = LaunchMemory(output_dir / log_name, metrics, processes, earlier)
    run_watched([str(part) for part in command], memory.log, env, memory, poll_seconds)
    missing = [name for name in ("building", "built", "done") if name not in memory.marks]
    if missing or len(memory.pids) < processes or not memory.steps:
        raise SystemExit(f"{memory.log}: the launch ended without the marks the memory splits at (missing "
                         f"{missing}, ranks {sorted(memory.pids)}, steps {sorted(memory.steps)})")
    return memory


def run_single(command: list, log: Path, env: dict) -> dict:
    """One process to completion: its wall seconds and peak RSS (``os.wait4``)."""
    wall_seconds, usage = run_watched([str(part) for part in command], log, env)
    return {"wall_seconds": wall_seconds, "peak_bytes": usage.ru_maxrss * 1024}


# ----------------------------------------------------------------------------------------------
# The planner's terms
# ----------------------------------------------------------------------------------------------

def planned_terms(config, tp_size: int, seq_len: int, precision: str, processes: int = PROCESSES) -> dict:
    """The memory planner's per-rank terms for one launch of this benchmark: ``model_states_bytes`` (the
    ZeRO-3 partitions), ``step_bytes`` (the gathered largest layer, activations, logits and loss, the
    optimizer step's temporaries) and their parts, in ``precision``."""
    from smmd_train.tools import memory

    states = memory.model_states_bytes(config, 1, processes, tp_size, precision=precision)
    activations = memory.activation_bytes(config, seq_len, 1, tp_size, precision=precision)
    loss = memory.logits_and_loss_bytes(config.vocab_size, seq_len, 1, tp_size, fused_linear=True,
                                        hidden_size=config.hidden_size, precision=precision)
    step = states["gathered_bytes"] + activations + loss + states["optimizer_step_bytes"]
    return {"model_states_bytes": states["partitioned_bytes"], "gathered_layer_bytes": states["gathered_bytes"],
            "optimizer_step_bytes": states["optimizer_step_bytes"],
            "activation_bytes": activations, "logits_and_loss_bytes": loss, "step_bytes": step,
            "total_bytes": states["partitioned_bytes"] + step, "tp_params": states["tp_params"],
            "zero_partition_params": states["zero_partition_params"],
            "tp_largest_layer_params": states["tp_largest_layer_params"]}


TERMS = (("runtime_bytes", "runtime (not planned)"), ("model_states_bytes", "model states (ZeRO-3 partitions)"),
         ("step_bytes", "step (gathered layer + activations + loss + optimizer step)"),
         ("planned_bytes", "planned terms together"),
         ("training_peak_bytes", "peak RSS (training steps)"))


def phase_rows(phase: str, planned: dict, measured: dict) -> list:
    """One row per term of :data:`TERMS`: planner (fp32), measured per rank (GiB) and measured / planner."""
    rows = []
    for key, term in TERMS:
        row = {"phase": phase, "term": term}
        plan = {"model_states_bytes": planned["model_states_bytes"], "step_bytes": planned["step_bytes"],
                "planned_bytes": planned["total_bytes"]}.get(key)
        row["planner_gib"] = None if plan is None else plan / GIB
        for rank, split in measured.items():
            value = (split["model_states_bytes"] + split["step_bytes"] if key == "planned_bytes" else split[key])
            row[f"rank{rank}_gib"] = value / GIB
            row[f"rank{rank}_vs_planner"] = value / plan if plan else None
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# The stages
# ----------------------------------------------------------------------------------------------

def train_flags(args: RealWidthOptions, model_dir: Path, data: dict, output_dir: Path) -> dict:
    """The train.py options both launches share."""
    return dict(deepspeed_config=REPO / "ds_configs" / "zero3.json", model=model_dir, data=[data["train"]],
                seq_len=args.seq_len, micro_batch_size=1, warmup_steps=1, numeric_loss=["smmd"], fused_linear=True,
                output_dir=output_dir, cache_dir=output_dir.parent / "cache")


def answer(hf_dir: Path, model_dir: Path, question: dict, new_tokens: int = 8) -> dict:
    """Load the export with transformers and generate greedily after a held-out question; whether its
    weights differ from the initial model's (training moved them)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    prompt = question["prompt"]
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
    continuation = generated[0, inputs["input_ids"].shape[1]:]
    initial = {}
    for path in model_dir.glob("*.safetensors"):
        initial.update(load_file(path))
    exported = model.state_dict()
    changed = sum(not torch.equal(initial[name], exported[name]) for name in initial if name in exported)
    return {"prompt": prompt, "expected": question["answer"], "generated_tokens": len(continuation),
            "generated_text": tokenizer.decode(continuation), "logits_finite": bool(torch.isfinite(logits).all()),
            "tensors_changed_by_training": changed, "tensors": len(initial)}


def trained_phase(name: str, memory: LaunchMemory, output_dir: Path, config, tp_size: int, seq_len: int,
                  processes: int = PROCESSES) -> tuple:
    """The record of one launch (its memory split per rank, the planner's terms in fp32 and bf16, what rank 0
    held as the trainer counted it, the trainer's own peak) and its table rows."""
    measured = {rank: memory.split(rank) for rank in range(processes)}
    planned = {precision: planned_terms(config, tp_size, seq_len, precision, processes)
               for precision in ("fp32", "bf16")}
    last_step = max(memory.steps)
    trainer_peak = next(record["memory/peak_gib"] for record in read_metrics(output_dir)
                        if record["step"] == last_step and "memory/peak_gib" in record)
    record = {"tp": tp_size, "dp": processes // tp_size, "steps": sorted(memory.steps), "measured": measured,
              "planner": planned, "trainer_peak_gib": trainer_peak, "polls": len(memory.samples),
              "rank_parameters": json.loads((output_dir / "run_config.json").read_text())["rank_parameters"]}
    return record, phase_rows(name, planned["fp32"], measured)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from smmd_train.model.presets import parameter_count

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(work)
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    config = model_config(args, tokenizer)
    shape = (f"h{args.hidden_size}_a{args.num_attention_heads}_kv{args.num_key_value_heads}_i{args.intermediate_size}"
             f"_v{args.vocab_size}_l{args.num_hidden_layers}")
    model_dir = write_model(config, tokenizer, work / f"model_{shape}")
    output_dir, hf_dir = work / "run", work / "hf_export"
    for directory in (output_dir, hf_dir):
        shutil.rmtree(directory, ignore_errors=True)
    output_dir.mkdir(parents=True)
    env = child_environment(threads_per_run=1, on_gpu=False)
    env.update(LIVE_MEMORY, DS_ACCELERATOR="cpu")  # the CPU run this benchmark measures: fp32, whatever the machine has
    shared = train_flags(args, model_dir, data, output_dir)
    total_steps = args.steps + args.resumed_steps
    began = time.monotonic()

    # 1. ZeRO-3 + AutoTP TP 2: 2 sequences per step (micro-batch 1 x 2 accumulated x DP 1), saved at the end.
    trained = launch(train_command(processes=PROCESSES, tp=TRAIN_TP, gradient_accumulation_steps=2,
                                   max_steps=args.steps, save_steps=args.steps, **shared),
                     output_dir, env, args.poll_seconds, "train_tp2.log")
    phases, rows = {}, []
    phases["train TP 2"], phase_table = trained_phase("train TP 2", trained, output_dir, config, TRAIN_TP,
                                                      args.seq_len)
    rows += phase_table
    stages = {"train": {"wall_seconds": time.monotonic() - began}}
    # 2. The universal checkpoint, beforehand in one process; 3. resumed at TP 1 on the same ranks (or on one:
    # --resume_processes 1): the same 2 sequences per step (micro-batch 1 x DP 2, or x 2 accumulated).
    stages["convert"] = run_single([sys.executable, "-m", "smmd_train.checkpoint.saving", "convert", output_dir],
                                   output_dir / "convert.log", env)
    resumed_began = time.monotonic()
    resumed = launch(train_command(processes=args.resume_processes, tp=RESUME_TP,
                                   gradient_accumulation_steps=PROCESSES // args.resume_processes,
                                   max_steps=total_steps, save_steps=total_steps, resume=True, **shared),
                     output_dir, env, args.poll_seconds, "resume_tp1.log", args.resume_processes)
    phases["resume TP 1"], phase_table = trained_phase("resume TP 1", resumed, output_dir, config, RESUME_TP,
                                                       args.seq_len, args.resume_processes)
    rows += phase_table
    stages["resume"] = {"wall_seconds": time.monotonic() - resumed_began}
    resume_log = (output_dir / "resume_tp1.log").read_text(errors="replace")
    stages["resume"]["log"] = [line.replace(f"{REPO}/", "") for line in resume_log.splitlines()  # no machine path
                               if line.startswith(MARKS["resumed"]) or "universal checkpoint" in line]
    # 4. Export (a TP 1 checkpoint: offline, one process); 5. load it and generate.
    stages["export"] = run_single([sys.executable, REPO / "launch" / "export_hf.py", output_dir, hf_dir],
                                  output_dir / "export.log", env)
    answered = answer(hf_dir, model_dir, data["question"])

    columns = [("phase", "phase", ""), ("term", "term", ""), ("planner_gib", "planner GiB (fp32)", ".3f"),
               *[(f"rank{rank}_gib", f"rank {rank} GiB", ".3f") for rank in range(PROCESSES)],
               *[(f"rank{rank}_vs_planner", f"rank {rank} / planner", ".2f") for rank in range(PROCESSES)]]
    print(f"model: hidden {args.hidden_size}, {args.num_attention_heads} heads / {args.num_key_value_heads} KV, MLP "
          f"{args.intermediate_size}, vocabulary {args.vocab_size}, {args.num_hidden_layers} layers: "
          f"{parameter_count(config) / 1e9:.3f} B parameters; seq {args.seq_len}, fp32 on {PROCESSES} CPU ranks")
    print(markdown_table(rows, columns))
    for name, phase in phases.items():
        print(f"{name}: steps {phase['steps']}; rank 0 held {phase['rank_parameters']['zero_partition']:,} parameters "
              f"in its ZeRO-3 partition (planner {phase['planner']['fp32']['zero_partition_params']:,}); the trainer's "
              f"peak {phase['trainer_peak_gib']:.3f} GiB (max over ranks, since the process began)")
    print(f"universal checkpoint {stages['convert']['wall_seconds']:.0f} s, peak "
          f"{stages['convert']['peak_bytes'] / GIB:.2f} GiB; export {stages['export']['wall_seconds']:.0f} s, peak "
          f"{stages['export']['peak_bytes'] / GIB:.2f} GiB")
    print(f"answer: {answered['prompt']!r} -> {answered['generated_text']!r} ({answered['generated_tokens']} tokens; "
          f"{answered['tensors_changed_by_training']} of {answered['tensors']} tensors moved by training)")
    path = write_results(args.name, rows, results_dir=args.results_dir, model={
        "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "num_hidden_layers": args.num_hidden_layers,
        "parameters": parameter_count(config)}, seq_len=args.seq_len, precision="fp32", processes=PROCESSES,
        resume_processes=args.resume_processes,
        rank_environment=LIVE_MEMORY, phases=phases, stages=stages, answer=answered, poll_seconds=args.poll_seconds,
        wall_seconds=time.monotonic() - began)
    print("wrote", path)


if __name__ == "__main__":
    main()
