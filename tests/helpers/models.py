"""One factory for the tiny Llama models the tests train, export and load."""

import torch


def tiny_llama(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               max_positions: int = 128, seed=0, **config):
    """A randomly initialised ``LlamaForCausalLM`` (``intermediate_size = 2 * hidden_size``), seeded
    with ``torch.manual_seed(seed)`` unless ``seed`` is None; ``config``: more ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                        intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        max_position_embeddings=max_positions, **config))


def saved_activation_bytes(model, **inputs) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in ``model(**inputs)``."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs)
    return sum(saved.values())


def token_rows(ids, labels, length=None):
    """A ``torch.utils.data.Dataset`` of ``{"input_ids", "labels"}`` rows of ``ids [R, S]`` and
    ``labels``, cycling through them for ``length`` items (default R): what a Trainer test trains on."""
    rows = len(ids)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return length or rows

        def __getitem__(self, index):
            return {"input_ids": ids[index % rows], "labels": labels[index % rows]}

    return Rows()
