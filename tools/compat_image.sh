#!/usr/bin/env bash
# The tests against the GPU image's transformers, run here before the GPU check relies on it.
#
#   bash tools/compat_image.sh [pytest args]     # default: tests --ignore=tests/sglang -q
#
# The GPU image (its pip list) holds transformers 5.17.0 and
# huggingface_hub 1.33.0, which gpu_check.sh uses as they are; the project's venv has newer
# ones. Those two versions are installed with --no-deps into a folder of their own and put
# first on PYTHONPATH (the venv is left as it is; subprocesses see the same). tests/sglang
# is left out by default: the GPU check runs SGLang's receiver only where its interop env is.
# EPD_COMPAT_TRANSFORMERS / EPD_COMPAT_HUB pick other versions when the image changes.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
TF="${EPD_COMPAT_TRANSFORMERS:-5.17.0}"
HUB="${EPD_COMPAT_HUB:-1.33.0}"
DIR="${EPD_COMPAT_DIR:-/tmp/epd-compat-transformers-$TF-hub-$HUB}"
if [ ! -f "$DIR/.installed" ]; then
    rm -rf "$DIR"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$DIR" \
        "transformers==$TF" "huggingface_hub==$HUB"
    touch "$DIR/.installed"
fi
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" -c 'import transformers, huggingface_hub as h
print(f"compat_image: transformers {transformers.__version__}, huggingface_hub {h.__version__}")'
if [ $# -eq 0 ]; then set -- tests --ignore=tests/sglang -q; fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
