#!/usr/bin/env bash
# The main job: a self-contained CPU demo, CE against CE + SMMD on one-token arithmetic (Tier A of
# the numeracy study), each on one process, the SMMD run's last steps again under ZeRO-3 + AutoTP on
# 2 processes (the same losses), then greedy evaluation. Nothing is downloaded from a model hub.
#   bash launch/demo.sh                     # the study's 2,000 steps per run: 289 s after set-up on 2 idle cores
#   bash launch/demo.sh --arm ntl_was       # another of the study's arms beside CE
#   bash launch/demo.sh --help              # its options; prints at once, sets nothing up
# Set-up (launch/setup_venv.sh, shared with CI): .venv, the pinned CPU torch first, the package.
set -euo pipefail
cd "$(dirname "$0")/.."

for argument in "$@"; do
  # demo.py parses its arguments before importing anything but the standard library and
  # smmd_cli.options (which imports nothing else), so any python 3 prints the help.
  if [ "$argument" = "--help" ] || [ "$argument" = "-h" ]; then
    PYTHONPATH=plugin exec python3 launch/demo.py --help
  fi
done

# shellcheck source=launch/setup_venv.sh
. launch/setup_venv.sh train

export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec python launch/demo.py "$@"
