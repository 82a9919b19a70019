"""What ``launch/train.py`` is made of: its arguments and command-line builder (``arguments``), the
run's plan (``plan``: tokenizer, architecture, resolved DeepSpeed config from ``config``), data
loading and packing (``data``), model presets and creation (``presets``, ``model``), process-group
start-up (``distributed``), committed checkpoints (``checkpoint``), the non-finite step guard
(``guard``), Hugging Face export (``export``), the TensorBoard monitor (``monitor``) and the memory
planner behind ``launch/estimate.py`` (``planner``). Needs the ``train`` extra.
"""
