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
"""
from dataclasses import dataclass
from typing import Optional, Tuple

# Routes (Strategy 1): the CTTab's, or a fused bucket once it has decided.
FULL = "full precision"  # fp_buf: grad_buf as it is
COMPRESSED = "compressed"  # bit_buf: the codec's lanes
BUCKET = "fused bucket"  # a bucket's flat buffers, full precision or compressed

# Sites: where a part of the push runs.
ENCODER = "encoder"  # the pipeline's encoder thread (a Cython kernel without the GIL)
LOCAL_UPDATE = "local update"  # the local update's SGD pass over the gradient
PIECES = "pieces"  # the local update's engine operators, one per piece of bit_buf
DEVICE = "device"  # the device codec (framework ops on the gradient's device)
FINISHER = "finisher"  # the pipeline's finisher thread
UPDATE = "update"  # inside the global update: the sum is never written to memory

# How the finisher checks each round's result for NaN/Inf.
FINITE = "finite"  # every element
FINITE_IN_RANGE = "finite, lanes in range"  # the last round's digit lanes read once for
#                                             both NaN/Inf and the SGD kernel's lane range


@dataclass(frozen=True)
class Plan:
    """Where each part of one push runs (Planner.plan); immutable once made."""

    route: str  # FULL, COMPRESSED or BUCKET
    encode: Optional[str]  # bit_buf's encoder: ENCODER, LOCAL_UPDATE, PIECES, DEVICE; None:
    #                        fp_buf goes as it is
    decode: Optional[str]  # the sum's decoder: FINISHER, UPDATE, DEVICE; None: agg is the sum
    grad_check: str  # who finds NaN/Inf in this worker's gradient: ENCODER (its own pass,
    #                  or the codec's pre-check), LOCAL_UPDATE (the SGD kernel), DEVICE
    sum_check: str  # FINITE or FINITE_IN_RANGE, on the finisher thread
    serial: bool = False  # warm-up: transferred alone and timed, in the trainer's key order
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
