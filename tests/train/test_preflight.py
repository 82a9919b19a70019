"""The plan says which DeepSpeed ops a GPU run compiles at start-up and refuses the run, before any
model exists, when one cannot be compiled: no prebuilt op and no nvcc (or C++ compiler). The build
environment is described, not detected, so every case runs here on CPU."""

import json
from pathlib import Path

import pytest
from helpers.launching import REPO, train_flags

from smmd_train.config.arguments import parse_args
from smmd_train.config.deepspeed import load_config, resolve_config
from smmd_train.config.run_config import RunConfig
from smmd_train.distributed.preflight import BuildEnvironment, check_ops, ops_to_compile
from smmd_train.plan import plan_run

NOTHING_PREBUILT = {"fused_adam": False, "cpu_adam": False, "async_io": False}


def resolved(name: str, accelerator: str = "cuda", **optimizer_params) -> dict:
    config = load_config(str(REPO / "ds_configs" / name))
    config["optimizer"]["params"].update(optimizer_params)
    return resolve_config(config, world_size=8, micro_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-4,
                          weight_decay=0.0, bf16_supported=True, hidden_size=64, accelerator=accelerator)[0]


def environment(tmp_path, nvcc=None, cxx="/usr/bin/c++", **prebuilt) -> BuildEnvironment:
    return BuildEnvironment(installed_ops={**NOTHING_PREBUILT, **prebuilt}, nvcc=nvcc, cxx=cxx,
                            extensions_dir=Path(tmp_path, "torch_extensions"))


def test_the_ops_each_config_compiles():
    assert [op.name for op in ops_to_compile(resolved("zero3.json"), "cuda")] == ["fused_adam"]
    assert [op.name for op in ops_to_compile(resolved("zero3_offload.json"), "cuda")] == ["cpu_adam"]
    assert ops_to_compile(resolved("zero3.json", torch_adam=True), "cuda") == []
    assert ops_to_compile(resolved("zero3.json", accelerator="cpu"), "cpu") == []  # torch's AdamW on the CPU
    nvme = resolved("zero3.json")
    nvme["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme"}
    assert [op.name for op in ops_to_compile(nvme, "cuda")] == ["fused_adam", "async_io"]


def test_no_nvcc_and_no_prebuilt_op_is_a_problem_that_names_the_ways_out(tmp_path):
    notes, problems = check_ops(ops_to_compile(resolved("zero3.json"), "cuda"), environment(tmp_path))
    assert notes == [] and len(problems) == 1
    assert "optimizer AdamW (FusedAdam) is compiled at start-up" in problems[0]
    assert "needs nvcc (no CUDA toolkit found: set CUDA_HOME)" in problems[0]
    assert "DS_BUILD_FUSED_ADAM=1" in problems[0] and '"torch_adam": true' in problems[0]
    _, problems = check_ops(ops_to_compile(resolved("zero3_offload.json"), "cuda"), environment(tmp_path, cxx=None))
    assert "needs a C++ compiler" in problems[0] and "DS_BUILD_CPU_ADAM=1" in problems[0]


def test_a_prebuilt_op_needs_nothing_and_a_jit_build_is_announced(tmp_path):
    ops = ops_to_compile(resolved("zero3.json"), "cuda")
    assert check_ops(ops, environment(tmp_path, fused_adam=True)) == ([], [])
    notes, problems = check_ops(ops, environment(tmp_path, nvcc="/usr/local/cuda/bin/nvcc"))
    assert problems == [] and len(notes) == 1
    assert "DeepSpeed compiles fused_adam" in notes[0] and "/usr/local/cuda/bin/nvcc" in notes[0]


@pytest.mark.parametrize("layout", ["fused_adam/lock", "py311_cu121/fused_adam/lock"])
def test_a_lock_left_by_an_earlier_build_is_named(tmp_path, layout):
    lock = tmp_path / "torch_extensions" / layout
    lock.parent.mkdir(parents=True)
    lock.touch()
    notes, _ = check_ops(ops_to_compile(resolved("zero3.json"), "cuda"), environment(tmp_path, nvcc="/cuda/nvcc"))
    assert notes[1] == f"{lock} exists: if no build is running, delete it, or every rank waits on it forever " \
                       "('Waiting for lock')"


def test_the_plan_refuses_a_gpu_run_that_cannot_build_its_optimizer(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(BuildEnvironment, "detect", classmethod(lambda cls: environment(tmp_path)))
    flags = dict(model="tiny", tokenizer=tokenizer_dir, data=["unused.jsonl"], max_steps=2, output_dir=tmp_path)
    with pytest.raises(ValueError, match="needs nvcc"):
        plan_run(RunConfig.from_args(parse_args(train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json",
                                                             **flags))), 8, "cuda", True)
    torch_adam = load_config(str(REPO / "ds_configs" / "zero3.json"))
    torch_adam["optimizer"]["params"]["torch_adam"] = True
    (tmp_path / "torch_adam.json").write_text(json.dumps(torch_adam))
    config = RunConfig.from_args(parse_args(train_flags(deepspeed_config=tmp_path / "torch_adam.json", **flags)))
    plan = plan_run(config, 8, "cuda", True)
    assert plan.ds_config["optimizer"]["params"]["torch_adam"] is True


@pytest.mark.parametrize("arch_list", ["9.0a", "8.0;9.0a", "9.0 10.0f", "9.0", "8.6+PTX", "7.5;8.0 9.0", None])
def test_an_arch_list_deepspeeds_builder_cannot_read_is_refused_as_deepspeed_would_fail(tmp_path, monkeypatch,
                                                                                         arch_list):
    """Our reading of TORCH_CUDA_ARCH_LIST agrees with DeepSpeed's own JIT builder: the same list makes
    ``compute_capability_args`` raise exactly when the plan refuses the run (an H200 image set "9.0a"
    and every train.py run there died after the model was built)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list) if arch_list else monkeypatch.delenv(
        "TORCH_CUDA_ARCH_LIST", raising=False)
    import os

    detected = BuildEnvironment.detect(os.environ)  # before DeepSpeed's builder, which rewrites the variable
    assert detected.cuda_arch_list == arch_list
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder._jit_arch_list = None
    try:
        builder.compute_capability_args()
        deepspeed_fails = False
    except ValueError:
        deepspeed_fails = True
    except RuntimeError as error:  # no list and no GPU here: DeepSpeed asks for a list; we have nothing to say
        assert arch_list is None and "TORCH_CUDA_ARCH_LIST" in str(error)
        deepspeed_fails = False
    ops = ops_to_compile(resolved("zero3.json"), "cuda")
    notes, problems = check_ops(ops, BuildEnvironment(NOTHING_PREBUILT, "/cuda/bin/nvcc", "/usr/bin/c++",
                                                      Path(tmp_path), detected.cuda_arch_list))
    assert bool(problems) == deepspeed_fails, (problems, notes)
    if deepspeed_fails:
        assert f"cannot read TORCH_CUDA_ARCH_LIST={arch_list}" in problems[0]
        fixed = problems[0].split("set TORCH_CUDA_ARCH_LIST=")[1].split(" ")[0]
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", fixed)
        builder.compute_capability_args()  # the list the refusal suggests is one DeepSpeed reads
    # a prebuilt op reads no list
    assert check_ops(ops, BuildEnvironment({**NOTHING_PREBUILT, "fused_adam": True}, None, None, Path(tmp_path),
                                           arch_list)) == ([], [])
