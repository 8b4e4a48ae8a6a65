"""Without MXNet (a NumPy/PyTorch-only machine) the tests that need it skip, with the reason,
and the rest run; likewise the experiments' optional packages. Nothing here acts where the
packages are installed (requirements.txt installs them all)."""
import importlib.abc
import importlib.util
import sys

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


class _SkipTheModule(importlib.abc.MetaPathFinder):
    """While a test module is imported, importing a missing optional package skips it."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in MISSING:
            raise pytest.skip.Exception(_reason(top), allow_module_level=True)
        return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports MXNet at its top is one skip, not a collection error."""
    if not MISSING or not isinstance(collector, pytest.Module):
        return (yield)
    finder = _SkipTheModule()
    sys.meta_path.insert(0, finder)
    try:
        report = yield
    finally:
        sys.meta_path.remove(finder)
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if any(_reason(name) in reason for name in MISSING):
            report.longrepr = (str(collector.path), 0, reason)  # the module, not this file
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
