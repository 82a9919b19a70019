"""What DeepSpeed will compile when the engine starts, checked in the plan, before any model exists.

On a GPU, DeepSpeed's optimizers are compiled extensions: ``AdamW`` is FusedAdam (CPUAdam when ZeRO
offloads the optimizer), built just in time at ``deepspeed.initialize`` unless DeepSpeed was
installed with prebuilt ops (``DS_BUILD_FUSED_ADAM=1 pip install deepspeed``, ``ds_report`` lists
them). A JIT build needs nvcc (``CUDA_HOME``) for CUDA ops and a C++ compiler, takes minutes, and
every rank of a node waits on one lock in ``TORCH_EXTENSIONS_DIR``; a build killed midway leaves
that lock behind and later jobs wait on it forever. Without nvcc the job would fail on every rank
after the model was built; here it is refused first, with the ways out: prebuilt ops, a CUDA
toolkit, or torch's own AdamW (``"torch_adam": true`` in the optimizer's params, no build at all).
On the CPU accelerator the process group's start builds DeepSpeed's shared-memory all-reduce op; a
lock another process holds on that build is named before the wait (:func:`comm_build_wait`).

    ops = ops_to_compile(ds_config, accelerator="cuda")       # [CompiledOp("fused_adam", ...)]
    notes, problems = check_ops(ops, BuildEnvironment.detect())
    line = comm_build_wait(get_accelerator())   # before the process group: a lock it would wait on
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TORCH_ADAM_HINT = ("or use torch's AdamW, which needs no build: \"torch_adam\": true in the DeepSpeed config's "
                   "optimizer params")


@dataclass(frozen=True)
class CompiledOp:
    name: str  # DeepSpeed's op name, as ds_report and installed_ops spell it
    needs_nvcc: bool  # a CUDA op (else C++ only)
    build_flag: str  # the variable that prebuilds it at pip install time
    why: str  # what in the config asks for it


@dataclass(frozen=True)
class BuildEnvironment:
    installed_ops: dict  # op name -> prebuilt in this DeepSpeed install
    nvcc: Optional[str]  # path, None when there is none
    cxx: Optional[str]  # C++ compiler path, None when there is none
    extensions_dir: Path  # where JIT builds go (TORCH_EXTENSIONS_DIR or torch's default)
    cuda_arch_list: Optional[str] = None  # TORCH_CUDA_ARCH_LIST, which a JIT build of a CUDA op reads

    @classmethod
    def detect(cls, environ=os.environ) -> "BuildEnvironment":
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import CUDA_HOME, get_default_build_root

        nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
        return cls(installed_ops=dict(installed_ops), nvcc=str(nvcc) if nvcc and nvcc.is_file() else None,
                   cxx=shutil.which(environ.get("CXX", "c++")),
                   extensions_dir=Path(environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()),
                   cuda_arch_list=environ.get("TORCH_CUDA_ARCH_LIST"))


def arch_entries_deepspeed_cannot_read(arch_list: Optional[str]) -> list:
    """The entries of a TORCH_CUDA_ARCH_LIST that DeepSpeed's JIT op builder cannot sort: it reads each
    entry (split on ';' and spaces) as dot-separated integers, each allowed a '+...' suffix
    (``OpBuilder.compute_capability_args``), so an architecture-specific entry such as "9.0a" (which
    CUDA images for Hopper set) fails with ``ValueError: invalid literal for int()`` on every rank, after
    the model is built (seen with DeepSpeed 0.19.8 on an H200 whose image set 9.0a)."""
    def readable(entry: str) -> bool:
        return all(part.split("+")[0].isdigit() for part in entry.split("."))

    return [entry for entry in (arch_list or "").replace(" ", ";").split(";") if entry.strip()
            and not readable(entry.strip())]


def _offload_device(zero: dict, key: str) -> str:
    return str((zero.get(key) or {}).get("device", "none")).lower()


def ops_to_compile(ds_config: dict, accelerator: str) -> list:
    """The DeepSpeed ops that ``deepspeed.initialize`` loads for the resolved ``ds_config`` on
    ``accelerator`` (DeepSpeed's device name). On the CPU accelerator the config uses torch's AdamW
    (``smmd_train.config.deepspeed.CPU_SETTINGS``)."""
    if accelerator == "cpu":
        return []
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    zero = ds_config.get("zero_optimization") or {}
    offloaded = _offload_device(zero, "offload_optimizer") in ("cpu", "nvme")
    ops = []
    if kind in ("adam", "adamw") and not params.get("torch_adam", False):
        ops.append(CompiledOp("cpu_adam", False, "DS_BUILD_CPU_ADAM",
                              f"optimizer {optimizer['type']} with zero_optimization.offload_optimizer (CPUAdam)")
                   if offloaded else
                   CompiledOp("fused_adam", True, "DS_BUILD_FUSED_ADAM", f"optimizer {optimizer['type']} (FusedAdam)"))
    elif kind == "lamb":
        ops.append(CompiledOp("fused_lamb", True, "DS_BUILD_FUSED_LAMB", "optimizer Lamb (FusedLamb)"))
    elif kind == "lion":
        ops.append(CompiledOp("cpu_lion", False, "DS_BUILD_CPU_LION", "optimizer Lion with offload (CPULion)")
                   if offloaded else
                   CompiledOp("fused_lion", True, "DS_BUILD_FUSED_LION", "optimizer Lion (FusedLion)"))
    if "nvme" in (_offload_device(zero, "offload_optimizer"), _offload_device(zero, "offload_param")):
        ops.append(CompiledOp("async_io", False, "DS_BUILD_AIO", "ZeRO offload to NVMe (needs libaio-dev too)"))
    return ops


def _build_locks(extensions_dir: Path, op_name: str) -> list:
    """Lock files of ``op_name`` builds: torch puts them in ``<dir>/<op>/`` under TORCH_EXTENSIONS_DIR,
    in ``<dir>/py<version>_cu<version>/<op>/`` under its default root."""
    return sorted({*extensions_dir.glob(f"{op_name}/lock"), *extensions_dir.glob(f"*/{op_name}/lock")})


def check_ops(ops: list, environment: BuildEnvironment) -> tuple:
    """(notes, problems) for ``ops`` in ``environment``: a note for each op that will be compiled at
    start-up (and for a lock an earlier build left), a problem for each that cannot be compiled."""
    notes, problems = [], []
    for op in ops:
        if environment.installed_ops.get(op.name):
            continue
        tool = environment.nvcc if op.needs_nvcc else environment.cxx
        if tool is None:
            missing = ("nvcc (no CUDA toolkit found: set CUDA_HOME)" if op.needs_nvcc else
                       "a C++ compiler (none on PATH: set CXX)")
            problems.append(f"{op.why} is compiled at start-up because this DeepSpeed install has no prebuilt "
                            f"{op.name}, and that needs {missing}; install DeepSpeed with {op.build_flag}=1, or "
                            f"make the compiler available on every node, {TORCH_ADAM_HINT}")
            continue
        unreadable = arch_entries_deepspeed_cannot_read(environment.cuda_arch_list) if op.needs_nvcc else []
        if unreadable:
            plain = ";".join(dict.fromkeys(entry.rstrip("abcdefghijklmnopqrstuvwxyz").split("+")[0]
                                           for entry in environment.cuda_arch_list.replace(" ", ";").split(";")
                                           if entry.strip()))
            problems.append(f"{op.why} is compiled at start-up, and DeepSpeed's op builder cannot read "
                            f"TORCH_CUDA_ARCH_LIST={environment.cuda_arch_list} (entries {', '.join(unreadable)}: it "
                            f"reads each as numbers, and every rank would stop with 'invalid literal for int()' after "
                            f"the model is built); set TORCH_CUDA_ARCH_LIST={plain} for the job, install DeepSpeed "
                            f"with {op.build_flag}=1, {TORCH_ADAM_HINT}")
            continue
        notes.append(f"DeepSpeed compiles {op.name} for {op.why} at start-up with {tool} into "
                     f"{environment.extensions_dir} (minutes, once per node and environment; the ranks of a node "
                     f"wait on one lock): prebuild it with {op.build_flag}=1 pip install deepspeed, {TORCH_ADAM_HINT}")
        notes += [f"{lock} exists: if no build is running, delete it, or every rank waits on it forever "
                  "('Waiting for lock')" for lock in _build_locks(environment.extensions_dir, op.name)]
    return notes, problems


def comm_build_wait(accelerator) -> Optional[str]:
    """The line to print before DeepSpeed starts its process group, when that start will wait on a build
    lock, else None. On the CPU accelerator DeepSpeed builds its shared-memory all-reduce op just in
    time as the group starts (``deepspeed.comm.torch.build_shm_op``), and where another process holds
    the op's build lock, torch waits for it without a word (``torch.utils.file_baton.FileBaton.wait``):
    minutes while another environment or job builds into the same ``TORCH_EXTENSIONS_DIR``, forever
    when a killed build left the lock behind."""
    import deepspeed.ops

    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    environment = BuildEnvironment.detect()
    if (builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME)
            or environment.installed_ops.get(builder.NAME)):
        return None  # no build: no communication op here, or it cannot be built, or it is prebuilt
    # The op's build directory as torch chooses it: TORCH_EXTENSIONS_DIR/<op>, or under the default root
    # <root>/py<version>_<device>/<op>.
    locks = _build_locks(environment.extensions_dir, builder.NAME)
    if not locks:
        return None
    lock = locks[0]
    return (f"waiting for the build lock {lock} (another process is building DeepSpeed's {builder.NAME} op; if "
            "none is, a killed build left it: delete it)")
