"""train.py trains the same objective for any layout of the same global batch: per-step loss/total
equal (fp32, 1e-5 relative) for one rank with micro-batch 4 or 1 x accumulation 4, two data-parallel
ranks with or without accumulation (also through the fused linear head), and ZeRO-3 + AutoTP TP=2,
on a corpus where only one document in five carries numbers, so micro-batches hold very different
numbers of numeric targets. The logged parts add up to loss/total at every step."""

import json
import random

import pytest
from helpers.launching import REPO, TRAIN, launch_command, metrics, run, train_flags

pytestmark = pytest.mark.slow
STEPS, SEQ_LEN = 4, 32
LAYOUTS = {  # name: (processes, micro-batch, accumulation, extra train.py options)
    "1 rank, micro-batch 4": (1, 4, 1, {}),
    "1 rank, micro-batch 1 x accumulation 4": (1, 1, 4, {}),
    "DP=2, micro-batch 2": (2, 2, 1, {}),
    "DP=2, micro-batch 1 x accumulation 2": (2, 1, 2, {}),
    "DP=2, micro-batch 1 x accumulation 2, fused linear": (2, 1, 2, {"fused_linear": True}),
    "ZeRO-3 + AutoTP TP=2, micro-batch 4": (2, 4, 1, {"tp": 2}),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from helpers.style_tokenizers import llama3_style

    root = tmp_path_factory.mktemp("sparse_numbers")
    llama3_style().save_pretrained(root / "tokenizer")
    generator = random.Random(5)
    words = "the of boxes a river stone counted we little green under over".split()
    with open(root / "train.jsonl", "w") as handle:
        for line in range(400):
            if line % 5 == 0:
                a, b = generator.randint(0, 499), generator.randint(0, 499)
                text = f"Q: {a} + {b} = ? A: {a + b}."
            else:
                text = " ".join(generator.choice(words) for _ in range(generator.randint(8, 30))) + "."
            handle.write(json.dumps({"text": text}) + "\n")
    return root


def run_layout(corpus, output, processes, micro_batch_size, accumulation, options) -> dict:
    flags = train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny",
                        tokenizer=corpus / "tokenizer", data=[corpus / "train.jsonl"], seq_len=SEQ_LEN,
                        micro_batch_size=micro_batch_size, gradient_accumulation_steps=accumulation,
                        max_steps=STEPS, warmup_steps=1, lr=3e-3, output_dir=output,
                        numeric_loss=["smmd:1", "ntl-was:0.3"], ntl_squash_factor=9.0, **options)
    run(launch_command(TRAIN, *flags, processes=processes), timeout=600)
    return metrics(output)


def test_every_layout_of_the_global_batch_trains_the_same_objective(corpus, tmp_path):
    logged = {name: run_layout(corpus, tmp_path / f"run{index}", *layout)
              for index, (name, layout) in enumerate(LAYOUTS.items())}
    reference = logged["1 rank, micro-batch 4"]
    positions = [reference[step]["numeric/positions"] for step in range(1, STEPS + 1)]
    assert max(positions) > 0  # the steps hold numbers, unevenly
    for name, steps in logged.items():
        for step in range(1, STEPS + 1):
            record, expected = steps[step], reference[step]
            assert record["numeric/positions"] == expected["numeric/positions"], (name, step)
            assert record["loss/total"] == pytest.approx(expected["loss/total"], rel=1e-5), (name, step)
            assert record["loss/numeric"] == pytest.approx(expected["loss/numeric"], rel=1e-5, abs=1e-7), (name, step)
            # The logged parts add up: total = ce + numeric, numeric = smmd + 0.3 ntl_was.
            assert record["loss/total"] == pytest.approx(record["loss/ce"] + record["loss/numeric"], rel=1e-6)
            assert record["loss/numeric"] == pytest.approx(record["loss/smmd"] + 0.3 * record["loss/ntl_was"],
                                                           rel=1e-6, abs=1e-9), (name, step)
