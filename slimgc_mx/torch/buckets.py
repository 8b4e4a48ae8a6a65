"""The device path's buckets: which parameters each fuses (plan_buckets, DDP's rules) and a
bucket's state on the device (Bucket: glo_buf and its optimizer, the residual, the lanes)
with the stages of its pass, each in torch ops."""
import dataclasses

import torch

from ..codecs import NonFiniteGradientError
from ..engine import residual_watch
from ..engine.bucket_step import BOTH
from ..engine.push_plan import COMPRESSED, FULL, bucket_plan
from .device import _DTYPES, TorchDeviceCodec
from .lowrank import TorchPowerSGD
from .state_home import StateHome
from .framework import _constructor_args


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """Which parameters one bucket fuses (indices into the model's trainable parameters, in
    backward order), their param group, and whether the bucket is compressed."""

    indices: tuple
    group: int
    compressed: bool


def plan_buckets(named, group_of, codec, comm_threshold, cap_bytes):
    """The buckets of `named` ((name, parameter) pairs): reverse order; one param group and
    one kind (compressed or full precision) per bucket; a bucket closes before it would pass
    `cap_bytes`; a codec whose values depend on more than each element's own (1bit's
    scale and 4bit's group, terngrad's and thc's maximum, qsgd's norms, the random draws of
    those and of randomk, keyed by the tensor's seed) gets one bucket per compressed tensor,
    so that its statistic, draws and state stay the tensor's own, as the host path's per
    key; only one that encodes element by element (encodes_by_piece: 2bit) fuses tensors.
    A tensor the codec sends in full precision (compresses(): powersgd's vectors) goes to
    a full-precision bucket."""
    per_tensor = codec is not None and not codec.traits.encodes_by_piece
    specs, run, run_key, run_bytes = [], [], None, 0
    for i in reversed(range(len(named))):
        p = named[i][1]
        nbytes = p.numel() * p.element_size()
        compressed = codec is not None and nbytes >= comm_threshold \
            and codec.compresses(tuple(p.shape))  # (powersgd: matrices only, as the host's)
        key = (group_of[i], compressed)
        if run and (key != run_key or run_bytes + nbytes > cap_bytes
                    or (compressed and per_tensor)):
            specs.append(BucketSpec(tuple(run), run_key[0], run_key[1]))
            run, run_bytes = [], 0
        run.append(i)
        run_key, run_bytes = key, run_bytes + nbytes
    if run:
        specs.append(BucketSpec(tuple(run), run_key[0], run_key[1]))
    return specs


class Bucket:
    """One bucket's device state: glo_buf (flat) and its views, the global optimizer over
    them, the local optimizer over the parameters, the residual, the lanes."""

    def __init__(self, spec, named, optimizer, codec, num_workers):
        self.spec = spec
        self.names = [named[i][0] for i in spec.indices]
        self.params = [named[i][1] for i in spec.indices]
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        device = self.device = self.params[0].device
        with torch.no_grad():
            self.glo = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.home = None  # state_home.StateHome where glo_buf and the state are offloaded
        self.glo_views = self._views(self.glo)
        self._optimizer = optimizer  # the user's: its param group's settings each pass
        group = {k: v for k, v in optimizer.param_groups[spec.group].items() if k != "params"}
        args = _constructor_args(optimizer, group)
        self.shadow = type(optimizer)(self.glo_views, **args)  # glo_buf's optimizer: the state
        self.local = type(optimizer)(self.params, **args)  # loc_buf's: the state copied in
        self.codec = None
        if spec.compressed:  # powersgd's rounds: a bucket of one matrix (plan_buckets)
            self.codec = TorchPowerSGD(codec, self.params[0].shape, num_workers) \
                if TorchPowerSGD.supports(codec) else TorchDeviceCodec(codec)
        # the residual watch's samples (DevicePath judges them) and the compressed pushes
        self.watch = residual_watch.Series(codec.residual_fill(self.numel)) \
            if self.codec is not None else None
        self.pushes = 0
        self._q_lanes = self._fp_lanes = None  # each route's lanes (None: not needed)
        if self.codec is not None:
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
            n = codec.lane_count(self.numel, num_workers)
            self._q_lanes = torch.zeros(n, dtype=_DTYPES[codec.wire_dtype], device=device)
            self.lanes = self._q_lanes
        else:
            self.residual = None
            self.lanes = self._fp_lanes = torch.zeros(self.numel, dtype=torch.float32,
                                                      device=device)
        # the route of the next encode (the CTTab's, engine/bucket_cttab.py): COMPRESSED
        # (the device codec), HOST (the host codec) or FULL
        self.route = COMPRESSED if self.codec is not None else FULL
        self.sent = self.plan()  # the plan of the lanes last encoded (stages.encode_bucket)
        self.final = self.codec is None  # the route is kept from here on (settle())
        self.timing = None  # the warm-up: (bucket index, route, step, marks) until decoded
        self.mean = None  # the decoded mean gradient, from decode() to global_step()
        self.works = []  # the lanes' sums in flight (several: a large tensor's pieces)
        self.step = None  # the step whose sum the lanes hold (None: nothing pending)

    def _views(self, flat):
        out, offset = [], 0
        for p, n in zip(self.params, self.sizes):
            out.append(flat[offset:offset + n].view(p.shape))
            offset += n
        return out

    @property
    def indices(self):
        """Its parameters' indices in the model's trainable parameters (backward order)."""
        return self.spec.indices

    @property
    def base_codec(self):
        """The codec (codecs package) whose rule the device codec runs, or None."""
        return self.codec.codec if self.codec is not None else None

    @property
    def lane_bytes(self):
        """The bytes of the lanes last encoded (what one rank sends per step)."""
        return self.lanes.numel() * self.lanes.element_size()

    @property
    def offloaded(self):
        """Whether glo_buf, the state and the residual live in host memory (state_on)."""
        return self.home is not None

    def offload(self, copies):
        """glo_buf, the global optimizer's state and the residual kept in host memory from
        now on, staged on the device for the passes that read them (stage(), unstage())."""
        self.home = StateHome(self, copies)

    def stage(self, parts=BOTH):
        """`parts` (bucket_step's STATE, RESIDUAL) on the device for a pass (offloaded:
        swapped in); True where this call staged them."""
        return self.home.use(parts) if self.home is not None else False

    def prefetch(self, parts):
        """Offloaded: queue the stage-in of `parts` for this bucket's next pass."""
        if self.home is not None:
            self.home.fetch(parts)

    def unstage(self):
        """The stage-out queued, host memory back in place (offloaded); else nothing."""
        if self.home is not None:
            self.home.put_back()

    def settings(self):
        """The user's current settings of this bucket's param group into both optimizers."""
        group = self._optimizer.param_groups[self.spec.group]
        values = {k: v for k, v in group.items() if k != "params"}
        self.shadow.param_groups[0].update(values)
        self.local.param_groups[0].update(values)

    def local_step(self, grads, scale=None):
        """loc_buf <- one step of the rule from glo_buf with this rank's `grads` (times
        `scale` where given: a clipped step), reading the global state and writing none of
        it (the host path's local update, in torch ops)."""
        if scale is not None:
            grads = [g * scale for g in grads]
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.glo_views)
            for p, w, g in zip(self.params, self.glo_views, grads):
                self.local.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                       for k, v in self.shadow.state.get(w, {}).items()}
                p.grad = g
            self.local.step()
            for p in self.params:
                self.local.state.pop(p, None)

    @property
    def compressed(self):
        """Whether the bucket takes a codec's route, device or host (the next encode's)."""
        return self.codec is not None and self.route != FULL

    @property
    def rounds(self):
        """The device codec's exchanges per push (powersgd: 2), else 1."""
        return self.codec.rounds if self.codec is not None else 1

    def plan(self, timed=False):
        """The plan of this bucket's next pass on its route (push_plan.bucket_plan)."""
        return bucket_plan(self.route, self.rounds, timed)

    @property
    def host_route(self):
        """Whether the host codec can take this bucket: a codec that encodes element by
        element (2bit) keeps no state but the residual, which travels with it, so its lanes
        are the device codec's bit for bit from either place, step after step."""
        return self.codec is not None and self.codec.codec.traits.encodes_by_piece

    def settle(self, route):
        """The CTTab's decision: the bucket keeps `route` from now on, and lets go of the
        other route's lanes (a full-precision bucket's residual goes once flushed)."""
        self.route = route if self.codec is not None else FULL
        self.final = True
        if self.route != FULL:
            self._fp_lanes = None
        else:
            self._q_lanes = None

    def wait_sums(self):
        """Wait for the lanes' sums in flight (on NCCL the stream waits, not the host)."""
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []

    # -- the stages of a pass, which engine/stages.py runs at the sites of its plan -----------
    def fill_full_precision(self, grads, flag):
        """The lanes <- the flat gradient (a full-precision plan); `flag` (a 0-dim float64
        view) gets 1 where it is not finite."""
        with torch.no_grad():
            if self._fp_lanes is None:
                self._fp_lanes = torch.empty(self.numel, dtype=torch.float32,
                                             device=self.device)
            self.lanes = self._fp_lanes
            torch.cat([g.reshape(-1) for g in grads], out=self.lanes)
            if self.residual is not None:
                # The host path's rule for a key that leaves the compressed route
                # (engine/stages.py flush_residual, codecs/feedback.py): the full-precision
                # push sends grad + residual and the residual starts again from zero, so
                # the error feedback the compressed steps kept is not lost. A bucket the
                # CTTab keeps in full precision flushes once and then holds none.
                self.lanes.add_(self.residual)
                if self.final:
                    self.residual = None
                else:
                    self.residual.zero_()
            flag.copy_(~torch.isfinite(self.lanes).all())

    def flat_for_codec(self, grads, num_workers, watch=None):
        """The flat gradient a codec encodes (a bucket of one tensor: the gradient itself,
        read only), the codec's lanes sized and taken as the lanes; watch: two float64 slots
        that get the squared norms of the gradient and of the residual the last push left
        (the residual watch's sample)."""
        with torch.no_grad():
            flat = grads[0].reshape(-1) if len(grads) == 1 else \
                torch.cat([g.reshape(-1) for g in grads])
            if watch is not None:
                norms = torch.stack([torch.linalg.vector_norm(flat),
                                     torch.linalg.vector_norm(self.residual[:self.numel])])
                watch.copy_(norms.double().square())
        self.pushes += 1
        n = self.codec.codec.lane_count(self.numel, num_workers)  # 4bit's moves
        if self._q_lanes is None or self._q_lanes.numel() != n:
            dtype = _DTYPES[self.codec.codec.wire_dtype]
            self._q_lanes = torch.zeros(n, dtype=dtype, device=flat.device)
        self.lanes = self._q_lanes
        return flat

    def encode_on_device(self, flat, num_workers, flag, rank=0, on_piece=None):
        """The device codec: `flat` (+ residual) into the lanes (error feedback into the
        residual); `flag` gets 1 where not finite; a gathered codec's values go into slot
        `rank`; powersgd writes its first round (P; next_round makes Q from its sum).
        on_piece(lo, hi): called as each piece of a large tensor's lanes is encoded."""
        with torch.no_grad():
            if self.codec.rounds == 2:
                self.codec.encode(flat, self.residual, self.round_parts()[0], flag)
            else:
                self.codec.encode(flat, self.residual, num_workers, out=self.lanes, flag=flag,
                                  rank=rank, on_piece=on_piece)

    def round_parts(self):
        """powersgd's lanes as its rounds' exchanges, in order: P, then Q."""
        return self.codec.parts(self.lanes)

    def next_round(self, i, flag):
        """After round i's sum: write round i + 1's lanes (powersgd's Q_j from the summed P)."""
        p_sum, q = self.round_parts()[i:i + 2]
        self.codec.next_round(p_sum, q, flag)

    def encode_on_host(self, flat, num_workers, flag, rank=0, counts=None):
        """The host codec: the Cython codec encodes the gradient (+ residual) on the CPU, on
        this thread; on a CUDA device the gradient and residual come to the host and the
        lanes and residual go back, by blocking copies through pageable memory (a host
        synchronisation and pageable bytes, counted in `counts`, a copies.CopyCounts: a
        route the warm-up times, kept only where it is the fastest)."""
        on_host = not flat.is_cuda
        grad = flat if on_host else flat.cpu()
        residual = self.residual if on_host else self.residual.cpu()
        lanes = self.lanes if on_host else torch.empty(self.lanes.shape, dtype=self.lanes.dtype)
        try:
            self.codec.codec.encode(grad.numpy(), residual.numpy(), num_workers,
                                    out=lanes.numpy(), rank=rank)
            flag.fill_(0.0)
        except NonFiniteGradientError:  # nothing written: every rank drops the step
            flag.fill_(1.0)
            return
        if not on_host:
            self.residual.copy_(residual)
            self.lanes.copy_(lanes)
            if counts is not None:
                down = 2 * 4 * self.numel
                up = 4 * self.numel + lanes.numel() * lanes.element_size()
                counts.host_syncs += 1
                counts.d2h_bytes += down
                counts.h2d_bytes += up
                counts.pageable_bytes += down + up

    def _new_mean(self):
        # allocated per bucket: one bucket's worth is live at a time
        self.mean = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return self.mean

    def average(self, num_workers):
        """A full-precision sum -> the mean gradient (mean, until global_step)."""
        with torch.no_grad():
            torch.div(self.lanes, num_workers, out=self._new_mean())

    def decode_sum(self, num_workers, counts=None):
        """The summed lanes decoded by the device codec -> the mean gradient (mean)."""
        with torch.no_grad():
            mean = self._new_mean()
            if self.codec.rounds == 2:
                self.codec.decode(self.round_parts()[1], mean)
            else:
                self.codec.decode(self.lanes, self.numel, num_workers, out=mean, checked=False)
            if getattr(self.codec.codec, "trailer_lanes", 0) and self.lanes.is_cuda \
                    and counts is not None:
                counts.host_syncs += 1  # the statistic read back (1bit's scale, 4bit's group)
            # (gathered values, terngrad's, qsgd's, thc's, stay on the device: no read)
            mean.div_(num_workers)

    def global_step(self):
        """glo_buf <- one step of the user's optimizer with the mean gradient."""
        for w, m in zip(self.glo_views, self._views(self.mean)):
            w.grad = m
        with torch.no_grad():
            self.shadow.step()
        for w in self.glo_views:
            w.grad = None
        self.mean = None

    def write_back(self):
        """The parameters get glo_buf (backup off, a flush)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.glo_views)
