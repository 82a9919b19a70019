"""train.py trains the same objective for any layout of the same global batch (the layouts of
benchmarks/bench_layouts.py): per-step loss/total equal (fp32, 1e-5 relative) for one rank with
micro-batch 4 or 1 x accumulation 4, two data-parallel ranks with or without accumulation (also
through the fused linear head), and ZeRO-3 + AutoTP TP=2, on a corpus where only one document in
five carries numbers, so micro-batches hold very different numbers of numeric targets. The logged
parts add up to loss/total at every step."""

import pytest
from helpers.launching import run_many

from benchmarks.bench_layouts import LAYOUTS, STEPS, layout_command, steps_of, table_rows, write_corpus

pytestmark = pytest.mark.slow


def test_every_layout_of_the_global_batch_trains_the_same_objective(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    outputs = {name: tmp_path / f"run{index}" for index, name in enumerate(LAYOUTS)}
    run_many({name: layout_command(corpus, outputs[name], *layout) for name, layout in LAYOUTS.items()}, timeout=900)
    logged = {name: steps_of(output) for name, output in outputs.items()}
    reference = logged["1 rank, micro-batch 4"]
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert max(reference[step]["numeric/positions"] for step in reference) > 0  # the steps hold numbers
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
    rows = table_rows(logged)
    assert all(row["max_relative_difference"] <= 1e-5 for row in rows)
    assert all(row["count_share_of_step"] is not None for row in rows)
