"""Pretraining data: load raw text, tokenize and pack it into fixed-length blocks, and serve each
data-parallel rank deterministic, resumable micro-batches of those blocks.

    texts = load_text_dataset(["a.jsonl", "b.parquet"])               # one column of strings
    blocks = tokenize_and_pack(texts, tokenizer, seq_len=2048, cache_dir="cache/")
    batches = PackedBatches(blocks, micro_batch_size=4, dp_rank=dp_rank, dp_size=dp_size, seed=0)
    next(batches)["input_ids"]                                        # LongTensor [4, 2048]

Packing is GPT-style: every document's tokens, then EOS, concatenated over the whole corpus and cut
into blocks of exactly ``seq_len`` tokens, so a block may span documents and attention crosses the
EOS boundaries (no per-document masking).

Fine-tuning data is JSON lines of ``{"prompt": ..., "completion": ...}`` records, recognised by the
first record's keys (:func:`data_format`). Each record becomes one row of ``seq_len`` tokens, padded
on the right, never packed with others: prompt tokens, then completion tokens, then EOS, with
``labels`` -100 on the prompt and the padding, so the loss (and the step's count of valid targets)
covers the completion and its EOS alone. Under causal attention a token never attends to the
padding after it, so a padded row computes what the example alone would (no attention mask needed).

    blocks = pack_files(["sft.jsonl"], tokenizer, seq_len=512)          # input_ids and labels columns
    next(PackedBatches(blocks, 4, dp_rank, dp_size, seed=0))["labels"]  # LongTensor [4, 512]
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher

from smmd_scale.numeric_loss import IGNORE_INDEX

from . import compat

_TEXT_FILE_READERS = {
    ".jsonl": datasets.Dataset.from_json,
    ".json": datasets.Dataset.from_json,
    ".txt": datasets.Dataset.from_text,
    ".parquet": datasets.Dataset.from_parquet,
}
_UTF8_CHECKED_SUFFIXES = (".jsonl", ".json", ".txt")
PROMPT_COMPLETION_KEYS = ("prompt", "completion")
_UTF8_CHUNK_BYTES = 16 << 20
_SCAN_ROWS_PER_BATCH = 10_000
_PACK_ROWS_PER_BATCH = 1_000
# Bump when the tokenize or pack output changes for the same inputs, so old cache files are not reused.
_CACHE_FORMAT_VERSION = 1
# Megatron-style embedding padding (vocab rounded up to a multiple of 128 x TP <= 8) adds fewer rows.
_EMBEDDING_PADDING_ROWS = 1024


# ----------------------------------------------------------------------------------------------
# Loading raw text
# ----------------------------------------------------------------------------------------------

def load_text_dataset(paths: Sequence[str | os.PathLike], text_field: str = "text") -> datasets.Dataset:
    """Load text files and saved datasets into one dataset whose only column is ``text_field``.

    Args:
        paths: ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` files, or directories written by
            ``Dataset.save_to_disk`` (a ``DatasetDict`` directory contributes its "train" split), in
            any mix. Rows are concatenated in the given order. A ``.txt`` file is one example per line.
        text_field: the column holding the text; a ``.txt`` file's lines land in this column too.

    Returns:
        A ``datasets.Dataset`` with the single string column ``text_field``, rows in ``paths`` order.

    Raises:
        FileNotFoundError: a path does not exist, or is a directory not written by ``save_to_disk``.
        ValueError: unknown extension, empty file, invalid UTF-8 (with its 1-based line), no
            ``text_field`` column, a non-string value (with its row), or no text at all.
    """
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise ValueError(f"paths must be a non-empty list of files or dataset directories, got {paths!r}")
    parts = [_load_one_source(Path(path), text_field) for path in paths]
    if len({str(part.features[text_field]) for part in parts}) > 1:
        # e.g. pandas writes parquet strings as large_string, JSON loads as string; concatenation needs one type.
        large_string = datasets.Value("large_string")
        parts = [part if part.features[text_field] == large_string else part.cast_column(text_field, large_string)
                 for part in parts]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if not any(_has_nonempty_text(part, text_field) for part in parts):
        raise ValueError(f"all {len(dataset)} rows of {text_field!r} are empty strings in {[str(p) for p in paths]}; "
                         f"there is nothing to train on")
    return dataset


def _load_one_source(path: Path, text_field: str) -> datasets.Dataset:
    """One path as a dataset with the single column ``text_field``, its values checked to be strings."""
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist; pass existing files or save_to_disk directories")
    if path.is_dir():
        dataset = _load_saved_dataset(path)
    else:
        reader = _TEXT_FILE_READERS.get(path.suffix.lower())
        if reader is None:
            raise ValueError(f"{path}: unknown extension {path.suffix!r}; supported files are "
                             f"{', '.join(_TEXT_FILE_READERS)} and directories written by Dataset.save_to_disk")
        if path.stat().st_size == 0:
            raise ValueError(f"{path} is empty; remove it from the data paths")
        if path.suffix.lower() in _UTF8_CHECKED_SUFFIXES:
            _check_utf8(path)
        try:
            with _quiet_json_reader():
                dataset = reader(str(path))
        except ValueError as error:
            # datasets' wording for a file that parses to zero rows ("[]", blank lines, an empty parquet).
            if "corresponds to no data" in str(error):
                raise ValueError(f"{path} has no rows; remove it from the data paths") from error
            _raise_on_broken_json(path, error)
            raise
        except Exception as error:  # datasets' DatasetGenerationError chain for a line it cannot parse
            _raise_on_broken_json(path, error)
            raise
        if path.suffix.lower() == ".txt" and text_field != "text":
            dataset = dataset.rename_column("text", text_field)
    if len(dataset) == 0:
        raise ValueError(f"{path} has no rows; remove it from the data paths")
    if text_field not in dataset.column_names:
        raise ValueError(f"{path} has no column {text_field!r}; its columns are {dataset.column_names}. "
                         f"Pass the column holding the text as text_field (--text_field)")
    dataset = dataset.select_columns([text_field])
    _check_strings(dataset, text_field, path)
    return dataset


@contextlib.contextmanager
def _quiet_json_reader():
    """Silence ``datasets``' JSON builder while it reads: on a broken line it logs an error of its own
    (pyarrow's wording, rows counted from 0) before raising, and the caller's one line says it better."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _json_error(path: Path, line: int, broken: json.JSONDecodeError) -> str:
    """``file:line:column: not valid JSON: <json's message>`` for ``broken``, raised at ``line`` of
    ``path`` (line and column counted from 1)."""
    return f"{path}:{line}:{broken.colno}: not valid JSON: {broken.msg}"


def _raise_on_broken_json(path: Path, error: Exception) -> None:
    """After ``datasets`` failed to read a .jsonl/.json file: raise ValueError naming the file and
    the 1-based line (and column) of its first line that is not one JSON object, instead of
    datasets' chained tracebacks that count rows from 0. Returns when no such line is found (the
    caller re-raises ``error``). Runs only after a failure, so reading a good file costs nothing more."""
    if path.suffix.lower() not in (".jsonl", ".json"):
        return
    with open(path, encoding="utf-8") as handle:
        first = handle.read(1)
    if path.suffix.lower() == ".json" and first == "[":  # one JSON document, not JSON lines
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as broken:
            raise ValueError(_json_error(path, broken.lineno, broken)) from error
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                _json_object_line(path, number, line, "each line of a JSON-lines file must be one JSON object")
            except ValueError as refusal:
                raise refusal from error


def _load_saved_dataset(path: Path) -> datasets.Dataset:
    if (path / datasets.config.DATASETDICT_JSON_FILENAME).is_file():
        splits = datasets.load_from_disk(str(path))
        if "train" not in splits:
            raise ValueError(f"{path} is a DatasetDict without a 'train' split (splits: {list(splits)}); "
                             f"save the split to train on as 'train', or save that split alone with save_to_disk")
        return splits["train"]
    if (path / datasets.config.DATASET_STATE_JSON_FILENAME).is_file():
        return datasets.load_from_disk(str(path))
    raise FileNotFoundError(f"{path} is a directory but not one written by Dataset.save_to_disk or "
                            f"DatasetDict.save_to_disk; pass the data files inside it instead")


def _check_utf8(path: Path) -> None:
    """Raise ValueError naming ``path`` and the 1-based line of its first invalid UTF-8 byte.

    Reads the file in binary chunks through an incremental decoder, so a multi-byte character split
    across two chunks is still decoded whole and memory stays at one chunk.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    newlines_before = 0
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_UTF8_CHUNK_BYTES), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                # error.object is the decoder's pending bytes (an unfinished character, never a
                # newline) followed by this chunk, so counting newlines in it up to the error is exact.
                line = newlines_before + error.object.count(b"\n", 0, error.start) + 1
                _raise_not_utf8(path, line, error)
            newlines_before += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            _raise_not_utf8(path, newlines_before + 1, error)


def _raise_not_utf8(path, line: int, error: UnicodeDecodeError) -> None:
    raise ValueError(f"{path}: line {line} is not valid UTF-8 ({error.reason} at byte "
                     f"{error.object[error.start]:#04x}); re-encode the file as UTF-8 "
                     f"(e.g. iconv -f <its encoding> -t UTF-8) or fix that line") from None


def _check_strings(dataset: datasets.Dataset, text_field: str, path: Path) -> None:
    """Raise ValueError naming the first value of ``text_field`` that is not a string (None included)."""
    feature = dataset.features[text_field]
    is_string_column = feature in (datasets.Value("string"), datasets.Value("large_string"))
    if is_string_column:
        row = _first_null_row(dataset, text_field)
        offending = None if row is None else (f"row {row} (counting from 0)", None)
    elif path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        offending = _first_non_string_json_value(path, text_field)
    else:
        offending = next(((f"row {row} (counting from 0)", value) for row, value in enumerate(dataset[text_field])
                          if not isinstance(value, str)), None)
    if offending is not None:
        where, value = offending
        raise ValueError(f"{path}: {text_field!r} must hold strings, but {where} holds {value!r}; "
                         f"fix or drop such rows, or pick another text_field")
    if not is_string_column:
        raise ValueError(f"{path}: column {text_field!r} has type {feature}, not a string column; save it "
                         f"cast to strings (dataset.cast_column) or pick another text_field")


def _first_non_string_json_value(path: Path, text_field: str) -> tuple[str, object] | None:
    """(where, value) of the first non-string ``text_field`` in a JSON array or JSON-lines file.

    Parsed again with ``json``: datasets loads a column of mixed JSON types as a Json feature that
    stores a string such as "12" as the number 12, so the loaded values cannot tell which row is wrong.
    """
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        records = None
    if isinstance(records, list):
        located = ((f"element {index} (counting from 0)", record) for index, record in enumerate(records))
    else:
        located = ((f"line {number}", json.loads(line)) for number, line in enumerate(text.split("\n"), 1)
                   if line.strip())
    return next(((where, record.get(text_field)) for where, record in located
                 if not isinstance(record.get(text_field), str)), None)


def _first_null_row(dataset: datasets.Dataset, text_field: str) -> int | None:
    for start, table in _arrow_batches(dataset, _SCAN_ROWS_PER_BATCH):
        column = table[text_field]
        if column.null_count:
            return start + pc.index(pc.is_null(column), True).as_py()
    return None


def _has_nonempty_text(dataset: datasets.Dataset, text_field: str) -> bool:
    return any(pc.any(pc.greater(pc.binary_length(table[text_field]), 0)).as_py()
               for _, table in _arrow_batches(dataset, _SCAN_ROWS_PER_BATCH))


def _arrow_batches(dataset: datasets.Dataset, rows_per_batch: int) -> Iterator[tuple[int, pa.Table]]:
    """(first row, table) for consecutive slices of ``dataset`` in row order, zero-copy where possible."""
    tables = dataset.with_format("arrow")
    for start in range(0, len(dataset), rows_per_batch):
        yield start, tables[start:start + rows_per_batch]


# ----------------------------------------------------------------------------------------------
# Prompt/completion records
# ----------------------------------------------------------------------------------------------

def data_format(paths: Sequence[str | os.PathLike], text_field: str = "text") -> str:
    """``"prompt_completion"`` when the first record of every path is a ``.jsonl`` object with the keys
    ``prompt`` and ``completion`` (and not ``text_field``), ``"text"`` when none is; reads one line per file.

    Raises:
        ValueError: some paths are of one format and some of the other (named), or a first line is
            not valid JSON (``file:line:column`` and json's message).
    """
    formats = {str(path): _file_format(Path(path), text_field) for path in paths}
    kinds = set(formats.values())
    if len(kinds) > 1:
        by_kind = {kind: [path for path, found in formats.items() if found == kind] for kind in sorted(kinds)}
        raise ValueError(f"the data paths mix prompt/completion files {by_kind['prompt_completion']} and text "
                         f"sources {by_kind['text']}; train on one format per run")
    return kinds.pop() if kinds else "text"


def _file_format(path: Path, text_field: str) -> str:
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return "text"
    with open(path, encoding="utf-8", errors="replace") as handle:
        number, line = next(((number, line) for number, line in enumerate(handle, start=1) if line.strip()),
                            (0, ""))
    if not line:
        return "text"
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as broken:
        raise ValueError(f"{_json_error(path, number, broken)}; each line of a JSON-lines file must be one JSON "
                         "object") from None
    if isinstance(record, dict) and text_field not in record and all(key in record for key in PROMPT_COMPLETION_KEYS):
        return "prompt_completion"
    return "text"


def load_prompt_completion(paths: Sequence[str | os.PathLike], text_field: str = "text") -> datasets.Dataset:
    """Prompt/completion JSON-lines files as one dataset with the columns ``prompt``, ``completion``
    and ``source`` (``"file:line"`` of each record, for the errors that tokenizing may raise), rows
    in ``paths`` order. Other keys of a record are ignored.

    Raises:
        ValueError: naming ``file:line``: a line that is not valid JSON (with json's message) or not an
            object, a record without ``prompt`` or ``completion`` (a ``text_field`` record: the formats
            are mixed), a value that is not a string, or an empty one; also a file that is empty or
            not valid UTF-8.
    """
    prompts, completions, sources = [], [], []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"data path {path} does not exist; pass existing files")
        _check_utf8(path)
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    prompt, completion = _prompt_completion_record(path, number, line, text_field)
                    prompts.append(prompt)
                    completions.append(completion)
                    sources.append(f"{path}:{number}")
    if not prompts:
        raise ValueError(f"{[str(path) for path in paths]} hold no records; there is nothing to train on")
    records = {"prompt": prompts, "completion": completions, "source": sources}
    table = pa.table({name: pa.array(values, pa.string()) for name, values in records.items()})
    return datasets.Dataset(datasets.table.InMemoryTable(table),
                            fingerprint=Hasher.hash((_CACHE_FORMAT_VERSION, "prompt_completion", records)))


def _json_object_line(path: Path, number: int, line: str, expected: str) -> dict:
    """Line ``number`` of a JSON-lines file as the object it must be; else one line naming ``path:number``
    (json's own message for broken JSON) and what each line must be (``expected``)."""
    try:
        value = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as broken:
        raise ValueError(f"{_json_error(path, number, broken)}; each line of a JSON-lines file must be one JSON "
                         "object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: a JSON {type(value).__name__}, not an object; {expected}")
    return value


def _prompt_completion_record(path: Path, number: int, line: str, text_field: str) -> tuple[str, str]:
    where = f"{path}:{number}"
    record = _json_object_line(path, number, line, 'each line must be one {"prompt": ..., "completion": ...} object')
    missing = [key for key in PROMPT_COMPLETION_KEYS if key not in record]
    if missing:
        mixed = f"a text record ({text_field!r}) in a prompt/completion file: one format per run; " \
            if text_field in record else ""
        raise ValueError(f"{where}: {mixed}the record has no {' or '.join(map(repr, missing))} (its keys: "
                         f"{sorted(record)}); every record needs a 'prompt' and a 'completion' string")
    for key in PROMPT_COMPLETION_KEYS:
        if not isinstance(record[key], str) or not record[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {record[key]!r}")
    return record["prompt"], record["completion"]


def tokenize_prompt_completion(dataset: datasets.Dataset, tokenizer, seq_len: int,
                               cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """One row of ``seq_len`` tokens per record of :func:`load_prompt_completion`, padded, not packed.

    A row is ``tokenizer(prompt) + tokenizer(completion) + [EOS]``, each text tokenized on its own
    with ``add_special_tokens=False`` (no BOS, no chat template: the completion is a plain
    continuation of the prompt, so put a separating space or newline where the model should see
    one), then the pad token (the tokenizer's ``pad_token_id``, else EOS) up to ``seq_len``.
    ``labels`` is the row with -100 on the prompt and the padding: the model's shifted loss then has
    one target per completion token and for the EOS, none for the prompt. The padding is on the
    right, so under causal attention no real token attends to it.

    Args:
        dataset: the columns ``prompt``, ``completion`` and ``source`` (``load_prompt_completion``).
        tokenizer: a Hugging Face tokenizer with an EOS token.
        seq_len: the length of every row; a record longer than that is refused.
        cache_dir: where the rows are cached, keyed by the records, the tokenizer and ``seq_len``.

    Returns:
        A dataset with ``input_ids`` and ``labels``, each ``[num_records, seq_len]`` int32.

    Raises:
        ValueError: bad ``seq_len``, a tokenizer without EOS, or a record (named by ``file:line``)
            longer than ``seq_len`` tokens.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token, which ends every completion; use a tokenizer with one")
    fingerprint = Hasher.hash((_CACHE_FORMAT_VERSION, compat.dataset_fingerprint(dataset), Hasher.hash(tokenizer),
                               seq_len))
    path = None if cache_dir is None else Path(cache_dir) / f"prompt-completion-{fingerprint}.arrow"
    if path is not None and path.is_file():
        return datasets.Dataset.from_file(str(path))
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = tokenizer(list(dataset["prompt"]), add_special_tokens=False, verbose=False)["input_ids"]
    completions = tokenizer(list(dataset["completion"]), add_special_tokens=False, verbose=False)["input_ids"]
    input_ids = np.full((len(dataset), seq_len), pad_token_id, dtype=np.int32)
    labels = np.full((len(dataset), seq_len), IGNORE_INDEX, dtype=np.int32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        completion = completion + [tokenizer.eos_token_id]
        length = len(prompt) + len(completion)
        if length > seq_len:
            raise ValueError(f"{dataset[row]['source']}: the record is {length} tokens ({len(prompt)} prompt + "
                             f"{len(completion)} completion with EOS), more than --seq_len {seq_len}; raise "
                             "--seq_len or shorten the record")
        input_ids[row, :length] = prompt + completion
        labels[row, len(prompt):length] = completion
    schema = datasets.Features({name: datasets.List(datasets.Value("int32"), length=seq_len)
                                for name in ("input_ids", "labels")}).arrow_schema
    rows = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), seq_len)
                                       for values in (input_ids, labels)], schema=schema)
    if path is None:
        return datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_batches([rows], schema)),
                                fingerprint=fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, iter([rows]), schema)
    return datasets.Dataset.from_file(str(path))


# ----------------------------------------------------------------------------------------------
# Tokenizing and packing
# ----------------------------------------------------------------------------------------------

def tokenize_and_pack(dataset: datasets.Dataset, tokenizer, seq_len: int, text_field: str = "text",
                      num_proc: int = 1, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """Tokenize every document, append EOS, concatenate the corpus and cut it into ``seq_len`` blocks.

    Each document becomes ``tokenizer(text, add_special_tokens=False)`` followed by
    ``tokenizer.eos_token_id`` (nothing when the tokenizer has no EOS). No BOS is added, even for
    tokenizers that add one by convention (Llama): the EOS already marks every document boundary.
    Documents that tokenize to nothing (empty strings) contribute nothing, not a lone EOS. The
    final partial block is dropped.

    Caching (``cache_dir`` given): tokenization writes ``tokens-<fp>.arrow`` (``dataset.map``'s
    cache; ``num_proc > 1`` adds ``_0000k_of_0000n`` shards), fp = hash(dataset fingerprint,
    text_field, tokenizer); packing writes ``packed-<fp2>.arrow``, fp2 = hash(fp, seq_len). A call
    whose packed file exists returns it memory-mapped without tokenizing; a new ``seq_len`` reuses
    the tokens. Files are written under a temporary name and renamed, so a process never sees a
    partial file. Without ``cache_dir``, ``datasets``' default caching applies to the map and the
    blocks are packed in memory.

    Args:
        dataset: documents in the string column ``text_field`` (e.g. from ``load_text_dataset``).
        tokenizer: a ``transformers`` tokenizer.
        seq_len: tokens per block, a positive int.
        num_proc: processes for tokenization (1: in this process).
        cache_dir: directory for the cache files above (created if missing).

    Returns:
        A dataset with one column ``input_ids``: ``[num_blocks, seq_len]`` int32.

    Raises:
        ValueError: bad ``seq_len``, missing ``text_field``, or fewer than ``seq_len`` tokens in all.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    _check_positive_int("num_proc", num_proc)
    if text_field not in dataset.column_names:
        raise ValueError(f"the dataset has no column {text_field!r}; its columns are {dataset.column_names}")
    tokens_fingerprint = Hasher.hash((_CACHE_FORMAT_VERSION, compat.dataset_fingerprint(dataset), text_field,
                                      Hasher.hash(tokenizer)))
    packed_fingerprint = Hasher.hash((tokens_fingerprint, seq_len))
    map_cache = {}
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        packed_path = cache_dir / f"packed-{packed_fingerprint}.arrow"
        if packed_path.is_file():
            return datasets.Dataset.from_file(str(packed_path))
        map_cache = dict(cache_file_name=str(cache_dir / f"tokens-{tokens_fingerprint}.arrow"),
                         load_from_cache_file=True)

    # datasets >= 4 starts a worker pool for any num_proc that is not None, even 1.
    tokens = dataset.map(_tokenize_documents, batched=True, num_proc=None if num_proc == 1 else num_proc,
                         remove_columns=dataset.column_names,
                         fn_kwargs=dict(tokenizer=tokenizer, text_field=text_field),
                         features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
                         new_fingerprint=tokens_fingerprint, desc="Tokenizing", **map_cache)
    total_tokens = sum(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0
                       for _, table in _arrow_batches(tokens, _SCAN_ROWS_PER_BATCH))
    if total_tokens < seq_len:
        raise ValueError(f"the corpus has {total_tokens} tokens (EOS separators included), fewer than one block "
                         f"of seq_len={seq_len}; use a smaller --seq_len or more data")

    schema = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"), length=seq_len)}).arrow_schema
    blocks = _packed_record_batches(tokens, seq_len, schema)
    if cache_dir is None:
        return datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_batches(blocks, schema)),
                                fingerprint=packed_fingerprint)
    _write_atomically(packed_path, blocks, schema)
    return datasets.Dataset.from_file(str(packed_path))


def pack_files(paths: Sequence[str | os.PathLike], tokenizer, seq_len: int, text_field: str = "text",
               num_proc: int = 1, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """What train.py does with ``--data`` and ``--eval_data``: by :func:`data_format`,
    ``load_text_dataset`` then ``tokenize_and_pack`` (rows of ``input_ids``), or
    ``load_prompt_completion`` then ``tokenize_prompt_completion`` (rows of ``input_ids`` and ``labels``)."""
    if data_format(paths, text_field) == "prompt_completion":
        return tokenize_prompt_completion(load_prompt_completion(paths, text_field), tokenizer, seq_len,
                                          cache_dir=cache_dir)
    return tokenize_and_pack(load_text_dataset(paths, text_field), tokenizer, seq_len, text_field=text_field,
                             num_proc=num_proc, cache_dir=cache_dir)


def _tokenize_documents(batch: dict, tokenizer, text_field: str) -> dict:
    token_ids = tokenizer(batch[text_field], add_special_tokens=False, verbose=False)["input_ids"]
    eos_token_id = tokenizer.eos_token_id
    if eos_token_id is not None:
        token_ids = [ids + [eos_token_id] if ids else ids for ids in token_ids]
    return {"input_ids": token_ids}


def _packed_record_batches(tokens: datasets.Dataset, seq_len: int, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The token stream of ``tokens`` (rows in order) cut into full ``seq_len`` blocks, one record batch
    per slice of documents; tokens short of a block carry over to the next slice."""
    carry = np.empty(0, dtype=np.int32)
    for _, table in _arrow_batches(tokens, _PACK_ROWS_PER_BATCH):
        stream = np.concatenate([carry, pc.list_flatten(table["input_ids"]).to_numpy()])
        full = len(stream) // seq_len * seq_len
        carry = stream[full:]
        if full:
            block_column = pa.FixedSizeListArray.from_arrays(pa.array(stream[:full]), seq_len)
            yield pa.RecordBatch.from_arrays([block_column], schema=schema)


def _write_atomically(path: Path, batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> None:
    """Write an Arrow stream file (the format ``Dataset.from_file`` maps) under a temporary name, then rename."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp", delete=False) as file:
        try:
            with pa.ipc.new_stream(file, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
        except BaseException:
            os.unlink(file.name)
            raise
    os.replace(file.name, path)


# ----------------------------------------------------------------------------------------------
# Serving micro-batches
# ----------------------------------------------------------------------------------------------

class PackedBatches:
    """Deterministic, resumable micro-batches of packed blocks for one data-parallel rank.

    Epoch ``e`` visits the blocks in the permutation drawn from ``(seed, e)``. Optimizer step ``k``
    of an epoch takes the next ``global_batch_size = micro_batch_size * dp_size * accumulation``
    positions of it, whatever the layout: the same set of blocks for every (micro-batch, DP,
    accumulation) with that global batch, as Megatron's sampler does, so a run's data and objective
    do not depend on how the step is split. Inside the step, micro-step ``m`` of DP rank ``r`` takes
    positions ``m * micro_batch_size * dp_size + r * micro_batch_size`` onwards (``micro_batch_size``
    of them): ranks with the same ``dp_rank`` (the tensor-parallel ranks of one DP group) get the same
    batch, different DP ranks disjoint blocks. When fewer than ``global_batch_size`` positions are
    left, those blocks are skipped for this epoch and the next epoch starts (they are seen in other
    epochs' permutations).

    The permutation comes from numpy's legacy ``RandomState`` seeded with ``[seed, epoch]``: its
    stream is frozen across numpy versions and platforms, so every rank and a resumed run on other
    machines draw the same order.

    Yields ``{"input_ids": LongTensor [micro_batch_size, seq_len]}`` forever, ``accumulation`` per step,
    with ``"labels"`` of the same shape where the dataset has that column (prompt/completion rows).
    """

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 accumulation: int = 1):
        _check_positive_int("micro_batch_size", micro_batch_size)
        _check_positive_int("dp_size", dp_size)
        _check_positive_int("accumulation", accumulation)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an int in [0, dp_size={dp_size}), got {dp_rank!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if "input_ids" not in dataset.column_names:
            raise ValueError(f"the dataset has no 'input_ids' column (columns: {dataset.column_names}); "
                             f"pass the output of tokenize_and_pack")
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.accumulation = accumulation
        self.seed = seed
        self.num_blocks = len(dataset)
        self.micro_step_size = micro_batch_size * dp_size
        self.global_batch_size = self.micro_step_size * accumulation
        if self.num_blocks < self.global_batch_size:
            raise ValueError(f"the dataset has {self.num_blocks} blocks, fewer than one optimizer step of "
                             f"micro_batch_size={micro_batch_size} x dp_size={dp_size} x accumulation={accumulation} "
                             f"= {self.global_batch_size}; use more data, a smaller seq_len or a smaller batch")
        self.steps_per_epoch = self.num_blocks // self.global_batch_size
        self._blocks = dataset.with_format("numpy", columns=_row_columns(dataset))
        self._set_position(epoch=0, position=0)

    def _set_position(self, epoch: int, position: int) -> None:
        self._epoch = epoch
        self._position = position
        self._micro_step = 0
        self._order = np.random.RandomState([self.seed, epoch]).permutation(self.num_blocks)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def samples_consumed(self) -> int:
        """Blocks consumed so far by all DP ranks together (skipped epoch tails not counted)."""
        return (self._epoch * self.steps_per_epoch * self.global_batch_size + self._position
                + self._micro_step * self.micro_step_size)

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> dict:
        start = self._position + self._micro_step * self.micro_step_size + self.dp_rank * self.micro_batch_size
        batch = _stack_blocks(self._blocks, self._order[start:start + self.micro_batch_size])
        self._micro_step += 1
        if self._micro_step == self.accumulation:
            if self._position + 2 * self.global_batch_size > self.num_blocks:
                self._set_position(self._epoch + 1, 0)
            else:
                self._position += self.global_batch_size
                self._micro_step = 0
        return batch

    def state_dict(self) -> dict:
        """JSON-serialisable position at an optimizer-step boundary. On resume ``seed``,
        ``num_blocks`` and ``global_batch_size`` must match; the layout (micro-batch, DP degree,
        accumulation) may differ."""
        if self._micro_step:
            raise RuntimeError(f"the data position is saved between optimizer steps, not after micro-step "
                               f"{self._micro_step} of {self.accumulation}")
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "num_blocks": self.num_blocks,
                "global_batch_size": self.global_batch_size, "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size, "accumulation": self.accumulation}

    def load_state_dict(self, state: dict) -> None:
        """Continue with the optimizer step where the iterator that produced ``state`` stood.

        Raises ValueError if ``seed``, ``num_blocks`` or ``global_batch_size`` differ from this
        iterator's: the data order would silently change. Another split of the same global batch
        continues the same blocks in the same steps.
        """
        expected = self.state_dict()
        missing = sorted({"epoch", "position", "seed", "num_blocks"} - state.keys())
        if missing:
            raise ValueError(f"data state is missing {missing}; got keys {sorted(state)}")
        # Checkpoints written before the step-based order recorded the micro-step instead.
        saved_global_batch = state.get("global_batch_size", state.get("micro_batch_size", 0) * state.get("dp_size", 0))
        state = {**state, "global_batch_size": saved_global_batch}
        mismatches = [f"{key}: checkpoint {state[key]!r}, now {expected[key]!r}"
                      for key in ("seed", "global_batch_size", "num_blocks") if state[key] != expected[key]]
        if mismatches:
            raise ValueError(f"cannot resume the data order: {'; '.join(mismatches)}. Resume with the checkpoint's "
                             f"seed, global batch (micro-batch x DP x accumulation) and data (same files, tokenizer, "
                             f"seq_len), or start a new run")
        epoch, position = state["epoch"], state["position"]
        if (not isinstance(epoch, int) or epoch < 0 or not isinstance(position, int) or position < 0
                or position % self.global_batch_size or position + self.global_batch_size > self.num_blocks):
            raise ValueError(f"data state epoch={epoch!r} position={position!r} is not an optimizer-step start for "
                             f"{self.num_blocks} blocks in steps of {self.global_batch_size}")
        self._set_position(epoch, position)


def eval_batches(dataset: datasets.Dataset, micro_batch_size: int, max_batches: int | None = None) -> Iterator[dict]:
    """Blocks in dataset order as ``{"input_ids": LongTensor [micro_batch_size, seq_len]}`` (and
    ``"labels"`` where the dataset has them, as :class:`PackedBatches`).

    Full micro-batches only (a tail shorter than ``micro_batch_size`` is dropped), at most
    ``max_batches``. Not sharded: every rank that calls it gets the same batches.
    """
    _check_positive_int("micro_batch_size", micro_batch_size)
    if max_batches is not None:
        _check_positive_int("max_batches", max_batches)
    num_batches = len(dataset) // micro_batch_size
    if num_batches == 0:
        raise ValueError(f"the eval dataset has {len(dataset)} blocks, fewer than micro_batch_size={micro_batch_size}")
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    blocks = dataset.with_format("numpy", columns=_row_columns(dataset))
    return (_stack_blocks(blocks, range(index * micro_batch_size, (index + 1) * micro_batch_size))
            for index in range(num_batches))


def _row_columns(dataset: datasets.Dataset) -> list:
    return [name for name in ("input_ids", "labels") if name in dataset.column_names]


def _stack_blocks(blocks: datasets.Dataset, indices) -> dict:
    """Rows ``indices`` of a numpy-formatted block dataset: each column as LongTensor ``[len(indices), seq_len]``."""
    rows = blocks[[int(index) for index in indices]]
    return {name: torch.from_numpy(np.stack(values).astype(np.int64)) for name, values in rows.items()}


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Tokenizer / model agreement
# ----------------------------------------------------------------------------------------------

def check_tokenizer_fits_model(tokenizer, model_vocab_size: int) -> str | None:
    """Raise if token ids can index past the model's embedding; return a warning if it looks mismatched.

    Returns:
        None when the embedding has at least ``len(tokenizer)`` rows and at most
        ``_EMBEDDING_PADDING_ROWS`` more (the usual padding to a multiple of 128 x TP); otherwise a
        message for the caller to log: so many unused rows suggest a tokenizer from another model.

    Raises:
        ValueError: ``len(tokenizer) > model_vocab_size``.
    """
    tokenizer_size = len(tokenizer)
    if tokenizer_size > model_vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer_size} tokens but the model's embedding has {model_vocab_size} "
                         f"rows: ids >= {model_vocab_size} would index out of range; resize the embeddings "
                         f"(model.resize_token_embeddings) or use the model's tokenizer")
    if model_vocab_size - tokenizer_size > _EMBEDDING_PADDING_ROWS:
        return (f"the model's embedding has {model_vocab_size} rows but the tokenizer only {tokenizer_size} tokens: "
                f"{model_vocab_size - tokenizer_size} rows can never be targets, more than padding explains; "
                f"check that the tokenizer belongs to this model")
    return None
