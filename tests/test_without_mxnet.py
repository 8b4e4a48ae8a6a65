"""tests/conftest.py: on a machine without MXNet (the PyTorch adapter's), what needs MXNet
skips with the reason and everything else runs as it would; with MXNet, nothing changes.
The machine is played by this interpreter given its site-packages less MXNet."""
import os
import shutil
import site
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # each test runs pytest in a fresh interpreter

_TESTS = {
    "test_top.py": "import mxnet\n\ndef test_needs_it():\n    assert mxnet.nd\n",
    "test_broken.py": "import no_such_module_here\n\ndef test_never_runs():\n    pass\n",
    "test_mixed.py": (
        "import pytest\n\n"
        "def test_numpy_only():\n    import numpy\n    assert numpy.ones(2).sum() == 2\n\n"
        "def test_inner():\n    import mxnet\n    assert mxnet.nd\n\n"
        "def test_in_a_fixture(needs_mxnet):\n    assert needs_mxnet\n\n"
        "@pytest.fixture\ndef needs_mxnet():\n    import mxnet\n    return mxnet\n\n"
        "def test_a_missing_module_of_its_own_still_fails():\n    import no_such_module_here\n"),
}
_RUN = ("import sys; sys.path[:0] = sys.argv[1:]; import pytest; "
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-p', 'no:warnings', "
        "'--continue-on-collection-errors', 'tests']))")


def _pytest(tmp_path, hide_mxnet):
    (tmp_path / "tests").mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "tests")
    for name, text in _TESTS.items():
        (tmp_path / "tests" / name).write_text(text)
    paths = [path for path in site.getsitepackages() if os.path.isdir(path)]
    if hide_mxnet:  # the same packages, less MXNet
        view = tmp_path / "site"
        view.mkdir()
        for path in paths:
            for entry in os.listdir(path):
                if not entry.lower().startswith("mxnet") and not (view / entry).exists():
                    (view / entry).symlink_to(os.path.join(path, entry))
        paths = [str(view)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([sys.executable, "-S", "-c", _RUN] + paths, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_mxnet_its_tests_skip_saying_why_and_the_rest_run(tmp_path):
    r = _pytest(tmp_path, hide_mxnet=True)
    assert "1 failed, 1 passed, 3 skipped, 1 error" in r.stdout, r.stdout + r.stderr
    reason = "needs mxnet, which is not installed (requirements.txt installs it)"
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 3 and all(reason in line for line in skips), r.stdout
    assert any("tests/test_top.py" in line for line in skips), r.stdout  # the module, named
    # any other missing module still fails, in a test and at a module's top
    assert r.stdout.count("No module named 'no_such_module_here'") >= 2, r.stdout


def test_with_mxnet_every_test_runs(tmp_path):
    pytest.importorskip("mxnet")
    r = _pytest(tmp_path, hide_mxnet=False)
    assert "1 failed, 4 passed, 1 error" in r.stdout, r.stdout + r.stderr
