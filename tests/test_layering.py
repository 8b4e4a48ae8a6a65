"""Imports in layers: what imports MXNet, what runs at import, and what only a store installs.

Each check runs in a fresh interpreter, since this test process has imported everything.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


@pytest.mark.parametrize("module", ["slimgc_mx", "slimgc_mx.codecs", "slimgc_mx.threshold",
                                    "slimgc_mx.launch", "slimgc_mx.config", "slimgc_mx.env",
                                    "slimgc_mx.backup", "slimgc_mx.grad_buf",
                                    "slimgc_mx.backend", "slimgc_mx.transport",
                                    "slimgc_mx.planner", "slimgc_mx.pipeline",
                                    "slimgc_mx.notice", "slimgc_mx.aggregator",
                                    "slimgc_mx.numpy_backend", "slimgc_mx.sgd_rule"])
def test_these_modules_do_not_import_mxnet(module):
    r = _python("import sys, %s; print('mxnet' in sys.modules)" % module)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


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
def test_the_name_is_registered_in_either_import_order_and_hooks_wait_for_a_store(order):
    r = _python(_REGISTERED % order)
    assert r.returncode == 0, r.stderr
    # creating the store installed the Trainer hook and the exit guard, not the imports
    assert r.stdout.split() == ["False", "False"]


def test_hooks_are_installed_once():
    r = _python("import mxnet as mx, slimgc_mx\n"
                "import mxnet.gluon.trainer as t\n"
                "a = mx.kv.create('slimgc'); f = t.Trainer._allreduce_grads\n"
                "b = mx.kv.create('slimgc'); print(f is t.Trainer._allreduce_grads)\n"
                "from slimgc_mx import mxnet_hooks; mxnet_hooks.register()\n"
                "import mxnet.model as m, mxnet.module.module as mm\n"
                "print(m._create_kvstore is mm._create_kvstore is t._create_kvstore, "
                "m._create_kvstore.wrapped.__module__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "mxnet.model"]
