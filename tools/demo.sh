#!/usr/bin/env bash
# The main job on the embedded default model: `bash tools/demo.sh [epd-trio demo flags]`.
source "$(dirname "$0")/env.sh"
exec epd-trio demo "$@"
