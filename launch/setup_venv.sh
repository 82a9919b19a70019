# Sourced by launch/demo.sh and .ci/run: `. launch/setup_venv.sh EXTRAS` (from the repository root)
# creates $VENV (default .venv) if needed, activates it, installs the pinned CPU torch *first*, so pip
# never resolves a CUDA build for the package's torch>=2.4, then this package with EXTRAS (e.g. train,
# test). Idempotent: a second run finds torch in place and only refreshes the editable install.
VENV="${VENV:-.venv}"
TORCH_VERSION=2.13.0
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  python -m pip install -q --disable-pip-version-check --upgrade pip
  python -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
fi
python -m pip install -q --disable-pip-version-check -e ".[$1]"
