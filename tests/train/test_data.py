"""Pretraining data: loading every source kind, its errors, packing against a plain reference, the
map/pack cache (in this process and in a second one), and the DP-sharded resumable batch order."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import zlib

import datasets
import numpy as np
import pytest
import torch
from helpers import style_tokenizers
from helpers.host_probe import hang_guard
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from smmd_train.data import sources
from smmd_train.data.batches import PackedBatches, eval_batches
from smmd_train.data.packing import check_tokenizer_fits_model, pack_files, tokenize_and_pack
from smmd_train.data.sources import data_format, load_text_dataset

from conftest import SESSION_SEED

_WORDS = ("the", "of", "sold", "cars", "in", "2024", "12", "3.75", "1,000", "café", "naïve", "日本", "🙂", "x=7;",
          "Ελλάδα", "$5")


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    # datasets' builders (from_json, from_text, ...) cache under HF_DATASETS_CACHE; keep each test's apart.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


@pytest.fixture
def rng(request):
    """A random.Random seeded from the session seed and the test's id."""
    return random.Random(SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def tokenizer(tokenizer_dir):
    """The Llama-3-style tokenizer, loaded back from disk the way train.py loads one."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def random_documents(rng: random.Random, count: int, empty_share: float = 0.0) -> list[str]:
    return ["" if rng.random() < empty_share else " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 30)))
            for _ in range(count)]


def write_jsonl(path, documents, field="text"):
    with open(path, "w", encoding="utf-8") as file:
        for index, document in enumerate(documents):
            file.write(json.dumps({"id": index, field: document}, ensure_ascii=False) + "\n")
    return path


def write_txt(path, documents):
    path.write_text("".join(document + "\n" for document in documents), encoding="utf-8")
    return path


def reference_blocks(documents, backend_tokenizer, eos_token_id, seq_len) -> list[list[int]]:
    """Each non-empty document's ids, then EOS, all concatenated and cut into full seq_len blocks."""
    stream = []
    for document in documents:
        ids = backend_tokenizer.encode(document, add_special_tokens=False).ids
        if ids:
            stream += ids + ([] if eos_token_id is None else [eos_token_id])
    return [stream[start:start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]


def count_tokenizer_calls(monkeypatch, tokenizer) -> list[int]:
    """Count calls of tokenizer(...) by patching its class (the tokenizer's hash is unchanged)."""
    calls = [0]
    original = type(tokenizer).__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counted)
    return calls


# ----------------------------------------------------------------------------------------------
# load_text_dataset
# ----------------------------------------------------------------------------------------------

def test_every_source_kind_concatenates_in_the_given_order(tmp_path, rng):
    text_field = rng.choice(["text", "content"])
    documents = {kind: random_documents(rng, rng.randint(1, 8), empty_share=0.1)
                 for kind in ("jsonl", "json", "txt", "parquet", "saved", "saved_dict")}
    paths = {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", documents["jsonl"], text_field),
        "txt": write_txt(tmp_path / "c.txt", documents["txt"]),
    }
    paths["json"] = tmp_path / "b.json"
    paths["json"].write_text(json.dumps([{text_field: document, "n": 1} for document in documents["json"]]))
    # pandas writes large_string, JSON loads as string: the loader must reconcile them.
    paths["parquet"] = tmp_path / "d.parquet"
    datasets.Dataset.from_dict({text_field: documents["parquet"]}).to_pandas().to_parquet(paths["parquet"])
    paths["saved"] = tmp_path / "saved"
    datasets.Dataset.from_dict({text_field: documents["saved"], "extra": [0.5] * len(documents["saved"])}) \
        .save_to_disk(paths["saved"])
    paths["saved_dict"] = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({text_field: documents["saved_dict"]}),
                          "validation": datasets.Dataset.from_dict({text_field: ["held out"]})}) \
        .save_to_disk(paths["saved_dict"])

    order = list(paths)
    rng.shuffle(order)
    dataset = load_text_dataset([str(paths[kind]) for kind in order], text_field=text_field)

    assert dataset.column_names == [text_field]
    assert list(dataset[text_field]) == [document for kind in order for document in documents[kind]]


def test_missing_path_unknown_extension_and_plain_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_text_dataset([str(tmp_path / "nope.jsonl")])
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"data.csv: unknown extension '.csv'.*\.jsonl, \.json, \.txt, \.parquet"):
        load_text_dataset([str(tmp_path / "data.csv")])
    (tmp_path / "shards").mkdir()
    write_txt(tmp_path / "shards" / "a.txt", ["hello"])
    with pytest.raises(FileNotFoundError, match="shards is a directory but not one written by Dataset.save_to_disk"):
        load_text_dataset([str(tmp_path / "shards")])
    with pytest.raises(ValueError, match="non-empty list"):
        load_text_dataset(str(tmp_path / "shards" / "a.txt"))


def test_dataset_dict_without_train_split(tmp_path):
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "splits")
    with pytest.raises(ValueError, match=r"splits is a DatasetDict without a 'train' split \(splits: \['test'\]\)"):
        load_text_dataset([str(tmp_path / "splits")])


def test_missing_text_field_lists_the_columns(tmp_path, rng):
    path = write_jsonl(tmp_path / "a.jsonl", random_documents(rng, 3), field="body")
    with pytest.raises(ValueError, match=r"a.jsonl has no column 'text'; its columns are \['id', 'body'\]"):
        load_text_dataset([str(path)])


@pytest.mark.parametrize("suffix, broken, message", [
    (".jsonl", '{"text": "cut off', r":(\d+):10: not valid JSON: Unterminated string starting at; "),
    (".jsonl", "42", r":(\d+): a JSON int, not an object"),
    (".jsonl", '{"text": "a",, "id": 1}', r":(\d+):14: not valid JSON: Expecting property name enclosed in double "
                                         r"quotes; "),
])
def test_a_broken_json_line_is_named_by_file_and_1_based_line(tmp_path, rng, suffix, broken, message, capfd):
    lines = [json.dumps({"text": document}) for document in random_documents(rng, rng.randint(5, 40))]
    line = rng.randrange(1, len(lines))  # the first line decides the format: a broken one is tested apart
    lines[line] = broken
    path = tmp_path / f"corpus{suffix}"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as refused:
        load_text_dataset([str(path)])
    text = str(refused.value)
    found = re.search(re.escape(str(path)) + message, text)
    assert found and int(found.group(1)) == line + 1 and "\n" not in text, text
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own error log stays quiet


def test_a_broken_first_line_is_named_by_file_line_and_column(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": 1 2}\n{"text": "fine"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:1:12: not valid JSON: Expecting ',' delimiter; ")):
        load_text_dataset([str(path)])
    with pytest.raises(ValueError, match=re.escape(f"{path}:1:12: not valid JSON: Expecting ',' delimiter; ")):
        pack_files([str(path)], None, 8)


def test_a_broken_json_array_names_its_line(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text('[{"text": "a"},\n {"text": "b"},\n {"text": "c",,}\n]')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:15: not valid JSON: Expecting property name")):
        load_text_dataset([str(path)])


def test_non_string_values_name_the_first_offending_row(tmp_path, rng):
    # Numeric-looking strings ("12") beside a real number: datasets' Json feature decodes both as numbers.
    documents = [rng.choice(["12", "3.75", "true"]) if rng.random() < 0.5 else document
                 for document in random_documents(rng, rng.randint(2, 12))]
    bad_row = rng.randrange(len(documents))
    for bad_value in (None, 5, [1]):
        records = [{"text": bad_value if row == bad_row else document} for row, document in enumerate(documents)]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        with pytest.raises(ValueError, match=re.escape(f"rows.jsonl: 'text' must hold strings, but "
                                                       f"{'row' if bad_value is None else 'line'} "
                                                       f"{bad_row if bad_value is None else bad_row + 1} ")
                           + f".*holds {re.escape(repr(bad_value))}"):
            load_text_dataset([str(tmp_path / "rows.jsonl")])
        (tmp_path / "array.json").write_text(json.dumps(records))
        with pytest.raises(ValueError, match=rf"array.json: 'text' must hold strings, but (element|row) {bad_row} "):
            load_text_dataset([str(tmp_path / "array.json")])

    datasets.Dataset.from_dict({"text": [3, 4]}).to_parquet(tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: 'text' must hold strings, but row 0 \(counting from 0\) "
                                         r"holds 3"):
        load_text_dataset([str(tmp_path / "ints.parquet")])

    datasets.Dataset.from_dict({"text": ["a", "b"]}, features=datasets.Features({"text": datasets.Json()})) \
        .save_to_disk(tmp_path / "json_typed")
    with pytest.raises(ValueError, match="json_typed: column 'text' has type Json.*not a string column"):
        load_text_dataset([str(tmp_path / "json_typed")])


def test_empty_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_text_dataset([str(tmp_path / "empty.jsonl")])
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .to_parquet(tmp_path / "no_rows.parquet")
    with pytest.raises(ValueError, match="no_rows.parquet has no rows"):
        load_text_dataset([str(tmp_path / "no_rows.parquet")])
    (tmp_path / "blank_lines.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="blank_lines.jsonl has no rows"):
        load_text_dataset([str(tmp_path / "blank_lines.jsonl")])
    datasets.Dataset.from_dict({"text": ["dropped"]}).filter(lambda row: False).save_to_disk(tmp_path / "saved_empty")
    with pytest.raises(ValueError, match="saved_empty has no rows"):
        load_text_dataset([str(tmp_path / "saved_empty")])
    write_txt(tmp_path / "blank.txt", ["", "", ""])
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ValueError, match="all 5 rows of 'text' are empty strings"):
        load_text_dataset([str(tmp_path / "blank.txt"), str(tmp_path / "blank.jsonl")])


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json"])
def test_invalid_utf8_names_the_file_and_line(tmp_path, rng, monkeypatch, kind):
    # Tiny read chunks put multi-byte characters (and the bad bytes) across chunk boundaries.
    monkeypatch.setattr(sources, "_UTF8_CHUNK_BYTES", rng.randint(1, 64))
    documents = random_documents(rng, rng.randint(1, 20))
    if kind == "txt":
        lines = [document.encode() for document in documents]
    elif kind == "jsonl":
        lines = [json.dumps({"text": document}, ensure_ascii=False).encode() for document in documents]
    else:
        objects = [json.dumps({"text": document}, ensure_ascii=False) for document in documents]
        lines = [b"["] + [(text + ("," if index + 1 < len(objects) else "")).encode()
                          for index, text in enumerate(objects)] + [b"]"]
    path = tmp_path / f"corpus.{kind}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert len(load_text_dataset([str(path)])) == len(documents)

    bad_line = rng.randrange(len(lines))
    bad_bytes = rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80"])
    cut = rng.randint(0, len(lines[bad_line]))
    lines[bad_line] = lines[bad_line][:cut] + bad_bytes + lines[bad_line][cut:]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=rf"corpus.{kind}: line {bad_line + 1} is not valid UTF-8"):
        load_text_dataset([str(path)])

    path.write_bytes(b"".join(line + b"\n" for line in lines[:bad_line]) + b"end \xe6\x97")
    with pytest.raises(ValueError, match=rf"corpus.{kind}: line {bad_line + 1} is not valid UTF-8"):
        load_text_dataset([str(path)])


# ----------------------------------------------------------------------------------------------
# tokenize_and_pack
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_eos", [True, False])
def test_packing_is_the_eos_separated_stream_cut_into_blocks(tmp_path, rng, tokenizer, with_eos):
    if not with_eos:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        assert tokenizer.eos_token_id is None
    documents = random_documents(rng, rng.randint(20, 60), empty_share=0.15)
    dataset = load_text_dataset([str(write_jsonl(tmp_path / "a.jsonl", documents))])
    seq_len = rng.randint(1, 40)
    expected = reference_blocks(documents, tokenizer.backend_tokenizer, tokenizer.eos_token_id, seq_len)

    for cache_dir in (None, tmp_path / "cache"):
        packed = tokenize_and_pack(dataset, tokenizer, seq_len, cache_dir=cache_dir)
        assert packed.column_names == ["input_ids"]
        assert packed.features["input_ids"] == datasets.List(datasets.Value("int32"), length=seq_len)
        assert [list(block) for block in packed["input_ids"]] == expected


def test_packing_does_not_depend_on_num_proc(tmp_path, rng, tokenizer):
    documents = random_documents(rng, 2500)
    dataset = load_text_dataset([str(write_jsonl(tmp_path / "a.jsonl", documents))])
    seq_len = rng.randint(8, 64)
    serial = tokenize_and_pack(dataset, tokenizer, seq_len, cache_dir=tmp_path / "one")
    parallel = tokenize_and_pack(dataset, tokenizer, seq_len, num_proc=2, cache_dir=tmp_path / "two")
    assert len(list((tmp_path / "two").glob("tokens-*_00001_of_00002.arrow"))) == 1
    assert np.array_equal(np.stack(serial.with_format("numpy")[:]["input_ids"]),
                          np.stack(parallel.with_format("numpy")[:]["input_ids"]))


def test_bad_seq_len_and_too_small_corpus(tmp_path, tokenizer):
    dataset = datasets.Dataset.from_dict({"text": ["three words here", "and four more words"]})
    for seq_len in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="seq_len must be a positive int"):
            tokenize_and_pack(dataset, tokenizer, seq_len)
    tokens = len(reference_blocks(dataset["text"], tokenizer.backend_tokenizer, tokenizer.eos_token_id, 1))
    with pytest.raises(ValueError, match=rf"the corpus has {tokens} tokens .* seq_len={tokens + 1}; "
                                         rf"use a smaller --seq_len or more data"):
        tokenize_and_pack(dataset, tokenizer, tokens + 1, cache_dir=tmp_path / "cache")
    assert len(tokenize_and_pack(dataset, tokenizer, tokens)) == 1
    with pytest.raises(ValueError, match="num_proc must be a positive int, got 0"):
        tokenize_and_pack(dataset, tokenizer, 4, num_proc=0)
    with pytest.raises(ValueError, match=r"no column 'body'; its columns are \['text'\]"):
        tokenize_and_pack(dataset, tokenizer, 4, text_field="body")


def test_cache_reuses_blocks_and_tokens_and_notices_changes(tmp_path, rng, tokenizer, monkeypatch):
    documents = random_documents(rng, rng.randint(30, 60))
    path = write_jsonl(tmp_path / "a.jsonl", documents)
    cache_dir = tmp_path / "cache"
    calls = count_tokenizer_calls(monkeypatch, tokenizer)
    seq_len = rng.randint(4, 32)

    first = tokenize_and_pack(load_text_dataset([str(path)]), tokenizer, seq_len, cache_dir=cache_dir)
    assert calls[0] > 0
    assert {file.name.split("-")[0] for file in cache_dir.iterdir()} == {"tokens", "packed"}

    packed_file = first.cache_files[0]["filename"]
    assert os.path.dirname(packed_file) == str(cache_dir) and os.path.basename(packed_file).startswith("packed-")
    written = os.stat(packed_file)

    calls[0] = 0
    again = tokenize_and_pack(load_text_dataset([str(path)]), tokenizer, seq_len, cache_dir=cache_dir)
    assert calls[0] == 0
    assert again.cache_files[0]["filename"] == packed_file
    assert (os.stat(packed_file).st_ino, os.stat(packed_file).st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert list(again["input_ids"]) == list(first["input_ids"])

    other_seq_len = seq_len + rng.randint(1, 8)
    repacked = tokenize_and_pack(load_text_dataset([str(path)]), tokenizer, other_seq_len, cache_dir=cache_dir)
    assert calls[0] == 0, "a new seq_len must reuse the cached tokens"
    assert [list(block) for block in repacked["input_ids"]] == reference_blocks(
        documents, tokenizer.backend_tokenizer, tokenizer.eos_token_id, other_seq_len)

    tokenize_and_pack(load_text_dataset([str(path)]), style_tokenizers.gpt2_style(), seq_len, cache_dir=cache_dir)
    assert calls[0] > 0, "another tokenizer must not hit the cache"

    calls[0] = 0
    documents.append("one more document 42")
    write_jsonl(path, documents)
    changed = tokenize_and_pack(load_text_dataset([str(path)]), tokenizer, seq_len, cache_dir=cache_dir)
    assert calls[0] > 0, "changed data must not hit the cache"
    assert [list(block) for block in changed["input_ids"]] == reference_blocks(
        documents, tokenizer.backend_tokenizer, tokenizer.eos_token_id, seq_len)
    assert not list(cache_dir.glob("*.tmp"))


_SECOND_RANK = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from transformers import AutoTokenizer
    from smmd_train.data.sources import load_text_dataset
    from smmd_train.data.packing import tokenize_and_pack

    tokenizer_dir, cache_dir, seq_len, *paths = sys.argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    def refuse(*args, **kwargs):
        raise AssertionError("the second process re-tokenized instead of loading the cache")
    type(tokenizer).__call__ = refuse
    packed = tokenize_and_pack(load_text_dataset(paths), tokenizer, int(seq_len), cache_dir=cache_dir)
    blocks = np.stack(packed.with_format("numpy")[:]["input_ids"])
    print(json.dumps({"sha": hashlib.sha256(blocks.tobytes()).hexdigest(), "shape": list(blocks.shape),
                      "file": packed.cache_files[0]["filename"]}))
""")


def test_a_second_process_loads_the_first_ones_cache(tmp_path, rng, tokenizer, tokenizer_dir):
    """train.py's plan: rank 0 tokenizes, then after a barrier the other ranks load its cache files."""
    paths = [str(write_jsonl(tmp_path / "a.jsonl", random_documents(rng, 40))),
             str(write_txt(tmp_path / "b.txt", random_documents(rng, 40)))]
    cache_dir = tmp_path / "cache"
    seq_len = rng.randint(4, 32)
    packed = tokenize_and_pack(load_text_dataset(paths), tokenizer, seq_len, cache_dir=cache_dir)
    blocks = np.stack(packed.with_format("numpy")[:]["input_ids"])

    environment = dict(os.environ, HF_DATASETS_CACHE=str(datasets.config.HF_DATASETS_CACHE))
    result = subprocess.run([sys.executable, "-c", _SECOND_RANK, str(tokenizer_dir), str(cache_dir), str(seq_len),
                             *paths], capture_output=True, text=True, env=environment, timeout=hang_guard(120))
    assert result.returncode == 0, result.stderr[-3000:]
    second = json.loads(result.stdout.strip().splitlines()[-1])
    assert second == {"sha": hashlib.sha256(blocks.tobytes()).hexdigest(), "shape": list(blocks.shape),
                      "file": packed.cache_files[0]["filename"]}


# ----------------------------------------------------------------------------------------------
# PackedBatches and eval_batches
# ----------------------------------------------------------------------------------------------

def block_dataset(rng: random.Random, num_blocks: int, seq_len: int = 5) -> datasets.Dataset:
    """Blocks whose first id is their row index (to identify them) followed by random ids."""
    return datasets.Dataset.from_dict(
        {"input_ids": [[row] + [rng.randrange(50_000) for _ in range(seq_len - 1)] for row in range(num_blocks)]})


def take(batches: PackedBatches, steps: int) -> list[torch.Tensor]:
    return [next(batches)["input_ids"] for _ in range(steps)]


def test_dp_ranks_split_every_step_and_cover_each_epoch(rng):
    dp_size, micro_batch_size = rng.randint(1, 4), rng.randint(1, 3)
    global_batch = dp_size * micro_batch_size
    num_blocks = rng.randint(max(global_batch, 10), 6 * global_batch + 10)
    dataset = block_dataset(rng, num_blocks)
    rows = torch.tensor(dataset["input_ids"])
    seed = rng.randrange(2**32)
    steps_per_epoch = num_blocks // global_batch

    ranks = [PackedBatches(dataset, micro_batch_size, dp_rank, dp_size, seed) for dp_rank in range(dp_size)]
    tensor_parallel_peer = PackedBatches(dataset, micro_batch_size, dp_size - 1, dp_size, seed)
    epoch_orders = []
    for epoch in range(2):
        assert all(batches.epoch == epoch for batches in ranks)
        seen = []
        for _ in range(steps_per_epoch):
            batches = [next(batches)["input_ids"] for batches in ranks]
            assert torch.equal(next(tensor_parallel_peer)["input_ids"], batches[-1])
            for batch in batches:
                assert batch.dtype == torch.long and batch.shape == (micro_batch_size, rows.shape[1])
                assert torch.equal(batch, rows[batch[:, 0]])
            step_blocks = torch.cat(batches)[:, 0].tolist()
            assert len(set(step_blocks)) == global_batch
            seen += step_blocks
        assert len(set(seen)) == steps_per_epoch * global_batch
        assert ranks[0].samples_consumed == (epoch + 1) * steps_per_epoch * global_batch
        epoch_orders.append(seen)
    assert ranks[0].epoch == 2
    assert epoch_orders[0] != epoch_orders[1]


def test_same_arguments_give_the_same_batches_and_another_seed_does_not(rng):
    dataset = block_dataset(rng, rng.randint(12, 40))
    arguments = dict(micro_batch_size=rng.randint(1, 3), dp_rank=0, dp_size=rng.randint(1, 3),
                     seed=rng.randrange(2**32 - 1))
    steps = 3 * len(dataset) // (arguments["micro_batch_size"] * arguments["dp_size"])
    first = take(PackedBatches(dataset, **arguments), steps)
    assert all(torch.equal(a, b) for a, b in zip(first, take(PackedBatches(dataset, **arguments), steps)))
    reseeded = take(PackedBatches(dataset, **{**arguments, "seed": arguments["seed"] + 1}), steps)
    assert not all(torch.equal(a, b) for a, b in zip(first, reseeded))


def test_resume_after_random_steps_continues_exactly(rng):
    dp_size, micro_batch_size = rng.randint(1, 4), rng.randint(1, 3)
    dataset = block_dataset(rng, rng.randint(dp_size * micro_batch_size, 40))
    seed = rng.randrange(2**32)
    steps_per_epoch = len(dataset) // (dp_size * micro_batch_size)
    for dp_rank in {0, rng.randrange(dp_size)}:
        consumed = rng.randint(0, 3 * steps_per_epoch)
        original = PackedBatches(dataset, micro_batch_size, dp_rank, dp_size, seed)
        take(original, consumed)
        state = json.loads(json.dumps(original.state_dict()))

        resumed = PackedBatches(dataset, micro_batch_size, dp_rank, dp_size, seed)
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.samples_consumed) == (original.epoch, original.samples_consumed)
        assert original.samples_consumed == consumed * dp_size * micro_batch_size
        later = 2 * steps_per_epoch + 1
        assert all(torch.equal(a, b) for a, b in zip(take(original, later), take(resumed, later)))

        # Another DP rank may load the state (e.g. one checkpoint per DP group); it lands at the same step.
        other_rank = (dp_rank + 1) % dp_size
        moved = PackedBatches(dataset, micro_batch_size, other_rank, dp_size, seed)
        moved.load_state_dict(state)
        reference = PackedBatches(dataset, micro_batch_size, other_rank, dp_size, seed)
        take(reference, consumed)
        assert torch.equal(next(moved)["input_ids"], next(reference)["input_ids"])


def test_resume_refuses_a_different_data_order(rng):
    dataset = block_dataset(rng, 24)
    original = PackedBatches(dataset, micro_batch_size=2, dp_rank=0, dp_size=3, seed=7)
    take(original, rng.randint(0, 10))
    state = original.state_dict()
    for changed, expected in (
            (PackedBatches(dataset, 2, 0, 3, seed=8), "seed: checkpoint 7, now 8"),
            (PackedBatches(dataset, 2, 0, 2, seed=7), "global_batch_size: checkpoint 6, now 4"),
            (PackedBatches(dataset, 3, 0, 3, seed=7), "global_batch_size: checkpoint 6, now 9"),
            (PackedBatches(dataset, 2, 0, 3, seed=7, accumulation=2), "global_batch_size: checkpoint 6, now 12"),
            (PackedBatches(block_dataset(rng, 30), 2, 0, 3, seed=7), "num_blocks: checkpoint 24, now 30")):
        with pytest.raises(ValueError, match=f"cannot resume the data order: {expected}"):
            changed.load_state_dict(state)
    fresh = PackedBatches(dataset, 2, 0, 3, seed=7)
    with pytest.raises(ValueError, match=r"missing \['position'\]"):
        fresh.load_state_dict({key: value for key, value in state.items() if key != "position"})
    with pytest.raises(ValueError, match="position=5 is not an optimizer-step start"):
        fresh.load_state_dict({**state, "position": 5})
    mid_step = PackedBatches(dataset, 1, 0, 3, seed=7, accumulation=2)
    next(mid_step)
    with pytest.raises(RuntimeError, match="between optimizer steps, not after micro-step 1 of 2"):
        mid_step.state_dict()


def layout_steps(dataset, seed, micro_batch_size, dp_size, accumulation, steps):
    """The set of blocks each optimizer step trains on, over all DP ranks and micro-steps."""
    ranks = [PackedBatches(dataset, micro_batch_size, rank, dp_size, seed, accumulation=accumulation)
             for rank in range(dp_size)]
    return [sorted(row for batches in ranks for _ in range(accumulation) for row in next(batches)["input_ids"][:, 0]
                   .tolist()) for _ in range(steps)]


def test_every_layout_of_a_global_batch_trains_the_same_blocks_in_every_step(rng):
    """Micro-batch x DP x accumulation = 8 in every way: step k holds the same blocks (Megatron's
    sampler), across epoch boundaries too (the dataset is not a multiple of 8)."""
    dataset = block_dataset(rng, rng.randint(17, 60))
    seed = rng.randrange(2**32)
    steps = 3 * (len(dataset) // 8) + 2
    layouts = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8), (2, 1, 4), (1, 8, 1)]
    expected = layout_steps(dataset, seed, *layouts[0], steps)
    assert all(len(set(blocks)) == 8 for blocks in expected)
    for layout in layouts[1:]:
        assert layout_steps(dataset, seed, *layout, steps) == expected, layout


def test_resume_under_another_layout_continues_the_same_steps(rng):
    dataset = block_dataset(rng, rng.randint(24, 50))
    seed = rng.randrange(2**32)
    before, after = (2, 2, 2), (1, 2, 4)  # micro-batch, DP, accumulation: global batch 8 both
    done = rng.randint(1, 7)
    ranks = [PackedBatches(dataset, before[0], rank, before[1], seed, accumulation=before[2])
             for rank in range(before[1])]
    for _ in range(done * before[2]):
        for batches in ranks:
            next(batches)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    resumed = [PackedBatches(dataset, after[0], rank, after[1], seed, accumulation=after[2])
               for rank in range(after[1])]
    for batches in resumed:
        batches.load_state_dict(state)
    assert resumed[0].samples_consumed == ranks[0].samples_consumed
    following = layout_steps(dataset, seed, 8, 1, 1, done + 4)[done:]
    got = [sorted(row for batches in resumed for _ in range(after[2]) for row in next(batches)["input_ids"][:, 0]
                  .tolist()) for _ in range(4)]
    assert got == following


def test_batches_need_one_global_micro_step_and_valid_ranks(rng):
    dp_size, micro_batch_size = rng.randint(1, 4), rng.randint(2, 4)
    dataset = block_dataset(rng, dp_size * micro_batch_size - 1)
    with pytest.raises(ValueError, match=rf"{len(dataset)} blocks, fewer than one optimizer step of "
                                         rf"micro_batch_size={micro_batch_size} x dp_size={dp_size} x accumulation=1"):
        PackedBatches(dataset, micro_batch_size, 0, dp_size, seed=0)
    with pytest.raises(ValueError, match="accumulation must be a positive int, got 0"):
        PackedBatches(dataset, 1, 0, 1, seed=0, accumulation=0)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, dp_size=2\), got 2"):
        PackedBatches(dataset, 1, 2, 2, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int, got 0"):
        PackedBatches(dataset, 0, 0, 1, seed=0)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\), got -1"):
        PackedBatches(dataset, 1, 0, 1, seed=-1)


def test_eval_batches_are_in_order_full_and_capped(rng):
    dataset = block_dataset(rng, rng.randint(3, 30))
    rows = torch.tensor(dataset["input_ids"])
    micro_batch_size = rng.randint(1, 3)
    full_batches = len(dataset) // micro_batch_size
    for max_batches in (None, rng.randint(1, full_batches + 2)):
        batches = [batch["input_ids"] for batch in eval_batches(dataset, micro_batch_size, max_batches)]
        expected = full_batches if max_batches is None else min(full_batches, max_batches)
        assert len(batches) == expected
        assert torch.equal(torch.cat(batches), rows[:expected * micro_batch_size])
    with pytest.raises(ValueError, match=f"{len(dataset)} blocks, fewer than micro_batch_size={len(dataset) + 1}"):
        eval_batches(dataset, len(dataset) + 1)
    with pytest.raises(ValueError, match="max_batches must be a positive int, got 0"):
        eval_batches(dataset, 1, max_batches=0)


def test_check_tokenizer_fits_model(tokenizer):
    size = len(tokenizer)
    assert check_tokenizer_fits_model(tokenizer, size) is None
    assert check_tokenizer_fits_model(tokenizer, size + 1024) is None
    message = check_tokenizer_fits_model(tokenizer, size + 1025)
    assert f"embedding has {size + 1025} rows but the tokenizer only {size} tokens" in message
    with pytest.raises(ValueError, match=rf"the tokenizer has {size} tokens but the model's embedding has {size - 1} "
                                         rf"rows: ids >= {size - 1} would index out of range"):
        check_tokenizer_fits_model(tokenizer, size - 1)


# ----------------------------------------------------------------------------------------------
# Prompt/completion records (fine-tuning): one padded row per record, the loss on the completion
# ----------------------------------------------------------------------------------------------

def random_records(rng: random.Random, count: int) -> list[dict]:
    return [{"prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) + " =",
             "completion": " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))}
            for _ in range(count)]


def write_records(path, records, extra_lines=()) -> str:
    lines = [json.dumps({"id": index, **record}, ensure_ascii=False) for index, record in enumerate(records)]
    for index, line in extra_lines:
        lines.insert(index, line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def record_ids(record: dict, backend_tokenizer, eos_token_id) -> tuple[list, list]:
    """(prompt ids, completion ids + EOS), each text tokenized on its own with no special tokens."""
    return (backend_tokenizer.encode(record["prompt"], add_special_tokens=False).ids,
            backend_tokenizer.encode(record["completion"], add_special_tokens=False).ids + [eos_token_id])


def fitting_seq_len(records, tokenizer) -> int:
    """A --seq_len that every one of ``records`` fits: its longest record's prompt + completion + EOS. (A
    fixed 96 did not always: a record of 12 multi-token words is longer, as one drawn input was.)"""
    return max(sum(map(len, record_ids(record, tokenizer.backend_tokenizer, tokenizer.eos_token_id)))
               for record in records)


def test_prompt_completion_rows_are_prompt_completion_eos_then_padding(tmp_path, rng, tokenizer):
    files = [[*random_records(rng, rng.randint(1, 10))] for _ in range(rng.randint(1, 3))]
    paths = [write_records(tmp_path / f"sft{index}.jsonl", records) for index, records in enumerate(files)]
    records = [record for file in files for record in file]
    seq_len = max(sum(map(len, record_ids(record, tokenizer.backend_tokenizer, tokenizer.eos_token_id)))
                  for record in records) + rng.randint(0, 5)
    assert data_format(paths) == "prompt_completion"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    for cache_dir in (None, tmp_path / "cache", tmp_path / "cache"):  # the third reads the second's cache file
        rows = pack_files(paths, tokenizer, seq_len, cache_dir=cache_dir)
        assert rows.column_names == ["input_ids", "labels"] and len(rows) == len(records)
        for row, record in zip(rows, records):
            prompt, completion = record_ids(record, tokenizer.backend_tokenizer, tokenizer.eos_token_id)
            padding = seq_len - len(prompt) - len(completion)
            assert row["input_ids"] == prompt + completion + [pad] * padding
            assert row["labels"] == [-100] * len(prompt) + completion + [-100] * padding
    assert len(list((tmp_path / "cache").glob("prompt-completion-*.arrow"))) == 1


def _one_rank_group():
    """A real one-rank gloo process group in this process (target_counts all-reduces its counts)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist


def test_a_padded_batch_trains_the_examples_one_by_one_and_counts_completion_tokens(tmp_path, rng, tokenizer):
    """What train.py feeds the model for a micro-batch of prompt/completion rows: its loss is the
    CE of each example run alone (unpadded) on its completion and EOS, summed and divided by the
    step's count of valid targets, which counts the completion tokens and EOS alone."""
    from helpers.models import tiny_llama

    from smmd_train.distributed.sequence_parallel import forward_inputs, micro_batch_inputs, step_targets, target_counts

    records = random_records(rng, rng.randint(3, 6))
    seq_len = 4 * -(-(fitting_seq_len(records, tokenizer) + rng.randint(0, 8)) // 4)  # SP=4 shards it below
    rows = pack_files([write_records(tmp_path / "sft.jsonl", records)], tokenizer, seq_len)
    batches = PackedBatches(rows, micro_batch_size=len(records), dp_rank=0, dp_size=1, seed=rng.randrange(2**32))
    batch = next(batches)
    model = tiny_llama(len(tokenizer), max_positions=seq_len, seed=rng.randrange(2**31)).double().eval()

    order = [int(np.flatnonzero((np.array(rows["input_ids"]) == row.numpy()).all(axis=1))[0])
             for row in batch["input_ids"]]
    completion_tokens, reference_sum = 0, 0.0
    for index in order:
        prompt, completion = record_ids(records[index], tokenizer.backend_tokenizer, tokenizer.eos_token_id)
        alone = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(alone).logits[0]
        # position t predicts token t + 1: the completion's tokens are predicted from len(prompt) - 1 on
        reference_sum += torch.nn.functional.cross_entropy(logits[len(prompt) - 1:-1], alone[0, len(prompt):],
                                                           reduction="sum").item()
        completion_tokens += len(completion)

    inputs = micro_batch_inputs(batch, "cpu")
    dist = _one_rank_group()
    try:
        counts = target_counts(step_targets(inputs).reshape(-1), None, None)
    finally:
        dist.destroy_process_group()
    assert int(counts["num_items_in_batch"]) == completion_tokens
    with torch.no_grad():  # the batch's CE in float64 (HF's own loss would upcast to float32 only)
        logits = model(inputs["input_ids"]).logits
    batch_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                  step_targets(inputs).reshape(-1), reduction="sum").item()
    # float64 throughout; the padding after a token changes nothing it attends to (causal), so only the
    # order of the sums differs from the reference: ~1e-15 relative, checked with room.
    assert abs(batch_sum / int(counts["num_items_in_batch"]) - reference_sum / completion_tokens) \
        <= 1e-12 * reference_sum / completion_tokens

    # Ulysses shards (--sp): the shards' shifted labels put together are the whole row's targets.
    shards = [forward_inputs(batch["input_ids"], sp_rank, 4, labels=batch["labels"]) for sp_rank in range(4)]
    assert torch.equal(torch.cat([shard["shift_labels"] for shard in shards], dim=1)[:, :-1], inputs["labels"][:, 1:])
    assert sum(int((step_targets(shard) != -100).sum()) for shard in shards) == completion_tokens


def test_prompt_completion_data_resumes_through_the_same_data_state(tmp_path, rng, tokenizer):
    records = random_records(rng, rng.randint(10, 30))
    rows = pack_files([write_records(tmp_path / "sft.jsonl", records)], tokenizer,
                           fitting_seq_len(records, tokenizer))
    micro_batch_size, dp_size, seed = rng.randint(1, 3), rng.randint(1, 2), rng.randrange(2**32)
    original = PackedBatches(rows, micro_batch_size, 0, dp_size, seed)
    for _ in range(rng.randint(0, 12)):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))  # as train.py's checkpoint stores it
    resumed = PackedBatches(rows, micro_batch_size, 0, dp_size, seed)
    resumed.load_state_dict(state)
    for _ in range(10):
        expected, got = next(original), next(resumed)
        assert sorted(got) == ["input_ids", "labels"]
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert all(sorted(batch) == ["input_ids", "labels"] for batch in eval_batches(rows, 2))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "completion": "b",, }', r":{line}:35: not valid JSON: Expecting property name enclosed in "
                                              r"double quotes; "),
    ('{"prompt": "1 + 1 =", "completion": " 2', r":{line}:37: not valid JSON: Unterminated string starting at; "),
    ('["prompt", "completion"]', r":{line}: a JSON list, not an object"),
    ('{"prompt": "a"}', r":{line}: the record has no 'completion' \(its keys: \['prompt'\]\)"),
    ('{"text": "a b c"}', r":{line}: a text record \('text'\) in a prompt/completion file: one format per run; the "
                          r"record has no 'prompt' or 'completion'"),
    ('{"prompt": "a", "completion": 7}', r":{line}: 'completion' must be a non-empty string, got 7"),
    ('{"prompt": "", "completion": "b"}', r":{line}: 'prompt' must be a non-empty string, got ''"),
])
def test_a_bad_prompt_completion_record_is_one_line_naming_file_and_line(tmp_path, rng, tokenizer, line, message):
    records = random_records(rng, rng.randint(2, 20))
    index = rng.randint(1, len(records))
    path = write_records(tmp_path / "sft.jsonl", records, extra_lines=[(index, line)])
    with pytest.raises(ValueError) as refused:
        pack_files([path], tokenizer, fitting_seq_len(records, tokenizer))
    text = str(refused.value)
    assert re.search(re.escape(path) + message.format(line=index + 1), text) and "\n" not in text, text


def test_formats_do_not_mix_and_a_record_longer_than_seq_len_is_named(tmp_path, rng, tokenizer):
    records = random_records(rng, 4)
    sft = write_records(tmp_path / "sft.jsonl", records)
    text = str(write_jsonl(tmp_path / "text.jsonl", random_documents(rng, 3)))
    with pytest.raises(ValueError, match=re.escape(f"mix prompt/completion files ['{sft}'] and text sources "
                                                   f"['{text}']; train on one format per run")):
        pack_files([text, sft], tokenizer, 64)
    longest = max(range(len(records)), key=lambda index: sum(map(len, record_ids(
        records[index], tokenizer.backend_tokenizer, tokenizer.eos_token_id))))
    length = sum(map(len, record_ids(records[longest], tokenizer.backend_tokenizer, tokenizer.eos_token_id)))
    with pytest.raises(ValueError, match=re.escape(f"{sft}:{longest + 1}: the record is {length} tokens (")
                       + rf".*more than --seq_len {length - 1}; raise --seq_len"):
        pack_files([sft], tokenizer, length - 1)


def test_train_py_s_set_up_reads_prompt_completion_data_and_refuses_a_broken_line(tmp_path, rng, tokenizer_dir,
                                                                                 tokenizer):
    from helpers.launching import REPO, train_flags

    from smmd_train.config.arguments import parse_args
    from smmd_train.config.run_config import RunConfig
    from smmd_train.distributed.groups import Launch
    from smmd_train.run import RunRefused, prepare_run

    records = random_records(rng, 12)
    sft = write_records(tmp_path / "sft.jsonl", records)
    flags = dict(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny", tokenizer=tokenizer_dir,
                 data=[sft], eval_data=[sft], seq_len=max(96, fitting_seq_len(records, tokenizer)), micro_batch_size=2,
                 max_steps=2, output_dir=tmp_path / "run")
    run = prepare_run(RunConfig.from_args(parse_args(train_flags(**flags))), Launch(0, 1, 0, 1, "single"),
                      until="data")
    assert run.train_blocks.column_names == ["input_ids", "labels"] and len(run.train_blocks) == len(records)
    assert run.eval_blocks.column_names == ["input_ids", "labels"]

    broken = write_records(tmp_path / "broken.jsonl", records, extra_lines=[(3, '{"prompt": "a", "completion": ')])
    with pytest.raises(RunRefused) as refused:
        prepare_run(RunConfig.from_args(parse_args(train_flags(**{**flags, "data": [broken], "eval_data": None}))),
                    Launch(0, 1, 0, 1, "single"), until="data")
    assert str(refused.value) == f"{broken}:4:31: not valid JSON: Expecting value; each line of a JSON-lines file " \
                                 "must be one JSON object"
