"""Where SlimGC meets MXNet's training loops: the kvstore names, and Trainer's step.

register() runs once MXNet is imported and slimgc_mx too (see slimgc_mx/__init__.py):
  - registers SlimGC in MXNet's kvstore registry under 'slimgc', so mx.kv.create and
    every `kvstore=` argument accept the name;
  - lets MXNet's _create_kvstore create it for a single device: MXNet drops any kvstore
    name without 'dist' when there is one device, and Trainer would train alone.
install() runs when the first SlimGC store is created:
  - gluon.Trainer's reduction: after MXNet's pushes of a step, the store sends the fused
    buckets still waiting for parameters that were not pushed (send_pending).
Both are idempotent and change nothing for other kvstores.
"""
import threading

_lock = threading.Lock()
_done = set()

#: The names SlimGC is registered under in MXNet's kvstore registry.
NAMES = ("slimgc",)


def register():
    """Register the kvstore names and the single-device creation (idempotent)."""
    with _lock:
        if "register" in _done:
            return
        _done.add("register")
    from mxnet.kvstore import KVStoreBase

    from .kvstore import SlimGC
    for name in NAMES:
        KVStoreBase.kv_registry[name] = SlimGC
    _wrap_create_kvstore()


def _wrap_create_kvstore():
    """MXNet's _create_kvstore, creating the SlimGC names for one device too.

    Module, model and gluon.trainer each imported it by name, so each reference is replaced.
    """
    import mxnet.gluon.trainer as trainer_mod
    import mxnet.model as model_mod
    import mxnet.module.module as module_mod
    from mxnet.kvstore import KVStoreBase, create

    original = model_mod._create_kvstore

    def _create_kvstore(kvstore, num_device, arg_params):
        if isinstance(kvstore, str) and kvstore.lower() in NAMES:
            kv = create(kvstore)
            return kv, kv.is_capable(KVStoreBase.OPTIMIZER)
        return original(kvstore, num_device, arg_params)

    _create_kvstore.wrapped = original
    for mod in (model_mod, trainer_mod, module_mod):
        mod._create_kvstore = _create_kvstore


def install():
    """Hook gluon.Trainer's reduction so that partial fused buckets go out (idempotent)."""
    with _lock:
        if "install" in _done:
            return
        _done.add("install")
    import mxnet.gluon.trainer as trainer_mod

    from .kvstore import SlimGC
    allreduce = trainer_mod.Trainer._allreduce_grads

    def _allreduce_grads(trainer):
        """MXNet's loop of pushes, then SlimGC sends what its fused buckets hold."""
        allreduce(trainer)
        if isinstance(trainer._kvstore, SlimGC):
            trainer._kvstore.send_pending()

    trainer_mod.Trainer._allreduce_grads = _allreduce_grads
