"""grad_buf, fp_buf and bit_buf of one key (SlimGC §3.6): the CPU buffers of Strategy 2.

The gradient is copied into grad_buf; the full-precision route sends grad_buf itself
as fp_buf, the compressed route encodes it into bit_buf (the codec's lanes). What comes
back is the sum over workers: `agg` for fp_buf, `bit_sum` for bit_buf, decoded into
`agg` (or inside the SGD kernel's update). A codec may exchange several rounds per step
(PowerSGD: P, then Q) and gather instead of sum (TopK: every worker's slot side by
side); each round has its own send and receive buffers (`rounds`), and a push exchanges
the rounds Codec.push_rounds picks (dgc's stage, 4bit's group's geometry). A codec whose payload
size follows the data (gcomp) pre-declares several slot sizes, `wire_classes`, and picks
one per push (`codec.wire_class`); their buffers share the memory of the largest.
With float32 lanes (lanes32.py) a float64 sum round also holds the float32 arrays that
actually travel: `wire_send` and `wire_recv`. A large key may be encoded and sent in
pieces (Piece, a streamed push). A worker whose gradient holds NaN/Inf sends NaN naming
its rank (mark_nonfinite), so that every worker fails the sum.
"""
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import residual_watch
from ..codecs import NonFiniteGradientError
from .lanes32 import Lanes32Layout, uses_float64_lanes


@dataclass
class WireRound:
    """One exchange of a compressed step: what is sent, where the result lands, and how.

    route: 'sum' (the servers add the workers' arrays) or 'gather' (every worker's slot
    comes back side by side, worker j's in rows j*slot_rows ..).
    """

    route: str
    send: object  # a Buffer
    recv: object  # a Buffer
    key: Optional[int] = None  # the wire key, once declared
    lanes32: Optional["Lanes32Wire"] = None  # float32 lanes carry this round's float64 lanes

    @property
    def wire_send(self):
        """The Buffer pushed on the wire: `send`, or its float32 lanes."""
        return self.send if self.lanes32 is None else self.lanes32.send

    @property
    def wire_recv(self):
        """The Buffer the wire's result lands in: `recv`, or the float32 lanes' sum."""
        return self.recv if self.lanes32 is None else self.lanes32.recv


@dataclass
class Lanes32Wire:
    """The float32 lanes of one float64 sum round (lanes32.Lanes32Layout) and their buffers."""

    layout: object  # lanes32.Lanes32Layout
    send: object  # a Buffer, float32
    recv: object  # a Buffer, float32


def add_lanes32(rounds, codec, size, num_workers, make_buffer):
    """Give every float64 sum round of a lane codec its float32 lanes (lane_dtype float32)."""
    if not uses_float64_lanes(codec):
        return
    for r, levels in zip(rounds, codec.round_levels()):
        if r.route == "sum" and np.dtype(r.send.nd.dtype) == np.float64:
            layout = Lanes32Layout.of(codec, size, num_workers, levels)
            r.lanes32 = Lanes32Wire(layout, make_buffer((layout.count32,), np.float32),
                                    make_buffer((layout.count32,), np.float32))


class KeyBuffers:
    """Everything the pipeline holds for one key.

    grad_buf  float32 copy of the local gradient (sent as is on the fp_buf route)
    rounds    the codec's WireRounds: bit_buf (send) and bit_sum (recv) of each; a push
              exchanges those of Codec.push_rounds (a transfer's `exchange`), not
              necessarily round 0 (4bit declares one round per lane geometry)
    agg       float32 sum over workers of the gradient (pulled, or decoded from bit_sum)
    residual  the codec's error-feedback memory (Codec.memory_size: the residual, then any
              further per-worker state)
    watch     the residual watch's samples of this key (residual_watch.Series)
    device    a DeviceCodec when encoding runs as NDArray ops (offload off), else None
    wire      the transport's wire keys of this key (transport.keys.KeyWire)
    """

    def __init__(self, index, shape, codec, num_workers, make_buffer, wire=None, lanes32=False):
        self.index = index
        self.shape = tuple(shape)
        self.size = size = int(np.prod(shape))
        self.nbytes = 4 * size
        self.codec = codec
        self.wire = wire
        self.grad_buf = make_buffer(shape, np.float32)
        self.agg = make_buffer(shape, np.float32)
        self.device = None
        self.device_codec = None  # offload='auto': the device codec, used where placed
        self.residual_pending = False  # the residual may hold error feedback not yet sent
        self.grad_in_place = None  # fused pushes read the gradient in place (None: not yet known)
        if codec is not None:
            self.residual = make_buffer((codec.memory_size(size),), np.float32)
            self.watch = residual_watch.Series(codec.residual_fill(size))
            self.round_sets = _round_sets(codec.wire_classes(size, self.shape, num_workers),
                                          make_buffer)
            if lanes32:
                for rounds in self.round_sets:
                    add_lanes32(rounds, codec, size, num_workers, make_buffer)
        else:  # compressor 'none': full precision only, no error feedback
            self.residual = None
            self.watch = None
            self.round_sets = []

    @property
    def rounds(self):
        """The WireRounds of the codec's current slot class (what the next push uses)."""
        return self.round_sets[self.codec.wire_class] if self.round_sets else []

    @property
    def fp_buf(self):
        """What the full-precision route sends: grad_buf itself."""
        return self.grad_buf

    @property
    def label(self):
        return "key #%d" % self.index

    def host_residual(self):
        """The residual buffer, made current first where a device codec keeps the residual on
        its device (a CUDA model's offload=False): before the host reads or writes it."""
        to_host = getattr(self.device, "residual_to_host", None)
        if to_host is not None:
            to_host(self)
        return self.residual


def _round_sets(classes, make_buffer):
    """WireRounds per slot class; with several classes, round i's buffers of every class are
    views of the largest one's (a key has one transfer in flight, so one class at a time).
    Classes that declare the same rounds (gcomp's slot in pieces) share one set: one wire
    key, and buffers of one piece."""
    if all(rounds == classes[0] for rounds in classes):
        shared = [WireRound(route, make_buffer(send, dtype), make_buffer(recv, dtype))
                  for route, send, recv, dtype in classes[0]]
        return [shared] * len(classes)
    if any(len(rounds) != len(classes[0]) for rounds in classes):
        raise ValueError("every wire class must have the same number of rounds")
    shared = []
    for i in range(len(classes[0])):
        dtype = classes[0][i][3]
        send = max((int(np.prod(rounds[i][1])) for rounds in classes))
        recv = max((int(np.prod(rounds[i][2])) for rounds in classes))
        shared.append((make_buffer((send,), dtype), make_buffer((recv,), dtype)))
    return [[WireRound(route, shared[i][0].view(0, send), shared[i][1].view(0, recv))
             for i, (route, send, recv, _) in enumerate(rounds)] for rounds in classes]


class GradCheck:
    """The local update's count of NaN/Inf in grad_buf, so that the encoder need not read
    grad_buf a second time (its pre-check is a full pass over the gradient).

    `ready`: the host array the local update writes; `nonfinite` is set before it is readable.
    When the local update also encoded bit_buf (FusedEncode), `encoded` is True,
    `spans` the (start, end) perf_counter times of each of its operators' encoding (one
    per piece of a streamed push, else one), `seconds` their total and `nonfinite` the
    number of them whose encoder refused the gradient; `error` holds any other
    exception of those operators.
    """

    __slots__ = ("ready", "nonfinite", "encoded", "error", "spans")

    def __init__(self):
        self.ready = None
        self.nonfinite = None
        self.encoded = False
        self.error = None
        self.spans = []

    @property
    def seconds(self):
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True)
class Piece:
    """A part of a key that is encoded and sent on its own (a streamed push): elements
    [lo, hi) of the gradient, lanes `lanes` of bit_buf, which travel as the transport's
    piece array `send` of bit_buf."""

    lo: int
    hi: int
    lanes: slice
    send: object  # the NDArray the transport pushes for these lanes (Buffer.pieces)


def stream_pieces(codec, size, send, lane_bounds, num_workers):
    """The Pieces of a key whose bit_buf `send` travels as `lane_bounds`, or None when the
    codec cannot encode a piece of lanes alone (Codec.piece_elements)."""
    elements = codec.piece_elements(size, num_workers, lane_bounds)
    if elements is None:
        return None
    return [Piece(lo, hi, slice(*lanes), nd)
            for (lo, hi), lanes, nd in zip(elements, lane_bounds, send.pieces(lane_bounds))]


class FusedEncode:
    """bit_buf of one push encoded inside its local update: the codec's encode with the
    local SGD step in the same pass (Traits.fuses_local_update), so grad_buf is read once.

    With `pieces` (a streamed push) each Piece is encoded by an operator of its own,
    which writes that piece's array, so the transport pushes a piece as soon as it is
    encoded. A key's next push waits for the publish of its last one (ModelBackup
    .wait_version), by which every access of those pieces has finished.
    """

    def __init__(self, buffers, send, num_workers, rank, check, pieces=None, measure=False):
        self.buffers = buffers
        self.send = send  # the round's bit_buf (a Buffer)
        self.num_workers = num_workers
        self.rank = rank
        self.check = check
        self.pieces = pieces
        self.measure = measure  # the residual watch samples this push (Plan.measure)

    def parts(self):
        """What each operator encodes: the Pieces, or [None] for the whole key in one."""
        return [None] if self.pieces is None else list(self.pieces)

    def __call__(self, grad, local, piece=None):
        """Encode `grad` (grad_buf, or the gradient read in place: its held() view), or the
        elements of `piece`, with `local` (kernels.LocalSGD of the same elements). Runs
        where the caller holds every buffer (an engine operator): nothing here waits; a
        failure is kept in `check` for the pipeline. A piece that fails goes out as NaN
        naming this worker, so that every worker fails its sum instead of adding it."""
        b, check = self.buffers, self.check
        start = time.perf_counter()
        out = self.send.held()
        if piece is not None:
            out = out[piece.lanes]
        try:  # grad.held() refuses a gradient relaid since the probe (a LayoutError)
            grad, residual = grad.held(), b.residual.held()
            if piece is not None:
                grad, residual = grad[piece.lo:piece.hi], residual[piece.lo:piece.hi]
            if self.measure:
                b.watch.add(grad, residual)
            b.codec.encode(grad, residual, self.num_workers, out=out, rank=self.rank,
                           local=local)
            bad = 0
        except NonFiniteGradientError:
            bad = 1
        except BaseException as exc:
            if check.error is None:
                check.error = exc
            if piece is not None:
                mark_nonfinite(out, self.rank)
            raise
        if bad and piece is not None:
            mark_nonfinite(out, self.rank)
        check.nonfinite = (check.nonfinite or 0) + bad
        check.spans.append((start, time.perf_counter()))
        check.encoded = True


@dataclass
class Push:
    """One key's gradient of one step, in its grad_buf."""

    key: object
    buffers: KeyBuffers
    step: int
    local: bool  # its local update (backup) has run: publishing waits for the loc_buf flag
    priority: int = 0  # MXNet's priority of its transfer (Trainer and Module pass -index)


#: A quiet NaN's payload bits (float64 / float32), below the quiet bit.
_PAYLOAD = {np.dtype(np.float64): (np.uint64, 0x7FF8000000000000, 0x0007FFFFFFFFFFFF),
            np.dtype(np.float32): (np.uint32, 0x7FC00000, 0x003FFFFF)}


def mark_nonfinite(array, rank):
    """Fill `array` with a quiet NaN whose payload is rank + 1.

    The servers' float adds pass a NaN operand's payload on (x86), so every worker
    finds in the sum which worker sent a non-finite gradient.
    """
    uint, quiet, _ = _PAYLOAD[array.dtype]
    array.view(uint).fill(uint(quiet | (rank + 1)))


def nonfinite_sender(array, num_workers):
    """The rank named by the payload of the first NaN in `array`, or None."""
    bad = np.flatnonzero(~np.isfinite(array))
    if not bad.size or not np.isnan(array[bad[0]]):
        return None
    uint, _, mask = _PAYLOAD[array.dtype]
    payload = int(array[bad[0]:bad[0] + 1].view(uint)[0]) & mask
    return payload - 1 if 1 <= payload <= num_workers else None
