#!/usr/bin/env bash
# SGLang 0.5.23 for the interop tests (tests/sglang/), installed with --no-deps
# into <repo>/.sglang (EPD_SGLANG_DIR overrides) and never into the project's
# environment: the tests put that folder on PYTHONPATH for their SGLang
# subprocesses only. The exact list, pinned, is tools/sglang-requirements.txt;
# torch, transformers, pyzmq, numpy, pillow, aiohttp, requests, pydantic and
# the servers' small deps (click, h11, anyio) come from the project's venv.
#
# Idempotent: a stamp (the list's hash and the Python version) skips the work
# when nothing changed. Needs only PyPI. By default it uses the project's venv
# (tools/env.sh creates or refreshes it); EPD_PYTHON=/path/to/python uses that
# interpreter instead, e.g. a venv shared by several checkouts.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
if [ -n "${EPD_PYTHON:-}" ]; then
    PY="$EPD_PYTHON"
else
    source "$HERE/env.sh"
    PY="$VENV/bin/python"
fi
TARGET="${EPD_SGLANG_DIR:-$ROOT/.sglang}"
REQ="$HERE/sglang-requirements.txt"
STAMP="$TARGET/.epd-sglang-installed"
WANT="$(sha256sum < "$REQ" | cut -d' ' -f1) $("$PY" -c 'import sys; print(f"py{sys.version_info.major}.{sys.version_info.minor}")')"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "installing SGLang's receiver code into $TARGET (about 50 MB of wheels)" >&2
rm -rf "$TARGET"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --target "$TARGET" -r "$REQ"
# The receiver module, the encoder's registration code and its gRPC server (whose
# grpcio and smg-grpc-proto are the project's own dependencies, in the venv) must
# import on CPU with exactly this list plus the venv; otherwise the list is wrong: say so.
if ! PYTHONPATH="$TARGET" PYTHONWARNINGS=ignore "$PY" -c '
import sglang.srt.disaggregation.encoder.receiver
import sglang.srt.disaggregation.encoder.http_server
import sglang.srt.disaggregation.encoder.grpc_server
from sglang.srt.disaggregation.encoder.receiver import MMReceiverGrpc, WaitingZmqRequestGrpc
' >/dev/null; then
    echo "SGLang does not import from $TARGET with $PY: fix tools/sglang-requirements.txt" >&2
    exit 1
fi
echo "$WANT" > "$STAMP"
