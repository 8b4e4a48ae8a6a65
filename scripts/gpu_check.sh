#!/usr/bin/env bash
# The GPU checks in one run, from the project root on a machine with a CUDA device, torch,
# torchvision, NumPy and Cython (no network needed): builds the kernels, runs the tests that
# skip without CUDA, then `bench gpu` on VGG-16 at one and two ranks and ResNet-50 at one
# (batch 32; docs/benchmarks.md).
#
#   bash scripts/gpu_check.sh OUT [BASELINE]
#
# OUT gets all.log (the run's log), summary.md (the tests' last line and each part's
# Fig. 14, accounting and target rows) and results.tgz (every part's table.md,
# results.json, fig14.png, the profiles and tests.log), both rewritten after each part,
# so a run cut short keeps what it finished. When BASELINE (a checkout of another commit)
# is given, its SlimGC device-path rows on VGG-16 run on the same card in the same run,
# for a before/after. Each part has its own time limit (GPU_CHECK_SCALE scales them,
# default 1) and a part that fails leaves the rest to run; GPU_CHECK_PARTS names the parts
# to run (default: tests vgg16 baseline p2 resnet50, in that order), for a lease too short
# for all. Exits non-zero only when the build fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_check.sh OUT [BASELINE]}
BASE=${2:-}
PY=${SLIMGC_PYTHON:-python3}
SCALE=${GPU_CHECK_SCALE:-1}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/all.log" >&2; }
PARTS=" ${GPU_CHECK_PARTS:-tests vgg16 baseline p2 resnet50} "
limit() { echo $(( $1 * SCALE )); }
want() { [[ "$PARTS" == *" $1 "* ]]; }
pack() {  # every part's files so far into OUT/results.tgz, and the summary
    tar czf "$OUT/results.tgz.tmp" -C "$WORK" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
    : >"$OUT/summary.md"
    [ -f "$WORK/tests.log" ] && echo "tests: $(tail -n 1 "$WORK/tests.log")" >>"$OUT/summary.md"
    for table in "$WORK"/*/table.md; do
        [ -f "$table" ] || continue
        echo "## $(basename "$(dirname "$table")")" >>"$OUT/summary.md"
        awk '/^## /{f = /Fig. 14|accounting|Targets/; next} f && /^\| [a-z0-9]/' "$table" \
            >>"$OUT/summary.md"
    done
}

log "building the kernels"
bash scripts/device_setup.sh >>"$OUT/all.log" 2>&1 || { log "build failed"; exit 1; }
if [ -n "$BASE" ]; then
    (cd "$BASE" && "$PY" setup.py -q build_ext --inplace >/dev/null 2>&1) &
    base_build=$!
fi

if want tests; then
    log "CUDA tests"
    timeout "$(limit 100)" "$PY" -m pytest -q -rs -n 6 -p no:cacheprovider \
        tests/test_torch_copies.py tests/test_torch_device_codec.py \
        tests/test_torch_device_path.py tests/test_torch_api_floor.py \
        tests/test_torch_lowrank.py >"$WORK/tests.log" 2>&1
    log "tests: $(tail -n 1 "$WORK/tests.log")"
    pack
fi

bench() {  # NAME SECONDS ARGS...: one bench gpu invocation into WORK/NAME
    local name=$1 seconds=$2
    shift 2
    want "$name" || return 0
    log "$name"
    timeout "$(limit "$seconds")" "$PY" -m slimgc_mx.bench gpu --out "$WORK/$name" \
        --timeout 100 "$@" >>"$OUT/all.log" 2>&1
    log "$name: exit $?"
    pack
}

bench vgg16 275 --model vgg16 --procs 1 --steps 20 --warmup 8 --profile 3 \
    --configs no-ddp,ddp,ddp-fp16,ddp-powersgd,ddp-powersgd-buckets,ddp-gpu-1bit,ddp-gpu-2bit,slimgc-device,slimgc-device-nobackup,slimgc-device-nooverlap,slimgc-device-cttab,slimgc-device-offload,slimgc-offload,slimgc-placement

if [ -n "$BASE" ] && want baseline; then
    wait "$base_build"
    log "baseline"
    (cd "$BASE" && timeout "$(limit 60)" "$PY" -m slimgc_mx.bench gpu --out "$WORK/baseline" \
        --timeout 100 --model vgg16 --procs 1 --steps 20 --warmup 8 \
        --configs slimgc-device,slimgc-device-nobackup >>"$OUT/all.log" 2>&1)
    log "baseline: exit $?"
    pack
fi

bench p2 145 --model vgg16 --procs 2 --steps 10 --warmup 5 \
    --configs ddp,ddp-powersgd,ddp-gpu-1bit,ddp-gpu-2bit,slimgc-device,slimgc-device-cttab,slimgc-device-powersgd,slimgc-offload
bench resnet50 155 --model resnet50 --procs 1 --steps 20 --warmup 8 \
    --configs no-ddp,ddp,ddp-powersgd,ddp-gpu-1bit,ddp-gpu-2bit,slimgc-device,slimgc-device-nooverlap,slimgc-device-cttab,slimgc-device-offload,slimgc-offload
log "done"
cat "$OUT/summary.md"
