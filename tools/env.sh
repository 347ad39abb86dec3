# Sourced by tools/demo.sh and tools/test.sh: create or reuse .venv and install
# the project (with its test extras) whenever pyproject.toml has changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EPD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.epd-trio-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing epd-trio and its dependencies into $VENV (torch is large: a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test${EPD_EXTRAS:+,$EPD_EXTRAS}]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# Nothing is ever downloaded from a model hub: models are local checkpoints
# or the generated tiny one.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
