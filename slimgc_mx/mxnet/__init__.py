"""MXNet's adapter: the only modules of the package that import MXNet, reaching the
framework-free engine through the backend protocol (docs/backend.md). `kvstore.SlimGC` is
the store, `hooks` registers it, `framework.MXNetFramework` is the aggregator's side.
Importing this package alone imports nothing; its modules import MXNet."""


def __getattr__(name):
    """SlimGC (slimgc_mx.mxnet.SlimGC) on first use: it imports MXNet."""
    if name == "SlimGC":
        from .kvstore import SlimGC
        return SlimGC
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
