import json
import os
import resource
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import torch

from smmd_scale import NumericVocab

# Reference values of the objective (docs/objective.md) computed in float64 with the paper's published code.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "smmd_reference_digits.pt"
# Fresh random inputs every run; rerun one with SMMD_TEST_SEED=<seed printed in the header>. Set in
# the environment here, so pytest-xdist's workers (started after this import) draw with the same seed.
SESSION_SEED = int(os.environ.setdefault("SMMD_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))


# Every time limit in the tests is a hang guard scaled by a probe of the host (helpers/host_probe.py):
# measured once per session, by .ci/run (SMMD_HOST_PROBE) or here in the background while the tests are
# collected; set in the environment before pytest-xdist's workers start, like the seed.
if "PYTEST_XDIST_WORKER" not in os.environ:
    from helpers import host_probe

    host_probe.start_in_background()


def pytest_report_header(config):
    return f"smmd-scale random seed: SMMD_TEST_SEED={SESSION_SEED}"


def pytest_terminal_summary(terminalreporter):
    # -q (CI's command) hides the header: the seed is printed again at the end, so a failure in a CI
    # log can be replayed.
    terminalreporter.write_line(f"smmd-scale random seed: SMMD_TEST_SEED={SESSION_SEED}")
    from helpers import host_probe

    if host_probe.ready():  # (a short session does not wait for the background probe)
        reading = host_probe.reading()
        terminalreporter.write_line(f"smmd-scale host probe: {reading['cpu_seconds']} CPU-s, "
                                    f"{reading['wall_seconds']} s wall: hang guards x {host_probe.slowdown():.2f}")


@pytest.fixture(autouse=True)
def _seeded_global_generator(request):
    # Tests that draw a rank function's seed with torch.randint(...) use torch's global generator, which
    # otherwise differs from run to run: seeded here from the session seed and the test's id (mixed apart
    # from the generator fixture's), so SMMD_TEST_SEED reproduces those draws too.
    torch.manual_seed(SESSION_SEED ^ zlib.crc32(b"global " + request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _one_thread():
    # Tests run beside other processes on 2 cores; one intra-op thread keeps them predictable.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The accuracy tests run on every device here: the CPU, and a CUDA GPU when there is one (skipped
    otherwise); inputs are made on the CPU, moved, and compared on the CPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


@pytest.fixture
def reference_cases():
    return torch.load(FIXTURES)


def random_problem(generator, vocab_size=None, numeric_size=None, shape=None, numeric_share=0.4, ignore_share=0.15,
                   duplicate_values=False, dtype=torch.float64, scale=3.0):
    """Fresh random (vocab, logits, targets): targets mix numeric ids, other ids and ignore_index."""
    def draw(low, high):
        return int(torch.randint(low, high, (1, ), generator=generator))

    vocab_size = vocab_size or draw(20, 200)
    numeric_size = numeric_size or draw(2, min(vocab_size, 40))
    shape = shape or (draw(1, 4), draw(1, 12))
    token_ids = torch.randperm(vocab_size, generator=generator)[:numeric_size]
    if duplicate_values:
        values = torch.randint(0, max(numeric_size // 2, 2), (numeric_size, ), generator=generator).double()
        values[:2] = torch.tensor([0.0, 1.0])  # SMMD needs two distinct values
    else:
        values = torch.randperm(3 * numeric_size, generator=generator)[:numeric_size].double()
    logits = (torch.randn(*shape, vocab_size, generator=generator, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    numeric = torch.rand(shape, generator=generator) < numeric_share
    targets[numeric] = token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ), generator=generator)]
    targets[torch.rand(shape, generator=generator) < ignore_share] = -100
    vocab = NumericVocab(token_ids.tolist(), values.tolist(), vocab_size)
    return vocab, logits, targets


@pytest.fixture
def generator(request):
    """A generator seeded from the session seed and the test's id."""
    return torch.Generator().manual_seed(SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A Llama-3-style tokenizer (0..999 single tokens) saved as a Hugging Face directory."""
    from helpers.style_tokenizers import llama3_style

    directory = tmp_path_factory.mktemp("tokenizer")
    llama3_style().save_pretrained(directory)
    return directory


# Under pytest-xdist the suite runs with --dist loadfile: a test module's tests run on one worker, so a
# module-scoped fixture that trains (test_launch.py's ZeRO-3 run, test_deepspeed.py's layouts) trains
# once. (xdist 3.8's --dist loadgroup did not keep a group on one worker here.)
# The longest modules first (each a minute or more of a worker), so that under xdist no worker starts one
# of them while the others are nearly done: their order by CPU seconds and wall time in a fresh-clone CI
# run (SMMD_TEST_CPU_LOG, --durations) on 2 cores. xdist's loadfile scheduler would reorder the modules
# by their number of tests (its --loadscope-reorder default), which put the slowest modules, holding one
# or a few tests each, last: pytest_configure turns that off.
LONGEST_FIRST = ("tests/numeracy/test_tier_b.py", "tests/train/test_deepspeed.py", "tests/launch/test_demo.py",
                 "tests/numeracy/test_numeracy_study.py", "tests/launch/test_benchmarks.py",
                 "tests/launch/test_real_width.py", "tests/train/test_scaling.py",
                 "tests/launch/test_launch_parallel.py", "tests/launch/test_launch.py",
                 "tests/launch/test_gpu_smoke.py", "tests/launch/test_objective_layouts.py",
                 "tests/launch/test_faults.py", "tests/launch/test_resume_changes.py",
                 "tests/launch/test_launch_launchers.py", "tests/loss/test_ntloss_suite.py",
                 "tests/train/test_sequence_parallel.py", "tests/train/test_rank_zero_work.py",
                 "tests/train/test_shutdown.py")


# SMMD_TEST_CPU_LOG=<file>: each test's CPU seconds (the worker's own and its waited-for child processes',
# from getrusage) appended as JSON lines, phase by phase: where CI's CPU goes, independent of the load.
# Not counted: the gloo ranks of helpers.distributed, children of a fork server that outlives the test.
CPU_LOG = os.environ.get("SMMD_TEST_CPU_LOG")


def _cpu_seconds():
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        return (yield)
    before, began = _cpu_seconds(), time.time()
    result = yield
    after = _cpu_seconds()
    with open(CPU_LOG, "a") as log:  # with the wall-clock span and the worker: how busy the cores were when
        log.write(json.dumps({"test": item.nodeid, "self": round(after[0] - before[0], 2),
                              "children": round(after[1] - before[1], 2), "began": round(began, 2),
                              "ended": round(time.time(), 2),
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # A subprocess that ran past its limit failed a hang guard, not a speed target: say so, with the probe.
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(subprocess.TimeoutExpired):
        from helpers import host_probe

        report.sections.append(("hang guard", host_probe.describe()))
    return report


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist installed: keep LONGEST_FIRST's order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected
