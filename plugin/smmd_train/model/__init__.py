"""The model room: ``presets`` (Llama-architecture presets and their exact parameter counts), ``autotp``
(how DeepSpeed AutoTP splits a model, and what it cannot), ``build`` (the model from a preset or a local
HF folder, built partitioned under ZeRO-3).
"""

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
