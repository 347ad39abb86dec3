# Sourced by tools/demo.sh and tools/test.sh: create or reuse .venv and install
# the project (with its test and docs extras) whenever pyproject.toml has changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EPD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# Extras beside [test,docs]: by default the CPU build of the Mooncake transfer
# engine, unless a mooncake module (e.g. the CUDA build) is already installed —
# the two must never be installed together. EPD_EXTRAS overrides ("" = none).
if [ -z "${EPD_EXTRAS+set}" ]; then
    if "$VENV/bin/python" -c "import mooncake" >/dev/null 2>&1; then EPD_EXTRAS=""; else EPD_EXTRAS="mooncake-cpu"; fi
fi
STAMP="$VENV/.epd-trio-installed"
WANT="$( (cat "$ROOT/pyproject.toml"; echo "$EPD_EXTRAS") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing epd-trio[test,docs${EPD_EXTRAS:+,$EPD_EXTRAS}] into $VENV (torch is large: a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,docs${EPD_EXTRAS:+,$EPD_EXTRAS}]"
    echo "$WANT" > "$STAMP"
fi
# Mooncake's glog: errors only (it reports "No RDMA devices found" and the like at start).
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
export PATH="$VENV/bin:$PATH"
# Nothing is ever downloaded from a model hub: models are local checkpoints
# or the generated tiny one.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # idle OpenMP threads must not spin against the trio thread
