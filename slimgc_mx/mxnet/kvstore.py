"""SlimGC as an MXNet KVStore: kvstore='slimgc' (or 'dist_sync_slimgc') in gluon.Trainer,
Module.fit, or mx.kv.create.

A thin adapter: it turns MXNet's calling conventions (keys or lists of keys, per-device
value lists, `out`, priorities, the Updater that Trainer reads back) into calls on an
aggregator.Aggregator, which holds SlimGC's data path. Registered with MXNet by
hooks.register(). Its semantics are dist_sync's: without an optimizer a push
makes the sum over workers the key's value; with one, the updated weights.
"""
import logging
import threading

import mxnet as mx
from mxnet.kvstore import KVStoreBase

from .. import codecs, env, shutdown
from ..engine import checkpoint
from ..engine.aggregator import Aggregator, report
from ..engine.planner import check_momentum
from ..engine.config import SlimGCConfig
from ..transport import LocalTransport
from .framework import MXNetFramework

log = logging.getLogger(__name__)


class SlimGC(KVStoreBase):
    """Gradient-compression KVStore with SlimGC's threshold table, CPU offload and model backup.

    Options (see SlimGCConfig) come from kwargs, Trainer's `compression_params`
    or SLIMGC_* environment variables. `transport` overrides the automatic choice
    (MXNet dist_sync when launched as a worker, else in-process).
    """

    is_slimgc = True  # what slimgc_mx.flush() looks for (it imports no adapter)

    def __init__(self, transport=None, **options):
        self._options = dict(options)  # the script's explicit parameters (configuration.md)
        self.config = SlimGCConfig.from_sources(options)
        # Plain sums (no optimizer) are compressed only when the user chose a compressor.
        self._compressor_chosen = ("compressor" in options or "type" in options
                                   or bool(env.option_variables(["compressor"])))
        self._transport = transport
        self._agg = None  # Aggregator, built when the first key is initialized
        self._optimizer = None  # the Trainer's optimizer (it sets lr / rescale_grad on it)
        install()
        shutdown.track(self)

    # -- KVStoreBase properties ------------------------------------------------------------
    @property
    def type(self):
        """'dist_sync_slimgc', whichever name created it: MXNet's Module and example scripts
        test 'dist' and '_sync' in it to scale gradients by the workers, as for dist_sync."""
        return TYPE

    @property
    def rank(self):
        return self._ensure_transport().rank

    @property
    def num_workers(self):
        return self._ensure_transport().num_workers

    @staticmethod
    def is_capable(capability):
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError("Unknown capability: {}".format(capability))

    def _ensure_transport(self):
        if self._transport is None:
            self._transport = _create_transport(timeout=self.config.timeout,
                                               piece_bytes=self.config.piece_bytes)
        return self._transport

    def _aggregator(self, key=None):
        """The aggregator; built at the first key (a collective start), or KeyError for
        `key` when no key was initialized."""
        if self._agg is None and key is not None:
            raise KeyError("key %r was not initialized (call init or broadcast first)" % (key,))
        if self._agg is None:
            self._agg = Aggregator(self.config, self._ensure_transport(), MXNetFramework(),
                                   compress_sums=self._compressor_chosen)
            if self._optimizer is not None:
                self._agg.set_optimizer(self._optimizer)
        return self._agg

    # -- configuration ---------------------------------------------------------------------
    def set_gradient_compression(self, compression_params):
        """Choose the compressor and SlimGC options, e.g. {'type': '2bit', 'threshold': 0.5}."""
        if self._agg is not None and self._agg.planner.keys:
            raise RuntimeError("set_gradient_compression must be called before any key is "
                               "initialized (gluon.Trainer does so itself)")
        self._options.update(compression_params)
        self.config = SlimGCConfig.from_sources(self._options, source="compression_params")
        self._compressor_chosen |= "type" in compression_params or "compressor" in compression_params

    def set_optimizer(self, optimizer):
        """Run `optimizer` on the aggregated gradients, on every worker."""
        if self.config.compressor != "none":
            check_momentum(codecs.create(self.config.compressor, **self.config.codec_options),
                           getattr(optimizer, "momentum", 0.0) or 0.0,
                           "compression_params={'type': %r, 'momentum': %r}")
        self._optimizer = optimizer
        if self._agg is not None:
            self._agg.set_optimizer(optimizer)

    # -- keys ------------------------------------------------------------------------------
    def init(self, key, value):
        """Initialize keys with rank 0's values."""
        for k, v, _ in _triples(key, value, None):
            self._aggregator().add_key(k, _as_list(v)[0])

    def broadcast(self, key, value, out, priority=0):
        """Initialize `key` with rank 0's `value` and write it into `out`."""
        for k, v, o in _triples(key, value, out):
            agg = self._aggregator()
            agg.add_key(k, _as_list(v)[0])
            for dst in _as_list(o):
                agg.backup.glo_buf(k).copyto(dst)

    # -- the data path ---------------------------------------------------------------------
    def push(self, key, value, priority=0):
        """Push `value` (an NDArray, or one per device) of `key`, or lists of keys and values.

        Without an optimizer the sum over devices and workers becomes the key's value;
        with one, the optimizer's step on that sum. pull() waits for it.
        """
        for k, v, _ in _triples(key, value, None):
            self._aggregator(k).push(k, _as_list(v), None, priority)

    def pushpull(self, key, value, out=None, priority=0):
        """push, then pull into `out`; with an optimizer and `out`, the trainer's parameters:
        they get loc_buf (backup on) at once or w_{i+1} when it is ready. Without an
        optimizer `out` (default: `value`) gets the sum over devices and workers."""
        for k, v, o in _triples(key, value, out):
            agg = self._aggregator(k)
            grads, outs = _as_list(v), _as_list(o) if o is not None else None
            if self._optimizer is None:
                agg.push(k, grads, None, priority)
                agg.pull(k, outs if outs is not None else grads)
            else:
                agg.push(k, grads, outs, priority)

    def send_pending(self):
        """Send the fused buckets still waiting for parameters not pushed this step."""
        if self._agg is not None:
            self._agg.send_pending()

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Write the key's newest value (global weights, or the last sum) into `out`."""
        for k, o, _ in _triples(key, out, None):
            self._aggregator(k).pull(k, _as_list(o))

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Write rows `row_ids` of the key's newest value into the row_sparse `out`.

        SlimGC keeps every key dense, so this reads the rows of the dense value.
        """
        if row_ids is None:
            raise ValueError("row_sparse_pull needs row_ids (the rows to pull)")
        outs, ids = _as_list(out), _as_list(row_ids)
        if len(ids) == 1:
            ids = ids * len(outs)
        if len(ids) != len(outs) or isinstance(key, (list, tuple)) and len(key) != 1:
            raise ValueError("row_sparse_pull takes one key and one row_ids per out array")
        k = key[0] if isinstance(key, (list, tuple)) else key
        for dst, rows in zip(outs, ids):
            if dst.stype != "row_sparse":
                raise TypeError("row_sparse_pull writes row_sparse arrays, got stype %r; use "
                                "pull() for dense arrays" % dst.stype)
            value = mx.nd.zeros(dst.shape, dtype=dst.dtype)
            self._aggregator(k).pull(k, [value])
            mx.nd.sparse.retain(value.tostype("row_sparse"), rows).copyto(dst)

    def flush(self):
        """Wait for every aggregation in flight and write the global weights into the parameters.

        Call it before evaluating or saving a model trained with backup on: during
        training the parameters hold loc_buf (global weights plus this worker's step).
        """
        if self._agg is None:
            return
        self._agg.flush()
        mx.nd.waitall()

    def flush_local(self):
        """flush() if some parameters hold this worker's loc_buf (Module calls it before it
        reads its parameters or evaluates)."""
        if self._agg is not None and self._agg.params_local:
            self.flush()

    # -- checkpoints -----------------------------------------------------------------------
    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save everything a resumed job needs (Trainer.save_states calls this), as data.

        Flushes first, so the parameters hold the global weights (save them too). The
        optimizer's settings and state are always saved (dump_optimizer is implied).
        """
        self.flush()
        checkpoint.save(fname, self._agg)

    def load_optimizer_states(self, fname):
        """Restore a file written by save_optimizer_states (Trainer.load_states calls this)."""
        agg = self._aggregator()
        state = checkpoint.read(fname, agg)
        agg.send_pending()
        agg.pipeline.wait_idle(self.config.timeout)
        checkpoint.load(state, agg)
        self._optimizer = agg.update.optimizer

    @property
    def _updater(self):
        """What gluon.Trainer.load_states reads back: `.optimizer` is the trainer-facing one."""
        return _UpdaterView(self)

    # -- reporting -------------------------------------------------------------------------
    def stats(self):
        """Bytes on the wire versus fp32, times, and the threshold decision (aggregator.report)."""
        pieces = self._transport.pieces_declared if self._transport else 0
        return report(self._agg, self.config.compressor, pieces)

    @property
    def cttab(self):
        return self._agg.cttab if self._agg is not None else None

    @property
    def broken(self):
        """True once an aggregation failed or timed out: peers may be gone or out of step."""
        return self._agg is not None and self._agg.broken

    def close(self):
        """Stop the pipeline threads and release the transport; False if that is stuck.

        A broken store keeps its transport: releasing MXNet's dist kvstore waits
        for every peer, forever if one is dead (see shutdown.py).
        """
        if not shutdown.untrack(self):
            return True
        broken = self.broken
        if self._agg is not None:
            self._agg.close(join=not broken)
        if broken:
            return self._transport.kind != "dist_sync"
        return self._transport is None or self._transport.close(shutdown.SHUTDOWN_TIMEOUT)


#: What SlimGC.type returns.
TYPE = "dist_sync_slimgc"


class _UpdaterView:
    """Stands in for MXNet's Updater where gluon.Trainer reads `kvstore._updater.optimizer`."""

    def __init__(self, kv):
        self._kv = kv

    @property
    def optimizer(self):
        return self._kv._optimizer


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _triples(key, value, out):
    """(key, value, out) per key, for one key or lists of them (out may be None)."""
    if isinstance(key, (list, tuple)):
        outs = out if out is not None else [None] * len(key)
        if not (len(key) == len(value) == len(outs)):
            raise ValueError("keys, values and outs differ in length")
        return list(zip(key, value, outs))
    return [(key, value, out)]


def _create_transport(timeout=None, piece_bytes=0):
    """MXNet dist_sync when this process was launched as a worker, else in-process."""
    if env.launched_as_worker():
        from .dist import DistTransport
        return DistTransport(timeout=timeout, piece_bytes=piece_bytes)
    return LocalTransport()


_install_lock = threading.Lock()
_installed = False


def install():
    """When the first store is created (idempotent; nothing changes for other kvstores):
    gluon.Trainer's reduction, after MXNet's pushes of a step, sends the fused buckets
    still waiting for parameters that were not pushed (send_pending); Module, before it
    reads its parameters back (get_params, save_checkpoint, the epoch-end callback) or
    runs an inference forward pass (score, predict), gets the global weights written into
    them (during training they hold loc_buf)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    import mxnet.gluon.trainer as trainer_mod
    import mxnet.module.module as module_mod

    allreduce = trainer_mod.Trainer._allreduce_grads

    def _allreduce_grads(trainer):
        """MXNet's loop of pushes, then SlimGC sends what its fused buckets hold."""
        allreduce(trainer)
        if isinstance(trainer._kvstore, SlimGC):
            trainer._kvstore.send_pending()

    trainer_mod.Trainer._allreduce_grads = _allreduce_grads

    module = module_mod.Module
    sync_params = module._sync_params_from_devices
    forward = module.forward

    def _sync_params_from_devices(mod):
        """Module reads its parameters back: the global weights, not this worker's loc_buf."""
        if isinstance(mod._kvstore, SlimGC):
            mod._kvstore.flush_local()
        sync_params(mod)

    def _forward(mod, data_batch, is_train=None):
        """An inference forward pass (score, predict) runs on the global weights."""
        training = mod.for_training if is_train is None else is_train
        if not training and isinstance(mod._kvstore, SlimGC):
            mod._kvstore.flush_local()
        return forward(mod, data_batch, is_train)

    module._sync_params_from_devices = _sync_params_from_devices
    module.forward = _forward
