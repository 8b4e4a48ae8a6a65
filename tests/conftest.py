"""Without MXNet (a NumPy/PyTorch-only machine) the tests that need it skip, with the reason,
and the rest run; likewise the experiments' optional packages. Nothing here acts where the
packages are installed (requirements.txt installs them all).

A test marked multiprocess is marked slow as well, so that the quick tier
(bash scripts/run.sh test --quick: pytest -m "not slow") leaves it out. mnist1d_dir: the
MNIST-1D arrays, generated once per session, for the launched jobs that train on them."""
import importlib.util

import pytest

#: Packages whose absence skips the tests that import them, rather than failing them.
OPTIONAL = ("mxnet", "matplotlib", "mnist1d")
MISSING = {name for name in OPTIONAL if importlib.util.find_spec(name) is None}


def _reason(name):
    return "needs %s, which is not installed (requirements.txt installs it)" % name


def _missing_module(exc):
    """The missing optional package that `exc` reports, or None."""
    if isinstance(exc, ModuleNotFoundError):
        top = (exc.name or "").split(".")[0]
        if top in MISSING:
            return top
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports MXNet at its top is one skip, not a collection error."""
    report = yield
    if MISSING and report.failed and isinstance(collector, pytest.Module):
        text = str(report.longrepr)
        for name in sorted(MISSING):
            if "ModuleNotFoundError: No module named %r" % name in text:
                report.outcome = "skipped"
                report.longrepr = (str(collector.path), 0, "Skipped: " + _reason(name))
                break
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed only because it imported a missing optional package is skipped."""
    report = yield
    name = _missing_module(call.excinfo.value) if call.excinfo is not None else None
    if name is not None and report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "Skipped: " + _reason(name))
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A multiprocess test is slow too: the quick tier (-m "not slow") leaves it out."""
    for item in items:
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def mnist1d_dir(tmp_path_factory):
    """A folder holding MNIST-1D's arrays, generated once for the session: a launched job
    given it as SLIMGC_DATA_DIR loads them, where each of its workers would otherwise
    generate them again (seconds of CPU each)."""
    pytest.importorskip("mnist1d")
    from slimgc_mx.bench import datasets
    path = str(tmp_path_factory.mktemp("mnist1d"))
    datasets.load("mnist1d", cache_dir=path)
    return path
