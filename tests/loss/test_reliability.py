"""Reliability of the loss on real gloo groups: every bad input raises the same error on every
tensor-parallel rank (never a hang), and the group stays usable after it. Also static safety rules
of the code base. Launch-level faults (lost ranks, crashes mid-save, NaN steps) are test_faults.py's."""

import re
import time

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks, values_or_raise
from helpers.launching import REPO

from smmd_scale import NumericVocab, SMMDLoss, numeric_cross_entropy

# ------------------------------------------------------------------------------------------------
# The loss-level catalogue, on 2 and 4 gloo ranks: (scenario, rank that gets the bad input or "all")
# -> the error every rank must raise.
# ------------------------------------------------------------------------------------------------

PG_TIMEOUT_SECONDS = 30
CATALOGUE = {
    "target_out_of_range": (1, "ValueError", r"rank 1 of the group: targets\[4\] = \d+ is outside the vocabulary"),
    "negative_target": ("last", "ValueError", r"targets\[2\] = -5 is outside"),
    "targets_differ_across_ranks": (0, "ValueError", "targets differ across the tensor-parallel ranks"),
    "float_targets": (1, "TypeError", "rank 1 of the group: targets have dtype torch.float32"),
    "bool_targets": (0, "TypeError", "targets have dtype torch.bool"),
    "integer_logits": (1, "TypeError", "rank 1 of the group: logits have dtype torch.int64"),
    "targets_shape": (0, "ValueError", "rank 0 of the group: targets hold 11 positions"),
    "targets_rank_shape_all": ("all", "ValueError", "targets hold 12 positions in 2 dims but logits .* 1 dims"),
    "shards_overlap": (1, "ValueError", "do not tile the vocabulary"),
    "shards_leave_a_gap": ("last", "ValueError", "do not tile the vocabulary"),
    "shard_beyond_vocabulary": ("last", "ValueError", r"shard covers vocabulary ids \[\d+, \d+\) which is not inside"),
    "different_vocabulary": (1, "ValueError", "hold different numeric vocabularies or numeric-loss options"),
    "different_options": (0, "ValueError", "hold different numeric vocabularies or numeric-loss options"),
    "negative_weight": (1, "ValueError", "weight=-0.5 must be a finite number >= 0"),
    "nan_weight": (0, "ValueError", "weight=nan must be"),
    "negative_num_items": (1, "ValueError", "num_items_in_batch=-3 must be >= 0"),
    "negative_num_numeric": ("last", "ValueError", "num_numeric_in_batch=-2 must be >= 0"),
    "empty_vocabulary": ("all", "ValueError", "empty numeric vocabulary"),
    "one_value_vocabulary": ("all", "ValueError", "needs at least two distinct"),
    # (a Refusal is the ValueError that carries the refused option as data: smmd_scale.refusal)
    "bad_sigmas": ("all", "Refusal", "sigmas=.* must be a non-empty sequence of finite positive numbers"),
}


def _one_scenario(rank, world_size, scenario):
    where, _, _ = CATALOGUE[scenario]
    bad = where == "all" or where == rank or (where == "last" and rank == world_size - 1)
    vocab_size, tokens = 30 * world_size, 12
    width = vocab_size // world_size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab_size, generator=generator)
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::3] = 5
    start, end = rank * width, (rank + 1) * width
    weight, num_items, num_numeric = 1.0, None, None
    began = time.monotonic()
    try:
        ids, values, options = [1, 5, width + 2, vocab_size - 1], [1.0, 5.0, 9.0, 2.0], {}
        if bad and scenario == "different_vocabulary":
            ids, values = [1, 5], [1.0, 5.0]
        if bad and scenario == "different_options":
            options = {"sigmas": (1.0, )}
        if bad and scenario == "empty_vocabulary":
            ids, values = [], []
        if bad and scenario == "one_value_vocabulary":
            values = [3.0] * 4
        if bad and scenario == "bad_sigmas":
            options = {"sigmas": (-1.0, )}
        smmd = SMMDLoss(NumericVocab(ids, values, vocab_size), **options)
        if bad:
            if scenario == "target_out_of_range":
                targets[4] = vocab_size + 7
            elif scenario == "negative_target":
                targets[2] = -5
            elif scenario == "targets_differ_across_ranks":
                targets[7] = (targets[7] + 1) % vocab_size
            elif scenario == "float_targets":
                targets = targets.float()
            elif scenario == "bool_targets":
                targets = targets > 3
            elif scenario == "integer_logits":
                logits = logits.long()
            elif scenario == "targets_shape":
                targets = targets[:-1]
            elif scenario == "targets_rank_shape_all":
                targets = targets.reshape(3, 4)
            elif scenario == "shards_overlap":
                start -= 1
            elif scenario == "shards_leave_a_gap":
                start += 1
            elif scenario == "shard_beyond_vocabulary":
                start, end = start + 2, end + 2
            elif scenario == "negative_weight":
                weight = -0.5
            elif scenario == "nan_weight":
                weight = float("nan")
            elif scenario == "negative_num_items":
                num_items = -3
            elif scenario == "negative_num_numeric":
                num_numeric = -2
        shard = logits[:, start:min(end, vocab_size)] if scenario != "shard_beyond_vocabulary" or not bad else \
            torch.cat([logits[:, start:vocab_size], logits[:, :2]], dim=1)
        numeric_cross_entropy(shard, targets, smmd, weight=weight, tp_group=dist.group.WORLD, vocab_start_index=start,
                              num_items_in_batch=num_items, num_numeric_in_batch=num_numeric)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error), time.monotonic() - began
    return "no error", "", time.monotonic() - began


def _catalogue(rank, world_size):
    outcomes = {}
    for scenario in CATALOGUE:
        outcomes[scenario] = _one_scenario(rank, world_size, scenario)
        # A healthy call after each failure: the group is still usable, nothing is left half-done.
        vocab = NumericVocab([1, 5], [1.0, 5.0], 10 * world_size)
        logits = torch.randn(6, 10 * world_size)
        out = numeric_cross_entropy(logits[:, rank * 10:(rank + 1) * 10], torch.tensor([1, 5, 7, 9, -100, 3]),
                                 SMMDLoss(vocab), tp_group=dist.group.WORLD, vocab_start_index=rank * 10)
        assert torch.isfinite(out.total)
    return outcomes


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_bad_input_raises_the_same_error_on_every_rank(world_size):
    assert len(CATALOGUE) >= 15
    results = values_or_raise(run_ranks(_catalogue, world_size, timeout=180, pg_timeout=PG_TIMEOUT_SECONDS))
    for scenario, (_, error_type, pattern) in CATALOGUE.items():
        seen = [result[scenario] for result in results]
        assert all(kind == error_type for kind, _, _ in seen), (scenario, seen)
        assert len({message for _, message, _ in seen}) == 1, (scenario, seen)  # the same error everywhere
        assert re.search(pattern, seen[0][1]), (scenario, seen[0][1])
        # Raised by the checks before any collective, not by a collective that timed out waiting for a peer.
        assert max(seconds for _, _, seconds in seen) < PG_TIMEOUT_SECONDS / 2, (scenario, seen)


# ------------------------------------------------------------------------------------------------
# Safety
# ------------------------------------------------------------------------------------------------


def _calls(text: str, name: str) -> list:
    """The full text of every ``name(...)`` call in ``text`` (balanced parentheses)."""
    found = []
    for match in re.finditer(re.escape(name) + r"\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        found.append(text[match.start():end + 1])
    return found


def test_no_shell_no_remote_code_no_pickles_from_elsewhere():
    sources = {path: path.read_text() for folder in ("plugin", "launch", "benchmarks")
               for path in (REPO / folder).rglob("*.py")}
    for path, text in sources.items():
        assert "shell=True" not in text, path
        assert "trust_remote_code=True" not in text, path  # only ever the user's --trust_remote_code flag
        for call in _calls(text, "torch.load"):
            # The one exception: DeepSpeed's own (pickled) shard files of the run's checkpoint, read for
            # the universal conversion as DeepSpeed's loader reads them, in one named function.
            if path.name == "universal.py" and call == 'torch.load(path, map_location="cpu", weights_only=False)':
                assert text.count("weights_only=False") == 1 and "def load_deepspeed_shard(path: Path):" in text
                continue
            assert "weights_only=True" in call, (path, call)
    train = sources[REPO / "plugin" / "smmd_train" / "train.py"]
    arguments = sources[REPO / "plugin" / "smmd_train" / "config" / "arguments.py"]
    assert '"--trust_remote_code", action="store_true"' in arguments
    # the flag reaches the typed run configuration, and from there every from_pretrained of the plan and run
    assert 'trust_remote_code: bool = setting("--trust_remote_code")' in sources[
        REPO / "plugin" / "smmd_train" / "config" / "run_config.py"]
    assert "trust_remote_code=inputs.trust_remote_code" in sources[REPO / "plugin" / "smmd_train" / "plan.py"]
    assert "trust_remote_code=inputs.trust_remote_code" in sources[REPO / "plugin" / "smmd_train" / "run.py"]
    # Checkpoints are only ever loaded from the run's own --output_dir (the Checkpointer's directory).
    assert re.findall(r"Checkpointer\(run\.engine, ([^,]+),", train) == ["output_dir"]
    assert "output_dir = checkpointing.output_dir" in train
    saving = sources[REPO / "plugin" / "smmd_train" / "checkpoint" / "saving.py"]
    assert re.findall(r"[^_]load\(self\.engine, ([^,]+),", saving) == ["self.output_dir"]
