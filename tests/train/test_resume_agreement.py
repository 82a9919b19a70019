"""The resume checkpoint is rank 0's choice on every rank, on real gloo ranks that each look at their
own directory (as ranks on nodes with a node-local --output_dir do): they start at the same step, or
all refuse with the same message."""

import json
from pathlib import Path

import pytest
from helpers.distributed import run_ranks, values_or_raise

from smmd_train.checkpoint.commits import COMMIT_FILE, LATEST_FILE, agreed_resume_tag
from smmd_train.checkpoint.saving import tag_for_step

pytestmark = pytest.mark.gloo


def commit(directory: Path, *steps: int, latest=None) -> None:
    for step in steps:
        (directory / tag_for_step(step)).mkdir(parents=True)
        (directory / tag_for_step(step) / COMMIT_FILE).write_text(json.dumps({"step": step, "world_size": 2}))
    if latest is not None:
        (directory / LATEST_FILE).write_text(tag_for_step(latest))


def _resume_tag(rank, world_size, directories):
    try:
        return "resumes", agreed_resume_tag(directories[rank])
    except ValueError as error:  # each rank names its own directory (on a cluster: the same path)
        return "refused", str(error).replace(directories[rank], "OUTPUT_DIR")


def outcomes(tmp_path, rank0_steps, rank1_steps, rank1_latest=None):
    directories = [tmp_path / "node0", tmp_path / "node1"]
    for directory, steps, latest in zip(directories, (rank0_steps, rank1_steps), (None, rank1_latest)):
        directory.mkdir()
        commit(directory, *steps, latest=latest)
    return values_or_raise(run_ranks(_resume_tag, 2, [str(directory) for directory in directories], fresh=True))


def test_ranks_that_see_the_same_checkpoints_resume_from_one_tag(tmp_path):
    # rank 1's `latest` is stale (a network filesystem's cache), yet it sees rank 0's newer commit
    assert outcomes(tmp_path, (2, 4), (2, 4), rank1_latest=2) == [("resumes", "step00000004")] * 2


@pytest.mark.slow  # starts processes: the fast loop keeps one test of this kind
@pytest.mark.parametrize("rank0_steps, rank1_steps, view", [
    ((2, 4), (), "rank 0 resumes from step00000004 but rank 1 sees none"),
    ((2, ), (2, 4), "rank 0 resumes from step00000002 but rank 1 sees step00000004"),
    ((), (4, ), "rank 0 resumes from none (step 0) but rank 1 sees step00000004"),
], ids=["rank1-sees-none", "rank1-sees-another", "rank0-sees-none"])
def test_ranks_that_see_different_checkpoints_all_refuse_with_one_message(tmp_path, rank0_steps, rank1_steps,
                                                                        view):
    (verdict0, message0), (verdict1, message1) = outcomes(tmp_path, rank0_steps, rank1_steps)
    assert verdict0 == verdict1 == "refused" and message0 == message1
    assert view in message0 and "filesystem every node shares" in message0
