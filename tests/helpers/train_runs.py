"""What the end-to-end train.py tests (tests/launch/test_launch*.py) share: their corpus on disk, train.py's
command line for it, and readers of what a run leaves (metrics, TensorBoard, an exported model)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.launching import REPO, TRAIN, launch_command, metrics, train_flags
from helpers.models import tiny_llama

EXPORT = REPO / "launch" / "export_hf.py"

CONTRACT_SCALARS = {"loss/total", "loss/ce", "loss/numeric", "loss/smmd", "loss/mmd", "loss/smooth",
                    "comm/loss_backward_bytes", "numeric/accuracy",
                    "numeric/mae", "numeric/positions", "perf/tokens_per_second", "perf/tokens_per_second_per_rank",
                    "perf/tflops_per_rank", "perf/step_seconds", "memory/peak_gib", "comm/loss_bytes", "train/lr",
                    "train/grad_norm", "train/skipped_steps", "summary/tokens_per_second", "summary/peak_memory_gib"}

SEQ_LEN, EVAL_BATCHES = 48, 3



def corpus_fixture():
    """A module-scoped ``corpus`` fixture for a test module (``corpus = corpus_fixture()``): a
    Llama-3-style tokenizer and small numeric corpora on disk, as a user would have them."""
    @pytest.fixture(scope="module")
    def corpus(tmp_path_factory):
        return write_launch_corpus(tmp_path_factory.mktemp("corpus"))

    return corpus


def write_launch_corpus(root: Path) -> Path:
    """A Llama-3-style tokenizer and small numeric corpora written into ``root``, as a user would have."""
    import random

    from helpers.style_tokenizers import llama3_style

    llama3_style().save_pretrained(root / "tokenizer")
    generator = random.Random(0)
    for name, lines in (("train.jsonl", 600), ("eval.jsonl", 80)):
        with open(root / name, "w") as handle:
            for _ in range(lines):
                a, b = generator.randint(0, 499), generator.randint(0, 499)
                handle.write(json.dumps({"text": f"Q: {a} + {b} = ? A: {a + b}. At {generator.randint(1, 12)}:"
                                                 f"{generator.randint(10, 59)} we counted {generator.randint(2, 99)} "
                                                 "boxes."}) + "\n")
    return root



def train_args(corpus, output_dir, steps=4, model="tiny", lr=3e-3, warmup_steps=1, micro_batch_size=2, **options):
    """train.py and its flags: a preset with the corpus tokenizer, or a model dir (which brings its own)."""
    return [TRAIN, *train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model=model,
                                tokenizer=corpus / "tokenizer" if model == "tiny" else None,
                                data=[corpus / "train.jsonl"], eval_data=[corpus / "eval.jsonl"],
                                eval_batches=EVAL_BATCHES, seq_len=SEQ_LEN, micro_batch_size=micro_batch_size,
                                max_steps=steps,
                                warmup_steps=warmup_steps, lr=lr, output_dir=output_dir, **options)]



def deepspeed_command(processes, script, *args, port=None):
    return launch_command(script, *args, processes=processes, master_port=port)



def eval_ce_of_hf_model(model_dir, corpus) -> float:
    """Token-mean CE of a saved HF model on the same packed eval blocks train.py evaluates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smmd_train.data.batches import eval_batches
    from smmd_train.data.packing import tokenize_and_pack
    from smmd_train.data.sources import load_text_dataset

    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    blocks = tokenize_and_pack(load_text_dataset([str(corpus / "eval.jsonl")]), tokenizer, SEQ_LEN)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(blocks, 2, EVAL_BATCHES):
            ids = batch["input_ids"]
            logits = model(input_ids=ids).logits[:, :-1].double()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += ids[:, 1:].numel()
    return total / count



def tensorboard_run(output_dir) -> tuple:
    """(scalar tags, HParams session values) of the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    event_files = list(Path(output_dir, "tensorboard").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files  # rank 0 writes, once
    accumulator = EventAccumulator(str(event_files[0]))
    accumulator.Reload()
    session = plugin_data_pb2.HParamsPluginData.FromString(
        accumulator.SummaryMetadata("_hparams_/session_start_info").plugin_data.content).session_start_info
    hparams = {name: getattr(value, value.WhichOneof("kind")) for name, value in session.hparams.items()}
    return set(accumulator.Tags()["scalars"]), hparams



def local_hf_checkpoint(directory, corpus, extra_rows=0, **shape):
    """A small Llama with the corpus tokenizer saved as a Hugging Face dir, as a user's checkpoint;
    its embedding has ``extra_rows`` beyond the tokenizer's; ``shape``: more ``tiny_llama`` options."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    tiny_llama(len(tokenizer) + extra_rows, **shape).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory



def cut_back_to_step_4(reference, output):
    """``output``: the run directory ``reference`` as it was right after its step-4 checkpoint."""
    import shutil

    shutil.copytree(reference, output, ignore=shutil.ignore_patterns(
        "hf", "tensorboard", "metrics.jsonl", "step00000002", "step00000006"))
    (output / "latest").write_text("step00000004")



def assert_steps_5_and_6_continue(expected, output):
    resumed = metrics(output)
    assert sorted(step for step in resumed if step) == [5, 6]
    for step in (5, 6):
        for name in ("loss/total", "loss/ce", "loss/smmd", "numeric/positions", "train/lr"):
            assert resumed[step][name] == pytest.approx(expected[step][name], rel=1e-6, abs=1e-9), (step, name)



def adam_step_bound(step: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can reach at ``step`` over all gradient sequences (eps 0):
    by Cauchy-Schwarz, sqrt(sum_k a_k^2 / b_k) for the bias-corrected weights a_k of m and b_k of v."""
    ages = range(step)
    a = [(1 - beta1) * beta1 ** age / (1 - beta1 ** step) for age in ages]
    b = [(1 - beta2) * beta2 ** age / (1 - beta2 ** step) for age in ages]
    return sum(x * x / y for x, y in zip(a, b)) ** 0.5

