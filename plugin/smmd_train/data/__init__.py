"""The data room. Pretraining data: load raw text, tokenize and pack it into fixed-length blocks, and serve each
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

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
