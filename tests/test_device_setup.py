"""scripts/device_setup.sh: builds with the interpreter it is given, prints the versions, and
stops with the cause when the build cannot run or fails. A stub setup.py stands in for the
kernels' build (the real build is `python setup.py build_ext --inplace`)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # runs the setup script

_BUILDS = """
import os, sys
assert sys.argv[1:] == ["build_ext", "--inplace"], sys.argv
os.makedirs("slimgc_mx/torch", exist_ok=True)
for name in ("__init__.py", "_kernels.py", "torch/__init__.py"):
    open(os.path.join("slimgc_mx", name), "w").close()
"""
_FAILS = 'import sys\nsys.exit("kernels.c:1: error: the compiler stopped here")\n'


def _run(tmp_path, setup_py, python=sys.executable):
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "device_setup.sh"), tmp_path / "scripts")
    (tmp_path / "setup.py").write_text(setup_py)
    env = dict(os.environ, SLIMGC_PYTHON=python, TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(tmp_path / "scripts" / "device_setup.sh")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_it_builds_in_place_and_prints_the_versions(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("Cython")
    r = _run(tmp_path, _BUILDS)
    assert r.returncode == 0, r.stderr
    import Cython
    import numpy
    import torch
    lines = r.stdout.splitlines()
    assert lines[0].startswith("python %d.%d." % sys.version_info[:2])
    assert "numpy " + numpy.__version__ in lines
    assert "cython " + Cython.__version__ in lines
    assert "torch " + torch.__version__ in lines
    assert any(line.startswith("cuda ") for line in lines)
    assert lines[-1] == "kernels built; slimgc_mx.torch imports"
    assert (tmp_path / "slimgc_mx" / "_kernels.py").is_file()  # built where the script lives
    assert not list(tmp_path.glob("slimgc-build.*"))  # the log goes once the build succeeded


def test_a_failed_build_stops_with_its_output(tmp_path):
    r = _run(tmp_path, _FAILS)
    assert r.returncode == 1
    assert "the compiler stopped here" in r.stderr
    assert "[device_setup] ERROR building the kernels failed" in r.stderr
    assert r.stdout == ""  # no versions printed as if all were well


def test_a_python_that_is_not_there_is_named(tmp_path):
    r = _run(tmp_path, _BUILDS, python="python3-not-here")
    assert r.returncode == 1
    assert "no 'python3-not-here' on PATH: set SLIMGC_PYTHON" in r.stderr


def test_a_python_without_the_build_packages_is_told_what_it_lacks(tmp_path):
    """An interpreter with the standard library only (-S: no site-packages)."""
    wrapper = tmp_path / "bare-python"
    wrapper.write_text('#!/bin/sh\nexec %s -S "$@"\n' % sys.executable)
    wrapper.chmod(0o755)
    r = _run(tmp_path, _BUILDS, python=str(wrapper))
    assert r.returncode == 1
    assert "lacks numpy Cython setuptools, which building the kernels needs" in r.stderr
