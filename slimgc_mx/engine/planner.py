"""Keys -> transfers: the CTTab's route for every push, and the fused full-precision buckets.

The planner owns each key's buffers (grad_buf.KeyBuffers) and step count. For every
push it decides, in one place (Planner.plan), the route of Algorithm 2 (bit_buf when the
CTTab compresses the tensor's size, fp_buf otherwise; both alternately during the warm-up)
and where the push is encoded, decoded and checked, and hands out an offload.Transfer
that carries that decision as an immutable push_plan.Plan.

Fused buckets: sent one by one, every small tensor pays a transfer, three pipeline
hand-offs and an optimizer call in Python, 0.3-0.5 ms of CPU per key and step
(scripts/per_key_cost.py), where MXNet's own kvstore pays one call into C++. After
the CTTab's decision the full-precision keys share one flat fp_buf per server: each
member's grad_buf and agg become views into it, so the gradient copy the training
thread makes anyway fills the fused buffer, one transfer moves it, and the global
update serves every member with one Updater call (MXNet's multi-tensor ops).

Compressed keys too small for their own transfer to pay (Cupcake's observation: a
per-tensor cost of encoding, decoding and starting a transfer that does not shrink
with the tensor) are fused the same way into compressed buckets: one residual, one
codec instance and one set of lanes per bucket (option fuse_compressed; the CTTab's fit
gives the size below which a tensor's fixed costs exceed what its bytes cost).
"""
import logging
import warnings

import numpy as np

from . import residual_watch
from ..codecs.rng import key_seed
from .grad_buf import GradCheck, KeyBuffers, Push, WireRound, add_lanes32, stream_pieces
from .offload import Transfer
from .push_plan import (BUCKET, COMPRESSED, DEVICE, ENCODER, FINISHER, FINITE,
                        FINITE_IN_RANGE, FULL_BUCKET_PLAN, FULL_PLAN, FULL_SERIAL_PLAN,
                        LOCAL_UPDATE, PIECES, UPDATE, Plan)
from .cttab import format_bytes
from ..transport.keys import KeyWire

log = logging.getLogger(__name__)


class Bucket:
    """Consecutive member keys in one flat grad_buf / agg, sent as one wire key.

    It stands in for a KeyBuffers in the pipeline (its plan: push_plan.BUCKET).
    `pending` holds the Pushes of the members since the last transfer; the bucket is
    sent once every member is in it.
    """

    residual_pending = False

    def __init__(self, members, wire_key, make_buffer, codec=None, num_workers=1, lanes32=False):
        self.members = members  # {user key: KeyBuffers}, in key order
        self.size = sum(b.size for b in members.values())
        self.nbytes = 4 * self.size
        self.wire = KeyWire(wire_key, wire_key if codec is not None else None, None)
        self.grad_buf = make_buffer((self.size,), np.float32)
        self.agg = make_buffer((self.size,), np.float32)
        self.codec = codec  # compressed bucket: one codec instance for all its members
        self.residual = make_buffer((self.size,), np.float32) if codec is not None else None
        self.watch = residual_watch.Series(codec.residual_fill(self.size)) \
            if codec is not None else None
        offset = 0
        for b in members.values():
            b.grad_buf = self.grad_buf.view(offset, b.shape)
            b.agg = self.agg.view(offset, b.shape)
            if codec is not None:  # the member's error feedback carries on in the bucket
                view = self.residual.view(offset, (b.size,))
                np.copyto(view.for_write(), b.residual.for_read())
                b.residual = view
            offset += b.size
        self.rounds = []
        if codec is not None:
            self.rounds = [WireRound(route, make_buffer(send, dtype), make_buffer(recv, dtype))
                           for route, send, recv, dtype in codec.wire_rounds(
                               self.size, (self.size,), num_workers)]
            if lanes32:
                add_lanes32(self.rounds, codec, self.size, num_workers, make_buffer)
        self.round_sets = [self.rounds] if self.rounds else []  # one wire class
        self.pending = []
        self._pending_keys = set()  # of `pending`: holds() in constant time
        self.settings = None  # the optimizer settings of the first push since the last transfer

    @property
    def fp_buf(self):
        return self.grad_buf

    def label(self, name_of):
        """How messages name the bucket: its parameters' names, e.g. 'parameters conv0_bias,
        dense0_bias (fused)'; keys without a name as 'keys 0..64 (fused)'."""
        keys = list(self.members)
        names = [name_of(k) for k in keys[:6]]  # the ones shown (500 keys: 500 lookups a step)
        if any(n is not None for n in names):
            shown = ", ".join(n if n is not None else repr(k) for n, k in zip(names, keys))
            more = " and %d more" % (len(keys) - 6) if len(keys) > 6 else ""
            return "parameter%s %s%s (fused)" % ("s" if len(keys) > 1 else "", shown, more)
        if len(keys) == 1:
            return "key %r (fused)" % (keys[0],)
        return "keys %r..%r (fused)" % (keys[0], keys[-1])

    def holds(self, key):
        """True when `key` was pushed since the last transfer."""
        return key in self._pending_keys

    def add(self, push, settings):
        """Record that a member's gradient is in grad_buf; True once every member's is."""
        if not self.pending:
            self.settings = settings
        self.pending.append(push)
        self._pending_keys.add(push.key)
        return len(self.pending) == len(self.members)

    def take(self, name_of, plan):
        """The transfer of what is in, under `plan` (Planner.take); the bucket starts
        collecting the next round."""
        pending, self.pending = self.pending, []
        self._pending_keys = set()
        return Transfer(self, pending[0].step, pending, self.settings, self.label(name_of),
                        plan, priority=max(p.priority for p in pending))


class FusedRoute:
    """The buckets of the full-precision keys (one per server, split by bytes in key
    order), and of small compressed keys (runs in key order of at most `limit` bytes).

    One bucket per server keeps every server busy, as the per-key route does
    (consecutive wire keys go to consecutive servers). Building it declares the
    buckets' wire keys, so every worker must build it at the same point.
    """

    def __init__(self, members, transport, make_buffer, compressed=None, limit=0,
                 make_codec=None, lanes32=False):
        self.keys = list(members)
        self.compressed_keys = list(compressed or {})
        self.buckets = []
        self._of = {}
        groups = [(g, None) for g in _split(list(members.items()), transport.num_servers)]
        groups += [(g, make_codec) for g in _runs(list((compressed or {}).items()), limit)]
        for (group, make), wire_key in zip(groups, transport.keys.fused(len(groups))):
            codec = make(wire_key) if make is not None else None
            bucket = Bucket(dict(group), wire_key, make_buffer, codec,
                            transport.num_workers if codec is not None else 1, lanes32)
            if codec is None:
                transport.declare(wire_key, bucket.grad_buf)
            else:  # a codec may declare several sum rounds and pick one per push (4bit)
                for i, r in enumerate(bucket.rounds):
                    r.key = wire_key if i == 0 else transport.keys.rounds(1)[0]
                    transport.declare(r.key, r.wire_send)
            self.buckets.append(bucket)
            for key, _ in group:
                self._of[key] = bucket

    def __contains__(self, key):
        return key in self._of

    def bucket(self, key):
        return self._of[key]

    def partial(self):
        """Buckets holding some but not all of their members' pushes."""
        return [b for b in self.buckets if b.pending]


def _runs(items, limit):
    """Runs of consecutive (key, KeyBuffers) of at most `limit` bytes, of two keys or more."""
    runs, current, size = [], [], 0
    for key, b in items:
        if current and size + b.nbytes > limit:
            runs.append(current)
            current, size = [], 0
        current.append((key, b))
        size += b.nbytes
    runs.append(current)
    return [r for r in runs if len(r) > 1]


def _split(items, parts):
    """`items` ((key, KeyBuffers) in key order) cut into at most `parts` runs of similar bytes."""
    parts = max(1, min(parts, len(items)))
    total = sum(b.nbytes for _, b in items)
    groups, current, done = [], [], 0
    for i, (key, b) in enumerate(items):
        current.append((key, b))
        done += b.nbytes
        left = len(items) - i - 1
        wanted = parts - len(groups) - 1  # groups still to start after this one
        if wanted and (done >= total * (len(groups) + 1) / parts or left == wanted):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


class Planner:
    """Every key's buffers and step, the route of each push, and the fused buckets.

    make_buffer(shape, dtype) makes CPU Buffers; device_codec(codec) wraps a codec for
    offload off; wait_version(key, step) blocks until no transfer reads the key's
    buffers of that step (fusing moves them).
    """

    def __init__(self, config, transport, codec, cttab, make_buffer, device_codec,
                 wait_version, name_of, lanes32=False, every_key=False):
        self.config = config
        self.transport = transport
        self.codec = codec  # the prototype codec; each key gets a clone
        self.cttab = cttab
        self.keys = {}  # user key -> KeyBuffers
        self.steps = {}  # user key -> steps pushed
        self.fused = None  # FusedRoute, built at the first step after the CTTab's decision
        self._make_buffer = make_buffer
        self._device_codec = device_codec
        self._wait_version = wait_version
        self._name_of = name_of  # user key -> parameter name, or None
        self.lanes32 = lanes32  # float64 lanes travel as float32 lanes (lanes32.py)
        self.every_key = every_key  # every step pushes every key: buckets from the first

    # -- keys ------------------------------------------------------------------------------
    def add(self, key, shape):
        """Buffers and wire keys of a new key (collective: declares its wire keys)."""
        index = len(self.keys)
        codec = self.codec.clone() if self.codec is not None else None
        if codec is not None and not codec.compresses(tuple(shape)):
            codec = None  # the codec sends it in full precision: fp_buf only, no bit_buf
        if codec is not None:
            codec.seed = key_seed(self.config.seed, index)
        b = KeyBuffers(index, shape, codec, self.transport.num_workers, self._make_buffer,
                       wire=self.transport.keys.per_key(index), lanes32=self.lanes32)
        if codec is not None:
            self.cttab.declare(index, b.nbytes)
        if codec is not None and self.config.offload is False:
            b.device = self._device_codec(codec)
        elif codec is not None and self.cttab.places:
            b.device_codec = self._device_codec(codec)  # used where the CTTab places it
        self.transport.declare(b.wire.fp, b.grad_buf)
        for c, rounds in enumerate(b.round_sets):
            for i, r in enumerate(rounds):
                if r.key is not None:  # a round every slot class shares: declared once
                    continue
                r.key = b.wire.bit if c == i == 0 else self.transport.keys.rounds(1)[0]
                if r.route == "sum":
                    self.transport.declare(r.key, r.wire_send)
                else:
                    self.transport.declare_gather(r.key, r.send, r.recv)
        self.keys[key] = b
        self.steps[key] = 0
        return b

    def buffers(self, key):
        if key not in self.keys:
            raise KeyError("key %r was not initialized (call init or broadcast first)" % (key,))
        return self.keys[key]

    # -- routes ----------------------------------------------------------------------------
    def compressed(self, b, step):
        """The CTTab's route of key buffers `b` at `step`: True for bit_buf (in the warm-up,
        only for the keys it times)."""
        if b.codec is None or (self.cttab.phase == "warmup" and not self.cttab.timed(b.index)):
            return False
        return self.cttab.compressed(b.nbytes, step)

    def place(self, b, step):
        """offload='auto': set b.device for `step` to where the CTTab encodes the key (its
        device codec, or None for the host), bringing a device-held residual home first."""
        if b.device_codec is None:
            return
        device = self.cttab.where(b.nbytes, step) == "device"
        if b.device is not None and not device:
            b.host_residual()
        b.device = b.device_codec if device else None

    def compressible_sizes(self):
        """The sizes of the keys a codec may compress, sorted (the same on every worker)."""
        return sorted({b.nbytes for b in self.keys.values() if b.codec is not None})

    def route_summary(self):
        """One line for the user: the CTTab's BestCT, its reason, and how many tensors (and
        bytes) it compresses, with the way to force compression when it compresses none."""
        cut = self.cttab.best_ct
        keys = list(self.keys.values())
        chosen = [b for b in keys if b.codec is not None and b.nbytes >= cut]
        total = sum(b.nbytes for b in keys)
        text = "CTTab: BestCT = %s (%s); %d of %d tensors compressed (%s of %s)" % (
            format_bytes(cut), self.cttab.reason, len(chosen), len(keys),
            format_bytes(sum(b.nbytes for b in chosen)), format_bytes(total))
        if self.cttab.places:
            on_device = [b for b in chosen if self.cttab.where(b.nbytes, 0) == "device"]
            text += ", %d of them encoded on the device (%s), %d on CPU threads" % (
                len(on_device), format_bytes(sum(b.nbytes for b in on_device)),
                len(chosen) - len(on_device))
        if not chosen and self.codec is not None:
            text += ("; %s compresses nothing here: comm_threshold='off' compresses every "
                     "tensor (docs/usage.md)" % self.codec.name)
        return text

    def label(self, key):
        """How messages name a key: its parameter's name, else 'key 3'."""
        name = self._name_of(key)
        return name if name is not None else "key %r" % (key,)

    def transfer(self, push, settings, decodes_in_update, compress=True, local_kernel=False):
        """The transfer of one key's push (not fused), with its plan (see plan()); settings
        None: a plain sum, no global update to decode in."""
        plan = self.plan(push.buffers, push.step,
                         decodes_in_update if settings is not None else None,
                         local_kernel, compress)
        check = GradCheck() if plan.grad_check == LOCAL_UPDATE else None
        return Transfer(push.buffers, push.step, [push], settings, self.label(push.key), plan,
                        priority=push.priority, check=check)

    def take(self, bucket):
        """The transfer of what a fused bucket holds, with its plan."""
        return bucket.take(self._name_of, self.plan(bucket, None))

    def plan(self, b, step, decodes_in_update=None, local_kernel=False, compress=True):
        """The push_plan.Plan of one push of `b` (a key's buffers, or a fused Bucket) at
        `step`: the one place that decides its route and where it is encoded, decoded and
        checked for NaN/Inf.

        decodes_in_update(buffers): whether the global update's kernel can decode a sum
        itself (None: no update, a plain sum); asked only where the codec decodes by
        table. local_kernel: the push's local update runs as an SGD kernel (backup with
        MXNet's or torch's SGD rule on the host), so it reads the gradient anyway.
        compress=False keeps the push in full precision whatever the CTTab says.
        """
        n = self.transport.num_workers
        if isinstance(b, Bucket):
            if b.codec is None:
                return FULL_BUCKET_PLAN
            # the codec's state is that of the bucket's last decoded push, alike everywhere
            return Plan(BUCKET, ENCODER, FINISHER, ENCODER, FINITE,
                        rounds=tuple(b.codec.push_rounds(b.size, n)),
                        measure=residual_watch.due(b.codec))
        serial = self.cttab.phase == "warmup"
        self.place(b, step)
        if not (compress and self.compressed(b, step)):
            return FULL_SERIAL_PLAN if serial else FULL_PLAN
        codec = b.codec
        # The codec's state is that of the key's last decoded push (the caller waited for
        # it), the same on every worker, so every worker exchanges the same rounds.
        rounds, wire_class = tuple(codec.push_rounds(b.size, n)), codec.wire_class
        traits = codec.traits
        if b.device is not None:  # its residual may be on the device: not watched
            return Plan(COMPRESSED, DEVICE, DEVICE, DEVICE, FINITE, serial, rounds, wire_class,
                        optimizer_view=traits.wants_optimizer)
        # After warm-up (whose timings include the decode) the SGD kernel decodes the
        # sum tile by tile inside its update: the aggregate never goes to memory.
        in_update = (not serial and decodes_in_update is not None and traits.decodes_by_table
                     and decodes_in_update(b))
        encode = grad_check = ENCODER
        pieces = None
        if local_kernel and not serial:
            # The local update's SGD pass reads the gradient anyway: it encodes bit_buf in
            # that pass (FusedEncode), else counts NaN/Inf so the encoder skips its own.
            grad_check = LOCAL_UPDATE
            if traits.fuses_local_update and not traits.wants_optimizer:
                pieces = self._pieces(b, rounds, wire_class)
                encode = LOCAL_UPDATE if pieces is None else PIECES
        return Plan(COMPRESSED, encode, UPDATE if in_update else FINISHER, grad_check,
                    FINITE_IN_RANGE if in_update else FINITE, serial, rounds, wire_class,
                    pieces, traits.wants_optimizer, residual_watch.due(codec))

    def _pieces(self, b, rounds, wire_class):
        """The Pieces a push encoded in its local update is encoded and sent as, one by
        one (a tuple), or None: its lanes travel whole, as float32 lanes, in several
        rounds, or carry values that depend on the whole key (Codec.piece_elements)."""
        r = b.round_sets[wire_class][rounds[0]]
        bounds = self.transport.pieces(r.key)
        if (bounds is None or not self.config.stream or r.lanes32 is not None
                or r.route != "sum" or len(rounds) != 1):
            return None
        pieces = stream_pieces(b.codec, b.size, r.send, bounds, self.transport.num_workers)
        return tuple(pieces) if pieces is not None else None

    # -- fused buckets ---------------------------------------------------------------------
    def bucket(self, key):
        """The fused bucket `key` goes in, or None; builds the FusedRoute once routing is final.

        It is built at the first push of a step after the first, so that its members
        are the keys the job pushes (gluon.Trainer also initializes keys it never
        pushes, such as BatchNorm's running statistics); at the first push of all where
        every step pushes every key (every_key: the PyTorch adapter). In the CTTab's
        warm-up it holds the keys the warm-up does not time; end_warmup() drops it for the
        final one.
        """
        if self.fused is None:
            if not self.config.fuse or (self.steps[key] == 0 and not self.every_key):
                return None
            self.fused = self._build_fused(warmup=self.cttab.phase == "warmup")
        return self.fused.bucket(key) if key in self.fused else None

    def end_warmup(self):
        """The CTTab has decided: the warm-up's buckets give way to the final routes' (built
        at the next push; every bucket was sent and its transfer finished)."""
        self.fused = None

    def _build_fused(self, warmup=False):
        """Collect every full-precision key, and the compressed keys below the fuse limit,
        into buckets (collective: declares wire keys). warmup: every key pushed that the
        CTTab does not time, in full precision."""
        if warmup:
            members = {k: b for k, b in self.keys.items() if self._pushed(k)
                       and not (b.codec is not None and self.cttab.timed(b.index))}
        else:
            members = {k: self.keys[k] for k in self.full_precision_keys()}
        limit = 0 if warmup else self.fuse_limit()
        small = {k: b for k, b in self.keys.items() if k not in members and self._pushed(k)
                 and b.codec is not None and b.device is None and b.device_codec is None
                 and b.nbytes < limit
                 and b.codec.rounds == 1 and all(r.route == "sum" for r in b.rounds)
                 and len(b.round_sets) == 1 and b.codec.memory_size(b.size) == b.size}
        for key in list(members) + list(small):  # no transfer still reads their buffers
            self._wait_version(key, self.steps[key])

        def make_codec(wire_key):
            codec = self.codec.clone()
            codec.seed = key_seed(self.config.seed, wire_key)
            return codec

        route = FusedRoute(members, self.transport, self._make_buffer, small, limit,
                           make_codec, self.lanes32)
        self.fused = route
        self._apply_bucket_state()
        text = "slimgc: %d full-precision keys fused%s into %d transfer(s) of %s bytes" % (
            len(members), " for the CTTab's warm-up" if warmup else "",
            sum(b.codec is None for b in route.buckets),
            [b.nbytes for b in route.buckets if b.codec is None])
        if self.fuses_compressed():
            text += "; %d compressed keys below %d bytes into %d" % (
                sum(len(b.members) for b in route.buckets if b.codec is not None), limit,
                sum(b.codec is not None for b in route.buckets))
        log.info("%s", text)
        return route

    def fuses_compressed(self):
        """Whether compressed keys may share buckets (option fuse_compressed, a codec, offload)."""
        option = self.config.fuse_compressed
        return not (option is False or option == "off" or self.codec is None
                    or not self.config.offload)

    def fuse_limit(self):
        """Bytes below which a compressed key goes into a compressed bucket (0: none)."""
        option = self.config.fuse_compressed
        if not self.fuses_compressed():
            return 0
        return self.cttab.fuse_limit() if option == "auto" else int(option)

    def _pushed(self, key):
        """Whether `key` is one the job pushes: pushed once, or every key (every_key)."""
        return self.every_key or self.steps[key] > 0

    def full_precision_keys(self):
        """Keys pushed so far that the CTTab routes to full precision, in key order."""
        return [k for k, b in self.keys.items() if self._pushed(k) and (
            b.codec is None or not self.cttab.compressed(b.nbytes, self.steps[k]))]

    def partial_buckets(self):
        """The transfers of buckets still waiting for members that were not pushed."""
        if self.fused is None:
            return []
        return [self.take(bucket) for bucket in self.fused.partial()]

    def refuse_stale_buckets(self):
        """After a checkpoint with another BestCT: rebuild the buckets (new wire keys)."""
        if self.fused is not None and self.cttab.phase != "warmup" and \
                self.fused.keys != self.full_precision_keys():
            self.fused = None  # (compressed buckets are rebuilt with it)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self):
        """Per key: step, error-feedback residual and codec state."""
        out = {}
        for key, b in self.keys.items():
            compressed = b.codec is not None
            out[key] = {"step": self.steps[key],
                        "residual": b.host_residual().for_read().copy() if compressed
                        else None,
                        "codec": b.codec.state_dict() if compressed else None}
        return out

    def bucket_state(self):
        """The codec states of the compressed buckets, in order (checkpoints)."""
        if self.fused is None:
            return []
        return [b.codec.state_dict() for b in self.fused.buckets if b.codec is not None]

    def load_bucket_state(self, states):
        """Restore bucket_state(), now or when the buckets are built."""
        self._bucket_states = list(states)
        self._apply_bucket_state()

    def _apply_bucket_state(self):
        states = getattr(self, "_bucket_states", None)
        if not states or self.fused is None:
            return
        codecs = [b.codec for b in self.fused.buckets if b.codec is not None]
        if len(codecs) != len(states):
            raise ValueError("the checkpoint holds %d compressed buckets, this job builds %d: "
                             "resume with the same fuse_compressed and threshold table"
                             % (len(states), len(codecs)))
        for codec, state in zip(codecs, states):
            codec.load_state_dict(state)
        self._bucket_states = None

    def load_state_dict(self, state):
        for key, ks in state.items():
            b = self.keys[key]
            self.steps[key] = ks["step"]
            if b.codec is not None:
                np.copyto(b.host_residual().for_write(), ks["residual"])
                b.codec.load_state_dict(ks["codec"])


def check_momentum(codec, momentum, example):
    """Refuse an optimizer with momentum under a codec that applies momentum itself (dgc's
    momentum correction accumulates the velocity before sparsifying), naming the fix:
    `example` % (codec name, momentum) is how the adapter's user gives the codec's option.
    Warn once per process where the codec advises against the pair (momentum_advice)."""
    if codec is None:
        return
    if codec.traits.owns_momentum and momentum:
        raise ValueError(
            "codec %r applies momentum itself, so the optimizer's momentum must be 0, got "
            "momentum=%r: create the optimizer with momentum=0 and give the codec's own option "
            "instead, e.g. %s" % (codec.name, momentum, example % (codec.name, momentum)))
    advice = codec.momentum_advice(momentum)
    if advice is not None and advice not in _ADVISED:
        _ADVISED.add(advice)
        warnings.warn(advice, UserWarning, stacklevel=3)


_ADVISED = set()  # momentum advice already given in this process


__all__ = ["Bucket", "FusedRoute", "Planner", "Push", "check_momentum"]
