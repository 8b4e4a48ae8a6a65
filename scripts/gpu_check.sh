#!/usr/bin/env bash
# The GPU checks in one run, from the project root on a machine with a CUDA device, torch,
# torchvision, NumPy and Cython (no network needed): builds the kernels, runs the tests that
# skip without CUDA, then `bench gpu` on VGG-16 and ResNet-50 (batch 32; docs/benchmarks.md).
#
#   bash scripts/gpu_check.sh OUT [BASELINE]
#
# OUT gets tests.log, vgg16.md/.json, fig14.png, resnet50.md, p2.md and, when BASELINE (a
# checkout of another commit) is given, baseline.md: its SlimGC rows on the same card in the
# same run, for a before/after. Each part has its own time limit (GPU_CHECK_SCALE scales
# them, default 1) and a part that fails leaves the rest to run; GPU_CHECK_PARTS names the
# parts to run (default: tests vgg16 baseline resnet50 p2), for a lease too short for all.
# Exits non-zero only when the build fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_check.sh OUT [BASELINE]}
BASE=${2:-}
PY=${SLIMGC_PYTHON:-python3}
SCALE=${GPU_CHECK_SCALE:-1}
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/all.log" >&2; }
PARTS=" ${GPU_CHECK_PARTS:-tests vgg16 baseline resnet50 p2} "
limit() { echo $(( $1 * SCALE )); }
want() { [[ "$PARTS" == *" $1 "* ]]; }

log "building the kernels"
bash scripts/device_setup.sh >>"$OUT/all.log" 2>&1 || { log "build failed"; exit 1; }
if [ -n "$BASE" ]; then
    (cd "$BASE" && "$PY" setup.py -q build_ext --inplace >/dev/null 2>&1) &
    base_build=$!
fi

if want tests; then
    log "CUDA tests"
    timeout "$(limit 90)" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_torch_copies.py \
        tests/test_torch_device_codec.py tests/test_torch_device_path.py >"$OUT/tests.log" 2>&1
    log "tests: $(tail -n 1 "$OUT/tests.log")"
fi

bench() {  # NAME SECONDS ARGS...: one bench gpu invocation, its table as OUT/NAME.md
    local name=$1 seconds=$2
    shift 2
    want "$name" || return 0
    timeout "$(limit "$seconds")" "$PY" -m slimgc_mx.bench gpu --out "/tmp/gpu_$name" \
        --timeout 120 "$@" >>"$OUT/all.log" 2>&1
    log "$name: exit $?"
    cp "/tmp/gpu_$name/table.md" "$OUT/$name.md" 2>/dev/null
}

bench vgg16 170 --model vgg16 --procs 1 --steps 20 --warmup 8 \
    --configs no-ddp,ddp,ddp-gpu-2bit,slimgc-device,slimgc-device-nobackup,slimgc-device-cttab,slimgc-offload
cp /tmp/gpu_vgg16/results.json "$OUT/vgg16.json" 2>/dev/null
cp /tmp/gpu_vgg16/fig14.png "$OUT/fig14.png" 2>/dev/null

if [ -n "$BASE" ] && want baseline; then
    wait "$base_build"
    log "baseline"
    (cd "$BASE" && timeout "$(limit 60)" "$PY" -m slimgc_mx.bench gpu --out /tmp/gpu_base \
        --timeout 120 --model vgg16 --procs 1 --steps 20 --warmup 8 \
        --configs slimgc-offload >>"$OUT/all.log" 2>&1)
    cp /tmp/gpu_base/table.md "$OUT/baseline.md" 2>/dev/null
fi

bench resnet50 105 --model resnet50 --procs 1 --steps 20 --warmup 8 \
    --configs no-ddp,ddp,slimgc-device,slimgc-device-cttab,slimgc-offload
bench p2 95 --model vgg16 --procs 2 --steps 10 --warmup 5 \
    --configs ddp,ddp-powersgd,slimgc-device,slimgc-device-cttab,slimgc-offload
log "done"
