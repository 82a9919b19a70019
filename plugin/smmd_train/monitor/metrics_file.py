"""A run's ``metrics.jsonl``: one JSON record per line, ``{"step": N, "<tag>": value, ...}``,
appended by rank 0's monitor (the same scalars as TensorBoard; the first record is the run's layout,
the last ones its ``summary/*``). A resumed run first drops the records of the steps it trains again
(:func:`keep_records_through`), so each step is in the file once."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def read_metrics(output_dir) -> list:
    """The records of ``<output_dir>/metrics.jsonl`` in the order written. A last line without its
    newline is a record still being written and is left out, so a running job can be read."""
    text = Path(output_dir, METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def keep_records_through(path, step: int) -> int:
    """Rewrite the metrics file ``path`` (if there is one) keeping only the records of steps up to
    ``step``, the step a resumed run continues from: it logs every later step again (a run killed
    after step 5 and resumed from its step-4 checkpoint trains step 5 twice). At step 0 nothing is
    kept: a run that starts from scratch writes its own layout record. A last line without its newline
    (cut off by the kill) goes too. Returns the number of records dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if step > 0 and line.endswith("\n") and _step_of(line) <= step]
    if len(kept) < len(lines):
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)  # a reader sees the old file or the new one, never half of it
    return len(lines) - len(kept)


def _step_of(line: str) -> float:
    """A record's step; a line that is not a record (damaged on disk) counts as past every step, so
    the rewrite drops it instead of failing on rank 0 alone while the other ranks train on."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
