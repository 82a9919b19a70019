"""Tokenizing and packing: plain text into fixed-length blocks (:func:`tokenize_and_pack`, GPT-style),
prompt/completion records into one padded row each (:func:`tokenize_prompt_completion`), both
through :func:`pack_files` as train.py calls it, cached by fingerprint; and whether the tokenizer
fits the model's embedding (:func:`check_tokenizer_fits_model`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher

from smmd_scale.numeric_loss import IGNORE_INDEX

from .. import compat
from .batches import check_positive_int
from .sources import (
    CACHE_FORMAT_VERSION,
    SCAN_ROWS_PER_BATCH,
    arrow_batches,
    data_format,
    load_prompt_completion,
    load_text_dataset,
)

_PACK_ROWS_PER_BATCH = 1_000
# Megatron-style embedding padding (vocab rounded up to a multiple of 128 x TP <= 8) adds fewer rows.
_EMBEDDING_PADDING_ROWS = 1024


# ----------------------------------------------------------------------------------------------
# Prompt/completion records
# ----------------------------------------------------------------------------------------------

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
    fingerprint = Hasher.hash((CACHE_FORMAT_VERSION, compat.dataset_fingerprint(dataset), Hasher.hash(tokenizer),
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
    check_positive_int("num_proc", num_proc)
    if text_field not in dataset.column_names:
        raise ValueError(f"the dataset has no column {text_field!r}; its columns are {dataset.column_names}")
    tokens_fingerprint = Hasher.hash((CACHE_FORMAT_VERSION, compat.dataset_fingerprint(dataset), text_field,
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
                       for _, table in arrow_batches(tokens, SCAN_ROWS_PER_BATCH))
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
    for _, table in arrow_batches(tokens, _PACK_ROWS_PER_BATCH):
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
