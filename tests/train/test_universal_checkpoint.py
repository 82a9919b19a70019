"""The pure pieces of a resume under another layout (smmd_train.checkpoint.universal): the re-split of a ZeRO-3
sub-group partitioned over the whole world into the data-parallel partitions ds_to_universal reads,
the {"param": tensor} form of a universal checkpoint's states, and the refusals of the conversion and
its command line. test_launch.py resumes real checkpoints under another --tp and world size."""

import math

import pytest
import torch

from smmd_train.checkpoint import saving as checkpoint
from smmd_train.checkpoint import universal
from smmd_train.checkpoint.commits import COMMIT_FILE
from smmd_train.checkpoint.universal import UNIVERSAL_DIR, convert_to_universal, repartition_over_dp


def zero3_partitions(parameters: list, ranks: int) -> list:
    """How ZeRO-3 lays a sub-group out over ``ranks``: each parameter flattened, zero-padded to a
    multiple of ``ranks``, rank r's ceil(n / ranks) elements of every parameter in turn."""
    flats = [[] for _ in range(ranks)]
    for parameter in parameters:
        part = math.ceil(parameter.numel() / ranks)
        padded = torch.cat([parameter.reshape(-1), parameter.new_zeros(part * ranks - parameter.numel())])
        for rank in range(ranks):
            flats[rank].append(padded[rank * part:(rank + 1) * part])
    return [torch.cat(flat) for flat in flats]


def parameters_of(partitions: list, shapes: list) -> list:
    """The whole parameters back from data-parallel partitions (the reference's inverse)."""
    ranks, whole, offset = len(partitions), [], 0
    for shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / ranks)
        whole.append(torch.cat([flat[offset:offset + part] for flat in partitions])[:numel].reshape(shape))
        offset += part
    return whole


@pytest.mark.parametrize("tp_size, dp_size", [(2, 1), (2, 2), (4, 3), (1, 3)])
def test_a_world_partitioned_group_is_re_split_over_the_data_parallel_ranks(tp_size, dp_size):
    generator = torch.Generator().manual_seed(tp_size * 10 + dp_size)
    shapes = [(int(torch.randint(1, 40, (), generator=generator)),) for _ in range(5)] + [(3, 7), (1,)]
    parameters = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    world = zero3_partitions(parameters, tp_size * dp_size)
    split = repartition_over_dp(world, [math.prod(shape) for shape in shapes], tp_size, dp_size)
    # Exactly ZeRO-3's layout over dp_size ranks, and the parameters come back whole and bit-equal.
    expected = zero3_partitions(parameters, dp_size)
    assert len(split) == dp_size and all(torch.equal(got, want) for got, want in zip(split, expected))
    assert all(torch.equal(got, want) for got, want in zip(parameters_of(split, shapes), parameters))
    assert all(flat.dtype == torch.float64 for flat in split)
    with pytest.raises(ValueError, match=f"{tp_size * dp_size - 1} partitions for {tp_size} x {dp_size} ranks"):
        repartition_over_dp(world[:-1], [math.prod(shape) for shape in shapes], tp_size, dp_size)


def test_a_bare_universal_state_is_wrapped_for_the_autotp_loader():
    tensor = torch.randn(6)
    wrapped = universal.wrapped_universal_state(tensor)
    assert list(wrapped) == ["param"] and wrapped["param"] is tensor
    already = {"param": tensor, "cat_dim": 0}
    assert universal.wrapped_universal_state(already) is already


def test_only_a_committed_zero3_checkpoint_converts_and_a_failure_leaves_no_conversion(tmp_path):
    tag = tmp_path / "step00000004"
    tag.mkdir()
    with pytest.raises(FileNotFoundError, match="is not a committed checkpoint"):
        convert_to_universal(str(tmp_path), tag.name)
    (tag / COMMIT_FILE).write_text('{"step": 4, "world_size": 2}')
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")  # a ZeRO-1/2 checkpoint's model file
    with pytest.raises(ValueError, match="no complete set of ZeRO-3 model and optimizer state files.*only ZeRO-3"):
        convert_to_universal(str(tmp_path), tag.name)
    assert sorted(path.name for path in tag.iterdir()) == [COMMIT_FILE, "mp_rank_00_model_states.pt"]
    assert not (tag / UNIVERSAL_DIR).exists()


def test_the_command_line_names_what_it_cannot_convert(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        checkpoint.main(["convert", str(tmp_path)])
    assert exited.value.code == 1 and f"no committed checkpoint in {tmp_path}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        checkpoint.main(["convert", str(tmp_path), "step00000002"])
    assert exited.value.code == 1 and "is not a committed checkpoint" in capsys.readouterr().err


def _load_a_checkpoint_that_cannot_convert(rank, world_size, output_dir):
    import torch.distributed as dist

    try:
        universal.load_universal(None, output_dir, "step00000004")  # fails before the engine is used
    except ValueError as error:
        message = f"{type(error).__name__}: {error}"
    dist.barrier()  # the default group is still usable
    return message


@pytest.mark.gloo
def test_a_failed_conversion_raises_the_same_error_on_every_rank(tmp_path):
    from helpers.distributed import run_ranks, values_or_raise

    tag = tmp_path / "step00000004"
    tag.mkdir()
    (tag / COMMIT_FILE).write_text('{"step": 4, "world_size": 4, "tp_size": 2, "zero_stage": 3}')
    rank0, rank1 = values_or_raise(run_ranks(_load_a_checkpoint_that_cannot_convert, 2, str(tmp_path), fresh=True))
    assert rank0.startswith("ValueError: ") and "no complete set of ZeRO-3 model and optimizer state files" in rank0
    assert rank1 == rank0.replace("ValueError: ", "ValueError: on rank 0: ", 1)
    assert not (tag / UNIVERSAL_DIR).exists()
