"""Sequence parallelism for Hugging Face models: DeepSpeed Ulysses (ALST), ``train.py --sp N``.

Each group of ``sp_size`` consecutive ranks trains on the same micro-batch; rank ``r`` of the group
holds the tokens ``[r * S/sp, (r + 1) * S/sp)`` of every sequence (``S`` = ``--seq_len``). Around the
core attention DeepSpeed's ``UlyssesSPAttentionHF`` swaps the sharding with an all-to-all (full
sequence, ``heads / sp`` heads), then swaps it back; everything else (embeddings, MLPs, norms, the
head and the loss) runs on the rank's shard only, so the activations per rank shrink ``sp``-fold.

    ulysses = UlyssesAttention(model, sp_size, micro_batch_size, seq_len)  # then deepspeed.initialize(mpu=ulysses.mpu)
    inputs = forward_inputs(input_ids, sp_rank, sp_size, group=group)  # this rank's shard: ids, positions, labels
    inputs.update(target_counts(inputs["shift_labels"], numeric_token_ids, group))  # the step's counts
    loss = engine(**inputs).loss                           # this shard's share of the step's loss
    engine.backward(loss * shard_loss_scale(engine, sp_size))

The layout is DeepSpeed's ``parallel_state_sp``: SP groups of consecutive ranks; ZeRO-3 partitions
over all ``dp x sp`` ranks and sums their gradients. A rank's loss is its shard's *share* of the
step's objective: sums over its targets divided by the counts of the whole step over all data- and
sequence-parallel ranks (:func:`target_counts`; train.py counts once per step), so the shares of an
SP group add up to what one rank would compute on the whole micro-batch. ZeRO-3 then divides the
summed gradients by ``dp x sp`` on its default reduce-scatter path, by ``dp`` on the other
(``zero_optimization.reduce_scatter: false``), so the share is also multiplied by
:func:`shard_loss_scale` before the backward (train.py: with accumulation x DP), and the gradient
is the step objective's, as without SP. (DeepSpeed's HF recipe instead
all-gathers each rank's mean and token count with a differentiable all-gather, whose backward sums
over the SP ranks; a numeric loss has a second count, the numeric-target positions, which that
recipe does not know.)

The batches come from :class:`smmd_train.data.batches.PackedBatches` with ``dp_rank = rank // sp``: every rank
of an SP group reads the same blocks and keeps its slice, so no data crosses the network.
``UlyssesSPDataLoaderAdapter`` is not used: it gathers a different sample from each rank of the
group and trains them one after the other, which would change what a micro-batch is. Its label
transform is kept exactly (:func:`shard_sequence`): pad with -100 and shift over the *whole*
sequence, then slice, so the target of a shard's last token (the next shard's first token) is
not lost. The whole sequence's shifted labels also go to the loss (``sequence_shard``, a
``smmd_scale.sequence_shard.SequenceShard``): a number whose digits cross a shard boundary is found
whole there, so DEL's place weights and number-level NTL are the ones of the whole sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from smmd_scale.numeric_loss import IGNORE_INDEX

from .. import compat
from ..model.presets import sliding_window_layers

# The core attention Ulysses wraps: it must be one the model runs (HF's default on every accelerator);
# eager is refused by DeepSpeed (it needs a 4D mask over the full sequence).
CORE_ATTENTION = "sdpa"


def check_sequence_parallel(config, sp_size: int, seq_len: int, tp_size: int, world_size: int) -> None:
    """Refuse what Ulysses cannot split, before any process group or weight exists (a ValueError
    naming the values): the attention heads (each rank attends with ``heads / sp`` of them; the KV
    heads must divide or be divided by ``sp``), the sequence (``seq_len`` a multiple of ``sp``), the
    world (a multiple of ``sp``), and AutoTP (see below)."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"--sp {sp_size!r} must be a positive int (the Ulysses sequence-parallel degree)")
    if sp_size == 1:
        return
    if tp_size > 1:
        # deepspeed.initialize takes one ``mpu``: AutoTP's (deepspeed.utils.groups, whose data-parallel
        # groups ZeRO-3 partitions over) or Ulysses' (parallel_state_sp, whose sequence-data-parallel
        # group is every rank and whose model-parallel size is 1). DeepSpeed 0.19 has no layout with both.
        raise ValueError(f"--sp {sp_size} with --tp {tp_size}: DeepSpeed cannot combine Ulysses sequence parallelism "
                         "with AutoTP (deepspeed.initialize takes either AutoTP's groups or Ulysses' groups as its "
                         "mpu, and ZeRO-3 would partition over the wrong ranks); use --tp 1 with --sp, or --sp 1")
    if world_size % sp_size:
        raise ValueError(f"--sp {sp_size} must divide the world size {world_size} (groups of {sp_size} consecutive "
                         "ranks share each sequence)")
    if seq_len % sp_size:
        raise ValueError(f"--seq_len {seq_len} must be a multiple of --sp {sp_size} (each rank holds seq_len / sp "
                         "tokens of every sequence)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise ValueError(f"--sp {sp_size} does not divide the model's num_attention_heads={heads}: Ulysses gives each "
                         f"rank heads / sp whole heads; use an --sp that divides {heads}")
    window = getattr(text_config, "sliding_window", None)
    sliding = sliding_window_layers(text_config)
    if sliding and window and seq_len > window:
        # DeepSpeed's Ulysses attention drops 4D masks and masks by position ids alone (causal), so a
        # window would silently become full causal attention
        raise ValueError(f"--sp {sp_size} with a sliding-window model: {sliding} of its "
                         f"{text_config.num_hidden_layers} layers attend over a window of {window} tokens, and "
                         f"--seq_len {seq_len} is longer; "
                         "DeepSpeed's Ulysses attention drops the attention mask and masks by position alone, so "
                         "those layers would attend over the whole sequence; use --sp 1, or --seq_len at most "
                         f"{window}")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(f"--sp {sp_size} and the model's num_key_value_heads={kv_heads}: one must divide the other "
                         "(Ulysses splits the KV heads, or replicates them when there are fewer than sp)")


class UlyssesAttention:
    """The SP groups of the run, and its model's attention routed through DeepSpeed Ulysses.

    Built after the model and before ``deepspeed.initialize``, which takes :attr:`mpu` (DeepSpeed's
    ``parallel_state_sp``) so that ZeRO-3 knows the layout; ``sp_size`` > 1. :meth:`destroy` undoes
    the routing and drops DeepSpeed's module-level references to the SP groups (so they can go before
    interpreter shutdown; ``smmd_train.distributed.groups.destroy_at_shutdown`` calls it)."""

    def __init__(self, model, sp_size: int, micro_batch_size: int, seq_len: int):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        implementation = compat.attention_implementation(model)
        if implementation != CORE_ATTENTION:
            raise ValueError(f"--sp needs the model's attention to be {CORE_ATTENTION!r}, but it runs "
                             f"{implementation!r}")
        self._core_attention = ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION]
        # Replaces ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION] (for every model of the process) with the
        # all-to-all around the core attention; the sequence length is fixed, so the shapes are checked.
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation=CORE_ATTENTION, sequence_parallel_size=sp_size,
            micro_batch_size=micro_batch_size, seq_length=seq_len, seq_length_is_variable=False)
        self.group = self.mpu.get_sequence_parallel_group()
        self.rank = dist.get_rank(self.group)

    def destroy(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION] = self._core_attention
        # DeepSpeed 0.19 keeps the groups in module globals (private names; no public release exists).
        compat.release_sequence_parallel_groups(self.mpu, self.group.group_name)
        self.group = None


def shard_sequence(tensor: torch.Tensor, sp_rank: int, sp_size: int) -> torch.Tensor:
    """Rank ``sp_rank``'s slice ``[..., S/sp]`` of ``tensor [..., S]`` on the last (sequence) dimension."""
    length = tensor.shape[-1]
    if length % sp_size:
        raise ValueError(f"sequence length {length} is not a multiple of sp_size={sp_size}")
    chunk = length // sp_size
    return tensor[..., sp_rank * chunk:(sp_rank + 1) * chunk]


def forward_inputs(input_ids: torch.Tensor, sp_rank: int = 0, sp_size: int = 1,
                   labels: Optional[torch.Tensor] = None, group=None) -> dict:
    """The model's training-forward inputs for ``input_ids [B, S]`` (the whole micro-batch, the same
    on every rank of the SP group) and its ``labels [B, S]`` (default: ``input_ids``; -100 where a
    token is no target, e.g. a prompt: ``smmd_train.data``).

    ``sp_size`` 1: ``{"input_ids", "labels"}`` (the model shifts the labels). Otherwise this rank's
    shard: ``input_ids``, ``position_ids`` (global positions: Ulysses gathers them for the causal
    attention) and ``shift_labels`` ``[B, S/sp]`` — the targets shifted over the whole sequence (the
    next token, -100 after the last), then sliced — also given as ``labels`` (HF computes a loss
    only when ``labels`` is set; the loss uses ``shift_labels`` as given), and ``sequence_shard``:
    the whole shifted labels and this shard's place in them, on the SP ``group`` (None: the
    default group), for the numeric losses that read whole numbers (the installed loss hook takes
    it; a model's own loss ignores it)."""
    from smmd_scale.sequence_shard import SequenceShard

    labels = input_ids if labels is None else labels
    if sp_size == 1:
        return {"input_ids": input_ids, "labels": labels}
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shift_labels = shard_sequence(shifted, sp_rank, sp_size).contiguous()
    return {"input_ids": shard_sequence(input_ids, sp_rank, sp_size).contiguous(),
            "position_ids": shard_sequence(positions, sp_rank, sp_size).contiguous(),
            "shift_labels": shift_labels, "labels": shift_labels,
            "sequence_shard": SequenceShard.even(shifted, sp_rank, sp_size, group)}


def step_targets(inputs: dict) -> torch.Tensor:
    """The targets of :func:`forward_inputs`' ``inputs``: the shard's ``shift_labels``, or the
    whole micro-batch's labels shifted (position t's target is token t + 1; the last has none)."""
    return inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]


def local_target_counts(shift_labels: torch.Tensor, numeric_token_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """``[2]`` int64: the valid targets of ``shift_labels`` (any shape) and, given the numeric
    vocabulary's ids ``numeric_token_ids`` (None: none counted), its numeric-target positions."""
    valid = shift_labels != IGNORE_INDEX
    numeric = (torch.isin(shift_labels, numeric_token_ids.to(shift_labels.device)) & valid
               if numeric_token_ids is not None else torch.zeros_like(valid))
    return torch.stack([valid.sum(), numeric.sum()]).to(torch.int64)


def target_counts(shift_labels: torch.Tensor, numeric_token_ids: Optional[torch.Tensor], group) -> dict:
    """The counts that make each rank's loss its share of the objective, as the loss's keyword
    arguments: ``num_items_in_batch`` (valid targets) and, given the numeric vocabulary's ids
    ``numeric_token_ids`` (None: the model's own loss), ``num_numeric_in_batch`` (numeric-target
    positions), both summed over the targets that the ranks of ``group`` hold (one small
    all-reduce; every rank of ``group`` must call, with its own ``shift_labels`` of any shape)."""
    counts = local_target_counts(shift_labels, numeric_token_ids)
    dist.all_reduce(counts, group=group)
    if numeric_token_ids is None:
        return {"num_items_in_batch": counts[0]}
    return {"num_items_in_batch": counts[0], "num_numeric_in_batch": counts[1]}


def shard_loss_scale(engine, sp_size: int) -> float:
    """What a rank's share of the micro-batch loss is multiplied by before ``engine.backward`` so that
    the gradient is the micro-batch loss's: ZeRO-3 sums the gradients of all ``dp x sp`` ranks and
    divides by ``dp x sp`` when it reduce-scatters them (``zero_optimization.reduce_scatter``, on by
    default), by ``dp`` when it all-reduces them (it divides by ``sp`` less there)."""
    return float(sp_size) if engine.zero_reduce_scatter() else 1.0


def micro_batch_inputs(batch: dict, device, sp_rank: int = 0, sp_size: int = 1, group=None) -> dict:
    """The forward inputs (``forward_inputs``) of a batch of ``smmd_train.data``: its ``input_ids``
    and, for prompt/completion rows, its ``labels`` (-100 on the prompt and the padding), on ``device``;
    ``group``: the SP group."""
    labels = batch.get("labels")
    return forward_inputs(batch["input_ids"].to(device), sp_rank, sp_size,
                          labels=None if labels is None else labels.to(device), group=group)
