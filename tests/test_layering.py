"""Imports in layers: what imports MXNet, what runs at import, and what only a store installs.

Only MXNet's adapter (slimgc_mx/mxnet/) and the experiments (slimgc_mx/bench/, scripts/)
import MXNet. Each import check runs in a fresh interpreter, since this test process has
imported everything.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The package's folders that may import MXNet: its adapter and the experiments.
MAY_IMPORT_MXNET = ("slimgc_mx/mxnet", "slimgc_mx/bench")


def _python(code, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def _package_modules():
    """{dotted name: path} of every module of the package outside MAY_IMPORT_MXNET."""
    out = {}
    for root, dirs, files in os.walk(os.path.join(ROOT, "slimgc_mx")):
        rel = os.path.relpath(root, ROOT).replace(os.sep, "/")
        dirs[:] = sorted(d for d in dirs if d != "__pycache__"
                         and rel + "/" + d not in MAY_IMPORT_MXNET)
        for name in sorted(files):
            if name.endswith(".py") and name != "__main__.py":  # __main__ runs a command
                dotted = (rel + "/" + name[:-3]).replace("/", ".")
                out[dotted[:-len(".__init__")] if name == "__init__.py" else dotted] = \
                    os.path.join(root, name)
    return out


def _mxnet_imports(path, library="mxnet"):
    """The lines of the file `path` that import MXNet itself (or `library`), at any depth of
    the code."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        if any(n == library or n.startswith(library + ".") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_mxnets_adapter_and_the_experiments_import_mxnet():
    modules = _package_modules()
    assert "slimgc_mx.engine.aggregator" in modules and "slimgc_mx.transport.base" in modules
    assert not any(m.split(".")[1:2] in (["mxnet"], ["bench"]) for m in modules)
    found = {os.path.relpath(path, ROOT): lines for path in modules.values()
             if (lines := _mxnet_imports(path))}
    assert found == {}, "import MXNet outside slimgc_mx/mxnet/ (file: lines): %s" % found


def test_the_import_check_sees_every_form_of_importing_mxnet(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os, mxnet as mx\n"
                   "from mxnet.kvstore import KVStoreBase\n"
                   "from . import mxnet\n"  # the package's own adapter: not MXNet
                   "import mxnet_like\n"
                   "def f():\n"
                   "    import mxnet.gluon.trainer as t\n")
    assert _mxnet_imports(str(src)) == [1, 2, 6]
    src.write_text("import torchvision\ndef f():\n    import torch.distributed as dist\n")
    assert _mxnet_imports(str(src), "torch") == [3]
    assert _mxnet_imports(os.path.join(ROOT, "slimgc_mx", "mxnet", "kvstore.py"))


@pytest.mark.slow
def test_importing_every_module_outside_the_adapter_leaves_mxnet_unloaded():
    """Indirectly too: a module importing the adapter at import time would load MXNet."""
    r = _python("import importlib, sys\n"
                "for name in %r:\n"
                "    importlib.import_module(name)\n"
                "    if 'mxnet' in sys.modules:\n"
                "        print(name); break\n"
                "else:\n"
                "    print('none')" % sorted(_package_modules()), timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", "importing %s loads MXNet" % r.stdout.strip()


#: The framework-free layers: the engine and what it builds on.
FRAMEWORK_FREE = ("slimgc_mx.engine", "slimgc_mx.codecs", "slimgc_mx.transport")


@pytest.mark.slow
def test_the_engine_imports_neither_framework():
    """Neither MXNet nor torch, anywhere in its code (function-level imports too), nor when
    every module of it is imported: what docs/backend.md says of the aggregator."""
    modules = {m: p for m, p in _package_modules().items() if m.startswith(FRAMEWORK_FREE)}
    assert "slimgc_mx.engine.aggregator" in modules
    found = {os.path.relpath(path, ROOT): lines for path in modules.values()
             for lib in ("mxnet", "torch") if (lines := _mxnet_imports(path, lib))}
    assert found == {}, "the engine imports a framework (file: lines): %s" % found
    r = _python("import importlib, sys\n"
                "for name in %r:\n"
                "    importlib.import_module(name)\n"
                "print(sorted({m.split('.')[0] for m in sys.modules} & {'mxnet', 'torch'}))"
                % sorted(modules), timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", "importing the engine loads %s" % r.stdout.strip()


@pytest.mark.slow
def test_the_launcher_ignores_the_callers_dmlc_role_and_warns_nothing():
    """With DMLC_ROLE=server in the shell, importing MXNet would enter the server loop."""
    env = dict(os.environ, PYTHONPATH=ROOT, DMLC_ROLE="server", DMLC_NUM_WORKER="2",
               DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9")
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.launch", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "usage: slimgc-launch" in r.stdout
    assert r.stderr == ""  # no runpy RuntimeWarning, no MXNet output


_REGISTERED = """
import sys
%s
from mxnet.kvstore import KVStoreBase
import mxnet.gluon.trainer as trainer_mod
original_step = trainer_mod.Trainer._allreduce_grads
hook = sys.excepthook
assert KVStoreBase.kv_registry["slimgc"].__name__ == "SlimGC"
kv = mx.kv.create("slimgc")
assert type(kv).__name__ == "SlimGC"
print(original_step is trainer_mod.Trainer._allreduce_grads, hook is sys.excepthook)
"""


@pytest.mark.parametrize("order", ["import slimgc_mx\nimport mxnet as mx",
                                   "import mxnet as mx\nimport slimgc_mx",
                                   # an inner module that imports MXNet, before MXNet
                                   "from slimgc_mx.mxnet.buffers import Buffer\nimport mxnet as mx"])
@pytest.mark.slow
def test_the_name_is_registered_in_either_import_order_and_hooks_wait_for_a_store(order):
    pytest.importorskip("mxnet")
    r = _python(_REGISTERED % order)
    assert r.returncode == 0, r.stderr
    # creating the store installed the Trainer hook and the exit guard, not the imports
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_hooks_are_installed_once():
    pytest.importorskip("mxnet")
    r = _python("import mxnet as mx, slimgc_mx\n"
                "import mxnet.gluon.trainer as t\n"
                "a = mx.kv.create('slimgc'); f = t.Trainer._allreduce_grads\n"
                "b = mx.kv.create('slimgc'); print(f is t.Trainer._allreduce_grads)\n"
                "from slimgc_mx.mxnet import hooks; hooks.register()\n"
                "import mxnet.model as m, mxnet.module.module as mm\n"
                "print(m._create_kvstore is mm._create_kvstore is t._create_kvstore, "
                "m._create_kvstore.wrapped.__module__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "mxnet.model"]


# ---------------------------------------------------------------- the house's layers
#: Each layer imports only from layers below it: kernels <- codecs <- engine <- adapters
#: <- experiments; the launcher and the shared utilities sit beside them.
LAYER = {"codecs": 1, "transport": 1, "engine": 2, "mxnet": 3, "torch": 3, "bench": 4}
UTILITIES = {"env", "notice", "trace", "shutdown", "dataio", "resume", "run"}


def _internal_imports(path, dotted):
    """The slimgc_mx modules that the module `dotted` at `path` imports, at any depth of
    its code (function-level imports too), absolute or relative."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = dotted.split(".") if path.endswith("__init__.py") else dotted.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("slimgc_mx"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("slimgc_mx"):
                continue
            found.add(module)
            found.update(module + "." + a.name for a in node.names)
    return found


def _graph():
    """{module: set of package modules it imports} over the whole package."""
    modules = {}
    for root, dirs, files in os.walk(os.path.join(ROOT, "slimgc_mx")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(root, ROOT).replace(os.sep, "/")
        for name in files:
            if name.endswith(".py"):
                dotted = (rel + "/" + name[:-3]).replace("/", ".")
                if name == "__init__.py":
                    dotted = dotted[:-len(".__init__")]
                modules[dotted] = os.path.join(root, name)
    return {m: {t for t in _internal_imports(p, m) if t in modules and t != m}
            for m, p in modules.items()}


def _layer(module):
    parts = module.split(".")
    if len(parts) == 1:
        return 0  # the front door
    return LAYER.get(parts[1], 0 if parts[1] in UTILITIES or parts[1] == "launch" else 3)


def test_imports_run_down_the_layers():
    graph = _graph()
    assert "slimgc_mx.engine.aggregator" in graph and "slimgc_mx.torch.optimizer" in graph
    upward = []
    for module, targets in graph.items():
        for target in targets:
            if module == "slimgc_mx" and target == "slimgc_mx.mxnet.hooks":
                continue  # the registration hook of the front door
            if _layer(target) > _layer(module) and not target.startswith(module + "."):
                upward.append("%s -> %s" % (module, target))
    assert upward == [], "imports that run back up the layers: %s" % upward


def test_the_engine_knows_no_framework_and_the_launcher_no_library():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("slimgc_mx.engine"):
            bad = [t for t in targets if t.split(".")[1:2] in (["mxnet"], ["torch"], ["bench"])]
            assert bad == [], "%s reaches into %s" % (module, bad)
        if module.startswith("slimgc_mx.launch"):
            bad = [t for t in targets if not t.startswith(("slimgc_mx.launch", "slimgc_mx.env",
                                                           "slimgc_mx.run"))
                   and t != "slimgc_mx"]
            assert bad == [], "%s imports %s (the launcher needs the standard library only)" % (
                module, bad)
        if module.startswith("slimgc_mx.mxnet"):
            assert not any(t.startswith("slimgc_mx.torch") for t in targets), module
        if module.startswith("slimgc_mx.torch"):
            assert not any(t.startswith("slimgc_mx.mxnet") for t in targets), module


def test_no_import_circles():
    graph = _graph()
    # a package's __init__ importing its own modules is no circle
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    circles, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == [], "import circles: %s" % circles


def test_the_layer_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..torch import optimizer\n")
    assert _internal_imports(str(path), "slimgc_mx.engine.x") >= {"slimgc_mx.torch",
                                                                  "slimgc_mx.torch.optimizer"}
    assert _layer("slimgc_mx.torch.optimizer") > _layer("slimgc_mx.engine.x")


def test_a_plans_sites_are_read_in_one_place():
    """Where each stage of a push runs (Plan.encode, decode, grad_check) is read by
    engine/stages.py alone; the planner writes it and push_plan.py defines it."""
    readers = set()
    for root, dirs, files in os.walk(os.path.join(ROOT, "slimgc_mx")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("encode", "decode",
                                                                     "grad_check"):
                    owner = node.value
                    if (isinstance(owner, ast.Attribute) and owner.attr == "plan"
                            or isinstance(owner, ast.Name) and owner.id == "plan"):
                        readers.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    assert "slimgc_mx/engine/stages.py" in readers
    assert readers <= {"slimgc_mx/engine/stages.py", "slimgc_mx/engine/planner.py",
                       "slimgc_mx/engine/push_plan.py"}, readers
