#!/usr/bin/env bash
# The whole test suite: `bash tools/test.sh [pytest args]`.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
