"""One worker's SlimGC data path: what happens to a key's gradient at every step.

    wait for glo_buf            the last aggregation of this key has published w_i
    plan the push               Strategy 1: the CTTab's fp_buf or bit_buf, or a fused
                                bucket; where it is encoded, decoded, checked (Plan)
    grad_buf <- gradient        Strategy 2: a CPU copy, consumed when it is ready
    loc_buf <- w_i - lr * g     Strategy 3: the local update; the trainer goes on
    pipeline                    encode -> push/pull -> decode -> glo_buf <- w_{i+1}

The Aggregator composes the parts (planner, pipeline, backup, updates) over a
transport and a framework's seams (docs/backend.md; mxnet.framework.MXNetFramework);
kvstore.SlimGC adapts MXNet's calling conventions to it.
"""
import logging
import time
from functools import partial

import numpy as np

from .. import codecs, notice
from . import agreement, backend, lanes32, residual_watch, stages
from .backend import Collective, Framework
from .backup import ModelBackup
from .grad_buf import Push
from .offload import Pipeline, TransferStats
from .planner import Planner
from .step_clip import StepClip
from .stages import Stages
from .cttab import CTTab, NEVER
from ..trace import Trace

log = logging.getLogger(__name__)


class Aggregator:
    """The keys of one worker and everything between their gradients and glo_buf."""

    def __init__(self, config, transport: Collective, framework: Framework, compress_sums=True):
        """framework: the seams of the framework whose arrays and optimizer it serves (an
        adapter's, backend.Framework); compress_sums: whether pushes without an optimizer
        (plain sums) may be compressed (the kvstore allows it only when the user chose a
        compressor)."""
        backend.check(framework, Framework, "the framework object")
        self.framework = framework
        self.config = config
        self.transport = transport
        self.compress_sums = compress_sums
        cfg = config
        if cfg.compressor == "none":
            codec, cttab = None, CTTab(NEVER, cfg.warmup_steps, cfg.cttab_rule)
        else:
            codec = codecs.create(cfg.compressor, threshold=cfg.threshold,
                                  num_threads=cfg.num_threads, **cfg.codec_options)
            cttab = CTTab(cfg.comm_threshold, cfg.warmup_steps, cfg.cttab_rule,
                          cfg.cttab_margin, places=self.places(cfg, framework),
                          fused_fp=cfg.fuse)
        self.cttab = cttab
        self.codec = codec
        lane_format = self._lane_format()  # a worker count the lanes cannot hold raises here
        # float32 lanes (lanes32.py) when lane_dtype says so or the servers are inexact.
        self.lanes32 = lanes32.choose(cfg.lane_dtype, codec, transport)
        agreement.check(transport, dict(cfg.agreement_fields(), num_workers=transport.num_workers,
                                         lanes=lane_format, lanes32=self.lanes32,
                                         bigarray_bound=transport.bigarray_bound))
        self.backup = ModelBackup(cfg.backup, cfg.timeout, framework.arrays)
        framework.on_error(partial(self.backup.fail, where=framework.engine_where))
        self.trace = Trace(cfg.trace, transport.rank) if cfg.trace else None
        self.stages = Stages(transport)  # each stage at the site its plan names
        self.pipeline = Pipeline(transport, self._finish, self.backup.fail, framework.readiness,
                                 self.trace, self.stages)
        self.planner = Planner(cfg, transport, codec, cttab, framework.new_buffer,
                               framework.device_codec, self.backup.wait_version, self.name_of,
                               self.lanes32, every_key=framework.pushes_every_key)
        self.stats = TransferStats()
        self.clip = StepClip(transport.num_workers)  # clipped steps' gate (step_clip.py)
        self._stepping = False  # between start_step (or clip_step) and end_step
        self._deferred = []  # backup off, in a step: (key, version, outs) to write back
        self.residual_growth = None  # what the residual watch found first (a message), or None
        self.update = None  # GlobalUpdate, once an optimizer is set
        self._local = None  # LocalUpdater, built at the first local update
        self.params_local = False  # some parameters hold loc_buf, not the global weights
        log.info("slimgc: rank %d/%d, transport %s, %s", transport.rank, transport.num_workers,
                 transport.kind, cfg)

    @staticmethod
    def places(config, framework):
        """True when the CTTab chooses per tensor where to compress: offload='auto' and a
        framework whose gradients are on a device that can encode them (a GPU)."""
        return config.offload == "auto" and getattr(framework, "has_device", False)

    def _lane_format(self):
        if self.codec is None:
            return "float32"
        return (self.codec.name, self.codec.wire_bits_per_element(self.transport.num_workers))

    @property
    def num_workers(self):
        return self.transport.num_workers

    # -- optimizer -------------------------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Run `optimizer` on the aggregated gradients (glo_buf) and in the local update.

        Collective: every worker's optimizer must have the same class and settings.
        """
        settings = self.framework.optimizer_settings(optimizer, self.config.loc_optimizer)
        agreement.check(self.transport, settings, what="optimizer settings")
        self.update = self.framework.global_update(optimizer, self.config.num_threads)
        backend.check(self.update, backend.GlobalUpdate, "the framework's global update")
        self._local = None

    def name_of(self, key):
        """The parameter name of `key` as the optimizer knows it, else None (or the key
        itself when it is a string, as Module's keys are)."""
        opt = self.update.optimizer if self.update is not None else None
        param = (getattr(opt, "param_dict", None) or {}).get(key)
        if param is not None:
            return param.name
        name = (getattr(opt, "idx2name", None) or {}).get(key)
        if name is None and isinstance(key, str):
            name = key
        return name

    def local_updater(self):
        if self._local is None:
            local = self.framework.local_updater(self.update, self.num_workers, self.config)
            backend.check(local, backend.LocalUpdate, "the framework's local update")
            self._local = local
        return self._local

    def optimizer_state(self):
        """Both updaters' optimizers and states, as data (the local one: None before use)."""
        return {"global": self.update.state(),
                "local": self._local.state() if self._local is not None else None}

    def load_optimizer_state(self, state, where):
        """Restore optimizer_state() (checkpoint.read has checked what it can before)."""
        self.update.load_state(state["global"], where)
        self._local = None  # rebuilt around the restored global optimizer
        if state["local"] is not None:
            self.local_updater().load_state(state["local"], where)

    # -- keys ------------------------------------------------------------------------------
    def add_key(self, key, value):
        """A new key with rank 0's initial weights `value`: buffers, wire keys, glo_buf."""
        if key in self.planner.keys:
            raise ValueError("key %r is already initialized" % (key,))
        weight = self.framework.weight(key, value)
        agreement.check(self.transport, {"key": repr(key), "shape": tuple(value.shape),
                                         "dtype": str(np.dtype(value.dtype))},
                        what="key #%d" % len(self.planner.keys))
        b = self.planner.add(key, value.shape)
        self.transport.declare(b.wire.weight, weight)
        self.transport.broadcast(b.wire.weight, weight)
        self.backup.add(key, self.framework.arrays.array(weight))

    # -- the data path ---------------------------------------------------------------------
    def push(self, key, grads, outs=None, priority=0):
        """One step of `key`: `grads` (per device) in.

        With an optimizer the key's value becomes w_{i+1} and `outs` (if given) get
        loc_buf (backup) or w_{i+1}; without one, the key's value becomes the sum over
        workers, as on MXNet's dist_sync servers. pull() reads the value.
        """
        if self.residual_growth is not None:
            residual_watch.warn(self.residual_growth)  # on this thread, once per process
        b = self._checked(key, grads)
        step = self._next_step(key)
        if self.update is None:
            return self._push_sum(key, b, step, grads, priority)
        bucket = self.planner.bucket(key)
        if bucket is not None and bucket.holds(key):
            self._submit(self.planner.take(bucket))  # pushed again before the rest of its bucket
        self.backup.wait_version(key, step)  # grad_buf and the residual are free again
        push = Push(key, b, step, local=self.config.backup and outs is not None,
                    priority=priority)
        if self.clip.active:
            self.clip.add(key, step)
        settings = self.update.settings(b.index)
        transfer = check = None
        if bucket is None:
            transfer = self.planner.transfer(
                push, settings, self.update.decodes_in_update,
                local_kernel=push.local and self.local_updater().fused)
            check = transfer.check
            if transfer.plan.optimizer_view:
                b.codec.set_optimizer_view(self.update.codec_view(
                    b.index, self.backup.glo_buffer(key), settings))
        encoder = self.stages.in_local_update(transfer)
        grad, source = self.framework.gradient(
            b, grads, encoder is not None,
            device_encoded=not self.stages.reads_gradient(transfer))
        if push.local:
            self.params_local = True
            start = time.perf_counter()
            self.backup.local_step(key, step, source, outs,
                                   partial(self.local_updater(), b.index, check=check,
                                           encoder=encoder))
            if self.trace is not None:
                self.trace.span("local update", start, time.perf_counter(),
                                key=self.name_of(key), step=step)
        if transfer is not None:
            self._submit(transfer, grad)
        elif bucket.add(push, settings):
            self._submit(self.planner.take(bucket))
        self.planner.steps[key] = step + 1
        if not self.config.backup and outs is not None:
            if self._stepping:  # written back by end_step, once every bucket is sent
                self._deferred.append((key, step + 1, outs))
                return
            if not self.framework.arrays.can_hold:
                self.send_pending()  # it waits below: a bucket must not wait for later keys
            self.backup.write_back(key, step + 1, outs)

    def _push_sum(self, key, b, step, grads, priority):
        """No optimizer: the sum over contexts and workers becomes the key's value."""
        self.backup.wait_version(key, step)
        grad, _ = self.framework.gradient(b, grads)
        push = Push(key, b, step, local=False, priority=priority)
        transfer = self.planner.transfer(push, None, None, compress=self.compress_sums)
        if transfer.plan.optimizer_view:
            b.codec.set_optimizer_view(None)  # a plain sum: no optimizer to weigh values by
        self._submit(transfer, grad)
        self.planner.steps[key] = step + 1

    def _checked(self, key, grads):
        b = self.planner.buffers(key)
        for g in grads:
            if tuple(g.shape) != b.shape:
                raise ValueError("key %r: pushed shape %s differs from the initialized shape %s"
                                 % (key, tuple(g.shape), b.shape))
        return b

    def _next_step(self, key):
        """The step about to be pushed; ends the warm-up and runs the audit when due."""
        step = self.planner.steps[key]
        if self.cttab.needs_decision(step):
            self.decide_threshold()
        elif step == 0 and self.planner.keys[key].index == 0 and self.cttab.phase == "trained":
            self._tell_routes()  # comm_threshold fixed or replayed: the routes hold from now
        every = self.config.audit_every
        if every and step and step % every == 0 and self.planner.keys[key].index == 0:
            self.audit(step)
        return step

    def _submit(self, transfer, grad=None):
        """Queue `transfer` in the pipeline, encoded first on this thread where its plan
        encodes on the device (stages.py)."""
        self.stages.on_device(transfer, grad)
        self.pipeline.submit(transfer)

    def send_pending(self):
        """Send the fused buckets still waiting for members that were not pushed this step.

        gluon.Trainer calls it after each step's pushes, so a parameter that stops
        being pushed (grad_req changed to 'null') never holds back the others.
        Waiting calls (pull, flush, checkpoints) also call it.
        """
        for transfer in self.planner.partial_buckets():
            self._submit(transfer)

    def _finish(self, transfer):
        """Aggregation thread: account, record timings, judge the residual watch's sample,
        update glo_buf, publish."""
        self.stats.add(transfer)
        plan = transfer.plan
        if plan.measure:
            found = transfer.buffers.watch.close()
            if found is not None and self.residual_growth is None:
                self.residual_growth = residual_watch.message(transfer.label, self.codec, found)
        # the link carries the larger direction: a gather pulls N slots
        self.cttab.record(transfer.label, transfer.buffers.nbytes, plan.compressed,
                          transfer.t_comm, transfer.t_proc, max(transfer.wire_bytes()),
                          self.stages.place(plan))
        published = [(p.key, p.step, p.local) for p in transfer.pushes]
        if transfer.settings is None:
            self.backup.publish(published, partial(_store_sums, transfer))
            return
        clipped = self.clip.take(transfer)
        if clipped is not None:  # held until the step's norm is known; its norm needs agg
            stages.decode_in_update(transfer, self.num_workers, kernel=False)
            self.clip.arrive(clipped, transfer, partial(
                self.backup.publish, published, partial(self.update, transfer, None)))
            return
        table = self.update.prepare(transfer, self.num_workers)
        self.backup.publish(published, partial(self.update, transfer, table))

    # -- steps and clipping by the global norm (step_clip.py) ----------------------------
    def start_step(self):
        """Push a whole step before end_step(): with backup off its write-backs wait until
        then, so a fused bucket is sent once all its members are in, not at its first."""
        self._stepping = True

    def clip_step(self, max_norm, norm_type=2.0):
        """Start a step (start_step) whose mean gradient is clipped by its norm over all
        its pushes (torch's clip_grad_norm_ after DDP's averaging): their global updates
        wait for the step's last sum. Every worker must clip the same steps alike."""
        if self.update is None:
            raise RuntimeError("clipping needs an optimizer (set_optimizer)")
        self.clip.start(max_norm, norm_type)
        self.start_step()

    def end_step(self):
        """After a step's pushes: send the partial buckets and seal a clipped step; with
        backup off the parameters then get the global weights, once the step is applied."""
        self.send_pending()
        self._stepping = False
        if self.clip.active:
            self.clip.seal()
        deferred, self._deferred = self._deferred, []
        self.backup.write_back_many(deferred)

    # -- collective decisions --------------------------------------------------------------
    def decide_threshold(self):
        """End of warm-up: rank 0 builds the CTTab and every worker adopts its BestCT; the
        warm-up's buckets give way to the final routes'."""
        self.send_pending()
        self.pipeline.wait_idle(self.config.timeout)
        mine = self.cttab.decide()
        sizes = self.planner.compressible_sizes() if self.cttab.places else []
        votes = self.transport.allgather([-1.0 if mine == NEVER else float(mine)]
                                         + self.cttab.placement_votes(sizes))
        chosen = votes[0, 0]
        placement = {size: "device" for size, vote in zip(sizes, votes[0, 1:]) if vote > 0}
        self.cttab.adopt(NEVER if chosen < 0 else int(chosen),
                         placement if self.cttab.places else None)
        self.planner.end_warmup()
        self._tell_routes()

    def _tell_routes(self):
        """Rank 0 tells the user what the CTTab compresses, whatever their logging setup."""
        if self.codec is not None and self.transport.rank == 0:
            notice.tell(self.planner.route_summary())

    def audit(self, step):
        """Consistency audit: all workers compare a checksum of every key's global weights."""
        self.send_pending()
        self.pipeline.wait_idle(self.config.timeout)
        param_dict = getattr(self.update.optimizer if self.update else None, "param_dict",
                             None) or {}
        weights = {}
        for key in self.planner.keys:
            param = param_dict.get(key)
            name = "%r (%s)" % (key, param.name) if param is not None else repr(key)
            weights[name] = self.backup.glo_buffer(key).for_read().tobytes()
        agreement.audit(self.transport, weights, step)

    # -- reading weights back --------------------------------------------------------------
    def pull(self, key, outs):
        """Write the key's newest value (global weights, or the last sum) into `outs`."""
        self.send_pending()
        self.backup.wait_version(key, self.planner.steps[key])
        for dst in outs:
            self.framework.arrays.copy(self.backup.glo_buf(key), dst)

    def flush(self):
        """Wait for every aggregation in flight and write the global weights into the parameters."""
        self.send_pending()
        self.pipeline.wait_idle(self.config.timeout)
        self.backup.flush()
        self.params_local = False

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def broken(self):
        """True once an aggregation failed or timed out: peers may be gone or out of step."""
        return (self.pipeline.error is not None or self.pipeline.timed_out
                or self.backup.failed)

    def close(self, join):
        """Stop the pipeline threads (join=False leaves threads stuck on a dead peer); write
        the trace."""
        self.pipeline.close(join=join)
        self.backup.close()
        if self.trace is not None:
            path = self.trace.write()
            log.info("slimgc: trace of rank %d written to %s", self.transport.rank, path)


def report(agg, compressor, pieces):
    """What SlimGC.stats() returns; zeros before the first key.

    bytes_pushed / bytes_pulled: bytes on the wire each direction, against bytes_fp32 (a
    gathering codec pulls every worker's slot: N times what it pushes);
    comm_s: transfer time summed over keys (transfers overlap each other);
    compress_s: encode + decode time (decoding fused into the SGD kernel's update
    after warm-up is not in it); blocked_s: time the training thread waited
    for global weights (the communication that was not hidden); cttab_rule and
    cttab_link: how BestCT was read and the link fitted to the warm-up;
    fused_keys / fused_buckets: full-precision keys sent together, in how many
    transfers per step (a bucket counts once in `transfers`); wire_pieces: wire keys
    of the pieces that large buffers travel as (a transfer counts once);
    streamed_transfers: compressed transfers whose pieces were each pushed as soon as
    the local update had encoded them;
    keys_encoded_in_local_update: keys whose local update has encoded them in its pass,
    of which keys_gradient_in_place read the gradient where MXNet keeps it (the rest
    were in MKLDNN's layout and copied into grad_buf);
    residual_growth: the residual watch's message about the first key whose error-feedback
    residual kept growing (compression likely wrecking training), or None.
    """
    cttab = agg.cttab if agg is not None else None
    best = cttab.best_ct if cttab is not None else None
    c = agg.stats if agg is not None else TransferStats()
    fused = agg.planner.fused if agg is not None else None
    layouts = [b.grad_in_place for b in agg.planner.keys.values()] if agg is not None else []
    return {
        "compressor": compressor,
        "comm_threshold_bytes": None if best in (None, NEVER) else int(best),
        "comm_threshold_phase": cttab.phase if cttab else None,
        "bytes_pushed": c.wire,
        "bytes_pulled": c.pulled,
        "bytes_fp32": c.fp32,
        "transfers": c.transfers,
        "compressed_transfers": c.compressed_transfers,
        "streamed_transfers": c.streamed_transfers,
        "comm_s": c.comm_s,
        "compress_s": c.compress_s,
        "blocked_s": agg.backup.blocked_s if agg else 0.0,
        "cttab": list(cttab.rows) if cttab else [],
        "cttab_rule": cttab.rule if cttab else None,
        "cttab_margin": cttab.margin if cttab else None,
        "cttab_reason": cttab.reason if cttab else None,
        "cttab_link": cttab.link_report() if cttab else None,
        "fused_keys": len(fused.keys) if fused is not None else 0,
        "fused_buckets": len(fused.buckets) if fused is not None else 0,
        "wire_pieces": pieces,
        "keys_encoded_in_local_update": sum(v is not None for v in layouts),
        "keys_gradient_in_place": sum(v is True for v in layouts),
        "residual_growth": agg.residual_growth if agg is not None else None,
    }


def _store_sums(transfer, glos):
    """No optimizer: the key's value (glo_buf) becomes the sum over workers."""
    for push, glo in zip(transfer.pushes, glos):
        np.copyto(glo.for_write(), push.buffers.agg.for_read())
