"""What ``launch/train.py`` is made of: its arguments and command-line builder (``arguments``), the
run's set-up in one call (``run``: plan, data, model and engine, the numeric loss; one train step),
the plan (``plan``: tokenizer, architecture, resolved DeepSpeed config from ``config``, numeric
vocabulary and loss), data loading and packing (``data``), model presets and creation (``presets``,
``model``), process-group start-up (``distributed``), checkpoints and the train state (``checkpoint``;
which are committed: ``commits``; resumed under another layout: ``universal``), whether an output
dir is resumed, refused or overwritten (``resume``), held-out evaluation (``evaluation``), the
non-finite step guard (``guard``), Hugging Face export (``export``), the training monitor
(``monitor``) and its TensorBoard views (``dashboards``), scaling sweeps (``scaling``), the memory
planner behind ``launch/estimate.py`` (``memory``) and ``train.py --dry_run``, the start checked for a
job's world size in one process (``dry_run``). Needs the ``train`` extra.
"""
