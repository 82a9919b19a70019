"""Where training text comes from: plain-text sources (``.jsonl``/``.json``/``.txt``/``.parquet`` files and
saved datasets, :func:`load_text_dataset`) and prompt/completion records (:func:`data_format`,
:func:`load_prompt_completion`), each checked as it is read (UTF-8, JSON, string fields)."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator, Sequence

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher

_TEXT_FILE_READERS = {
    ".jsonl": datasets.Dataset.from_json,
    ".json": datasets.Dataset.from_json,
    ".txt": datasets.Dataset.from_text,
    ".parquet": datasets.Dataset.from_parquet,
}
_UTF8_CHECKED_SUFFIXES = (".jsonl", ".json", ".txt")
PROMPT_COMPLETION_KEYS = ("prompt", "completion")
_UTF8_CHUNK_BYTES = 16 << 20
SCAN_ROWS_PER_BATCH = 10_000
# Bump when the tokenize or pack output changes for the same inputs, so old cache files are not reused.
CACHE_FORMAT_VERSION = 1


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
    for start, table in arrow_batches(dataset, SCAN_ROWS_PER_BATCH):
        column = table[text_field]
        if column.null_count:
            return start + pc.index(pc.is_null(column), True).as_py()
    return None


def _has_nonempty_text(dataset: datasets.Dataset, text_field: str) -> bool:
    return any(pc.any(pc.greater(pc.binary_length(table[text_field]), 0)).as_py()
               for _, table in arrow_batches(dataset, SCAN_ROWS_PER_BATCH))


def arrow_batches(dataset: datasets.Dataset, rows_per_batch: int) -> Iterator[tuple[int, pa.Table]]:
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
                            fingerprint=Hasher.hash((CACHE_FORMAT_VERSION, "prompt_completion", records)))


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
