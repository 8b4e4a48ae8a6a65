"""setup.py: the kernels build where Python has no distutils of its own (3.12 and later)."""
import os
import shutil
import site
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # runs setup.py

# Python 3.12's situation on this interpreter: no site hooks (setuptools' distutils shim is
# not preinstalled) and the standard library's distutils refuses to import.
_NO_STDLIB_DISTUTILS = """
import runpy, sys
class NoStdlibDistutils:
    def find_spec(self, name, path=None, target=None):
        if name == "distutils":
            raise ModuleNotFoundError("No module named 'distutils'", name=name)
sys.meta_path.insert(0, NoStdlibDistutils())
sys.path[:0] = sys.argv[1].split(%r)
sys.argv = ["setup.py", "--version"]
runpy.run_path("setup.py", run_name="__main__")
""" % os.pathsep


def test_setup_py_runs_without_the_standard_librarys_distutils(tmp_path):
    shutil.copy(os.path.join(ROOT, "setup.py"), tmp_path)
    (tmp_path / "cython_ext").mkdir()
    (tmp_path / "slimgc_mx" / "codecs").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "slimgc_mx", "codecs", "layout.py"),
                tmp_path / "slimgc_mx" / "codecs")
    # Cython's part is not under test here: cythonize hands the extensions back as they are.
    (tmp_path / "stub" / "Cython").mkdir(parents=True)
    (tmp_path / "stub" / "Cython" / "__init__.py").write_text("")
    (tmp_path / "stub" / "Cython" / "Build.py").write_text(
        "def cythonize(extensions, **options):\n    return extensions\n")
    paths = [str(tmp_path / "stub")] + site.getsitepackages()
    r = subprocess.run([sys.executable, "-S", "-c", _NO_STDLIB_DISTUTILS, os.pathsep.join(paths)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "0.1.0"
    assert (tmp_path / "cython_ext" / "layout.pxd").is_file()
