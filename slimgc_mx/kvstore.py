"""The SlimGC KVStore: `kvstore='slimgc'` in gluon.Trainer.

A short composition: SlimGCConfig (options), CTTab (which tensors to compress),
Pipeline (grad_buf -> codec -> transport -> aggregate), FusedRoute (the
full-precision tensors in one transfer), ModelBackup (loc_buf / glo_buf),
SGDKernel (both updates, for MXNet's SGD) and a Transport (MXNet dist_sync, or
in-process). The optimizer runs on every worker on the aggregated gradient, so
all workers hold the same global weights bit for bit.
"""
import atexit
import logging
import os
import pickle
import sys
import weakref
from functools import partial

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from . import agreement, codecs, sgd
from .backup import LocalUpdater, ModelBackup, clone_optimizer
from .config import SlimGCConfig
from .fusion import FusedRoute
from .pipeline import GradCheck, Job, KeyBuffers, Pipeline
from .threshold import CTTab, NEVER
from .transport import FUSED_KEY_BASE, Buffer, EngineNotifier, copy_array, create_transport

log = logging.getLogger(__name__)


@KVStoreBase.register
class SlimGC(KVStoreBase):
    """Gradient-compression KVStore with SlimGC's threshold table, CPU offload and model backup.

    Options (see SlimGCConfig) come from kwargs, Trainer's `compression_params`
    or SLIMGC_* environment variables. `transport` overrides the automatic choice
    (MXNet dist_sync when launched as a worker, else in-process).
    """

    def __init__(self, transport=None, **options):
        self.config = SlimGCConfig.from_sources(options)
        self._transport = transport
        self._keys = {}  # user key -> KeyBuffers
        self._steps = {}  # user key -> steps pushed
        self._optimizer = None  # the Trainer's optimizer (it sets lr / rescale_grad on it)
        self._glo_updater = None  # updates glo_buf on the aggregation thread
        self._sgd = None  # SGDKernel: the updates of glo_buf and loc_buf for MXNet's SGD
        self._local_updater = None
        self._pipeline = None
        self._engine = None  # EngineNotifier
        self._backup = None
        self._cttab = None
        self._codec = None  # the prototype codec; each key gets a clone
        self._fused = None  # FusedRoute, built at the first step after the CTTab's decision
        self._next_fused_key = FUSED_KEY_BASE
        self._counters = {"wire": 0, "fp32": 0, "comm_s": 0.0, "compress_s": 0.0,
                          "transfers": 0, "compressed_transfers": 0}
        _LIVE.add(self)
        _ALL.add(self)

    # -- KVStoreBase properties ------------------------------------------------------------
    @property
    def type(self):
        return "slimgc"

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

    # -- configuration ---------------------------------------------------------------------
    def set_gradient_compression(self, compression_params):
        """Choose the compressor and SlimGC options, e.g. {'type': '2bit', 'threshold': 0.5}."""
        if self._keys:
            raise RuntimeError("set_gradient_compression must be called before any key is "
                               "initialized (gluon.Trainer does so itself)")
        self.config = self.config.replace(compression_params)

    def set_optimizer(self, optimizer):
        """Run `optimizer` on the aggregated gradients, on every worker."""
        self._optimizer = optimizer
        self._glo_updater = mx.optimizer.get_updater(clone_optimizer(optimizer))
        self._local_updater = None
        self._sgd = self._sgd_kernel() if self._pipeline is not None else None  # else at _start

    def _sgd_kernel(self):
        """The CPU kernel for the optimizer's updates, or None for optimizers other than SGD."""
        if not sgd.supports(self._glo_updater.optimizer):
            return None
        return sgd.SGDKernel(self._glo_updater, self.config.num_threads)

    # -- keys ------------------------------------------------------------------------------
    def _ensure_transport(self):
        if self._transport is None:
            self._transport = create_transport(timeout=self.config.timeout,
                                               piece_bytes=self.config.piece_bytes)
        return self._transport

    def _start(self):
        if self._pipeline is not None:
            return
        transport = self._ensure_transport()
        cfg = self.config
        if cfg.compressor == "none":
            self._codec = None
            self._cttab = CTTab(NEVER, cfg.warmup_steps, cfg.cttab_rule)
        else:
            self._codec = codecs.create(cfg.compressor, threshold=cfg.threshold,
                                        num_threads=cfg.num_threads)
            self._cttab = CTTab(cfg.comm_threshold, cfg.warmup_steps, cfg.cttab_rule)
        transport.check_exact_sums()
        agreement.check(transport, dict(cfg.agreement_fields(), num_workers=transport.num_workers,
                                         lanes=self._lane_format(),
                                         bigarray_bound=transport.bigarray_bound))
        self._engine = engine = EngineNotifier()
        self._backup = ModelBackup(cfg.backup, cfg.timeout, engine)
        engine.on_error = partial(self._backup.fail, where="an operator run by MXNet's engine")
        self._pipeline = Pipeline(transport, self._finish, self._backup.fail, engine)
        if self._glo_updater is not None:
            self._sgd = self._sgd_kernel()
        log.info("slimgc: rank %d/%d, transport %s, %s", transport.rank, transport.num_workers,
                 transport.kind, cfg)

    def _lane_format(self):
        if self._codec is None:
            return "float32"
        n = self._transport.num_workers
        return (self._codec.name, self._codec.wire_bits_per_element(n))

    def _add_key(self, key, value):
        self._start()
        if key in self._keys:
            raise ValueError("key %r is already initialized" % (key,))
        if value.stype != "default":
            raise TypeError("key %r: slimgc supports dense (default storage) arrays only, "
                            "got stype %r; use kvstore='dist_sync' for sparse gradients"
                            % (key, value.stype))
        if np.dtype(value.dtype) != np.float32:
            raise TypeError("key %r is %s: slimgc aggregates float32 parameters only; cast the "
                            "model with net.cast('float32')" % (key, np.dtype(value.dtype)))
        agreement.check(self._transport, {"key": repr(key), "shape": tuple(value.shape),
                                          "dtype": str(np.dtype(value.dtype))},
                        what="key #%d" % len(self._keys))
        codec = self._codec.clone() if self._codec is not None else None
        b = KeyBuffers(len(self._keys), value.shape, codec, self._transport.num_workers, Buffer)
        if codec is not None and not self.config.offload:
            from .device import DeviceCodec
            b.device = DeviceCodec(codec)
        self._transport.declare(b.fp_key, b.grad_buf)
        if b.bit_send is not None:
            self._transport.declare(b.bit_key, b.bit_send)
        self._keys[key] = b
        self._steps[key] = 0
        return b

    def init(self, key, value):
        """Initialize keys with rank 0's values."""
        for k, v, _ in _triples(key, value, None):
            self._init_one(k, _first(v))

    def broadcast(self, key, value, out, priority=0):
        """Initialize `key` with rank 0's `value` and write it into `out`."""
        for k, v, o in _triples(key, value, out):
            self._init_one(k, _first(v))
            glo = self._backup.glo_buf(k)
            for dst in _as_list(o):
                glo.copyto(dst)

    def _init_one(self, key, value):
        b = self._add_key(key, value)
        weight = Buffer(b.shape, np.float32)
        value.copyto(weight.nd)  # also brings MKLDNN-layout arrays to the default layout
        self._transport.declare(b.weight_key, weight)
        self._transport.broadcast(b.weight_key, weight)
        self._backup.add(key, weight.nd)

    # -- the data path ---------------------------------------------------------------------
    def pushpull(self, key, value, out=None, priority=0):
        """Aggregate gradients `value` over workers; with an optimizer, `out` gets the weights."""
        for k, v, o in _triples(key, value, out):
            self._pushpull_one(k, _as_list(v), _as_list(o) if o is not None else None)

    def _pushpull_one(self, key, grads, outs):
        if key not in self._keys:
            raise KeyError("key %r was not initialized (call init or broadcast first)" % (key,))
        b = self._keys[key]
        step = self._steps[key]
        for g in grads:
            if tuple(g.shape) != b.shape:
                raise ValueError("key %r: pushed shape %s differs from the initialized shape %s"
                                 % (key, tuple(g.shape), b.shape))
        if self._cttab.needs_decision(step):
            self._decide_threshold()
        every = self.config.audit_every
        if every and step and step % every == 0 and b.index == 0:
            self._audit(step)
        if self._optimizer is None:
            return self._allreduce(key, b, step, grads, outs if outs is not None else grads)

        backup = self._backup
        bucket = self._bucket(key)
        if bucket is not None and bucket.holds(key):
            self._send_bucket(bucket)  # pushed again before the rest of its bucket: send what is in
        backup.wait_version(key, step)  # grad_buf and the residual are free again
        grad = _sum(grads)
        copy_array(grad, b.grad_buf.nd)
        local = backup.enabled and outs is not None
        check = GradCheck() if local and self._encodes_after_local_update(b, step) else None
        if local:
            backup.local_step(key, step, b.grad_buf, outs,
                              partial(self._local_update_ready(), b.index, check=check))
        opt = self._optimizer
        settings = (opt.lr, opt.wd, opt.rescale_grad, opt.param_dict)
        if bucket is None:
            self._submit(key, b, step, grad, settings, local, check)
        elif bucket.add(key, b, step, local, settings):
            self._send_bucket(bucket)
        self._steps[key] = step + 1
        if not backup.enabled and outs is not None:
            backup.write_back(key, step + 1, outs)

    def _allreduce(self, key, b, step, grads, outs):
        """No optimizer set: `outs` get the gradient summed over contexts and workers."""
        self._backup.wait_version(key, step)
        grad = _sum(grads)
        copy_array(grad, b.grad_buf.nd)
        self._submit(key, b, step, grad, None, False)
        self._steps[key] = step + 1
        self._backup.wait_version(key, step + 1)
        for o in outs:
            copy_array(b.agg.nd, o)

    def _submit(self, key, b, step, grad, opt_settings, local, check=None):
        compressed = b.codec is not None and self._cttab.compressed(b.nbytes, step)
        serial = self._cttab.phase == "warmup"
        job = Job(b, step, compressed, serial, ([(key, b, step, local)], opt_settings), key)
        if check is not None and check.ready is not None:  # the SGD kernel ran the update
            job.check = check
        # After warm-up (whose timings include the decode) the SGD kernel decodes the
        # sum tile by tile inside its update: the aggregate never goes to memory.
        job.decode_in_update = (compressed and not serial and opt_settings is not None
                                and self._sgd is not None and b.device is None
                                and b.codec.decodes_by_table)
        if compressed and b.device is not None:
            # Offload off: encode with NDArray ops on the gradient's own context, in line.
            try:
                b.device.encode(grad, b.residual.nd, self.num_workers, out=b.bit_send.nd)
            except codecs.NonFiniteGradientError:
                b.bit_send.nd[:] = np.nan
                job.nonfinite = True
        if serial:
            # Warm-up: one transfer at a time, in the trainer's key order on every worker.
            self._pipeline.submit(job)
        else:
            # Consume keys as their gradients become ready, not in a fixed order.
            ready = (job.check.ready if job.check is not None
                     else (b.bit_send if job.compressed and b.device is not None
                           else b.grad_buf).nd)
            self._pipeline.submit(job, ready=ready)

    def _encodes_after_local_update(self, b, step):
        """True when the Cython encoder will encode this step of the key after warm-up.

        Then the local update (SGD kernel) counts NaN/Inf in grad_buf as it reads it, and
        the encoder waits for it and skips its own pass over the gradient (GradCheck).
        """
        return (b.codec is not None and b.device is None and self._cttab.phase != "warmup"
                and self._cttab.compressed(b.nbytes, step))

    def _bucket(self, key):
        """The fused bucket `key` goes in, or None; builds the FusedRoute once routing is final.

        It is built at the first push of a step after the first, so that its members
        are the keys the job pushes (gluon.Trainer also initializes keys it never
        pushes, such as BatchNorm's running statistics).
        """
        if self._fused is None:
            if not self.config.fuse or self._cttab.phase == "warmup" or self._steps[key] == 0:
                return None
            self._fused = self._build_fused()
        return self._fused.bucket(key) if key in self._fused else None

    def _build_fused(self):
        """Collect every full-precision key into buckets (collective: declares wire keys)."""
        members = {k: self._keys[k] for k in self._full_precision_keys()}
        for key in members:  # no job still reads a member's old buffers
            self._backup.wait_version(key, self._steps[key])
        route = FusedRoute(members, self._transport, Buffer, self._next_fused_key)
        self._next_fused_key += len(route.buckets)
        log.info("slimgc: %d full-precision keys fused into %d transfer(s) of %s bytes",
                 len(members), len(route.buckets), [b.nbytes for b in route.buckets])
        return route

    def _full_precision_keys(self):
        """Keys pushed so far that the CTTab routes to full precision, in key order."""
        return [k for k, b in self._keys.items() if self._steps[k] > 0 and (
            b.codec is None or not self._cttab.compressed(b.nbytes, self._steps[k]))]

    def _send_bucket(self, bucket):
        entries = bucket.take()
        job = Job(bucket, entries[0][2], False, False, (entries, bucket.settings), bucket)
        self._pipeline.submit(job, ready=bucket.grad_buf.nd)

    def send_pending(self):
        """Send the fused buckets still waiting for members that were not pushed this step.

        gluon.Trainer calls it after each step's pushes, so a parameter that stops
        being pushed (grad_req changed to 'null') never holds back the others.
        Waiting calls (pull, flush, checkpoints) also call it.
        """
        if self._fused is not None:
            for bucket in self._fused.partial():
                self._send_bucket(bucket)

    def _local_update_ready(self):
        if self._local_updater is None:
            cfg = self.config
            self._local_updater = LocalUpdater(self._optimizer, self.num_workers,
                                               cfg.loc_lr, cfg.loc_optimizer, self._glo_updater,
                                               self._sgd, self._engine)
        return self._local_updater

    def _finish(self, job):
        """Aggregation thread: account, record timings, update glo_buf, publish."""
        b = job.buffers
        entries, opt_settings = job.context
        send = b.bit_send if job.compressed else b.grad_buf
        self._counters["wire"] += send.nbytes  # pushed, and pulled back as the same lanes
        self._counters["fp32"] += b.nbytes
        self._counters["comm_s"] += job.t_comm
        self._counters["compress_s"] += job.t_proc
        self._counters["transfers"] += 1
        self._counters["compressed_transfers"] += int(job.compressed)
        self._cttab.record(job.key, b.nbytes, job.compressed, job.t_comm, job.t_proc,
                           send.nbytes)
        published = [(key, step, local) for key, _, step, local in entries]
        if opt_settings is None:
            self._backup.publish(published, lambda glos: None)
            return
        lr, wd, rescale, param_dict = opt_settings
        indices = [kb.index for _, kb, _, _ in entries]
        aggs = [kb.agg for _, kb, _, _ in entries]
        # A bucket of small keys takes one multi-tensor op in MXNet's engine: cheaper
        # than the kernel's per-key engine waits (scripts/per_key_cost.py).
        kernel = self._sgd if len(entries) == 1 else None
        table = None
        if job.decode_in_update:
            lanes = b.bit_recv.for_read()
            if kernel is not None:
                table = b.codec.decode_table(lanes, b.size, self.num_workers)
            else:  # set_optimizer left SGD since this job was submitted
                b.codec.decode(lanes, b.size, self.num_workers, out=b.agg.for_write())

        def update(glos):
            opt = self._glo_updater.optimizer
            opt.lr, opt.wd, opt.rescale_grad, opt.param_dict = lr, wd, rescale, param_dict
            if table is not None:
                kernel.global_step_decoding(indices[0], b.bit_recv, table, glos[0])
            elif kernel is not None:
                kernel.global_step(indices, aggs, glos)
            else:
                # MXNet's Updater takes lists (a bucket: its multi-tensor ops, as
                # gluon.Trainer uses); it turns a single key into a list of one itself.
                self._glo_updater(indices, [a.nd for a in aggs], [g.nd for g in glos])

        self._backup.publish(published, update)

    def _decide_threshold(self):
        """End of warm-up: rank 0 builds the CTTab and every worker adopts its BestCT."""
        self._pipeline.wait_idle(self.config.timeout)
        mine = self._cttab.decide()
        votes = self._transport.allgather([-1.0 if mine == NEVER else float(mine)])
        chosen = votes[0, 0]
        self._cttab.adopt(NEVER if chosen < 0 else int(chosen))

    def _audit(self, step):
        """Consistency audit: all workers compare a checksum of every key's global weights."""
        self.send_pending()
        self._pipeline.wait_idle(self.config.timeout)
        names = {}
        param_dict = getattr(self._optimizer, "param_dict", None) or {}
        for key in self._keys:
            param = param_dict.get(key)
            names[key] = "%r (%s)" % (key, param.name) if param is not None else repr(key)
        agreement.audit(self._transport, {names[k]: self._backup.glo_buf(k).asnumpy().tobytes()
                                          for k in self._keys}, step)

    # -- reading weights back --------------------------------------------------------------
    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Write the newest global weights of `key` into `out`."""
        self.send_pending()
        for k, o, _ in _triples(key, out, None):
            self._backup.wait_version(k, self._steps[k])
            for dst in _as_list(o):
                self._backup.glo_buf(k).copyto(dst)

    def flush(self):
        """Wait for every aggregation in flight and write the global weights into the parameters.

        Call it before evaluating or saving a model trained with backup on: during
        training the parameters hold loc_buf (global weights plus this worker's step).
        """
        if self._pipeline is None:
            return
        self.send_pending()
        self._pipeline.wait_idle(self.config.timeout)
        self._backup.flush()
        mx.nd.waitall()

    # -- checkpoints -----------------------------------------------------------------------
    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save everything a resumed job needs (Trainer.save_states calls this).

        Flushes first, so the parameters hold the global weights (save them too).
        Saved: global and local optimizer states, per key the error-feedback
        residual, codec state, glo_buf, step and flag, and the CTTab decision.
        """
        self.flush()
        keys = {}
        for key, b in self._keys.items():
            compressed = b.codec is not None
            keys[key] = {"step": self._steps[key],
                         "residual": b.residual.for_read().copy() if compressed else None,
                         "codec": b.codec.state_dict() if compressed else None}
        local = self._local_updater
        state = {
            "format": CHECKPOINT_FORMAT,
            "settings": self.config.agreement_fields(),
            "num_workers": self.num_workers,
            "global": self._glo_updater.get_states(dump_optimizer),
            "local": local._updater.get_states(True) if local is not None else None,
            "keys": keys,
            "backup": self._backup.state_dict(),
            "cttab": self._cttab.state_dict(),
            "counters": dict(self._counters),
        }
        with open(fname, "wb") as f:
            pickle.dump(state, f)

    def load_optimizer_states(self, fname):
        """Restore a file written by save_optimizer_states (Trainer.load_states calls this)."""
        with open(fname, "rb") as f:
            state = pickle.load(f)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("%s is not a slimgc checkpoint (format %r); it was not written by "
                             "SlimGC.save_optimizer_states" % (fname, CHECKPOINT_FORMAT))
        mine = self.config.agreement_fields()
        for name, value in state["settings"].items():
            if mine.get(name) != value:
                raise ValueError("checkpoint %s was written with %s=%r but this job uses %r"
                                 % (fname, name, value, mine.get(name)))
        if state["num_workers"] != self.num_workers or set(state["keys"]) != set(self._keys):
            raise ValueError("checkpoint %s holds %d workers and keys %s; this job has %d "
                             "workers and keys %s" % (fname, state["num_workers"],
                                                      sorted(state["keys"]), self.num_workers,
                                                      sorted(self._keys)))
        self.send_pending()
        self._pipeline.wait_idle(self.config.timeout)
        self._glo_updater.set_states(state["global"])
        loaded = self._glo_updater.optimizer
        if loaded is not self._optimizer:  # the file held the optimizer itself
            self._optimizer = loaded
            self._glo_updater.optimizer = clone_optimizer(loaded)
        self._local_updater = None  # rebuilt around the (possibly new) global optimizer
        self._sgd = self._sgd_kernel()  # takes the loaded momentum at its first use
        if state["local"] is not None:
            self._local_update_ready()._updater.set_states(state["local"])
            self._local_updater.optimizer = self._local_updater._updater.optimizer
        for key, ks in state["keys"].items():
            b = self._keys[key]
            self._steps[key] = ks["step"]
            if b.codec is not None:
                np.copyto(b.residual.for_write(), ks["residual"])
                b.codec.load_state_dict(ks["codec"])
        self._backup.load_state_dict(state["backup"])
        self._cttab.load_state_dict(state["cttab"])
        if self._fused is not None and self._fused.keys != self._full_precision_keys():
            self._fused = None  # another BestCT: rebuilt, with new wire keys, at the next step
        self._counters.update(state["counters"])

    @property
    def _updater(self):
        """What gluon.Trainer.load_states reads back: `.optimizer` is the trainer-facing one."""
        return _UpdaterView(self)

    # -- reporting -------------------------------------------------------------------------
    def stats(self):
        """Bytes on the wire (each direction) versus fp32, times, and the threshold decision.

        comm_s: transfer time summed over keys (transfers overlap each other);
        compress_s: encode + decode time (decoding fused into the SGD kernel's update
        after warm-up is not in it); blocked_s: time the training thread waited
        for global weights (the communication that was not hidden); cttab_rule and
        cttab_link: how BestCT was read and the link fitted to the warm-up;
        fused_keys / fused_buckets: full-precision keys sent together, in how many
        transfers per step (a bucket counts once in `transfers`); wire_pieces: wire keys
        of the pieces that large buffers travel as (a transfer counts once).
        """
        best = self._cttab.best_ct if self._cttab is not None else None
        c = self._counters
        return {
            "compressor": self.config.compressor,
            "comm_threshold_bytes": None if best in (None, NEVER) else int(best),
            "comm_threshold_phase": self._cttab.phase if self._cttab else None,
            "bytes_pushed": c["wire"],
            "bytes_pulled": c["wire"],
            "bytes_fp32": c["fp32"],
            "transfers": c["transfers"],
            "compressed_transfers": c["compressed_transfers"],
            "comm_s": c["comm_s"],
            "compress_s": c["compress_s"],
            "blocked_s": self._backup.blocked_s if self._backup else 0.0,
            "cttab": list(self._cttab.rows) if self._cttab else [],
            "cttab_rule": self._cttab.rule if self._cttab else None,
            "cttab_link": self._cttab.link_report() if self._cttab else None,
            "fused_keys": len(self._fused.keys) if self._fused is not None else 0,
            "fused_buckets": len(self._fused.buckets) if self._fused is not None else 0,
            "wire_pieces": self._transport.pieces_declared if self._transport else 0,
        }

    @property
    def cttab(self):
        return self._cttab

    @property
    def broken(self):
        """True once an aggregation failed or timed out: peers may be gone or out of step."""
        pipeline, backup = self._pipeline, self._backup
        return bool(pipeline is not None and (pipeline.error is not None or pipeline.timed_out)
                    or backup is not None and backup.failed)

    def close(self):
        """Stop the pipeline threads and release the transport; False if that is stuck.

        A broken store keeps its transport: releasing MXNet's dist kvstore waits
        for every peer, forever if one is dead (see _close_all).
        """
        if self not in _LIVE:
            return True
        _LIVE.discard(self)
        broken = self.broken
        if self._pipeline is not None:
            self._pipeline.close(join=not broken)
        if self._backup is not None:
            self._backup.close()
        if broken:
            return self._transport.kind != "dist_sync"
        return self._transport is None or self._transport.close(SHUTDOWN_TIMEOUT)


CHECKPOINT_FORMAT = "slimgc-checkpoint-1"
_LIVE = weakref.WeakSet()  # stores not closed yet
_ALL = weakref.WeakSet()


class _UpdaterView:
    """Stands in for MXNet's Updater where gluon.Trainer reads `kvstore._updater.optimizer`."""

    def __init__(self, kv):
        self._kv = kv

    @property
    def optimizer(self):
        return self._kv._optimizer


SHUTDOWN_TIMEOUT = 30.0  # seconds MXNet's dist kvstore finalize may take at exit
_uncaught = []


def _record_uncaught(exc_type, exc, tb, _previous=sys.excepthook):
    _uncaught.append(exc_type)
    _previous(exc_type, exc, tb)


sys.excepthook = _record_uncaught


@atexit.register
def _close_all():
    """At exit: join the background threads, finalize MXNet's kvstore, never hang.

    After a failed aggregation in a distributed job MXNet's own shutdown (kvstore
    finalize, engine wait) would block forever on the lost peer; a finalize can
    also stall on its own. In both cases the process leaves with os._exit, status
    1 after a failure or an uncaught exception, else 0, before MXNet's exit handler.
    """
    closed = [kv.close() for kv in list(_LIVE)]
    if all(closed):
        return
    failed = any(kv.broken for kv in _ALL) or bool(_uncaught)
    sys.stderr.write("slimgc: %s; exiting without MXNet's kvstore shutdown, which would wait "
                     "forever\n" % ("an aggregation failed" if failed else
                                    "the kvstore finalize did not finish in %.0f s"
                                    % SHUTDOWN_TIMEOUT))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _first(v):
    return _as_list(v)[0]


def _sum(arrays):
    """Sum of the per-context arrays, on the first one's context."""
    total = arrays[0]
    if len(arrays) > 1:
        total = arrays[0].copy()
        for a in arrays[1:]:
            total += a.as_in_context(total.context)
    return total


def _triples(key, value, out):
    """(key, value, out) per key, for one key or lists of them (out may be None)."""
    if isinstance(key, (list, tuple)):
        outs = out if out is not None else [None] * len(key)
        if not (len(key) == len(value) == len(outs)):
            raise ValueError("keys, values and outs differ in length")
        return list(zip(key, value, outs))
    return [(key, value, out)]


def _patch_trainer():
    """Let gluon.Trainer keep kvstore='slimgc' with one context, and end its steps' pushes.

    MXNet's _create_kvstore drops any string kvstore without 'dist' when there is a
    single device; for the names registered here it now creates the store instead.
    After a step's pushes the Trainer now calls SlimGC.send_pending.
    """
    import mxnet.gluon.trainer as trainer_mod
    import mxnet.model as model_mod

    original = model_mod._create_kvstore
    if getattr(original, "_slimgc", False):
        return

    def _create_kvstore(kvstore, num_device, arg_params):
        if isinstance(kvstore, str) and kvstore.lower() == "slimgc":
            kv = mx.kv.create(kvstore)
            return kv, kv.is_capable(KVStoreBase.OPTIMIZER)
        return original(kvstore, num_device, arg_params)

    _create_kvstore._slimgc = True
    model_mod._create_kvstore = _create_kvstore
    trainer_mod._create_kvstore = _create_kvstore

    allreduce = trainer_mod.Trainer._allreduce_grads

    def _allreduce_grads(trainer):
        """MXNet's loop of pushes, then SlimGC sends what its fused buckets hold."""
        allreduce(trainer)
        if isinstance(trainer._kvstore, SlimGC):
            trainer._kvstore.send_pending()

    trainer_mod.Trainer._allreduce_grads = _allreduce_grads


_patch_trainer()
