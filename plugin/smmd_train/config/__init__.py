"""The config room: a run's settings, read once. ``arguments`` (train.py's command line and the one
builder of train.py command lines), ``run_config`` (the flags and the DeepSpeed JSON resolved into typed,
frozen sections), ``deepspeed`` (the DeepSpeed config: read, its ``"auto"`` values resolved, checked).
"""

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
