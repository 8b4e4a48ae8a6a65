"""A step of the device path's buckets, scheduled by the engine: each bucket's pass, the
step's tail, and the global updates the tail guards (model backup on the device).

The adapter gives its buckets (backend.DeviceBucket: the stages, in the framework's ops)
and its device (backend.DeviceStep: sums, timing marks, the tail, the clip); this module
decides the order. One pass per bucket, started as soon as its gradients are final
(ready(): in bucket order, from backward) or in step():
  1. backup on: the previous step's global update, deferred until now (finish_pending: the
     tail read, each bucket's sum decoded, the optimizer's rule into glo_buf);
  2. backup on: the local update into the parameters (loc_buf), from glo_buf;
  3. error feedback and the encode, 4. the sums started: each at the site of the pass's
     Plan (push_plan.bucket_plan, run by stages.encode_bucket / exchange_bucket).
Without backup, 1 runs after every bucket's 4 and the parameters get glo_buf.

The tail (one float64 vector, summed after the buckets, read one step later):
    [flag per bucket][overlap][the settings rider][||grad||^2, ||residual||^2 per bucket]
a bucket's flag is 2**rank where its gradient was not finite, the overlap slot where a
gradient changed after backward; it is read before the global update it guards, so a
poisoned sum writes nothing. With the state offloaded (state_on='host') each bucket's
deferred update runs in its own pass, and the next bucket's stage-in is queued beside it.
"""
import math
import time

import numpy as np

from .. import notice
from . import residual_watch, stages
from .bucket_cttab import agree
from .offload import NonFiniteAggregateError

#: What a pass reads of a bucket's offloaded state: glo_buf with the optimizer's state
#: (STATE: the updates) and the residual (RESIDUAL: the encode); with backup one pass reads
#: both (BOTH), without it the encode (ENCODE_PARTS) and the update (UPDATE_PARTS) are two
#: passes of a step.
STATE, RESIDUAL = "state", "residual"
BOTH = frozenset((STATE, RESIDUAL))
UPDATE_PARTS, ENCODE_PARTS = frozenset((STATE,)), frozenset((RESIDUAL,))


def pass_parts(backup):
    """What a bucket's pass in a step reads: all of it with backup (the deferred update, the
    local update, the encode), the residual alone without (the update comes after)."""
    return BOTH if backup else ENCODE_PARTS


def tail_size(n_buckets, rider_slots):
    """The tail's length for `n_buckets` and a settings rider of `rider_slots` float64s."""
    return n_buckets + 1 + rider_slots + 2 * n_buckets


class BucketStep:
    """The device path's step over `buckets` (backend.DeviceBucket) on `device`
    (backend.DeviceStep), routed by `routes` (bucket_cttab.BucketRoutes), whose decision
    rank 0 gives every rank over `transport` (its allgather)."""

    check = None  # a step_check.StepSettingsCheck (set by the adapter for several ranks)
    rider = None  # a Rider to send with this step's tail (the adapter's ride())

    def __init__(self, buckets, routes, device, config, transport, rider_slots,
                 offloaded=False):
        self.buckets, self.routes, self.device = buckets, routes, device
        self.config = config
        self.transport = transport
        self.num_workers, self.rank = transport.num_workers, transport.rank
        self.offloaded = offloaded
        n = len(buckets)
        self._rider_at = n + 1
        self._watch_at = n + 1 + rider_slots  # where the watch's slots start
        self._tail_rider = None  # the rider the pending step's tail carries
        self._flags = None  # the pending step's summed flags, once read
        self._pending = None  # the step whose global updates are still to run
        self._pending_clip = None  # its (max_norm, norm_type) where it is clipped
        self._due = []  # buckets whose global update of the pending step is still to run
        self._spans = []  # the warm-up's timing marks, read at the decision
        self._step_open = False  # this step's deferred global updates are done (backup)
        self._sampling = []  # this step's buckets whose norms ride in the tail: (j, push)
        self._watched = []  # the pending step's
        self._watch_sums = None  # their summed squared norms, once the tail is read
        self._ready = [0] * n  # final gradients per bucket this backward
        self._next = 0  # the next bucket to start, in order
        self.overlap = "off"  # buckets start in step(); from backward: 'watch', 'deciding',
        #                       then 'on' or 'off' (watch_backward)
        self._why = ""  # what this rank found against starting in backward, this step
        self.last_norm = None  # the mean gradient's norm of the last clipped step applied
        self.step_count = 0
        self.error = None  # a NaN/Inf sum found: raised by every later call
        self._error_kind = NonFiniteAggregateError
        self.residual_growth = None  # the residual watch's message, once found
        self.blocked_s = 0.0  # waiting for the tail on the host
        self.bytes_pushed = 0
        self.bytes_fp32 = 0
        self.transfers = 0  # the sums started: the buckets' exchanges and the tails
        self._fp32_bytes = 4 * sum(b.numel for b in buckets)

    # -- starting passes -----------------------------------------------------------------
    def watch_backward(self):
        """From the next step on, buckets may start from backward: the first step watches
        (every rank's verdict rides in its tail) whether that is right."""
        self.overlap = "watch"
        self._reset_ready()

    def _reset_ready(self):
        self._ready = [0] * len(self.buckets)
        self._next = 0

    def ready(self, j, grad_of):
        """One more gradient of bucket j is final for this backward: start the buckets that
        are complete, in bucket order (every rank issues the same sums in the same order,
        whatever order backward finishes them in). grad_of(i): parameter i's gradient."""
        if self.overlap != "on":
            return
        self._ready[j] += 1
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next].indices):
            b = self.buckets[self._next]
            self._start(self._next, [grad_of(i) for i in b.indices])
            self._next += 1

    def no_overlap(self, why):
        """A step where starting buckets in backward is wrong whatever the gradients say
        (GradScaler's unscale writes .grad without marking it): buckets start in step() from
        now on; if backward has started some already, every rank raises here alike."""
        if self.overlap == "on":
            self._overlap_error(self.step_count, why)
        if self.overlap in ("watch", "deciding"):
            self.overlap = "off"
            notice.tell("the device path starts its buckets in step(), not during "
                        "backward: %s" % why, once=True)

    def _start(self, j, grads, local_scale=None):
        """Bucket j's pass: (the step's first) the deferred global updates; the local update;
        the encode; its sum started."""
        backup = self.config.backup
        if not self._step_open:
            self.raise_error()
            due = self.routes.due(self.step_count)
            if backup:  # offloaded: each bucket's update at its own pass, below, except
                # before the CTTab's decision, which reads the samples their decodes complete
                self.finish_pending(apply=not self.offloaded or due)
            if due:
                self._decide()
            self.device.zero_tail(self._watch_at)  # read with the pending step's tail above
            self._step_open = True
        b = self.buckets[j]
        b.settings()
        parts = pass_parts(backup)  # (offloaded: what this pass reads)
        staged = b.stage(parts)
        if self.offloaded and j + 1 < len(self.buckets):
            self.buckets[j + 1].prefetch(parts)  # its stage-in beside this pass
        if backup:
            self._apply(b)  # (offloaded: its due update; else done above)
            b.local_step(grads, local_scale)
        try:
            self._encode_and_sum(j, b, grads)
        finally:
            if staged:
                b.unstage()

    def _encode_and_sum(self, j, b, grads):
        """Bucket j's encode (error feedback into its residual) and its lanes' sum started,
        each at the site of the pass's plan (stages.py); in the warm-up, timed."""
        timed = self.routes.warming and b.codec is not None
        if timed:  # the warm-up: this step's route, timed from the encode to the decode
            b.route = self.routes.route(j, self.step_count)
            start = self.device.mark()
        plan = b.plan(timed)
        watch = None
        if b.watch is not None and plan.compressed and residual_watch.due(b):
            watch = self.device.tail_slots(self._watch_at + 2 * j, self._watch_at + 2 * j + 2)
            self._sampling.append((j, b.pushes))
        pieces = []  # a large tensor's lanes, summed piece by piece as they are encoded
        on_piece = None if not self.device.sums else \
            (lambda lo, hi: pieces.append(self.device.start_sum(b.lanes[lo:hi])))
        flag = self.device.tail_slot(j)
        stages.encode_bucket(plan, b, grads, self.num_workers, flag, self.rank,
                             self.device.counts, watch=watch, on_piece=on_piece)
        if pieces:
            b.works = pieces
            self.transfers += len(pieces)
        else:
            self.transfers += stages.exchange_bucket(plan, b, self.device.start_sum, flag)
        if timed:  # the sum waited for (on a GPU: the stream waits), in the warm-up only
            b.wait_sums()
            b.timing = (j, plan.route, self.step_count, [start, self.device.mark()])
        b.step = self.step_count

    def step(self, grads_of, clip=None, changed=""):
        """One step: grads_of[i] is parameter i's gradient (model order). clip: (max_norm,
        norm_type, local_scale) of slimgc.clip_grad_norm_: the mean gradient clipped by its
        norm before the global update, the local update's gradient scaled by local_scale.
        changed: what the adapter found changed after backward ('' if nothing). The
        buckets backward started are kept, the others started here; the tail sent."""
        backup = self.config.backup
        local_scale = clip[2] if clip is not None else None
        self.raise_error()
        started = self._next if self.overlap == "on" else 0
        why = ""
        if self.overlap in ("on", "watch"):  # what would make starting in backward wrong
            why = changed or ("slimgc.clip_grad_norm_ with backup scales the local "
                              "update's gradient" if local_scale is not None and backup
                              else "")
            self._why = why
            if self.overlap == "watch":
                self.overlap = "deciding"  # by every rank's verdict, in the tail
        for j in range(started, len(self.buckets)):
            self._start(j, [grads_of[i] for i in self.buckets[j].indices], local_scale)
        if self.overlap != "off":
            self._reset_ready()
        self._step_open = False
        self._send_tail(1.0 if why else 0.0)
        self._pending = self.step_count
        self._pending_clip = clip[:2] if clip is not None else None
        self._watched, self._sampling = self._sampling, []
        self.step_count += 1
        self.bytes_pushed += sum(b.lane_bytes for b in self.buckets)
        self.bytes_fp32 += self._fp32_bytes
        if not backup:
            self.finish_pending(write_back=True)
        if self.offloaded:  # the next step's first pass: its stage-in now
            self.buckets[0].prefetch(pass_parts(backup))
        if self.residual_growth is not None:  # on the training thread, once per process
            residual_watch.warn(self.residual_growth)

    def _send_tail(self, overlap):
        """The step's tail completed (the overlap slot, every flag as 2**rank, the rider)
        and its sum started; a rider's verdict waits for it (_TailWork)."""
        n = len(self.buckets)
        rank_bit = float(2 ** self.rank) if self.num_workers <= 52 else 1.0
        rider, self.rider = self.rider, None
        self.device.send_tail(n, overlap, rank_bit, self._rider_at,
                              None if rider is None else rider.slots(np.float64))
        self.transfers += 1
        self._tail_rider = rider
        self._flags = None
        if rider is not None:
            rider.carried_by(_TailWork(self))

    def read_tail(self):
        """The pending step's summed tail onto the host, once: the step's one host
        synchronisation (with backup on, of a sum long done)."""
        if self._pending is None or self._flags is not None:
            return
        start = time.perf_counter()
        tail = self.device.read_tail()
        self.blocked_s += time.perf_counter() - start
        n = len(self.buckets)
        if self._tail_rider is not None:
            self._tail_rider.sums = tail[self._rider_at:self._watch_at].copy()
            self._tail_rider = None
        self._flags = tail[:n + 1].copy()
        self._watch_sums = tail[self._watch_at:].copy()

    # -- the global updates the tail guards ----------------------------------------------
    def finish_pending(self, write_back=False, apply=True):
        """The pending step's global updates: its tail read (NaN/Inf flags, settings), each
        bucket's sum decoded into glo_buf; with `write_back`, the parameters get glo_buf.
        apply=False: the tail read and checked only, each bucket's update left due until
        its own pass (offloaded state: one bucket's staged at a time, _apply)."""
        if self._pending is not None:
            self._settle_pending()
        if apply:
            due = list(self._due)
            for k, b in enumerate(due):
                if k + 1 < len(due) and due[k + 1].offloaded:  # the next one's stage-in
                    due[k + 1].prefetch(UPDATE_PARTS)  # beside this update
                self._apply(b, write_back)

    def _apply(self, b, write_back=False):
        """Bucket b's due global update (decoded unless a clipped step decoded it), with its
        glo_buf and state staged where they are offloaded; `write_back`: into the parameters."""
        if b not in self._due:
            return
        self._due.remove(b)
        if b.mean is None:
            self._decode(b)
        staged = b.stage(UPDATE_PARTS)  # (within a pass with backup: staged already)
        b.global_step()
        b.step = None
        if write_back:
            b.write_back()
        if staged:
            b.unstage()

    def _settle_pending(self):
        """The pending step's tail read and acted on (errors, verdicts, the residual watch,
        the settings check); its buckets made due (a clipped step's decoded and clipped)."""
        step = self._pending
        self.read_tail()
        for b in self.buckets:
            b.wait_sums()  # on NCCL: the stream waits, not the host
        n = len(self.buckets)
        bad = [j for j, f in enumerate(self._flags[:n]) if f != 0]
        self._pending = None
        if bad:
            self.error = self._nonfinite_message(step, self._flags, bad)
            self._error_kind = NonFiniteAggregateError
            self.raise_error()
        self._overlap_verdict(step, int(self._flags[n]))
        self._judge_residuals()
        if self.check is not None and self.check.differs(step):
            for b in self.buckets:
                b.step = None
            self.check.raise_found()
        self._due = [b for b in self.buckets if b.step is not None]
        clip, self._pending_clip = self._pending_clip, None
        if clip is not None:  # every mean first: the norm is over all of them
            for b in self._due:
                self._decode(b)
            self.last_norm = self.device.clip([b.mean for b in self._due], *clip)

    def _judge_residuals(self):
        """The residual watch judges the pending step's samples: the squared norms of each
        sampled bucket's gradient and residual, summed over the ranks (every rank alike)."""
        watched, self._watched = self._watched, []
        for j, push in watched:
            g2, r2 = self._watch_sums[2 * j], self._watch_sums[2 * j + 1]
            b = self.buckets[j]
            found = b.watch.record(push, math.sqrt(g2), math.sqrt(r2))
            if found is not None and self.residual_growth is None:
                self.residual_growth = residual_watch.message(bucket_name(b), b.base_codec,
                                                              found)

    def _decode(self, b):
        """Bucket b's sum decoded at its pass's site; in the warm-up, its route's sample
        completed (its marks read at the decision)."""
        timing, b.timing = b.timing, None
        start = self.device.mark() if timing is not None else None
        stages.decode_bucket(b.sent, b, self.num_workers, self.device.counts)
        if timing is not None:
            j, route, step, marks = timing
            self._spans.append((j, route, step, marks + [start, self.device.mark()]))

    # -- the CTTab per bucket (bucket_cttab.py) ------------------------------------------
    def read_spans(self):
        """The warm-up's marks read into the CTTab's samples (a GPU: one host
        synchronisation): each sample is encode-to-sum plus decode."""
        if not self._spans:
            return
        seconds = self.device.span_seconds([marks for _, _, _, marks in self._spans])
        for (j, route, step, _), s in zip(self._spans, seconds):
            self.routes.record(j, route, s, step)
        self._spans = []

    def _decide(self):
        """End of the warm-up: this rank's routes from its samples, rank 0's adopted by
        every rank (the transport's allgather), each bucket settled on its route."""
        self.read_spans()
        self.routes.adopt(agree(self.transport, self.routes.own_routes()))
        self.settle_routes()
        if self.rank == 0:
            notice.tell(self.routes.summary())

    def settle_routes(self):
        """Each bucket that can be compressed keeps the CTTab's route from now on."""
        for j, b in enumerate(self.buckets):
            if b.codec is not None:
                b.settle(self.routes.routes[j])

    # -- verdicts and errors -------------------------------------------------------------
    def _overlap_verdict(self, step, value):
        """Every rank's word on the step's gradients (the tail's overlap slot, 2**rank where
        a gradient changed after backward or clipping needs the local update): after the
        watched first step, whether buckets start in backward (alike on every rank); after
        one that started in backward, an error on every rank, nothing written."""
        if not value:
            if self.overlap == "deciding":
                self.overlap = "on"
            return
        ranks = self._ranks(value)
        why = self._why or "a gradient changed between backward and step()"
        if self.overlap == "deciding":
            self.overlap = "off"
            notice.tell("the device path starts its buckets in step(), not during "
                        "backward: %s (rank %s)" % (why, ranks), once=True)
            return
        if self.overlap == "on":
            self._overlap_error(step, "%s (rank %s)" % (why, ranks))

    def _overlap_error(self, step, why):
        """Raise, now and at every later call, that step `step` went wrong after backward
        had started its buckets (`why`); nothing of it was written."""
        self.error = ("step %d: %s, after backward had sent it; buckets start during backward "
                      "since the first step showed none of this, and no global weight was "
                      "written from this step: build the DistributedOptimizer with "
                      "overlap=False" % (step, why))
        self._error_kind = RuntimeError
        self.raise_error()

    def _ranks(self, value):
        """The ranks a summed slot of 2**rank names."""
        if self.num_workers > 52:
            return "%d of them" % value
        return ", ".join(str(r) for r in range(self.num_workers) if value >> r & 1)

    def _nonfinite_message(self, step, flags, bad):
        ranks = self._ranks(int(flags[bad[0]]))
        names = [n for j in bad for n in self.buckets[j].names]
        return ("step %d: the gradient of %s held NaN/Inf on rank %s (with its error-feedback "
                "residual, where compressed); no global weight was written from this step's "
                "sum and training cannot go on from it: lower the learning rate, or use a "
                "GradScaler, and restart from a checkpoint"
                % (step, ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""), ranks))

    def raise_error(self):
        """The error found (a non-finite sum, a gradient changed after it was sent), again."""
        if self.error is not None:
            raise self._error_kind(self.error)

    # -- reports and checkpoints ---------------------------------------------------------
    def stats(self):
        """What stats() reports of the device path (the codec's work is queued on the
        device, so it has no host-side encode or transfer times). routes: each bucket's
        route ('compressed' on the device, 'compressed on the host', 'full precision', or
        'warm-up' while the CTTab times them); compressed_buckets counts those that take a
        codec's route (in the warm-up, every bucket that can)."""
        routes = self.routes.route_names()
        on = [r != "full precision" for r in routes]
        return {"compressor": self.config.compressor, "backup": self.config.backup,
                "buckets": len(self.buckets),
                "compressed_buckets": sum(on),
                "compressed_keys": sum(len(b.indices) for b, c in zip(self.buckets, on) if c),
                "routes": routes, "bucket_names": [b.names for b in self.buckets],
                "cttab_phase": self.routes.phase, "cttab_reason": self.routes.reason,
                "keys": sum(len(b.indices) for b in self.buckets),
                "steps": self.step_count, "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pushed, "bytes_fp32": self.bytes_fp32,
                "compress_s": 0.0, "comm_s": 0.0, "blocked_s": self.blocked_s,
                "residual_growth": self.residual_growth,
                "overlap": self.overlap,
                "transfers": self.transfers}

    def state_dict(self):
        """The step's count and the CTTab's routes (in the warm-up: its samples so far), the
        pending updates done first; the buckets' tensors are the adapter's to save."""
        self.finish_pending()
        self.read_spans()
        return {"step": self.step_count, "routes": self.routes.state_dict()}

    def load_state_dict(self, step, routes):
        """Resume at `step` with the CTTab's saved `routes` (None: saved before the device
        path had a CTTab, which warms up anew); nothing pending."""
        if routes is not None:
            self.routes.load_state_dict(routes)
        elif self.routes.warming:
            self.routes.start = int(step)
        for b in self.buckets:
            b.step = None
            b.works = []
            b.timing = None
        self._spans = []
        if not self.routes.warming:
            self.settle_routes()
        self.step_count = step
        self._pending = self._flags = None
        self._due = []


def bucket_name(b):
    """How messages name a bucket: its first parameter, and how many more it holds."""
    return b.names[0] + (" (+%d)" % (len(b.names) - 1) if len(b.names) > 1 else "")


class _TailWork:
    """The rider's carrier: waiting for it reads the tail (Rider.same())."""

    def __init__(self, step):
        self._step = step

    def wait(self):
        self._step.read_tail()
