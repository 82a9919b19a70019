"""The tools room: programs beside training, reached from ``smmd_train.commands``, launch/ and
``train.py --dry_run``. ``memory`` (the memory planner behind ``smmd-estimate``), ``scaling`` (scaling
sweeps and their TensorBoard view), ``gguf_convert`` (a GGUF file as an HF folder,
``smmd-convert-gguf``), ``dry_run`` (a job's start at its real world size, in one process).
"""
