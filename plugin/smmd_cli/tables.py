"""The one table printer of the command-line tools and benchmarks: Markdown, so that what a tool
prints can be pasted into the docs as it is.

    print(markdown_table([{"run": "ce", "mae": 166.24}], [("run", "run", ""), ("mae", "MAE", ".1f")]))
    # | run | MAE |
    # |---|---|
    # | ce | 166.2 |
"""

from __future__ import annotations

from typing import Sequence

MISSING = "-"


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple]) -> str:
    """``columns``: (key, header, format spec) triples, e.g. ``("mae", "MAE", ".1f")`` (``""`` prints
    the value as it is); rows are dicts. A key a row lacks, or a None value (e.g. a mean over nothing),
    prints ``-``."""
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = [MISSING if row.get(key) is None else format(row[key], spec) for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
