#!/usr/bin/env bash
# A scaling sweep: train.py once per (world size, TP degree) through the deepspeed launcher, then the
# scaling view in TensorBoard (tokens/s, per-rank tokens/s, efficiency, memory vs world size):
#   bash launch/scaling.sh --world_sizes 1,2,4 [--tp 1,2] [--sp 1,2] [--weak] --max_steps N --output_dir DIR \
#       [any train.py option ...]
#   tensorboard --logdir DIR/tensorboard
# Options: bash launch/scaling.sh --help (and smmd_train/tools/scaling.py). Uses the active Python
# environment (PYTHON overrides it); relative paths are taken from where it is called.
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/scaling.py" "$@"
