"""Without MXNet (a NumPy/PyTorch-only machine) the tests that need it skip, with the reason,
and the rest run; likewise the experiments' optional packages. Nothing here acts where the
packages are installed (requirements.txt installs them all).

A test marked multiprocess is marked slow as well, so that the quick tier
(bash scripts/run.sh test --quick: pytest -m "not slow") leaves it out; the longest files
run first. mnist1d_dir: the MNIST-1D arrays, generated once per session, for the launched jobs that train on them."""
import fcntl
import importlib.util
import os

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
    """A multiprocess test is slow too: the quick tier (-m "not slow") leaves it out.

    The files of LONG_FIRST go first, then those with the most slow tests (each file's
    tests in their own order), so that parallel workers (--dist loadfile hands out files in
    this order) do not end on one long file while the others idle."""
    for item in items:
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    slow, first = {}, {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: (_long_rank(item.path), -slow[item.path], first[item.path]))


#: Files holding the suite's longest single tests (measured with --durations), longest
#: first: only the order in which parallel workers take files, never what runs.
LONG_FIRST = ("test_bench_gpu.py", "test_memory_bounded.py", "test_torch_device_path.py",
              "test_torch_adapter.py", "test_cluster_torch.py", "test_faults.py",
              "test_torch_offload_codecs.py", "test_distributed.py", "test_torch_clip.py",
              "test_reliability.py", "test_torch_rendezvous.py")


def _long_rank(path):
    return LONG_FIRST.index(path.name) if path.name in LONG_FIRST else len(LONG_FIRST)


@pytest.fixture(scope="session")
def mnist1d_dir(tmp_path_factory):
    """A folder holding MNIST-1D's arrays, generated once for the session, parallel workers
    (pytest -n) included: a launched job given it as SLIMGC_DATA_DIR loads them, where each
    of its workers would otherwise generate them again (seconds of CPU each)."""
    pytest.importorskip("mnist1d")
    from slimgc_mx.bench import datasets
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above every worker's own
    path = str(root / "mnist1d-shared")
    with open(str(root / "mnist1d-shared.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker generates, the others load its file
        datasets.load("mnist1d", cache_dir=path)
    return path
