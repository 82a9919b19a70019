"""Reading a run's ``metrics.jsonl``: one JSON record per line, ``{"step": N, "<tag>": value, ...}``,
appended by rank 0's monitor (the same scalars as TensorBoard; the first record is the run's layout,
the last ones its ``summary/*``)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def read_metrics(output_dir) -> list:
    """The records of ``<output_dir>/metrics.jsonl`` in the order written. A last line without its
    newline is a record still being written and is left out, so a running job can be read."""
    text = Path(output_dir, METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]
