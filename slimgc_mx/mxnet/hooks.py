"""Where SlimGC meets MXNet's training loops: the kvstore names, Trainer and Module.

register() runs once MXNet is imported and slimgc_mx too (see slimgc_mx/__init__.py):
  - registers SlimGC in MXNet's kvstore registry under 'slimgc' and 'dist_sync_slimgc',
    so mx.kv.create and every `kvstore=` argument accept both names;
  - lets MXNet's _create_kvstore create them for a single device: MXNet drops any kvstore
    name without 'dist' when there is one device, and Trainer or Module would train alone;
  - makes gluon.Trainer refuse sparse gradients for these names with a TypeError naming
    the parameters, before MXNet's own message about multi-device training.
kvstore.install() runs when the first SlimGC store is created (Trainer's end-of-step hook,
Module's global-weight reads). All are idempotent and change nothing for other kvstores.
"""
import sys
import threading

_lock = threading.Lock()
_done = set()

#: The names SlimGC is registered under in MXNet's kvstore registry. MXNet's example
#: scripts decide by the name whether a job is dist_sync: pass them 'dist_sync_slimgc'.
NAMES = ("slimgc", "dist_sync_slimgc")


def _once(step):
    with _lock:
        if step in _done:
            return False
        _done.add(step)
        return True


def is_slimgc(kvstore):
    """True for a SlimGC store or one of its registered names."""
    from .kvstore import SlimGC
    return isinstance(kvstore, SlimGC) or isinstance(kvstore, str) and kvstore.lower() in NAMES


def register():
    """Register the kvstore names, the single-device creation and the sparse check."""
    if not _once("register"):
        return
    from mxnet.kvstore import KVStoreBase

    if _slimgc_module_initializing():
        # MXNet was imported by a slimgc_mx module that is itself being imported, which the
        # kvstore module needs: importing it now would be circular, so it waits for a call
        entry = _create_slimgc
    else:
        from .kvstore import SlimGC as entry
    for name in NAMES:
        KVStoreBase.kv_registry[name] = entry
    _wrap_create_kvstore()
    _refuse_sparse_gradients()


def _slimgc_module_initializing():
    """True while some slimgc_mx module is part-way through its import."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items())
               if name.startswith("slimgc_mx.") and module is not None)


def _create_slimgc():
    """The registry's entry until the kvstore module can be imported: creates a SlimGC."""
    from .kvstore import SlimGC
    return SlimGC()


_create_slimgc.__name__ = "SlimGC"  # what MXNet's registry reports for the name


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


def _refuse_sparse_gradients():
    """gluon.Trainer with a SlimGC kvstore and sparse weights or gradients: a TypeError."""
    import mxnet.gluon.trainer as trainer_mod
    init_kvstore = trainer_mod.Trainer._init_kvstore

    def _init_kvstore(trainer):
        if is_slimgc(trainer._kvstore_params["kvstore"]):
            sparse = [p.name for p in trainer._params
                      if p._stype != "default" or p._grad_stype != "default"]
            if sparse:
                raise TypeError(
                    "slimgc aggregates dense gradients only, but parameter%s %s ha%s sparse "
                    "weights or gradients; use kvstore='dist_sync' for sparse models, or "
                    "sparse_grad=False" % ("s" if len(sparse) > 1 else "", ", ".join(sparse),
                                           "ve" if len(sparse) > 1 else "s"))
        init_kvstore(trainer)

    trainer_mod.Trainer._init_kvstore = _init_kvstore
