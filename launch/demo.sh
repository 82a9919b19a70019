#!/usr/bin/env bash
# The main job: a self-contained CPU demo of continued pretraining with SMMD vs CE (ZeRO-3 + AutoTP on
# 2 processes), then numeric evaluation. Nothing is downloaded from a model hub.
#   bash launch/demo.sh                     # ~4.5 minutes on 2 cores after the first set-up
#   bash launch/demo.sh --help              # flags to scale it up (steps, model size, data size)
# Set-up (launch/setup_venv.sh, shared with CI): .venv, the pinned CPU torch first, the package.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=launch/setup_venv.sh
. launch/setup_venv.sh train

export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec python launch/demo.py "$@"
