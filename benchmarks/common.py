"""Shared pieces of the benchmark scripts: the machine description and JSON results (their tables:
``smmd_cli.tables.markdown_table``)."""

import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from smmd_cli.options import option

REPO = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from (its launch/, ds_configs/)
RESULTS = REPO / "benchmarks" / "results"


def machine() -> dict:
    """What the numbers were measured on (recorded next to them)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    description = {"date": datetime.date.today().isoformat(), "cpu": cpu, "cpu_cores": os.cpu_count(),
                   "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        description["gpu"] = torch.cuda.get_device_name()
    return description


def median_and_spread(samples: list) -> tuple:
    """(median, (max - min) / median) of repeated measurements."""
    middle = statistics.median(samples)
    return middle, (max(samples) - min(samples)) / middle if middle else 0.0


def results_dir_option():
    """The scripts' ``--results_dir`` option: where their JSON goes (:func:`write_results`)."""
    return option("--results_dir", default=None, help="where the JSON goes (default benchmarks/results)")


def write_results(name: str, rows: list, results_dir=None, **extra) -> Path:
    """``<results_dir>/<name>.json`` (default ``benchmarks/results``) with the machine, ``extra`` and ``rows``."""
    results_dir = Path(results_dir or RESULTS)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **extra, "rows": rows}, indent=1))
    return path

