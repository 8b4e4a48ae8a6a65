"""grad_buf, fp_buf and bit_buf of one key (SlimGC §3.6): the CPU buffers of Strategy 2.

The gradient is copied into grad_buf; the full-precision route sends grad_buf itself
as fp_buf, the compressed route encodes it into bit_buf (the codec's lanes). What comes
back is the sum over workers: `agg` for fp_buf, `bit_sum` for bit_buf, decoded into
`agg` (or inside the SGD kernel's update). A codec may exchange several rounds per step
(PowerSGD: P, then Q) and gather instead of sum (TopK: every worker's slot side by
side); each round has its own send and receive buffers (`rounds`).
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np


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


class KeyBuffers:
    """Everything the pipeline holds for one key.

    grad_buf  float32 copy of the local gradient (sent as is on the fp_buf route)
    bit_buf   the codec's lanes for this worker (the compressed route)
    bit_sum   the lanes summed over workers
    agg       float32 sum over workers of the gradient (pulled, or decoded from bit_sum)
    residual  the codec's error-feedback memory (Codec.memory_size: the residual, then any
              further per-worker state)
    device    a DeviceCodec when encoding runs as NDArray ops (offload off), else None
    wire      the transport's wire keys of this key (transport.keys.KeyWire)
    """

    def __init__(self, index, shape, codec, num_workers, make_buffer, wire=None):
        self.index = index
        self.shape = tuple(shape)
        self.size = size = int(np.prod(shape))
        self.nbytes = 4 * size
        self.codec = codec
        self.wire = wire
        self.grad_buf = make_buffer(shape, np.float32)
        self.agg = make_buffer(shape, np.float32)
        self.device = None
        self.residual_pending = False  # the residual may hold error feedback not yet sent
        if codec is not None:
            self.residual = make_buffer((codec.memory_size(size),), np.float32)
            self.rounds = [WireRound(route, make_buffer(send, dtype), make_buffer(recv, dtype))
                           for route, send, recv, dtype in codec.wire_rounds(
                               size, self.shape, num_workers)]
            self.bit_buf, self.bit_sum = self.rounds[0].send, self.rounds[0].recv
        else:  # compressor 'none': full precision only, no error feedback
            self.residual = self.bit_buf = self.bit_sum = None
            self.rounds = []

    @property
    def fp_buf(self):
        """What the full-precision route sends: grad_buf itself."""
        return self.grad_buf

    @property
    def label(self):
        return "key #%d" % self.index


class GradCheck:
    """The local update's count of NaN/Inf in grad_buf, so that the encoder need not read
    grad_buf a second time (its pre-check is a full pass over the gradient).

    `ready`: the array the local update writes; `nonfinite` is set before it is readable.
    """

    __slots__ = ("ready", "nonfinite")

    def __init__(self):
        self.ready = None
        self.nonfinite = None


@dataclass
class Push:
    """One key's gradient of one step, in its grad_buf."""

    key: object
    buffers: KeyBuffers
    step: int
    local: bool  # its local update (backup) has run: publishing waits for the loc_buf flag
    check: Optional[GradCheck] = None
    priority: int = 0  # MXNet's priority of its transfer (Trainer and Module pass -index)
