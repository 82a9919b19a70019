"""Work that rank 0 does alone (packing the corpus into the cache, writing an export) while the other
ranks wait, on real gloo ranks whose process group times out after 2 seconds: the work may take
longer than that, and an error of any type on rank 0 reaches the other rank at once."""

import time
import zipfile
from pathlib import Path

import pytest
from helpers.distributed import run_ranks, values_or_raise

from smmd_train.distributed.groups import rank_zero_first

pytestmark = pytest.mark.gloo

PG_TIMEOUT_SECONDS = 2


class ShardIndexError(Exception):
    """A project-specific error type (not one of the builtins)."""


class NeedsTwoArguments(Exception):
    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")


def _slow_build(rank, world_size, cache: str):
    import torch.distributed as dist

    def build():
        path = Path(cache)
        if rank == 0:
            time.sleep(3 * PG_TIMEOUT_SECONDS)  # longer than the process group's timeout
            path.write_text("packed")
        return path.read_text()

    built = rank_zero_first(build)
    dist.barrier()  # the default group is still usable afterwards
    return built


@pytest.mark.slow  # starts processes: the fast loop keeps one test of this kind
def test_rank_zero_work_longer_than_the_process_group_timeout_completes(tmp_path):
    results = values_or_raise(run_ranks(_slow_build, 2, str(tmp_path / "cache"), timeout=120,
                                        pg_timeout=PG_TIMEOUT_SECONDS, fresh=True))
    assert results == ["packed", "packed"]


def _failing_build(rank, world_size, kind: str):
    class DefinedInAFunction(Exception):
        pass

    errors = {"project": ShardIndexError("shard 7 has no index"), "library": zipfile.BadZipFile("truncated corpus"),
              "constructor": NeedsTwoArguments("/data/a.jsonl", "bad line 3"),
              "local": DefinedInAFunction("unpicklable type")}

    def build():
        if rank == 0:
            time.sleep(0.5)
            raise errors[kind]
        return "built"

    began = time.monotonic()
    try:
        rank_zero_first(build)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - began
    return None


@pytest.mark.slow  # starts processes: the fast loop keeps one test of this kind
@pytest.mark.parametrize("kind, name, message", [
    ("project", "ShardIndexError", "on rank 0: shard 7 has no index"),
    ("library", "BadZipFile", "on rank 0: truncated corpus"),
    ("constructor", "RuntimeError", "on rank 0: NeedsTwoArguments: /data/a.jsonl: bad line 3"),
    ("local", "RuntimeError", "on rank 0: _failing_build.<locals>.DefinedInAFunction: unpicklable type"),
])
def test_a_rank_zero_error_of_any_type_reaches_the_other_rank_within_seconds(kind, name, message):
    outcomes = run_ranks(_failing_build, 2, kind, timeout=120, pg_timeout=60, fresh=True)
    assert all(outcome.ok for outcome in outcomes), outcomes
    (rank0_name, _, _), (rank1_name, rank1_message, waited_seconds) = [outcome.value for outcome in outcomes]
    assert rank0_name == type_name_on_rank_zero(kind)
    assert (rank1_name, rank1_message) == (name, message)
    assert waited_seconds < 30  # told by rank 0, not by the process group's 60 s timeout


def type_name_on_rank_zero(kind: str) -> str:
    return {"project": "ShardIndexError", "library": "BadZipFile", "constructor": "NeedsTwoArguments",
            "local": "DefinedInAFunction"}[kind]


def _prepare_on_broken_data(rank, world_size, tokenizer_dir: str, data: str, output_dir: str):
    from helpers.launching import REPO, train_flags

    from smmd_train.config.arguments import parse_args
    from smmd_train.config.run_config import RunConfig
    from smmd_train.distributed.groups import Launch
    from smmd_train.run import RunRefused, prepare_run

    config = RunConfig.from_args(parse_args(train_flags(
        deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny", tokenizer=tokenizer_dir, data=[data],
        seq_len=48, max_steps=2, output_dir=output_dir)))
    try:
        prepare_run(config, Launch(rank, world_size, rank, world_size, "test"), until="data")
    except RunRefused as error:
        return str(error)
    return None


def test_a_broken_jsonl_line_is_the_same_one_line_refusal_on_every_rank(tmp_path, tokenizer_dir):
    import json

    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"{index} + {index} = {2 * index}"}) for index in range(40)]
    lines[20] = '{"text": "21 + 21 = '
    data.write_text("\n".join(lines) + "\n")
    outcomes = run_ranks(_prepare_on_broken_data, 2, str(tokenizer_dir), str(data), str(tmp_path / "run"),
                         timeout=180, pg_timeout=60, fresh=True)
    messages = values_or_raise(outcomes)
    assert messages[0] == f"{data}:21:10: not valid JSON: Unterminated string starting at; each line of a " \
                          "JSON-lines file must be one JSON object"
    assert messages[1] == f"on rank 0: {messages[0]}"
