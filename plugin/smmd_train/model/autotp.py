"""How DeepSpeed AutoTP splits a Llama-family model over ``tp_size`` ranks, and the one thing it
cannot split. Read from ``deepspeed/module_inject/tp_shard.py`` (``get_shard_size``) and
``layers.py`` (``VocabParallelLinear``); ``tests/train/test_presets.py`` checks these shares against
DeepSpeed's own ``get_shard_size_list``.

* **Attention** is split by key/value head: rank ``r`` gets ``kv // T + (r < kv % T)`` KV heads and
  the query heads that share them, so 9 heads over 3 KV heads at T=2 give 6 + 3 query heads and
  2 + 1 KV heads. The split need not be even; each rank needs at least one KV head, so T may not
  exceed the KV head count (a rank without heads fails in its attention's reshape).
* **MLP** widths (gate/up/down) and the **vocabulary** (the vocabulary-parallel LM head, and a tied
  embedding with it) are split near-evenly: ``total // T + (r < total % T)`` rows, the first ranks
  one more. A vocabulary of 50,257 at T=2 is 25,129 + 25,128 rows; each rank's
  ``vocab_start_index`` is the sum of the shards before it, and the loss reads it from the head.

Rank 0 always holds the largest share, which is what a memory estimate counts.
"""

from __future__ import annotations


def near_even_shares(total: int, tp_size: int) -> list:
    """Rows of each of ``tp_size`` ranks for a dimension of ``total`` split near-evenly (MLP widths,
    the vocabulary), as DeepSpeed's ``get_shard_size`` with ``tp_grain_size`` 1."""
    return [total // tp_size + (rank < total % tp_size) for rank in range(tp_size)]


def kv_head_shares(num_key_value_heads: int, tp_size: int) -> list:
    """KV heads of each of ``tp_size`` ranks; each rank also gets the query heads of its KV heads."""
    return near_even_shares(num_key_value_heads, tp_size)


def check_tensor_parallel_split(config, tp_size: int) -> None:
    """Refuse (ValueError naming the counts and what to do) a TP degree AutoTP cannot split the
    model ``config`` by: more ranks than key/value heads (a rank would hold no attention head), or
    than vocabulary rows. Uneven splits are accepted: AutoTP gives the first ranks one more KV
    head (and its query heads), MLP column or vocabulary row."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads and tp_size > kv_heads:
        raise ValueError(f"--tp {tp_size} is more than the model's num_key_value_heads={kv_heads}: AutoTP splits "
                         f"attention by whole key/value heads (each with its query heads), so rank {kv_heads} "
                         f"would hold none; use --tp {kv_heads} or less (it need not divide {kv_heads}) and "
                         "data parallelism for the other ranks")
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size and tp_size > vocab_size:
        raise ValueError(f"--tp {tp_size} is more than the model's vocab_size={vocab_size}: the vocabulary-parallel "
                         "LM head needs at least one row per rank; use a smaller --tp")
