"""slimgc_mx: SlimGC gradient compression as an MXNet 1.9.1 KVStore plugin, and for PyTorch
as slimgc_mx.torch.DistributedOptimizer (docs/pytorch.md).

    import slimgc_mx                      # registers kvstore 'slimgc' (and 'dist_sync_slimgc')
    trainer = gluon.Trainer(params, 'sgd', {...}, kvstore='slimgc',
                            compression_params={'type': '2bit'})
    ...
    slimgc_mx.flush(trainer)              # global weights into the parameters

Importing the package does not import MXNet: the names are registered at once if MXNet
is already imported, else right after it is (mxnet.hooks.register): that hook is all this
front door knows of an adapter. The engine is slimgc_mx.engine, the adapters
slimgc_mx.mxnet (its store: slimgc_mx.mxnet.SlimGC) and slimgc_mx.torch;
`slimgc_mx.codecs`, `slimgc_mx.engine` and `slimgc_mx.launch` never import MXNet.
"""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"
__all__ = ["SlimGCConfig", "flush", "register"]


def register():
    """Register the kvstore names with MXNet (imports MXNet; idempotent)."""
    from .mxnet import hooks
    hooks.register()


def flush(trainer_or_kvstore):
    """Write the global weights into the parameters (wait for aggregations in flight).

    Accepts a gluon.Trainer or Module using a SlimGC kvstore, or the store itself; a
    no-op for any other kvstore, so scripts can call it unconditionally.
    """
    kv = getattr(trainer_or_kvstore, "_kvstore", trainer_or_kvstore)
    if getattr(kv, "is_slimgc", False):
        kv.flush()


def __getattr__(name):
    """SlimGCConfig on first use; where SlimGC lives now."""
    if name == "SlimGCConfig":
        return importlib.import_module(__name__ + ".engine.config").SlimGCConfig
    if name == "SlimGC":
        raise AttributeError("slimgc_mx.SlimGC is slimgc_mx.mxnet.SlimGC (or pass "
                             "kvstore='slimgc' by name)")
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


class _RegisterAfterMXNet(importlib.abc.MetaPathFinder):
    """Runs register() right after `import mxnet` has finished (never in a server process,
    whose import of MXNet does not return)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "mxnet":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register()

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


if "mxnet" in sys.modules:
    register()
elif not any(isinstance(f, _RegisterAfterMXNet) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterMXNet())
