"""The study's runs side by side (``--jobs``): each run's CPU is its own process's (os.wait4), results
come back in order, and a failing run does not stop the others."""

import os
import sys
import threading

import pytest
from helpers import host_probe
from helpers.host_probe import hang_guard

from benchmarks.numeracy import study_a
from benchmarks.numeracy.runner import RunFailed, run_measured

BUSY = ("import time\nend = {seconds}\nwhile time.process_time() < end:\n    pass\n")


def test_each_run_counts_its_own_cpu_when_runs_overlap(tmp_path):
    """A short and a long CPU-bound child run at once: each is charged its own CPU. os.times deltas
    around each run would charge the long run with the short one's CPU too (it ends inside the long
    run's window). Bounds: a child's CPU is at least the busy loop's (process_time counts it) and at
    most that plus its interpreter start, which takes well under 2 CPU-s even on a loaded machine."""
    short, long = 0.3, 1.5

    def run(seconds: float, name: str):
        return lambda: run_measured([sys.executable, "-c", BUSY.format(seconds=seconds)], tmp_path / name,
                                    dict(os.environ))

    host_probe.settle()  # the session's background probe, else reaped in this window with its CPU
    before = os.times()
    (_, short_cpu), (_, long_cpu) = study_a.in_parallel(2, [run(short, "short.log"), run(long, "long.log")])
    after = os.times()
    assert short <= short_cpu < short + 2.0
    assert long <= long_cpu < long + 2.0
    children = after.children_user + after.children_system - before.children_user - before.children_system
    # the two rusages are all the children this test reaped (same clock ticks, so to the tick, 10 ms each)
    assert abs(children - short_cpu - long_cpu) < 0.05


def test_a_failed_run_raises_with_its_log_tail(tmp_path):
    with pytest.raises(RunFailed, match=r"(?s)exited 3.*the last words"):
        run_measured([sys.executable, "-c", "print('the last words'); raise SystemExit(3)"], tmp_path / "x.log",
                     dict(os.environ))


def test_in_parallel_keeps_order_runs_every_task_and_raises_the_first_error():
    ran = []
    lock = threading.Lock()
    second_started = threading.Event()

    def task(index: int):
        def body():
            if index == 0:  # returns only if task 2 started while task 0 was still running: two in flight
                assert second_started.wait(timeout=hang_guard(60)), "the second task never ran beside the first"
            if index == 2:
                second_started.set()
            with lock:
                ran.append(index)
            if index in (1, 3):
                raise ValueError(f"task {index}")
            return index * 10
        return body

    assert study_a.in_parallel(2, [task(0), task(2), task(4)]) == [0, 20, 40]
    ran.clear()
    with pytest.raises(ValueError, match="task 1"):
        study_a.in_parallel(2, [task(index) for index in range(1, 6)])
    assert sorted(ran) == [1, 2, 3, 4, 5]
    assert study_a.in_parallel(1, [task(2), task(4)]) == [20, 40]


def test_jobs_is_parsed_and_checked():
    assert study_a.parse_args(["--jobs", "2"]).jobs == 2
    assert study_a.parse_args([]).jobs == 1
    with pytest.raises(SystemExit):
        study_a.parse_args(["--jobs", "0"])


def test_the_shared_selection_reference_must_have_been_made_with_the_same_options(tmp_path):
    """Every arm's selection shares one CE reference run; a reference made with other options (another
    CE setting) is refused rather than compared against."""
    reference = tmp_path / "selection" / "reference"
    reference.mkdir(parents=True)
    (reference / "run.json").write_text('{"flags": {"ce_label_smoothing": 0.1}, "eval": {}}')
    grid = {"settings": {}, "data": {}, "work_dir": tmp_path, "env": {}, "began": 0.0, "study": {}}
    with pytest.raises(SystemExit, match="reference run made with"):
        study_a.select_on_validation("smmd", {}, {}, grid, 1000, study_a.evaluate_a)


def test_evaluations_under_jobs_run_one_at_a_time(tmp_path):
    """Training runs overlap under --jobs, in-process evaluations do not (loading a model is not
    thread-safe: a tied head once came back unmaterialized in a parallel evaluation)."""
    import json

    active, peak, lock = [0], [0], threading.Lock()

    def evaluate(hf_dir, qa_path):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        threading.Event().wait(0.2)  # long enough for the other thread to arrive while this one runs
        with lock:
            active[0] -= 1
        return {"metrics": {"val": {}}, "answers": []}

    def trained(name: str):
        run = tmp_path / name
        (run / "hf").mkdir(parents=True)
        (run / "hf" / "config.json").write_text("{}")
        (run / "run.json").write_text(json.dumps({"train_seconds": 1.0, "train_cpu_seconds": 1.0}))
        return lambda: study_a.execute({}, {"qa_eval": "unused"}, "ce", {}, 0, run, {}, evaluate)

    records = study_a.in_parallel(2, [trained("a"), trained("b")])
    assert peak[0] == 1 and all(record["eval"] == {"val": {}} for record in records)
