#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), the wheels tools/gpu_check.sh needs on a GPU
# machine that has no network: epd-trio's requirements (and its test extra) that the
# machine's image lacks, as tools/gpu_wheels.py lists them, pinned to this checkout's .venv.
# The video and audio decoders (av, soundfile) stay out: imported only for those media,
# and av alone is 36 MB.
#
#   bash tools/gpu_wheels.sh            # → .whl/ (ignored by git), ~13 MB
#
# Then carry `.whl` to the GPU machine with the checkout and run tools/gpu_check.sh there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${1:-.whl}"
PY="${EPD_VENV:-$ROOT/.venv}/bin/python"
TARGET_PY="${EPD_TARGET_PYTHON:-3.12}"  # the GPU image's python3
PLATFORMS=()
for n in 17 27 28 31 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
mkdir -p "$DEST"
if [ -d .git ] && [[ "$DEST" != /* ]] && ! grep -qxF "/${DEST#./}/" .git/info/exclude 2>/dev/null; then
    echo "/${DEST#./}/" >> .git/info/exclude
fi
# Old wheels go: two versions of one package stop the offline install there.
rm -f "$DEST"/*.whl
mapfile -t pins < <("$PY" "$ROOT/tools/gpu_wheels.py" --python-version "$TARGET_PY")
[ "${#pins[@]}" -gt 0 ] || { echo "gpu_wheels: no package list" >&2; exit 1; }
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${pins[@]}"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
