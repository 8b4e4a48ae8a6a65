"""slimgc_mx: SlimGC gradient compression as an MXNet 1.9.1 KVStore plugin.

    import slimgc_mx                      # registers kvstore 'slimgc'
    trainer = gluon.Trainer(params, 'sgd', {...}, kvstore='slimgc',
                            compression_params={'type': '2bit'})
    ...
    slimgc_mx.flush(trainer)              # global weights into the parameters

Importing this package imports mxnet; in a server or scheduler process that is
where MXNet's server loop runs.
"""
from .config import SlimGCConfig
from .kvstore import SlimGC

__version__ = "0.1.0"
__all__ = ["SlimGC", "SlimGCConfig", "flush"]


def flush(trainer_or_kvstore):
    """Write the global weights into the parameters (wait for aggregations in flight).

    Accepts a gluon.Trainer using kvstore='slimgc' or a SlimGC instance; a no-op
    for any other kvstore, so scripts can call it unconditionally.
    """
    kv = getattr(trainer_or_kvstore, "_kvstore", trainer_or_kvstore)
    if isinstance(kv, SlimGC):
        kv.flush()
