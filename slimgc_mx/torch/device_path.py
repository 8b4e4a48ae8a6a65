"""The device path: a model's whole step in torch ops on its parameters' device.

The host path (the engine's pipeline) copies each gradient to the host and the global
weights and optimizer state back; here nothing leaves the device. Parameters are fused into
buckets (DDP's bucket_cap_mb, in reverse order, the order backward produces them), each
keeping on the device its glo_buf, the global optimizer's state (an instance of the user's
optimizer over glo_buf's views), its error-feedback residual and its lanes; with
state_on='host' its glo_buf, that state and the residual live in host memory instead,
staged on the device for the pass that reads them (state_home.py), and each bucket's
deferred global update (1) runs in its own pass rather than all in the step's first. One
pass per bucket, started from backward once its last gradient is accumulated (hook(); in
step() where the first step shows a gradient changing after backward):
  1. backup on: the previous step's global update, deferred until now: the sum waited for
     on the device (no host wait where the group is NCCL), decoded, the optimizer's rule
     into glo_buf;
  2. backup on: the local update into the parameter (loc_buf): glo_buf, then one step of
     the same rule with this rank's gradient on a copy of the global state;
  3. error feedback and the encode into lanes (torch/device.py: bitwise the Cython lanes);
  4. the lanes' sum started on the process group (async); powersgd (torch/lowrank.py)
     sums its P, waits for that sum on the device and then sums its Q.
Without backup, 1 runs after every bucket's 4 and the parameters get glo_buf.

Every bucket's NaN/Inf flag (2**rank) and the step's settings hash (step_check.py) travel
in one small tail summed after the buckets; it is read before the global update that it
guards, the step's one host synchronisation, so a poisoned sum writes nothing. Every 10th
compressed push of a bucket, the squared norms of its gradient and of the residual the last
push left ride in the tail too, summed over the ranks: the residual watch
(engine/residual_watch.py) judges them on every rank alike and warns once where the
residual keeps growing (compression that wrecks training), as on the host path.

With comm_threshold='auto' (the default) the CTTab chooses each bucket's route
(engine/bucket_cttab.py): for config.warmup_steps steps every bucket that can be compressed
cycles through the device codec, the host codec (2bit) and full precision, each timed (CUDA
events on the stream that runs them, read once at the decision; wall time on the CPU); then
each bucket keeps the fastest, a compressed one only where it wins by cttab_margin, and
every rank adopts rank 0's routes. A size in bytes,
or 'off', fixes the routes at build time (no warm-up).
"""
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import codecs, notice
from ..codecs.rng import key_seed
from ..engine import backend, residual_watch, stages
from ..engine.bucket_cttab import BucketRoutes, agree
from ..engine.offload import NonFiniteAggregateError
from ..engine.step_clip import EPS
from .collective import Collectives, Rider
from .copies import CopyCounts
from .buckets import Bucket, plan_buckets
from .device import TorchDeviceCodec
from .lowrank import TorchPowerSGD
from .state import from_tensors, to_tensors
from .state_home import UPDATE, StateCopies, pass_parts

#: DDP's default bucket size.
BUCKET_CAP_MB = 25.0


#: What data_path takes.
CHOICES = ("auto", "device", "host")
#: Where the device path keeps glo_buf and the optimizer's state (state_home.py).
STATE_ON = ("device", "host")


def check_state_on(value):
    """`value` if it is one of STATE_ON, else a ValueError naming the choices."""
    if value not in STATE_ON:
        raise ValueError("state_on must be one of %s (where the device path keeps glo_buf, "
                         "the optimizer's state and the residuals), got %r"
                         % (", ".join(repr(x) for x in STATE_ON), value))
    return value


def make_codec(config):
    """The codec `config` names (None for full precision), as every bucket's is cloned."""
    if config.compressor == "none":
        return None
    return codecs.create(config.compressor, threshold=config.threshold, **config.codec_options)


def lacks(config, optimizer):
    """Why the device path cannot run `config` (a SlimGCConfig) for `optimizer`, or None."""
    codec = make_codec(config)
    if codec is not None:
        if not (TorchDeviceCodec.supports(codec) or TorchPowerSGD.supports(codec)):
            return ("compression=%r has no torch-ops version yet (the device path serves "
                    "none, 1bit, 2bit, 4bit, terngrad, qsgd, thc, randomk and powersgd)"
                    % config.compressor)
    for name in ("loc_lr", "loc_optimizer", "trace"):
        if getattr(config, name) is not None:
            return "%s is the host path's option" % name
    if config.audit_every:
        return "audit_every is the host path's option"
    if not isinstance(config.comm_threshold, (int, float)) and \
            config.comm_threshold not in ("auto", "off"):
        return "a saved CTTab decision (comm_threshold=%r) is the host path's" % (
            config.comm_threshold,)
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        return "the parameters are on several devices (%s)" % ", ".join(sorted(map(str, devices)))
    if type(optimizer).__init__ is torch.optim.Optimizer.__init__:
        return "the optimizer class cannot be rebuilt from its settings"
    return None


def choose(data_path, config, optimizer, cuda, offload_given=False):
    """Where the step runs: 'device' or 'host' (the one place this is decided).

    'auto': the device path for a CUDA model whose settings it serves, else the host path;
    'device' is refused, naming why, where the device path lacks a setting. offload_given:
    the user set offload (keyword or SLIMGC_OFFLOAD); True or 'auto' asks for the host
    path's CPU codecs (offload=False, codecs on the device, is the device path's too)."""
    if data_path not in CHOICES:
        raise ValueError("data_path must be one of %s, got %r" % (", ".join(CHOICES),
                                                                 data_path))
    if data_path == "host":
        return "host"
    why = lacks(config, optimizer)
    if why is None and offload_given and config.offload is not False:
        why = "offload=%r (CPU codecs) is the host path's" % (config.offload,)
    if data_path == "device":
        if why is not None:
            raise ValueError("data_path='device': %s; use data_path='host'" % why)
        return "device"
    return "device" if cuda and why is None else "host"


def lane_group(transport_group, cuda):
    """The group that sums the lanes: the job's default group where it is NCCL and the model
    is on a GPU (the sum stays on the device), else the transport's Gloo group."""
    if cuda and dist.is_initialized() and dist.get_backend() == "nccl":
        return dist.group.WORLD
    return transport_group


class DevicePath:
    """A DistributedOptimizer's step on the device: buckets, their passes, the tail."""

    def __init__(self, optimizer, named, group_of, config, transport, group, cap_mb=None,
                 state_on="device"):
        self.state_on = check_state_on(state_on)
        self.optimizer = optimizer
        self.config = config
        self.num_workers, self.rank = transport.num_workers, transport.rank
        self.group = group
        self._nccl = group is not None and dist.get_backend(group) == "nccl"
        self._wire = Collectives(group) if group is not None else None
        self.counts = CopyCounts()
        codec = make_codec(config)
        threshold = config.comm_threshold
        auto = threshold == "auto"
        if threshold in ("auto", "off"):  # auto: every tensor a candidate of the CTTab
            threshold = 0
        elif not isinstance(threshold, (int, float)):
            raise ValueError("comm_threshold=%r: the device path takes a size in bytes or "
                             "'off' (a saved CTTab decision is the host path's)" % (threshold,))
        cap = float(BUCKET_CAP_MB if cap_mb is None else cap_mb) * 2 ** 20
        self.buckets = [Bucket(s, named, optimizer, _bucket_codec(codec, s, config.seed),
                               self.num_workers)
                        for s in plan_buckets(named, group_of, codec, threshold, cap)]
        for b in self.buckets[:1]:  # the stages the engine runs (stages.encode_bucket, ...)
            backend.check(b, backend.DeviceBucket, "the device path's bucket")
        device = named[0][1].device
        self._transport = transport  # rank 0's routes gathered over it at the decision
        self._cuda = device.type == "cuda"
        self.routes = BucketRoutes([b.codec is not None for b in self.buckets],
                                   [4 * b.numel for b in self.buckets],
                                   [_bucket_name(b) for b in self.buckets],
                                   mode="auto" if auto else "fixed",
                                   warmup_steps=config.warmup_steps,
                                   margin=config.cttab_margin,
                                   hosts=[b.host_route for b in self.buckets])
        self._spans = []  # CUDA: warm-up samples whose events are read at the decision
        if self.routes.warming and self.rank == 0:
            notice.tell(self.routes.opening())
        # the tail: each bucket's NaN/Inf flag, the overlap check, the settings rider
        # [flags per bucket][overlap][the settings rider][||grad||^2, ||residual||^2 per bucket]
        rider_slots = Rider([0], self.num_workers).slots(np.float64).size
        self._watch_at = len(self.buckets) + 1 + rider_slots  # where the watch's slots start
        n_tail = self._watch_at + 2 * len(self.buckets)
        self.tail = torch.zeros(n_tail, dtype=torch.float64, device=device)
        self.tail_host = torch.zeros(n_tail, dtype=torch.float64,
                                     pin_memory=device.type == "cuda")
        self._tail_work = None  # the tail's sum in flight
        self._tail_event = None  # CUDA: after the summed tail's copy into tail_host
        self._side = None  # CUDA: the stream that copies the tail out
        self._tail_rider = None  # the rider it carries
        self._flags = None  # the summed flags, once read
        self._pending = None  # the step whose global updates are still to run
        self._pending_clip = None  # its (max_norm, norm_type) where it is clipped
        self.last_norm = None  # the mean gradient's norm of the last clipped step applied
        self._rider = None
        self.step_count = 0
        self.overlap = "off"  # buckets start in step(); hook(): 'watch', 'deciding', 'on'/'off'
        self._why = ""  # what this rank found against starting in backward, this step
        self._handles = []
        self._names = [n for n, _ in named]
        self._step_open = False  # this step's deferred global updates are done (backup)
        self.error = None  # a NaN/Inf sum found: raised by every later call
        self.residual_growth = None  # the residual watch's message, once found
        self._sampling = []  # this step's buckets whose norms ride in the tail: (index, push)
        self._watched = []  # the pending step's
        self._watch_sums = None  # their summed squared norms, once the tail is read
        self.blocked_s = 0.0  # waiting for sums on the host
        self.bytes_pushed = 0
        self.bytes_fp32 = 0
        self.transfers = 0  # the sums started: the buckets' exchanges and the tails
        self._fp32_bytes = 4 * sum(b.numel for b in self.buckets)
        with torch.no_grad():  # rank 0's weights everywhere, as the host path's
            for b in self.buckets:
                self._sum(b.glo, broadcast=True)
                b.write_back()
        self._due = []  # buckets whose global update of the pending step is still to run
        self._copies = None  # state_home.StateCopies where the state is offloaded
        if state_on == "host":  # glo_buf, the optimizer's state, the residuals to the host
            self._copies = StateCopies(device, self.counts)
            for b in self.buckets:
                b.offload(self._copies)
            self._fetch_first()

    def _sum(self, tensor, broadcast=False):
        """Start the sum of `tensor` over the ranks (rank 0's value: `broadcast`); its Work,
        or None in a job of one process without torch.distributed."""
        if self._wire is None:
            return None
        if broadcast:
            self._wire.broadcast(tensor).wait()
            return None
        return self._wire.all_reduce(tensor)

    # -- the step ----------------------------------------------------------------------------
    def ride(self, values):
        """A Rider of `values` sent with this step's tail (StepSettingsCheck's transport)."""
        self._rider = Rider(values, self.num_workers)
        return self._rider

    # -- buckets started during backward (post-accumulate-grad hooks) -------------------
    def hook(self, params):
        """Start each bucket from backward, once its last gradient is accumulated, in bucket
        order (every rank issues the same sums in the same order, whatever order backward
        finishes them in). The first step only watches: if a gradient changes between its
        hook and step() (accumulation, GradScaler's unscale_, a clip writing .grad), or a
        clip with backup scales the local update, buckets keep starting in step()."""
        self._params = params
        self._bucket_of = {i: j for j, b in enumerate(self.buckets) for i in b.spec.indices}
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda p, i=i: self._on_grad(i)) for i, p in enumerate(params)]
        self.overlap = "watch"
        self._reset_hooks()

    def _reset_hooks(self):
        self._fired = [0] * len(self._params)
        self._versions = [None] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to start, in order

    def _on_grad(self, i):
        """Parameter i's gradient is final for this backward: note it; start the buckets
        that are complete, in order."""
        grad = self._params[i].grad
        self._fired[i] += 1
        self._versions[i] = (id(grad), grad._version)
        if self.overlap != "on" or self._fired[i] > 1:
            return
        self._ready[self._bucket_of[i]] += 1
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next].params):
            self._start(self._next, [self._params[k].grad
                                     for k in self.buckets[self._next].spec.indices])
            self._next += 1

    def no_overlap(self, why):
        """A step where starting buckets in backward is wrong whatever the gradients' versions
        say (GradScaler's unscale writes .grad without marking it): buckets start in step()
        from now on; if backward has started some already, every rank raises here alike."""
        if self.overlap == "on":
            self._overlap_error(self.step_count, why)
        if self.overlap in ("watch", "deciding"):
            self.overlap = "off"
            notice.tell("the device path starts its buckets in step(), not during backward: "
                        "%s" % why, once=True)

    def _changed(self):
        """What keeps this step's buckets from starting in backward: '' if nothing, else
        which parameters got no gradient from it, several, or one changed after its hook."""
        none = [self._names[i] for i, n in enumerate(self._fired) if n == 0]
        several = [self._names[i] for i, n in enumerate(self._fired) if n > 1]
        changed = [self._names[i] for i, p in enumerate(self._params) if self._fired[i] == 1
                   and (p.grad is None or (id(p.grad), p.grad._version) != self._versions[i])]
        for names, what in ((several, "got gradients from several backward calls before "
                             "step() (accumulation)"),
                            (changed, "changed after backward (GradScaler's unscale_, or a "
                             "clip writing .grad)"),
                            (none, "got no gradient from backward")):
            if names:
                return "the gradient of %s %s" % (", ".join(names[:4]), what)
        return ""

    # -- the step ------------------------------------------------------------------------------
    def _start(self, j, grads, local_scale=None):
        """Bucket j's pass: (the step's first) the deferred global updates; the local update;
        the encode; its sum started."""
        backup = self.config.backup
        offloaded = self.state_on == "host"
        if not self._step_open:
            self.raise_error()
            due = self.routes.due(self.step_count)
            if backup:  # offloaded: each bucket's update at its own pass, below, except
                # before the CTTab's decision, which reads the samples their decodes complete
                self.finish_pending(apply=not offloaded or due)
            if due:
                self._decide()
            self.tail[self._watch_at:].zero_()  # read with the pending step's tail above
            self._step_open = True
        b = self.buckets[j]
        b.settings(self.optimizer.param_groups[b.spec.group])
        parts = pass_parts(backup)  # (offloaded: what this pass reads)
        staged = b.stage(parts)
        if offloaded and j + 1 < len(self.buckets):
            self.buckets[j + 1].home.fetch(parts)  # its stage-in beside this pass
        if backup:
            self._apply(b)  # (offloaded: its due update; else done above)
            b.local_step(grads if local_scale is None else [g * local_scale for g in grads])
        try:
            self._encode_and_sum(j, b, grads)
        finally:
            if staged:
                b.unstage()

    def _encode_and_sum(self, j, b, grads):
        """Bucket j's encode (error feedback into its residual) and its lanes' sum started,
        each at the site of the pass's plan (engine/stages.py); in the warm-up, timed."""
        timed = self.routes.warming and b.codec is not None
        if timed:  # the warm-up: this step's route, timed from the encode to the decode
            b.route = self.routes.route(j, self.step_count)
            start = self._mark()
        plan = b.plan(timed)
        watch = None
        if b.watch is not None and plan.compressed and residual_watch.due(b):
            watch = self.tail[self._watch_at + 2 * j:self._watch_at + 2 * j + 2]
            self._sampling.append((j, b.pushes))
        pieces = []  # a large tensor's lanes, summed piece by piece as they are encoded
        stages.encode_bucket(plan, b, grads, self.num_workers, self.tail[j], self.rank,
                             self.counts, watch=watch, on_piece=None if self._wire is None
                             else lambda lo, hi: pieces.append(self._sum(b.lanes[lo:hi])))
        if pieces:
            b.works = pieces
            self.transfers += len(pieces)
        else:
            self.transfers += stages.exchange_bucket(plan, b, self._sum, self.tail[j])
        if timed:  # the sum waited for (CUDA: the stream waits), in the warm-up only
            b.wait_sums()
            b.timing = (j, plan.route, self.step_count, [start, self._mark()])
        b.step = self.step_count

    def step(self, grads_of, clip=None):
        """One step: grads_of[i] is parameter i's gradient (model order). clip: (max_norm,
        norm_type, local_scale) of slimgc.clip_grad_norm_: the mean gradient clipped by its
        norm before the global update, the local update's gradient scaled by local_scale.
        The buckets backward started are checked, the others started here."""
        backup = self.config.backup
        local_scale = clip[2] if clip is not None else None
        self.raise_error()
        started = self._next if self.overlap == "on" else 0
        why = ""
        if self.overlap in ("on", "watch"):  # what would make starting in backward wrong
            why = self._changed() or ("slimgc.clip_grad_norm_ with backup scales the local "
                                      "update's gradient" if local_scale is not None and backup
                                      else "")
            self._why = why
            if self.overlap == "watch":
                self.overlap = "deciding"  # by every rank's verdict, in the tail
        for j in range(started, len(self.buckets)):
            self._start(j, [grads_of[i] for i in self.buckets[j].spec.indices], local_scale)
        if self.overlap != "off":
            self._reset_hooks()
        self._step_open = False
        rank_bit = float(2 ** self.rank) if self.num_workers <= 52 else 1.0
        n = len(self.buckets)
        with torch.no_grad():
            self.tail[n].fill_(1.0 if why else 0.0)
            self.tail[:n + 1].mul_(rank_bit)
            rider, self._rider = self._rider, None
            if rider is not None:  # through pinned memory: no pageable copy
                staged = self.tail_host[n + 1:self._watch_at]
                staged.copy_(torch.from_numpy(rider.slots(np.float64)))
                self.tail[n + 1:self._watch_at].copy_(staged, non_blocking=True)
                if self.tail.is_cuda:
                    self.counts.h2d_bytes += staged.numel() * staged.element_size()
        self._tail_work = self._sum(self.tail)
        self.transfers += 1
        self._tail_event = self._tail_to_host()
        self._tail_rider = rider
        self._flags = None
        if rider is not None:
            rider.carried_by(_TailWork(self))
        self._pending = self.step_count
        self._pending_clip = clip[:2] if clip is not None else None
        self._watched, self._sampling = self._sampling, []
        self.step_count += 1
        self.bytes_pushed += sum(b.lanes.numel() * b.lanes.element_size()
                                 for b in self.buckets)
        self.bytes_fp32 += self._fp32_bytes
        if not backup:
            self.finish_pending(write_back=True)
        if self._copies is not None:  # the next step's first pass: its stage-in now
            self._fetch_first()
        if self.residual_growth is not None:  # on the training thread, once per process
            residual_watch.warn(self.residual_growth)

    def _tail_to_host(self):
        """NCCL: on a side stream, wait for the tail's sum and copy it into pinned memory;
        the event after the copy (the compute stream does not wait: the next forward runs
        while the sums travel). None otherwise: read_tail waits for Gloo and copies."""
        if not (self.tail.is_cuda and self._nccl):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.tail.device)
        self._side.wait_stream(torch.cuda.current_stream(self.tail.device))
        with torch.cuda.stream(self._side):
            if self._tail_work is not None:
                self._tail_work.wait()  # NCCL: this stream waits; Gloo: the host does
            self.tail_host.copy_(self.tail, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        self.counts.d2h_bytes += self.tail.numel() * self.tail.element_size()
        return event

    def read_tail(self):
        """The pending step's summed tail onto the host, once: the step's one host
        synchronisation (with backup on, of a sum long done)."""
        if self._pending is None or self._flags is not None:
            return
        start = time.perf_counter()
        if self._tail_event is not None:  # CUDA: the copy queued after the sum, waited for
            self._tail_event.synchronize()
            self._tail_event = None
            self.counts.host_syncs += 1
        else:
            if self._tail_work is not None:
                self._tail_work.wait()
            self.tail_host.copy_(self.tail)
            if self.tail.is_cuda:  # a Gloo group's sum of CUDA tensors: a blocking copy
                self.counts.host_syncs += 1
                self.counts.d2h_bytes += self.tail.numel() * self.tail.element_size()
        self._tail_work = None
        self.blocked_s += time.perf_counter() - start
        tail = self.tail_host.numpy()
        n = len(self.buckets)
        if self._tail_rider is not None:
            self._tail_rider.sums = tail[n + 1:self._watch_at].copy()
            self._tail_rider = None
        self._flags = tail[:n + 1].copy()
        self._watch_sums = tail[self._watch_at:].copy()

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
                if k + 1 < len(due) and due[k + 1].home is not None:  # the next one's
                    due[k + 1].home.fetch(UPDATE)  # stage-in beside this update
                self._apply(b, write_back)

    def _apply(self, b, write_back=False):
        """Bucket b's due global update (decoded unless a clipped step decoded it), with its
        glo_buf and state staged where they are offloaded; `write_back`: into the parameters."""
        if b not in self._due:
            return
        self._due.remove(b)
        if b.mean is None:
            self._decode(b)
        staged = b.stage(UPDATE)  # (within a pass with backup: staged already)
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
            self._clip(self._due, *clip)

    def _judge_residuals(self):
        """The residual watch judges the pending step's samples: the squared norms of each
        sampled bucket's gradient and residual, summed over the ranks (every rank alike)."""
        watched, self._watched = self._watched, []
        for j, push in watched:
            g2, r2 = self._watch_sums[2 * j], self._watch_sums[2 * j + 1]
            b = self.buckets[j]
            found = b.watch.record(push, math.sqrt(g2), math.sqrt(r2))
            if found is not None and self.residual_growth is None:
                self.residual_growth = residual_watch.message(_bucket_name(b), b.codec.codec,
                                                              found)

    def _decode(self, b):
        """Bucket b's sum decoded at its pass's site; in the warm-up, its route's sample
        completed."""
        timing, b.timing = b.timing, None
        if timing is None:
            stages.decode_bucket(b.sent, b, self.num_workers, self.counts)
            return
        start = self._mark()
        stages.decode_bucket(b.sent, b, self.num_workers, self.counts)
        j, route, step, marks = timing
        marks += [start, self._mark()]
        if self._cuda:
            self._spans.append((j, route, step, marks))
        else:
            self.routes.record(j, route, (marks[1] - marks[0]) + (marks[3] - marks[2]), step)

    # -- the CTTab (engine/bucket_cttab.py) -----------------------------------------------------
    def _mark(self):
        """Now: a CUDA event recorded on the current stream (the one that runs the encode,
        waits for the sum and decodes), or the wall clock on the CPU."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.tail.device))
        return event

    def _read_spans(self):
        """CUDA: the warm-up's events read into the samples, after one host synchronisation
        (the last event: the others were recorded before it on the stream)."""
        if not self._spans:
            return
        self._spans[-1][3][-1].synchronize()
        self.counts.host_syncs += 1
        for j, route, step, marks in self._spans:
            for event in marks:
                if not event.query():  # recorded on another stream
                    event.synchronize()
            seconds = (marks[0].elapsed_time(marks[1]) + marks[2].elapsed_time(marks[3])) / 1e3
            self.routes.record(j, route, seconds, step)
        self._spans = []

    def _decide(self):
        """End of the warm-up: this rank's routes from its samples, rank 0's adopted by
        every rank (the host transport's allgather), each bucket settled on its route."""
        self._read_spans()
        self.routes.adopt(agree(self._transport, self.routes.own_routes()))
        self._settle()
        if self.rank == 0:
            notice.tell(self.routes.summary())

    def _settle(self):
        for j, b in enumerate(self.buckets):
            if b.codec is not None:
                b.settle(self.routes.routes[j])

    def _clip(self, buckets, max_norm, norm_type):
        """The step's mean gradient scaled by min(1, max_norm / (norm + 1e-6)), its norm
        over every bucket, as torch's clip_grad_norm_ after DDP's averaging; on the device
        (last_norm keeps the norm as a tensor: reading it is the caller's synchronisation)."""
        with torch.no_grad():
            norms = torch.stack([torch.linalg.vector_norm(b.mean, norm_type) for b in buckets])
            total = torch.linalg.vector_norm(norms, norm_type)
            coef = torch.clamp(max_norm / (total + EPS), max=1.0)
            for b in buckets:
                b.mean.mul_(coef)
        self.last_norm = total

    check = None  # a step_check.StepSettingsCheck (set by the optimizer for several ranks)

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
            notice.tell("the device path starts its buckets in step(), not during backward: "
                        "%s (rank %s)" % (why, ranks), once=True)
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

    def describe(self):
        """Where the step runs and its state lives, as the optimizer says it at start."""
        if self.routes.warming:
            kind = "%d to be routed by the CTTab after %d warm-up steps" % (
                sum(self.routes.candidates), self.routes.warmup_steps)
        else:
            kind = "%d compressed" % sum(b.compressed for b in self.buckets)
        where = ("glo_buf, the optimizer's state and the residuals stay on %s"
                 % self.buckets[0].device if self.state_on == "device" else
                 "glo_buf, the optimizer's state and the residuals offloaded to %shost "
                 "memory, staged on %s for each bucket's pass"
                 % ("pinned " if self._copies.cuda else "", self.buckets[0].device))
        return ("data path: device: %s, %d buckets (%s) summed over %s%s" % (
                    where, len(self.buckets), kind,
                    "NCCL" if self._nccl else "Gloo" if self.group is not None else "no group",
                    "" if self.overlap != "off" else ", started in step()"))

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

    _error_kind = NonFiniteAggregateError

    def flush(self):
        """Every pending global update done and the parameters given glo_buf."""
        self.wait()
        for b in self.buckets:
            b.write_back()

    def wait(self):
        """The pending global updates done, the parameters left as they are (state_dict);
        offloaded state: its copies into host memory done."""
        self.finish_pending()
        if self._copies is not None:
            self._copies.settle()

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
                "compressed_keys": sum(len(b.params) for b, c in zip(self.buckets, on) if c),
                "routes": routes, "bucket_names": [b.names for b in self.buckets],
                "cttab_phase": self.routes.phase, "cttab_reason": self.routes.reason,
                "keys": sum(len(b.params) for b in self.buckets),
                "steps": self.step_count, "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pushed, "bytes_fp32": self.bytes_fp32,
                "compress_s": 0.0, "comm_s": 0.0, "blocked_s": self.blocked_s,
                "residual_growth": self.residual_growth,
                "overlap": self.overlap,
                "transfers": self.transfers}

    # -- checkpoint state ----------------------------------------------------------------------
    def state_dict(self):
        """glo_buf, the residual and the global optimizer's state of every bucket (host), and
        the CTTab's routes (in the warm-up: its samples so far); a codec's arrays (powersgd's
        Q) as state.py keeps them, so that torch.load(weights_only=True) reads it back."""
        self.wait()
        self._read_spans()
        out = []
        for b in self.buckets:
            state = b.shadow.state_dict()
            out.append({"names": b.names,
                        "glo_buf": _to_cpu(b.glo),
                        "residual": _to_cpu(b.residual),
                        "optimizer": _to_cpu(state),
                        "codec": None if b.codec is None else to_tensors(b.codec.state_dict())})
        return {"buckets": out, "step": self.step_count, "routes": self.routes.state_dict()}

    def load_state_dict(self, state):
        buckets = state["buckets"]
        mine = [b.names for b in self.buckets]
        if [s["names"] for s in buckets] != mine:
            raise ValueError("this checkpoint's device-path buckets hold other parameters "
                             "(saved %d buckets, this optimizer has %d): save and load with the "
                             "same model, bucket size and comm_threshold"
                             % (len(buckets), len(mine)))
        routes = state.get("routes")
        if routes is not None:
            self.routes.load_state_dict(routes)
        elif self.routes.warming:  # saved before the device path had a CTTab: warm up anew
            self.routes.start = int(state["step"])
        with torch.no_grad():
            for b, s in zip(self.buckets, buckets):
                if b.home is not None:
                    b.home.discard()  # a stage-in queued before the load reads old values
                b.glo.copy_(s["glo_buf"])
                if b.codec is not None:
                    if s["residual"] is None:  # flushed for good (a full-precision route)
                        b.residual = None
                    else:
                        if b.residual is None:  # (offloaded: adopt_state moves it home)
                            b.residual = torch.zeros(b.numel, device=b.device)
                        b.residual.copy_(s["residual"])
                    b.codec.load_state_dict(from_tensors(s["codec"]))
                b.shadow.load_state_dict(s["optimizer"])
                if b.home is not None:
                    b.home.adopt_state()  # (torch loads it into pageable memory)
                b.step = None
                b.works = []
                b.timing = None
        self._spans = []
        if not self.routes.warming:
            self._settle()
        self.step_count = state["step"]
        self._tail_work = self._tail_event = self._pending = self._flags = None
        self._due = []
        if self._copies is not None:
            self._fetch_first()

    def _fetch_first(self):
        """Offloaded: queue the stage-in of the first bucket's next pass."""
        self.buckets[0].home.fetch(pass_parts(self.config.backup))

    def close(self):
        """Wait for the sums in flight (a collective left running would outlive the group)
        and take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for b in self.buckets:
            b.wait_sums()
        if self._tail_work is not None:
            self._tail_work.wait()
            self._tail_work = None
        if self._wire is not None:
            self._wire.settle(self.config.timeout)  # Gloo lets go before the group does


def _bucket_name(b):
    """How messages name a bucket: its first parameter, and how many more it holds."""
    return b.names[0] + (" (+%d)" % (len(b.names) - 1) if len(b.names) > 1 else "")


def _bucket_codec(codec, spec, job_seed):
    """Bucket `spec`'s codec: a clone of `codec` (None for full precision), its random
    draws keyed as the host path keys its first tensor's (parameter i is key i there), so
    that a bucket of one tensor draws what that key draws."""
    if codec is None or not spec.compressed:
        return None
    out = codec.clone()
    out.seed = key_seed(job_seed, spec.indices[0])
    return out


class TailRides:
    """StepSettingsCheck's transport on the device path: riders travel in the step's tail,
    the rest (rank, allgather) is the host transport's."""

    def __init__(self, transport, path):
        self._transport, self._path = transport, path
        self.rank = transport.rank

    def ride(self, values):
        return self._path.ride(values)

    def allgather(self, values):
        return self._transport.allgather(values)


class _TailWork:
    """The rider's carrier: waiting for it reads the tail (Rider.same())."""

    def __init__(self, path):
        self._path = path

    def wait(self):
        self._path.read_tail()


def _to_cpu(obj):
    """A copy on the host (a CPU tensor too: the live one changes with the next step)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
