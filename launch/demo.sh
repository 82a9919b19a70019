#!/usr/bin/env bash
# The main job: an embedded CPU demo of continued pretraining with SMMD vs CE (ZeRO-3 + AutoTP on
# 2 processes), then numeric evaluation. Nothing is downloaded from a model hub.
#   bash launch/demo.sh                     # ~8 minutes on 2 cores after the first set-up
#   bash launch/demo.sh --help              # flags to scale it up (steps, model size, data size)
# Set-up is idempotent: .venv, the pinned CPU torch (before anything can pull CUDA wheels), the package.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  python -m pip install -q --disable-pip-version-check --upgrade pip
  python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
python -m pip install -q --disable-pip-version-check -e ".[train]"

export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec python launch/demo.py "$@"
