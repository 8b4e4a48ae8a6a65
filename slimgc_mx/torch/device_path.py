"""The device path's PyTorch side: a CUDA model's step in torch ops on its parameters' device.

The host path (the engine's pipeline) copies each gradient to the host and the global
weights and optimizer state back; here nothing leaves the device. Parameters are fused into
buckets (DDP's bucket_cap_mb, in reverse order, the order backward produces them: buckets.py),
each keeping on the device its glo_buf, the global optimizer's state (an instance of the
user's optimizer over glo_buf's views), its error-feedback residual and its lanes; with
state_on='host' its glo_buf, that state and the residual live in host memory instead,
staged on the device for the pass that reads them (state_home.py).

The engine schedules the step (engine/bucket_step.py: each bucket's pass, the deferred
global update, the tail) and places each stage of a pass by its Plan (engine/stages.py);
this module is the adapter under it: DevicePath builds the buckets and starts them from
backward (post-accumulate-grad hooks; in step() where the first step shows a gradient
changing after backward), and TorchStep (backend.DeviceStep) gives the engine the job's
sums (NCCL on the device where the group is NCCL, else Gloo), CUDA-event timing marks,
the step's tail and the clip, in torch ops.

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
every rank adopts rank 0's routes. A size in bytes, or 'off', fixes the routes at build
time (no warm-up).
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import codecs, notice
from ..codecs.rng import key_seed
from ..engine import backend
from ..engine.bucket_cttab import BucketRoutes
from ..engine.bucket_step import BucketStep, bucket_name, pass_parts, tail_size
from ..engine.step_clip import EPS
from .collective import Collectives, Rider
from .copies import CopyCounts
from .buckets import Bucket, plan_buckets
from .device import TorchDeviceCodec
from .lowrank import TorchPowerSGD
from .state import from_tensors, to_tensors
from .state_home import StateCopies

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
    """A DistributedOptimizer's step on the device: its buckets, started from backward, and
    the engine's schedule over them (engine/bucket_step.py)."""

    def __init__(self, optimizer, named, group_of, config, transport, group, cap_mb=None,
                 state_on="device"):
        self.state_on = check_state_on(state_on)
        self.config = config
        self.num_workers, self.rank = transport.num_workers, transport.rank
        self.group = group
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
        for b in self.buckets[:1]:  # what the engine calls (bucket_step.py, stages.py)
            backend.check(b, backend.ScheduledBucket, "the device path's bucket")
        routes = BucketRoutes([b.codec is not None for b in self.buckets],
                              [4 * b.numel for b in self.buckets],
                              [bucket_name(b) for b in self.buckets],
                              mode="auto" if auto else "fixed",
                              warmup_steps=config.warmup_steps, margin=config.cttab_margin,
                              hosts=[b.host_route for b in self.buckets])
        if routes.warming and self.rank == 0:
            notice.tell(routes.opening())
        rider_slots = Rider([0], self.num_workers).slots(np.float64).size
        device = named[0][1].device
        self.device = TorchStep(device, group, tail_size(len(self.buckets), rider_slots))
        backend.check(self.device, backend.DeviceStep, "the device path's device")
        self.engine = BucketStep(self.buckets, routes, self.device, config, transport,
                                 rider_slots, offloaded=state_on == "host")
        self._handles = []
        self._names = [n for n, _ in named]
        with torch.no_grad():  # rank 0's weights everywhere, as the host path's
            for b in self.buckets:
                self.device.broadcast(b.glo)
                b.write_back()
        self._copies = None  # state_home.StateCopies where the state is offloaded
        if state_on == "host":  # glo_buf, the optimizer's state, the residuals to the host
            self._copies = StateCopies(device, self.device.counts)
            for b in self.buckets:
                b.offload(self._copies)
            self._fetch_first()

    # what the optimizer reads and sets of the step
    counts = property(lambda self: self.device.counts)
    step_count = property(lambda self: self.engine.step_count)
    last_norm = property(lambda self: self.engine.last_norm)
    check = property(lambda self: self.engine.check,
                     lambda self, value: setattr(self.engine, "check", value))

    def ride(self, values):
        """A Rider of `values` sent with this step's tail (StepSettingsCheck's transport)."""
        self.engine.rider = Rider(values, self.num_workers)
        return self.engine.rider

    # -- buckets started during backward (post-accumulate-grad hooks) -------------------
    def hook(self, params):
        """Start each bucket from backward, once its last gradient is accumulated (the
        engine's ready(), in bucket order). The first step only watches: if a gradient
        changes between its hook and step() (accumulation, GradScaler's unscale_, a clip
        writing .grad), or a clip with backup scales the local update, buckets keep
        starting in step()."""
        self._params = params
        self._bucket_of = {i: j for j, b in enumerate(self.buckets) for i in b.indices}
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda p, i=i: self._on_grad(i)) for i, p in enumerate(params)]
        self._reset_hooks()
        self.engine.watch_backward()

    def _reset_hooks(self):
        self._fired = [0] * len(self._params)
        self._versions = [None] * len(self._params)

    def _on_grad(self, i):
        """Parameter i's gradient is final for this backward: note it (its version, to see a
        later change); its bucket one gradient nearer to starting."""
        grad = self._params[i].grad
        self._fired[i] += 1
        self._versions[i] = (id(grad), grad._version)
        if self._fired[i] == 1:
            self.engine.ready(self._bucket_of[i], lambda k: self._params[k].grad)

    def no_overlap(self, why):
        """Buckets start in step() from now on (engine: BucketStep.no_overlap)."""
        self.engine.no_overlap(why)

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
    def step(self, grads_of, clip=None):
        """One step (engine: BucketStep.step), told what changed after backward."""
        watched = self.engine.overlap in ("on", "watch")
        changed = self._changed() if watched else ""
        if self.engine.overlap != "off":
            self._reset_hooks()
        self.engine.step(grads_of, clip, changed)

    def flush(self):
        """Every pending global update done and the parameters given glo_buf."""
        self.wait()
        for b in self.buckets:
            b.write_back()

    def wait(self):
        """The pending global updates done, the parameters left as they are (state_dict);
        offloaded state: its copies into host memory done."""
        self.engine.finish_pending()
        if self._copies is not None:
            self._copies.settle()

    def stats(self):
        """What stats() reports of the device path (engine: BucketStep.stats)."""
        return self.engine.stats()

    def describe(self):
        """Where the step runs and its state lives, as the optimizer says it at start."""
        routes = self.engine.routes
        if routes.warming:
            kind = "%d to be routed by the CTTab after %d warm-up steps" % (
                sum(routes.candidates), routes.warmup_steps)
        else:
            kind = "%d compressed" % sum(b.compressed for b in self.buckets)
        where = ("glo_buf, the optimizer's state and the residuals stay on %s"
                 % self.buckets[0].device if self.state_on == "device" else
                 "glo_buf, the optimizer's state and the residuals offloaded to %shost "
                 "memory, staged on %s for each bucket's pass"
                 % ("pinned " if self._copies.cuda else "", self.buckets[0].device))
        wire = "NCCL" if self.device.nccl else "Gloo" if self.group is not None else "no group"
        return ("data path: device: %s, %d buckets (%s) summed over %s%s" % (
                    where, len(self.buckets), kind, wire,
                    "" if self.engine.overlap != "off" else ", started in step()"))

    # -- checkpoint state ----------------------------------------------------------------------
    def state_dict(self):
        """glo_buf, the residual and the global optimizer's state of every bucket (host), and
        the CTTab's routes (in the warm-up: its samples so far); a codec's arrays (powersgd's
        Q) as state.py keeps them, so that torch.load(weights_only=True) reads it back."""
        self.wait()
        own = self.engine.state_dict()
        out = []
        for b in self.buckets:
            state = b.shadow.state_dict()
            out.append({"names": b.names,
                        "glo_buf": _to_cpu(b.glo),
                        "residual": _to_cpu(b.residual),
                        "optimizer": _to_cpu(state),
                        "codec": None if b.codec is None else to_tensors(b.codec.state_dict())})
        return {"buckets": out, "step": own["step"], "routes": own["routes"]}

    def load_state_dict(self, state):
        buckets = state["buckets"]
        mine = [b.names for b in self.buckets]
        if [s["names"] for s in buckets] != mine:
            raise ValueError("this checkpoint's device-path buckets hold other parameters "
                             "(saved %d buckets, this optimizer has %d): save and load with the "
                             "same model, bucket size and comm_threshold"
                             % (len(buckets), len(mine)))
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
        self.engine.load_state_dict(state["step"], state.get("routes"))
        if self._copies is not None:
            self._fetch_first()

    def _fetch_first(self):
        """Offloaded: queue the stage-in of the first bucket's next pass."""
        self.buckets[0].prefetch(pass_parts(self.config.backup))

    def close(self):
        """Wait for the sums in flight (a collective left running would outlive the group)
        and take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for b in self.buckets:
            b.wait_sums()
        self.device.close(self.config.timeout)


class TorchStep:
    """The device path's device for the engine (backend.DeviceStep): the job's sums, timing
    marks, the step's tail and the clip, in torch ops on `device`; `group`: the process
    group that sums (None: a job of one process), `n_tail`: the tail's length."""

    def __init__(self, device, group, n_tail):
        self._wire = Collectives(group) if group is not None else None
        self.sums = self._wire is not None
        self.nccl = group is not None and dist.get_backend(group) == "nccl"
        self._cuda = device.type == "cuda"
        self.counts = CopyCounts()
        self.tail = torch.zeros(n_tail, dtype=torch.float64, device=device)
        self.tail_host = torch.zeros(n_tail, dtype=torch.float64, pin_memory=self._cuda)
        self._tail_work = None  # the tail's sum in flight
        self._tail_event = None  # CUDA: after the summed tail's copy into tail_host
        self._side = None  # CUDA: the stream that copies the tail out

    def broadcast(self, tensor):
        """Rank 0's `tensor` on every rank (at the start), waited for."""
        if self._wire is not None:
            self._wire.broadcast(tensor).wait()

    def start_sum(self, tensor):
        """Start the sum of `tensor` over the ranks; its Work, or None in a job of one
        process without torch.distributed."""
        if self._wire is None:
            return None
        return self._wire.all_reduce(tensor)

    # -- timing marks (the CTTab's warm-up) ------------------------------------------------
    def mark(self):
        """Now: a CUDA event recorded on the current stream (the one that runs the encode,
        waits for the sum and decodes), or the wall clock on the CPU."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.tail.device))
        return event

    def span_seconds(self, spans):
        """Each span's seconds, (b - a) + (d - c) of its marks [a, b, c, d]; CUDA: after one
        host synchronisation (the last event: the others were recorded before it)."""
        if not self._cuda:
            return [(m[1] - m[0]) + (m[3] - m[2]) for m in spans]
        spans[-1][-1].synchronize()
        self.counts.host_syncs += 1
        out = []
        for marks in spans:
            for event in marks:
                if not event.query():  # recorded on another stream
                    event.synchronize()
            out.append((marks[0].elapsed_time(marks[1]) +
                        marks[2].elapsed_time(marks[3])) / 1e3)
        return out

    # -- the step's tail -------------------------------------------------------------------
    def tail_slot(self, i):
        """Slot i of the tail (a 0-dim view: a bucket's NaN/Inf flag)."""
        return self.tail[i]

    def tail_slots(self, lo, hi):
        """Slots lo..hi of the tail (a view: the residual watch's norms)."""
        return self.tail[lo:hi]

    def zero_tail(self, lo):
        """The tail's slots from `lo` on <- 0."""
        self.tail[lo:].zero_()

    def send_tail(self, n, overlap, scale, rider_at, rider):
        """Slot n <- overlap, slots [0, n] *= scale, the rider's float64 values (or None) at
        rider_at through pinned memory (no pageable copy); the tail's sum started and its
        copy to the host queued after it."""
        with torch.no_grad():
            self.tail[n].fill_(overlap)
            self.tail[:n + 1].mul_(scale)
            if rider is not None:
                staged = self.tail_host[rider_at:rider_at + rider.size]
                staged.copy_(torch.from_numpy(rider))
                self.tail[rider_at:rider_at + rider.size].copy_(staged, non_blocking=True)
                if self.tail.is_cuda:
                    self.counts.h2d_bytes += staged.numel() * staged.element_size()
        self._tail_work = self.start_sum(self.tail)
        self._tail_event = self._tail_to_host()

    def _tail_to_host(self):
        """NCCL: on a side stream, wait for the tail's sum and copy it into pinned memory;
        the event after the copy (the compute stream does not wait: the next forward runs
        while the sums travel). None otherwise: read_tail waits for Gloo and copies."""
        if not (self.tail.is_cuda and self.nccl):
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
        """The summed tail as a host float64 array (a view of pinned memory, valid until the
        next send_tail): the step's one host synchronisation."""
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
        return self.tail_host.numpy()

    def clip(self, means, max_norm, norm_type):
        """The step's mean gradients scaled by min(1, max_norm / (norm + 1e-6)), their norm
        over every bucket, as torch's clip_grad_norm_ after DDP's averaging; on the device
        (the norm returned as a tensor: reading it is the caller's synchronisation)."""
        with torch.no_grad():
            norms = torch.stack([torch.linalg.vector_norm(m, norm_type) for m in means])
            total = torch.linalg.vector_norm(norms, norm_type)
            coef = torch.clamp(max_norm / (total + EPS), max=1.0)
            for m in means:
                m.mul_(coef)
        return total

    def close(self, timeout):
        """The tail's sum in flight waited for; the group let go (Gloo lets go first)."""
        if self._tail_work is not None:
            self._tail_work.wait()
            self._tail_work = None
        if self._wire is not None:
            self._wire.settle(timeout)


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


def _to_cpu(obj):
    """A copy on the host (a CPU tensor too: the live one changes with the next step)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
