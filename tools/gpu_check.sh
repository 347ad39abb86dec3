#!/usr/bin/env bash
# The prepared GPU check: on a machine with a CUDA GPU (no network needed), run the GPU
# tests and the engine / service / production benchmarks on a real-size Qwen2.5-VL-7B
# vision tower (random weights, bfloat16) and the capacity benchmark (CPU side, null forward),
# then print a compact table. Under 9 minutes: every step has its own timeout, within one budget
# for the whole script (EPD_GPU_BUDGET, 520 s). Elsewhere it prints "no CUDA device: skipped", exit 0.
#
#   bash tools/gpu_check.sh                       # logs under $OUT (or /tmp/epd-gpu-check)
#
# Python: $PYTHON (default python3, the one that holds torch). Packages that python lacks
# come from a wheel directory, $EPD_WHEELS (default .whl, made here by tools/gpu_wheels.sh),
# installed offline into a venv that also sees $PY's own packages (torch, transformers).
# On a GPU machine without network: first `bash tools/gpu_wheels.sh` where PyPI is reachable,
# copy .whl there beside the checkout, then run `bash tools/gpu_check.sh` (allow it 580 s).
# Exit status: 0 when every step passed (or no CUDA), 1 when a step failed or timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOGS="${OUT:-/tmp/epd-gpu-check}"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
WHEELS="${EPD_WHEELS:-$ROOT/.whl}"
VENV="${EPD_GPU_VENV:-/tmp/epd-gpu-venv}"
CKPT="${EPD_GPU_CKPT:-/tmp/epd-gpu-ckpt/qwen2.5-vl-7b-vision}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
# As tools/env.sh does, and as docs/deployment.md asks of every encoder: idle OpenMP threads sleep.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device: skipped (nothing to check here; $PY sees no CUDA torch)"
    exit 0
fi

# ---- environment: the system's torch, plus our other packages from wheels ----------
# Every module epd_trio imports when it loads (tools/gpu_wheels.py lists what the image lacks).
NEEDED="import epd_trio, pytest, pytest_trio, hypothesis, msgpack"
if ! "$PY" -c "$NEEDED" >/dev/null 2>&1; then
    if [ ! -x "$VENV/bin/python" ]; then
        # $PY may itself be a venv's (the GPU image's is /opt/torch/.venv): a new venv is built
        # on the base interpreter, and --system-site-packages would show it the base's packages,
        # not torch. So a .pth file adds $PY's own site directories after the venv's (pip
        # included: the venv has none of its own), and the wheels go into the venv, first.
        "$PY" -m venv --without-pip "$VENV" || { echo "gpu_check: cannot create $VENV"; exit 1; }
        VSITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$PY" -c 'import sys; print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in sys.path if p.endswith("-packages")))' > "$VSITE/_epd_outer.pth"
    fi
    if ! "$VENV/bin/python" -c "$NEEDED" >/dev/null 2>&1; then
        if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            echo "gpu_check: $PY lacks packages ($("$PY" -c "$NEEDED" 2>&1 | tail -1)) and there is"
            echo "           no wheel directory $WHEELS: run 'bash tools/gpu_wheels.sh' where pip works"
            exit 1
        fi
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
            --disable-pip-version-check "$WHEELS"/*.whl || { echo "gpu_check: offline install from $WHEELS failed"; exit 1; }
    fi
    PY="$VENV/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "$NEEDED" || exit 1
"$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

# ---- the steps -----------------------------------------------------------------
declare -a ROWS
FAILED=0
# One budget for the whole script (set-up included), so the table is out in under 8 minutes
# however the steps fare: a step gets its own limit or what is left, whichever is less.
BUDGET="${EPD_GPU_BUDGET:-520}"
# At most 8 files under $OUT (what a remote runner brings back): a step named LOG:PART appends to
# LOG's log (LOG.log), so the logs and summary.txt stay within that.
step() {  # step NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS status left=$((BUDGET - SECONDS - 5)) log append=()
    log="$LOGS/${name%%:*}.log"; [[ "$name" == *:* ]] && append=(-a)
    if ((left < 10)); then
        ROWS+=("$(printf '%-18s %-12s %5ss' "$name" "NOT RUN" 0)"); FAILED=1
        echo; echo "== $name: not run, the ${BUDGET}s budget is spent" | tee "${append[@]}" "$log"; return
    fi
    ((limit > left)) && limit=$left
    { echo; echo "== $name (timeout ${limit}s): $*"; } | tee "${append[@]}" "$log"
    timeout -k 5 "$limit" "$@" 2>&1 | grep --line-buffered -v -E '^[IW][0-9]{4} |^USDT' | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    case $rc in 0) status=ok ;; 124|137) status="TIMEOUT"; FAILED=1 ;; *) status="FAILED ($rc)"; FAILED=1 ;; esac
    ROWS+=("$(printf '%-18s %-12s %5ss' "$name" "$status" "$((SECONDS - t0))")")
}

# torch.compile (cold Inductor cache) runs last, as step gpu_tests:compile, so a slow compile
# cannot take the other GPU tests' time or the benchmarks'.
step gpu_tests 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py -k "not compile" -p no:cacheprovider \
    -o faulthandler_timeout=110
# SGLang's own Mooncake receiver (WaitingRDMARequest) with its unmodified per-request CUDA
# landing buffer; on CPU, tests/sglang lands in a CPU tensor instead. Needs the interop env
# (tools/sglang_env.sh) and a CUDA build of mooncake-transfer-engine on that machine; without
# them (.sglang is ~270 MB, more than is copied along with the checkout) the step is skipped.
if [ -f "$ROOT/.sglang/.epd-sglang-installed" ] && "$PY" -c 'import mooncake.engine' >/dev/null 2>&1; then
    step sglang_mooncake 120 env EPD_SGLANG_LANDING=cuda EPD_REQUIRE_SGLANG=1 "$PY" -m pytest -q \
        tests/sglang/test_sglang_end_to_end.py -k mooncake -p no:cacheprovider -o faulthandler_timeout=110
else
    ROWS+=("$(printf '%-18s %-12s %5ss' sglang_mooncake "skipped" 0)")
    echo; echo "== sglang_mooncake: skipped (no .sglang interop env or no mooncake here)"
fi
# The 7B vision tower's checkpoint is built once (in bench_engine) and reused. 64 images a pass:
# from one request per forward, the adaptive cap climbs one doubling per 3 forwards, so it is
# learned within the first pass; the table shows it (cap tok), images/s and the fixed ceiling's.
step bench_engine 150 "$PY" tools/bench_engine.py --device cuda --checkpoint-dir "$CKPT" \
    --images 64 --concurrency 8 16
# bench_service has no --device: its throughput part would run the 7B tower on the CPU, so
# only the added-latency part (tiny model) runs, to see the service overhead on a fast host.
step bench_service 90 "$PY" tools/bench_service.py --quick --skip-throughput --requests 100
step bench_production 80 "$PY" tools/bench_production.py --quick --full-size --device cuda \
    --checkpoint-dir "$CKPT"
# Preprocessing: threads against processes up to 16 workers, and the device path (nvJPEG +
# the processor on CUDA), images/s per format and size.
step bench_preprocess 100 "$PY" tools/bench_preprocess.py --quick --workers 1 4 16 \
    --sizes 448 1024 --repeat 2 --device cuda
# Everything but the model: images/s and server CPU per image against preprocessing workers.
# No --plot: the 8 files under $OUT are the step logs and summary.txt.
step bench_capacity 75 "$PY" tools/bench_capacity.py --quick --null-forward --formats jpeg \
    --sizes 64 448 --workers 1 4 16 --repeats 1
# The same with preprocessing in child processes: threads share one GIL, so on many cores
# processes are what should scale.
step bench_capacity:process 60 "$PY" tools/bench_capacity.py --quick --null-forward --formats jpeg \
    --sizes 448 --workers 4 16 --repeats 1 --preprocess-mode process
# ZMQ against the raw socket at 1-64 MiB on a quiet many-core host (the target: 0.8 x raw).
step bench_transfer 40 "$PY" tools/bench_transfer.py --quick --skip-mooncake --plot ''
step gpu_tests:compile 90 "$PY" -m pytest -q -m gpu tests/test_gpu.py -k compile -p no:cacheprovider \
    -o faulthandler_timeout=80

# ---- the compact table -----------------------------------------------------------
{
    echo; echo "== gpu_check summary ($(date -u +%FT%TZ), logs in $LOGS)"
    printf '%-18s %-12s %6s\n' step status time
    printf '%s\n' "${ROWS[@]}"
    echo; echo "-- gpu tests:"; sed '/^== gpu_tests:compile/,$d' "$LOGS/gpu_tests.log" | grep -E 'passed|failed|skipped|error' | tail -1
    echo "-- bfloat16 + torch.compile (gpu_tests:compile):"
    sed -n '/^== gpu_tests:compile/,$p' "$LOGS/gpu_tests.log" | grep -E 'passed|failed|skipped|error|not run' | tail -1
    echo; echo "-- SGLang's Mooncake receiver on CUDA:"
    grep -E 'passed|failed|skipped|error' "$LOGS/sglang_mooncake.log" 2>/dev/null | tail -1 || echo "(not run)"
    echo; echo "-- engine vs bare transformers (img/s; cap tok: the learned batch cap, tokens per forward):"
    grep -E '^(config|qwen2\.5-vl-7b-vision) ' "$LOGS/bench_engine.log" || echo "(no table)"
    echo; echo "-- service:"; grep -E '^summary' "$LOGS/bench_service.log" || echo "(no summary)"
    echo; echo "-- preprocessing (images/s):"
    sed -n '/^images\/s/,$p' "$LOGS/bench_preprocess.log" || echo "(no table)"
    echo; echo "-- cache and workers:"
    sed -n '/^path /,/^$/p;/^configuration /,/^$/p' "$LOGS/bench_production.log" || true
    echo; echo "-- capacity (null forward; CPU ms per image):"
    sed -n '/^ *fmt /,/^(CPU/p' "$LOGS/bench_capacity.log" || true
    echo; echo "-- transfers (ratio to the raw socket):"
    grep -E '^zmq tcp: ' "$LOGS/bench_transfer.log" || echo "(no summary)"
} | tee "$LOGS/summary.txt"
exit $FAILED
