#!/usr/bin/env bash
# First step on a GPU machine without MXNet (the PyTorch adapter's machine), from the project
# root: builds the Cython kernels in place with the python3 found there, installing nothing
# (no network needed), then prints the versions the tests and benchmarks run on.
#
#   bash scripts/device_setup.sh      # SLIMGC_PYTHON=/path/to/python picks the interpreter
#
# Exits non-zero, naming the cause, when the interpreter lacks what the build needs, the
# build fails, or the built kernels or slimgc_mx.torch do not import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SLIMGC_PYTHON:-python3}

fail() { echo "[device_setup] ERROR $*" >&2; exit 1; }
log() { echo "[device_setup] $*" >&2; }

command -v "$PY" >/dev/null 2>&1 \
    || fail "no '$PY' on PATH: set SLIMGC_PYTHON to the Python that has numpy, Cython and torch"
missing=$("$PY" -c 'import importlib.util as u
print(" ".join(n for n in ("numpy", "Cython", "setuptools") if u.find_spec(n) is None))')
[ -z "$missing" ] || fail "$("$PY" -c 'import sys; print(sys.executable)') lacks $missing," \
    "which building the kernels needs: install them into that Python, or set SLIMGC_PYTHON" \
    "to one that has them"

build_log=$(mktemp "${TMPDIR:-/tmp}/slimgc-build.XXXXXX")
log "building the kernels with $PY (log: $build_log)"
if ! "$PY" setup.py build_ext --inplace >"$build_log" 2>&1; then
    tail -n 30 "$build_log" >&2
    fail "building the kernels failed (the build's last lines are above, all of it in" \
        "$build_log); a C compiler and Python's headers (python3-dev) are needed"
fi
"$PY" -c 'import slimgc_mx._kernels' \
    || fail "the kernels built but do not import (the error is above); full build log: $build_log"
rm -f "$build_log"

"$PY" - <<'EOF' || fail "slimgc_mx.torch does not import with torch installed (the error is above)"
import importlib.util
import platform
import sys

import Cython
import numpy

print("python", platform.python_version(), sys.executable)
print("numpy", numpy.__version__)
print("cython", Cython.__version__)
if importlib.util.find_spec("mxnet") is not None:
    print("mxnet installed (its tests run too)")
if importlib.util.find_spec("torch") is None:
    print("torch not installed: slimgc_mx.torch needs it")
    sys.exit(0)
import torch

print("torch", torch.__version__)
if torch.cuda.is_available():
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print("cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "(%s)" % names)
elif torch.version.cuda is None:
    print("cuda none: this torch is a CPU-only build")
else:
    print("cuda %s, but no device is visible" % torch.version.cuda)
import slimgc_mx.torch  # noqa: F401,E402

print("kernels built; slimgc_mx.torch imports")
EOF
