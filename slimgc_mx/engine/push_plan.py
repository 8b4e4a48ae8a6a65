"""One push's plan: for one key (or fused bucket) and step, where bit_buf is encoded, where
the sum is decoded and where the gradient and the sum are checked for NaN/Inf.

Planner.plan decides it once per push, from the CTTab's route and placement, the warm-up,
the codec, the local update and the transport; stages.py is the one place that reads the
sites and runs each stage there:

    encode   ENCODER       Stages.encode: the codec on the encoder thread
             LOCAL_UPDATE  Stages.in_local_update: a grad_buf.FusedEncode that the local
                           update runs in its pass over the gradient
             PIECES        the same, one engine operator per piece (a streamed push)
             DEVICE        Stages.on_device: the device codec on the training thread
    decode   FINISHER      Stages.decode: the codec on the finisher thread
             UPDATE        stages.decode_in_update: the SGD kernel decodes inside its update
             DEVICE        Stages.decode: the device codec

A device-path bucket's pass (torch/device_path.py, a placement of the same stages on the
parameters' device) gets its plan from bucket_plan(), made from the route the CTTab per
bucket (bucket_cttab.py) gives it; stages.py's encode_bucket, exchange_bucket and
decode_bucket read it:

    encode   DEVICE        the device codec (torch ops), error feedback included
             HOST_CODEC    the Cython codec on the training thread (the gradient and the
                           residual brought to the host, the lanes and residual sent back)
             None          the flat gradient (+ a residual a compressed route left)
    decode   DEVICE        the device codec; None: the sum divided by the workers
    rounds                 one sum per round on the job's process group (exchange_bucket)
    sum_check TAIL         each rank's flag summed in the step's tail, read before the
                           global update it guards
"""
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

# Routes (Strategy 1): the CTTab's, or a fused bucket once it has decided.
FULL = "full precision"  # fp_buf: grad_buf as it is
COMPRESSED = "compressed"  # bit_buf: the codec's lanes
BUCKET = "fused bucket"  # a bucket's flat buffers, full precision or compressed
HOST = "compressed on the host"  # a device-path bucket's lanes made by the host codec

# Sites: where a part of the push runs.
ENCODER = "encoder"  # the pipeline's encoder thread (a Cython kernel without the GIL)
LOCAL_UPDATE = "local update"  # the local update's SGD pass over the gradient
PIECES = "pieces"  # the local update's engine operators, one per piece of bit_buf
DEVICE = "device"  # the device codec (framework ops on the gradient's device)
FINISHER = "finisher"  # the pipeline's finisher thread
UPDATE = "update"  # inside the global update: the sum is never written to memory
HOST_CODEC = "host codec"  # a device-path bucket's: the Cython codec on the training thread

# How the finisher checks each round's result for NaN/Inf.
FINITE = "finite"  # every element
FINITE_IN_RANGE = "finite, lanes in range"  # the last round's digit lanes read once for
#                                             both NaN/Inf and the SGD kernel's lane range
TAIL = "tail"  # a device-path bucket's: its rank's flag, summed in the step's tail


@dataclass(frozen=True)
class Plan:
    """Where each part of one push runs (Planner.plan); immutable once made."""

    route: str  # FULL, COMPRESSED or BUCKET; a device-path bucket's: its CTTab route (FULL,
    #             COMPRESSED on the device, HOST)
    encode: Optional[str]  # bit_buf's encoder: ENCODER, LOCAL_UPDATE, PIECES, DEVICE; None:
    #                        fp_buf goes as it is
    decode: Optional[str]  # the sum's decoder: FINISHER, UPDATE, DEVICE; None: agg is the sum
    grad_check: str  # who finds NaN/Inf in this worker's gradient: ENCODER (its own pass,
    #                  or the codec's pre-check), LOCAL_UPDATE (the SGD kernel), DEVICE
    sum_check: str  # FINITE or FINITE_IN_RANGE, on the finisher thread; TAIL
    serial: bool = False  # warm-up: transferred alone and timed, in the trainer's key order
    #                       (a device-path bucket: its sum waited for, encode to decode timed)
    rounds: Tuple[int, ...] = (0,)  # the codec's rounds this push exchanges (push_rounds)
    wire_class: int = 0  # the codec's slot class at this push (its decode may change it)
    pieces: Optional[tuple] = None  # PIECES: the grad_buf.Piece each operator encodes
    optimizer_view: bool = False  # the encoder reads the optimizer's view of the key, which
    #                               the aggregator hands the codec before the push
    measure: bool = False  # the residual watch samples this push: its encoder adds the
    #                        norms, the finisher judges them (residual_watch.py)

    @property
    def compressed(self):
        """True on bit_buf (a key's compressed route, or a compressed bucket)."""
        return self.encode is not None


#: The plans of a full-precision push, the same for every key: made once.
FULL_PLAN = Plan(FULL, None, None, ENCODER, FINITE)
FULL_SERIAL_PLAN = Plan(FULL, None, None, ENCODER, FINITE, serial=True)
FULL_BUCKET_PLAN = Plan(BUCKET, None, None, ENCODER, FINITE)


#: A device-path bucket's sites per CTTab route: (encode, decode, grad_check).
_BUCKET_SITES = {FULL: (None, None, DEVICE), COMPRESSED: (DEVICE, DEVICE, DEVICE),
                 HOST: (HOST_CODEC, DEVICE, HOST_CODEC)}


@functools.lru_cache(maxsize=None)
def bucket_plan(route, rounds=1, timed=False):
    """The plan of a device-path bucket's pass on `route` (bucket_cttab.py's FULL, COMPRESSED
    or HOST): its codec's `rounds` where the device codec encodes (powersgd: 2), one
    otherwise; `timed`: a warm-up pass, its sum waited for and timed. Made once per
    argument set (immutable, shared)."""
    if route not in _BUCKET_SITES:
        raise ValueError("a device-path bucket's route is one of %s, got %r"
                         % (", ".join(repr(r) for r in _BUCKET_SITES), route))
    encode, decode, check = _BUCKET_SITES[route]
    return Plan(route, encode, decode, check, TAIL, serial=bool(timed),
                rounds=tuple(range(rounds)) if route == COMPRESSED else (0,))
