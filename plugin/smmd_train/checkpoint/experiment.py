"""What a checkpoint was trained on, so that a resume cannot silently change the experiment.

Every commit marker records the run's *objective* (what the loss computes) and its *data* (what
the packed training blocks are); a resumed run compares the checkpoint's record with its own
before any model is built (``smmd_train.run.prepare_run``) and refuses each difference in one line
(``old -> new``) unless ``--allow_objective_change`` says to continue with this run's, which the
log then names.

    record = experiment_record(config.model_data, plan.loss, plan.numeric_vocab, blocks)  # {"objective", "data"}
    experiment_changes(committed, record)   # ["--numeric_loss smmd:1 ntl-was:0.3 -> ntl-mse:0.5", ...]

The objective: ``--framework_loss``; otherwise ``--numeric_loss`` (names and weights),
``--numeric_policy`` and ``--numeric_max_value`` (the latter where the policy reads it), the numeric
vocabulary itself (its size and a hash of its ids and values: another tokenizer changes it too), the
options of the losses in use (``smmd_train.components.loss_reporter.LOSS_FLAGS``; the loss reporter
writes this part of the record), and CE's ``--z_loss`` and ``--label_smoothing``. ``--fused_linear`` is
not part of it: the fused head computes the same loss without the logits.

The data: the packed blocks (their number and length, and a hash of evenly spaced blocks), and, to
name the cause, ``--data``, ``--text_field``, ``--seq_len`` and the tokenizer. Only a change of the
blocks is a change: a corpus read from another path (or a tokenizer from another directory) that
packs into the same blocks resumes. The data order is another matter: it is a shuffle of the
blocks by ``--seed``, so another number of blocks or another seed cannot continue it at all
(:func:`data_order_problems`, refused even with ``--allow_objective_change``).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

ALLOW_FLAG = "--allow_objective_change"

FINGERPRINT_BLOCKS = 64  # blocks hashed for the data's fingerprint, evenly spaced over the corpus


def blocks_fingerprint(blocks) -> str:
    """``"<count> blocks x <seq_len> tokens, sha256 <12 hex>"`` of packed blocks (a dataset with an
    ``input_ids`` column, ``smmd_train.data.packing.tokenize_and_pack``): the hash covers
    :data:`FINGERPRINT_BLOCKS` evenly spaced blocks (the first and the last among them), which any
    other corpus, tokenizer, text field or length changes; reading them costs milliseconds for any
    corpus size."""
    count = len(blocks)
    rows = sorted({int(row) for row in np.linspace(0, count - 1, min(count, FINGERPRINT_BLOCKS))})
    # Prompt/completion rows carry their labels too (which tokens are targets): text that moves
    # between prompt and completion keeps the ids and changes the labels.
    columns = [name for name in ("input_ids", "labels") if name in blocks.column_names]
    sampled = blocks.with_format("numpy", columns=columns)[rows]
    digest = hashlib.sha256()
    for name in columns:
        digest.update(np.asarray(sampled[name], dtype="<i4").tobytes())
    width = np.asarray(sampled["input_ids"]).shape[1]
    return f"{count} blocks x {width} tokens, sha256 {digest.hexdigest()[:12]}"


def data_record(inputs, blocks) -> dict:
    """What the run trains on: its packed ``blocks`` and the flags they come from (``inputs``: the run's
    ``smmd_train.config.run_config.ModelData``)."""
    return _as_json({"packed blocks": blocks_fingerprint(blocks),
                     "--data": [os.path.abspath(path) for path in inputs.data], "--text_field": inputs.text_field,
                     "--seq_len": inputs.seq_len, "--tokenizer": _as_path(inputs.tokenizer or inputs.model)})


def _as_path(name: str) -> str:
    """A local folder as an absolute path (another spelling of it is no change); anything else as given."""
    return os.path.abspath(name) if os.path.exists(name) else name


def experiment_record(inputs, loss, vocab, blocks) -> dict:
    """The record a commit marker carries (``checkpoint.run_record``): ``{"objective", "data"}``; ``inputs``:
    the run's ``smmd_train.config.run_config.ModelData``; ``loss``: its
    ``smmd_train.components.loss_reporter.LossReporter``."""
    return {"objective": _as_json(loss.objective_record(vocab)), "data": data_record(inputs, blocks)}


def experiment_changes(saved: dict, current: dict) -> list:
    """One ``"<what> <old> -> <new>"`` per difference between a commit marker's record ``saved`` and
    this run's ``current`` (:func:`experiment_record`). Only what both record is compared (a marker
    written before the record has none; the options of a loss one side does not use are implied by
    ``--numeric_loss``); the data differ only if the packed blocks do, and then every data flag that
    differs is named with them."""
    changes = []
    for section in ("objective", "data"):
        old, new = saved.get(section) or {}, current.get(section) or {}
        if section == "data" and old.get("packed blocks") == new.get("packed blocks"):
            continue
        changes += [f"{key} {_shown(old[key])} -> {_shown(new[key])}" for key in new
                    if key in old and old[key] != new[key]]
    return changes


def data_order_problems(committed: dict, seed: int, num_blocks: int) -> list:
    """Why the checkpoint's data order (``committed``: its commit marker, which records the
    ``num_blocks`` and ``seed`` of ``smmd_train.data.batches.PackedBatches`` since it has them) cannot
    continue on this run's ``num_blocks`` packed blocks shuffled by ``seed``; empty when it can."""
    problems = []
    if committed.get("num_blocks", num_blocks) != num_blocks:
        problems.append(f"its data order shuffles {committed['num_blocks']} packed blocks, this run's data packs into "
                        f"{num_blocks}")
    if committed.get("seed", seed) != seed:
        problems.append(f"its data order was shuffled by --seed {committed['seed']}, this run has --seed {seed}")
    return problems


def check_resumed_experiment(tag: str, committed: dict, current: dict, seed: int, num_blocks: int,
                             allow_change: bool) -> list:
    """Refuse (ValueError, one line per problem) a resume of ``tag`` that would change the experiment
    (:func:`experiment_changes`) without ``allow_change``, or whose data order cannot continue
    (:func:`data_order_problems`) at all. Returns the warning lines for the log: with ``allow_change``,
    one naming the changes."""
    changes = experiment_changes(committed, current)
    order = data_order_problems(committed, seed, num_blocks)
    if order:
        raise ValueError("\n".join([*(f"resuming {tag} changes {change}" for change in changes),
                                    *(f"checkpoint {tag} cannot continue here: {problem}" for problem in order),
                                    f"resume {tag} on its data, --seq_len, tokenizer and --seed ({ALLOW_FLAG} cannot "
                                    "continue another data order), or export it (launch/export_hf.py) and continue "
                                    "pretraining from the HF directory"]))
    if not changes:
        return []
    if not allow_change:
        raise ValueError("\n".join([*(f"resuming {tag} changes {change}" for change in changes),
                                    f"resume {tag} with the settings it was trained with, pass {ALLOW_FLAG} to "
                                    "continue it with this run's, or start a new run (another --output_dir, or "
                                    "--overwrite_output_dir)"]))
    return [f"{ALLOW_FLAG}: {tag} continues with {'; '.join(changes)}"]


def _as_json(record: dict) -> dict:
    """``record`` as it reads back from a commit marker (tuples as lists), so that equal settings compare equal."""
    return json.loads(json.dumps(record))


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return " ".join(map(_shown, value))
    return "none" if value is None else str(value)
