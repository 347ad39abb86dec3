#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), the wheels tools/gpu_check.sh needs on a GPU
# machine that has no network: the packages epd-trio needs beyond what that machine's
# image holds (torch, transformers, numpy, pillow, httpx, safetensors, prometheus-client,
# pytest and hypothesis are there). Versions are pinned to this checkout's .venv.
#
#   bash tools/gpu_wheels.sh            # → .whl/ (ignored by git), ~10 MB
#
# Then carry `.whl` to the GPU machine with the checkout and run tools/gpu_check.sh there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${1:-.whl}"
PY="${EPD_VENV:-$ROOT/.venv}/bin/python"
TARGET_PY="${EPD_TARGET_PYTHON:-3.12}"  # the GPU image's python3
PACKAGES=(trio outcome sniffio hypercorn h11 h2 hpack hyperframe priority wsproto quart quart-trio
          flask blinker itsdangerous werkzeug pyzmq trio-util async-generator pytest-trio)
PLATFORMS=()
for n in 17 27 28 31 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
mkdir -p "$DEST"
if [ -d .git ] && [[ "$DEST" != /* ]] && ! grep -qxF "/${DEST#./}/" .git/info/exclude 2>/dev/null; then
    echo "/${DEST#./}/" >> .git/info/exclude
fi
pins=()
for name in "${PACKAGES[@]}"; do
    version="$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')"
    if [ -z "$version" ]; then echo "gpu_wheels: $name is not installed in $PY's environment" >&2; exit 1; fi
    pins+=("$name==$version")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${pins[@]}"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
