#!/usr/bin/env bash
# One entry point for a fresh machine: creates/updates the project venv, builds the
# Cython kernels, then runs what was asked.
#
#   bash scripts/run.sh test [PYTEST_ARGS...]   # the whole test suite (what CI runs), its
#                                               # files on min(cores, 4) workers side by side
#                                               # (SLIMGC_TEST_WORKERS=N; 0: one process)
#   bash scripts/run.sh test --quick [ARGS...]  # the quick tier, under 2 minutes on 2 cores:
#                                               # the engine's, codecs' and adapters' unit
#                                               # tests, pytest -m "not slow" (tests that
#                                               # launch processes or train for seconds are
#                                               # marked slow)
#   bash scripts/run.sh train [TRAIN_ARGS...]   # the main job: 2 workers + 2 servers, slimgc 2bit,
#                                               # MNIST-1D, on an emulated 1 Gbit/s cluster when
#                                               # this machine can make one (root, namespaces);
#                                               # with --framework torch: through PyTorch, 2
#                                               # workers over Gloo, no servers
#   bash scripts/run.sh setup                   # only install and build
#   bash scripts/run.sh python ARGS...          # the venv's python (e.g. -m slimgc_mx.bench codecs)
#   bash scripts/run.sh horovod                 # optional: Horovod 0.28.1 for the benchmark's
#                                               # horovod-fp32/-fp16 baselines (builds ~2-5 min)
#
# Environment: SLIMGC_VENV (default .venv), SLIMGC_PYTHON (default python3.11, else python3),
# SLIMGC_TEST_WORKERS (test workers; default min(cores, 4)).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SLIMGC_VENV:-$ROOT/.venv}
BASE_PY=${SLIMGC_PYTHON:-$(command -v python3.11 || command -v python3)}

log() { echo "[run.sh] $*" >&2; }

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating virtual environment $VENV"
        "$BASE_PY" -m venv "$VENV"
    fi
    local stamp="$VENV/.slimgc-requirements.sha256"
    local want
    want=$(cat requirements.txt setup.py pyproject.toml | sha256sum | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        log "installing pinned dependencies (requirements.txt)"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q -r requirements.txt
        "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
        echo "$want" > "$stamp"
    fi
    # Incremental: cythonize and build_ext skip what is up to date.
    "$VENV/bin/python" setup.py -q build_ext --inplace >/dev/null
}

# System tools of the multi-host test (tests/test_ssh_hosts.py): OpenSSH's server and
# client, iproute2. Installed only as root with apt-get; otherwise that test is skipped.
system_tools() {
    if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && command -v ip >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "openssh-server/iproute2 missing and not root on apt: the multi-host ssh test is skipped"
        return
    fi
    log "installing openssh-server, openssh-client, iproute2 (the multi-host ssh test)"
    local pkgs=(openssh-server openssh-client iproute2)
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${pkgs[@]}" >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${pkgs[@]}" >/dev/null 2>&1 \
            || log "could not install ${pkgs[*]}: the multi-host ssh test is skipped"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup)
        setup ;;
    test)
        quick=()
        if [ "${1:-}" = --quick ]; then
            shift
            quick=(-m "not slow")
        fi
        setup
        if [ ${#quick[@]} -eq 0 ]; then
            system_tools  # the quick tier has no multi-host test
        fi
        [ $# -eq 0 ] && set -- tests
        # Test files run side by side on min(cores, 4) workers, each file's tests on one
        # worker (they share launched jobs); SLIMGC_TEST_WORKERS=0 runs them in this process.
        workers=${SLIMGC_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
        [ "$workers" -gt 4 ] && workers=4
        unset SLIMGC_TEST_WORKERS  # this script's, not a slimgc option: not for the tests
        exec "$VENV/bin/python" -m pytest -q -n "$workers" --dist loadfile "${quick[@]}" "$@" ;;
    train)
        setup
        framework=mxnet help=0 prev=
        for arg in "$@"; do
            case "$arg" in
                -h|--help) help=1 ;;
                --framework=*) framework=${arg#--framework=} ;;
            esac
            [ "$prev" = --framework ] && framework=$arg
            prev=$arg
        done
        case "$framework" in
            mxnet) job=(-n 2 -s 2) who="2 workers + 2 servers" ;;
            torch) job=(-n 2 --framework torch) who="2 PyTorch workers (Gloo, no servers)" ;;
            *) echo "run.sh train: --framework $framework: expected mxnet or torch" >&2
               exit 2 ;;
        esac
        if [ "$help" = 1 ]; then
            exec "$VENV/bin/python" scripts/train.py --framework "$framework" --help
        fi
        if why=$("$VENV/bin/python" -m slimgc_mx.launch.netns --check); then
            where=(--launcher netns --bandwidth 1gbit)
            log "$who, each in its own network namespace on a 1 Gbit/s link"
        else
            where=(--launcher local)
            log "$who on loopback ($why): with no link to save, compression" \
                "may not pay, and the threshold table may choose full precision"
        fi
        exec "$VENV/bin/python" -m slimgc_mx.launch "${job[@]}" "${where[@]}" \
            "$VENV/bin/python" scripts/train.py --kvstore slimgc --compressor 2bit \
            --model cnn1d --dataset mnist1d "$@" ;;
    python)
        setup
        exec "$VENV/bin/python" "$@" ;;
    horovod)
        setup
        if "$VENV/bin/python" -c "import horovod.mxnet" 2>/dev/null; then
            log "Horovod with MXNet support is installed"; exit 0
        fi
        log "building Horovod 0.28.1 against the MXNet wheel (Gloo, no MPI)"
        "$VENV/bin/python" -m pip install -q -r requirements-horovod.txt
        HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_CPU_OPERATIONS=GLOO \
            "$VENV/bin/python" -m pip install -q --no-build-isolation --no-cache-dir horovod==0.28.1
        "$VENV/bin/python" -c "import horovod.mxnet as h; assert h.gloo_built()" ;;
    *)
        echo "usage: bash scripts/run.sh {test|train|setup|python|horovod} [ARGS...]" >&2
        exit 2 ;;
esac
