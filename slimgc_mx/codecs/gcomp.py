"""gcomp (Li et al., SoCC 2024): near-lossless coding of every float32 gradient value.

A value c = g + r keeps its sign and exponent; its exponent is Huffman-coded with a
length limit (rarer exponents: an escape code, then the raw 8 bits), its 23-bit
mantissa loses 0, 6, 12 or 18 low bits, a 2-bit level chosen per value by the
optimizer-aware metric delta (how large the weight is against the update this gradient
causes), and zeros and denormals are sent as their exponent code alone. What the
truncation drops stays in the residual. The payload is not additive, so it travels on
the gather route: every worker's slot side by side, as integers below 2**24 in float32
lanes. The code table is shared state: every K pushes each worker rebuilds it from the
exponent histogram of all N decoded payloads, which every worker decodes alike. Slots
come in pre-declared size classes; decode picks the next push's class from the
payload lengths every worker reported, and blocks that outgrow their slot stay in the
residual. A large key's slot travels in pieces, one gather round each on one wire key,
and is decoded piece by piece, so that a worker never holds N whole slots
(docs/codecs.md).
"""
import heapq
import math
import numbers
import zlib
from dataclasses import replace

import numpy as np

from .base import (Codec, check_grad_residual, NonFiniteGradientError, Option, Traits, check_disjoint,
                   check_num_workers, check_vector, kernels, output, raise_nonfinite)
from .registry import register

#: Elements per block: blocks encode and decode independently (and in parallel).
BLOCK = 4096
#: Header lanes before the block lengths: table id, blocks sent, sent lanes (2),
#: wanted lanes (2).
HEADER = 6
#: The escape symbol (exponent 255 is Inf/NaN, which is never sent).
ESC = 255
#: Mantissa bits truncated at levels 0..3.
TRUNCATE = (0, 6, 12, 18)
#: Lanes carry integers below this bound (exact in float32 through the servers' x + 0).
LANE_LIMIT = 1 << 24
#: Widest slot row (lanes); rows are what the servers' row_sparse merge places.
MAX_COLS = 1024
#: The largest slot class, in bits per element: a value with a raw exponent (escape of
#: length 0: the first push) at level 0, so that the first push is never cut.
TOP_BITS = 34.0
#: The smallest slot class, in bits per element.
MIN_BITS = 2.0
#: Bits of one value beyond its exponent code: sign, level, mantissa at level 0.
REST_BITS = 26
#: A slot whose largest class exceeds this many lanes (1 MiB) travels in pieces of about
#: as many (more beyond MAX_PIECES), one gather round each; its classes are 1..k pieces.
PIECE_LANES = 1 << 18
#: The most pieces of a streamed slot (its pulled N pieces are 1/MAX_PIECES of N slots).
MAX_PIECES = 32


def _int_list(values, count, name, low, high):
    """`values` as `count` Python ints in [low, high], or a ValueError naming `name`."""
    if len(values) != count or not all(isinstance(v, numbers.Integral)
                                       and not isinstance(v, bool) and low <= v <= high
                                       for v in values):
        raise ValueError("gcomp state: %s must be %d integers in %d..%d" % (name, count, low,
                                                                           high))
    return [int(v) for v in values]


def huffman_lengths(weights):
    """{symbol: code length} of a Huffman code for {symbol: weight > 0}; ties are broken by
    symbol, then by the order merged nodes were made, so every worker builds the same."""
    if len(weights) == 1:
        return {s: 0 for s in weights}
    heap = [(w, i, (s,)) for i, (s, w) in enumerate(sorted(weights.items()))]
    heapq.heapify(heap)
    depth = dict.fromkeys(weights, 0)
    made = len(heap)
    while len(heap) > 1:
        w1, _, a = heapq.heappop(heap)
        w2, _, b = heapq.heappop(heap)
        for s in a + b:
            depth[s] += 1
        heapq.heappush(heap, (w1 + w2, made, a + b))
        made += 1
    return depth


def build_lengths(histogram, max_bits):
    """Code lengths (uint8[256], ESC at 255) from an exponent histogram, none above max_bits.

    The k most frequent exponents (ties: the smaller) get Huffman codes; the escape weighs
    1 + the counts of the others, which it stands for. k is the largest for which no code
    is longer than max_bits (found by bisection, then checked downwards). An empty
    histogram gives the escape alone, at length 0: every exponent raw.
    """
    ranked = sorted((e for e in range(255) if histogram[e] > 0),
                    key=lambda e: (-int(histogram[e]), e))
    total = sum(int(histogram[e]) for e in ranked)

    def lengths_of(k):
        weights = {e: int(histogram[e]) for e in ranked[:k]}
        weights[ESC] = 1 + total - sum(weights.values())
        lengths = huffman_lengths(weights)
        return lengths if max(lengths.values()) <= max_bits else None

    lo, hi = 0, len(ranked)  # lengths_of(0) is always valid: the escape alone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lengths_of(mid) is not None:
            lo = mid
        else:
            hi = mid - 1
    k = lo
    while lengths_of(k) is None:
        k -= 1
    lengths = lengths_of(k)
    out = np.zeros(256, dtype=np.uint8)
    for s, n in lengths.items():
        out[s] = n
    return out


def check_lengths(lengths, max_bits):
    """Raise ValueError unless `lengths` describe a complete prefix code with the escape."""
    if not lengths.any():
        return
    used = lengths[lengths > 0].astype(np.int64)
    if lengths[ESC] == 0 or used.max() > max_bits or \
            int(np.sum(np.left_shift(1, max_bits - used))) != 1 << max_bits:
        raise ValueError("gcomp state: the code lengths do not form a complete prefix code "
                         "with an escape of at most %d bits" % max_bits)


class Table:
    """The encoder's and decoder's tables of one set of code lengths (canonical codes)."""

    def __init__(self, lengths, max_bits):
        self.lengths = lengths
        self.max_bits = max_bits
        self.id = zlib.crc32(lengths.tobytes()) & (LANE_LIMIT - 1)
        order = sorted((int(n), s) for s, n in enumerate(lengths) if n or s == ESC)
        codes = {}
        code, prev = 0, order[0][0]
        for n, s in order:
            code <<= n - prev
            codes[s] = (code, n)
            code += 1
            prev = n
        esc_code, esc_len = codes[ESC]
        self.code = np.zeros(256, dtype=np.uint32)
        self.length = np.zeros(256, dtype=np.int32)
        for e in range(256):
            c, n = codes[e] if e in codes and e != ESC else ((esc_code << 8) | e, esc_len + 8)
            self.code[e], self.length[e] = c, n
        # The decoder's lookup: entry = symbol | length << 8 for every max_bits-bit prefix.
        self.lut = np.full(1 << max_bits, 0xFFFF, dtype=np.uint16)
        for s, (c, n) in codes.items():
            shift = max_bits - n
            self.lut[c << shift:(c + 1) << shift] = s | (n << 8)
        self.max_record = int(self.length.max()) + REST_BITS


def layout(size, ratio):
    """(blocks, header lanes, row width, rows of each slot class, largest first, rows of a
    piece: 0 when the slot travels whole).

    Class c holds size * TOP_BITS / ratio**c bits (down to MIN_BITS per element) plus
    the header, in rows of `cols` lanes: rows of up to 1024 lanes (4 KiB), at least ~64
    rows in the largest class so that the classes can differ. A largest class of more
    than PIECE_LANES lanes is cut into k <= MAX_PIECES equal pieces instead, and the
    classes are k, k-1, .., 1 pieces: each push gathers its class's pieces one by one.
    """
    blocks = -(-size // BLOCK)
    header = HEADER + blocks
    full = header + -(-size * int(TOP_BITS) // 24)
    cols = 1
    while cols * 2 <= min(MAX_COLS, full // 64):
        cols *= 2
    rows = []
    c = 0
    while TOP_BITS / ratio ** c >= MIN_BITS or not rows:
        lanes = header + math.ceil(size * (TOP_BITS / ratio ** c) / 24)
        r = -(-lanes // cols)
        if not rows or r < rows[-1]:
            rows.append(r)
        c += 1
    if rows[0] * cols <= PIECE_LANES:
        return blocks, header, cols, tuple(rows), 0
    k = min(MAX_PIECES, -(-rows[0] * cols // PIECE_LANES))
    piece = -(-rows[0] // k)
    return blocks, header, cols, tuple((k - c) * piece for c in range(k)), piece


def geometry(size, ratio):
    """(blocks, header lanes, row width, rows of each slot class, largest first): layout()
    without the piece."""
    return layout(size, ratio)[:4]


@register
class GComp(Codec):
    """Huffman-coded exponents, mantissas truncated per value by delta, zeros pruned."""

    name = "gcomp"
    wire_dtype = np.dtype(np.float32)
    TRAITS = Traits(wants_optimizer=True)
    options = {
        "refresh": Option(int, 50, lambda v: 1 <= v <= 10 ** 9,
                          "an integer >= 1: pushes between rebuilds of the code table"),
        "max_code_bits": Option(int, 12, lambda v: 1 <= v <= 16,
                                "an integer in 1..16: the longest exponent code before the "
                                "escape"),
        "delta_slack": Option(int, 0, lambda v: 0 <= v <= 60,
                              "an integer in 0..60: bits by which the delta thresholds "
                              "2**(t+1) are lowered"),
        "default_level": Option(int, 0, lambda v: 0 <= v <= 3,
                                "an integer in 0..3: the level used without an optimizer"),
        "class_ratio": Option(float, 2 ** 0.25, lambda v: 1.01 <= v <= 4.0,
                              "a number in 1.01..4: the size ratio of consecutive slot "
                              "classes"),
        "headroom": Option(float, 0.02, lambda v: 0.0 <= v <= 1.0,
                           "a number in 0..1: the margin over the last payload when the "
                           "next slot is chosen"),
    }

    def __init__(self, threshold=None, num_threads=None, **options):
        super().__init__(threshold=threshold, num_threads=num_threads, **options)
        self.histogram = np.zeros(256, dtype=np.int64)
        self.wire_class = 0
        self._set_table(np.zeros(256, dtype=np.uint8))
        self.stats = {}  # the last encode's and decode's lengths (for measurements)
        self._outgoing = None  # a streamed push's encoded slot, sent piece by piece
        self._incoming = None  # the pieces of every worker's slot decoded so far

    # ------------------------------------------------------------ shared state
    def _set_table(self, lengths):
        self.table = Table(lengths, self.max_code_bits)

    @property
    def table_id(self):
        return self.table.id

    def state_dict(self):
        state = super().state_dict()
        state.update(code_lengths=[int(n) for n in self.table.lengths],
                     histogram=[int(n) for n in self.histogram], wire_class=int(self.wire_class))
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        lengths = np.array(_int_list(state["code_lengths"], 256, "code_lengths", 0,
                                     self.max_code_bits), dtype=np.uint8)
        check_lengths(lengths, self.max_code_bits)
        histogram = _int_list(state["histogram"], 256, "histogram", 0, 2 ** 62)
        if histogram[ESC]:
            raise ValueError("gcomp state: the histogram counts exponent 255 (Inf/NaN)")
        wire_class = _int_list([state["wire_class"]], 1, "wire_class", 0, 10 ** 6)[0]
        self._set_table(lengths)
        self.histogram = np.array(histogram, dtype=np.int64)
        self.wire_class = wire_class

    # ------------------------------------------------------------ the wire
    def _layout(self, size):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError("size must be an integer >= 0, got %r" % (size,))
        key = ("layout", int(size))
        if key not in self._cache:
            self._cache[key] = layout(int(size), self.class_ratio)
        return self._cache[key]

    def _geometry(self, size):
        return self._layout(size)[:4]

    def _class_rows(self, size):
        _, _, cols, rows = self._geometry(size)
        if not 0 <= self.wire_class < len(rows):
            raise ValueError("gcomp: slot class %d does not exist for %d elements (%d classes); "
                             "the state belongs to another key" % (self.wire_class, size,
                                                                   len(rows)))
        return cols, rows[self.wire_class]

    def lane_count(self, size, num_workers):
        """Lanes of this worker's slot at the next push (its class's rows x cols)."""
        check_num_workers(num_workers)
        cols, rows = self._class_rows(size)
        return rows * cols

    def piece_lanes(self, size):
        """Lanes of one piece of a slot that travels in pieces, else 0 (it travels whole)."""
        _, _, cols, _, piece = self._layout(size)
        return piece * cols

    def wire_bits_per_element(self, num_workers):
        """Bits per element pushed in the largest slot class (24 payload bits per 32-bit
        lane), an upper bound: the slots follow the data (docs/codecs.md has the measured
        average); each worker pulls N slots."""
        return TOP_BITS * 32 / 24

    def wire_rounds(self, size, shape, num_workers):
        n = check_num_workers(num_workers)
        _, _, cols, _, piece = self._layout(size)
        if piece:
            return [("gather", (piece, cols), (n * piece, cols), self.wire_dtype)]
        cols, rows = self._class_rows(size)
        return [("gather", (rows, cols), (n * rows, cols), self.wire_dtype)]

    def wire_classes(self, size, shape, num_workers):
        """One gather round per class; a slot in pieces: the same piece round for every
        class (one wire key), which a push exchanges once per piece (push_rounds)."""
        n = check_num_workers(num_workers)
        _, _, cols, rows, piece = self._layout(size)
        if piece:
            return [self.wire_rounds(size, shape, n) for _ in rows]
        return [[("gather", (r, cols), (n * r, cols), self.wire_dtype)] for r in rows]

    def push_rounds(self, size, num_workers):
        """The next push's exchanges: one per piece of its slot (one when it travels whole)."""
        check_num_workers(num_workers)
        _, rows = self._class_rows(size)
        piece = self._layout(size)[4]
        return (0,) * (rows // piece if piece else 1)

    def work_bytes(self, size, num_workers):
        """Bytes of the work arrays this codec holds for a key of `size` elements beyond the
        key's buffers, at the largest class: the encoder's scratch (one stride per block,
        which a streamed push also keeps its decoded blocks in) and a streamed round's
        staging (every worker's piece and the lanes of a block it cuts)."""
        n = check_num_workers(num_workers)
        blocks, _, _, _, piece = self._layout(size)
        scratch = blocks * (-(-BLOCK * (8 + REST_BITS) // 24) + 1)
        stage = n * (self.piece_lanes(size) + -(-BLOCK * (8 + REST_BITS) // 24)) if piece else 0
        return 4 * (scratch + stage + (-(-size // MAX_PIECES) if piece else 0))

    # ------------------------------------------------------------ delta -> level
    def _level_args(self, size):
        """(weight, state1, state2, (E, B, D), thresholds, fixed level) for the kernels.

        level = #{T in thresholds : |w*(sqrt(state2) + E) + B*state1| >= T * D*|c|}: delta
        is the weight against the update this gradient causes (docs/codecs.md); without
        an optimizer view every nonzero value gets default_level.
        """
        view = self.optimizer_view
        if view is None:
            return None, None, None, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), self.default_level
        arrays = view.arrays()
        if not isinstance(arrays, tuple) or len(arrays) != 3:
            raise TypeError("gcomp: OptimizerView.arrays() must return (weight, state1, state2)")
        weight, s1, s2 = arrays
        check_vector("optimizer weight", weight, np.float32, length=size)
        if s1 is not None:
            check_vector("optimizer state1", s1, np.float32, length=size)
        if s2 is not None:
            check_vector("optimizer state2", s2, np.float32, length=size)
        lr, wd, rescale, mu = view.lr, view.wd, view.rescale_grad, view.momentum
        if view.kind == "sgd":
            coef = (1.0 - lr * wd, mu, lr * rescale)
            s2 = None
        elif view.kind == "nag":
            coef = (1.0 - lr * wd * (1.0 + mu), mu * mu, lr * (1.0 + mu) * rescale)
            s2 = None
        elif view.kind == "adam":
            t = max(1, int(view.t))
            lr_t = lr * math.sqrt(1.0 - view.beta2 ** t) / (1.0 - view.beta1 ** t)
            coef = (view.epsilon - lr_t * (1.0 - view.beta1) * wd, -lr_t * view.beta1,
                    lr_t * (1.0 - view.beta1) * rescale)
        else:
            raise ValueError("gcomp: optimizer kind %r has no delta; kinds: 'sgd', 'nag', "
                             "'adam' (or pass no view: default_level)" % (view.kind,))
        if not all(math.isfinite(v) for v in coef):
            raise ValueError("gcomp: the optimizer's settings give non-finite delta "
                             "coefficients %r" % (coef,))
        thresholds = tuple(2.0 ** (t + 1 - self.delta_slack) for t in TRUNCATE[1:])
        return weight, s1, s2, coef, thresholds, -1

    # ------------------------------------------------------------ encode
    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0):
        """Compensate, level, truncate, code: this worker's slot; `residual` is updated.

        grad, residual: 1-D C-contiguous float32 of equal length. NaN/Inf in grad raises
        NonFiniteGradientError before residual or out is touched (unless grad_checked).
        Blocks beyond the slot are not sent and their values stay in the residual. An
        `out` of one piece (piece_lanes) of a slot of several gets the slot's first piece;
        next_round writes the others.
        """
        n_workers = check_num_workers(num_workers)
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) \
                or not 0 <= rank < n_workers:
            raise ValueError("rank must be in 0..%d, got %r" % (n_workers - 1, rank))
        size = check_grad_residual(grad, residual)
        n_lanes = self.lane_count(size, n_workers)
        piece = self.piece_lanes(size)
        streamed = piece and n_lanes > piece and isinstance(out, np.ndarray) \
            and out.ndim == 1 and out.shape[0] == piece
        if streamed:
            check_vector("out", out, self.wire_dtype, writeable=True, length=piece)
        else:
            out = output(out, n_lanes, self.wire_dtype)
        check_disjoint(grad=grad, residual=residual, out=out)
        self._outgoing = None
        blocks, header, _, _ = self._geometry(size)
        args = self._level_args(size)
        stride = -(-BLOCK * self.table.max_record // 24) + 1
        words, payload = self._encode_blocks(grad, residual, args, stride, grad_checked)
        # The blocks that fit, in order; the rest stay in the residual.
        ends = header + np.cumsum(words)
        sent = int(np.searchsorted(ends, n_lanes, side="right"))
        wanted = int(ends[-1]) if blocks else header
        used = int(ends[sent - 1]) if sent else header
        head = np.zeros(header, np.float32)
        head[0] = self.table.id
        head[1] = sent
        head[2], head[3] = used % LANE_LIMIT, used // LANE_LIMIT
        head[4], head[5] = wanted % LANE_LIMIT, wanted // LANE_LIMIT
        head[HEADER:HEADER + sent] = words[:sent]
        offsets = np.concatenate(([header], ends[:sent - 1])).astype(np.int64) if sent else \
            np.zeros(0, np.int64)
        if streamed:
            self._outgoing = {"size": size, "payload": payload, "stride": stride,
                              "words": words, "offsets": offsets, "sent": sent, "head": head,
                              "pieces": n_lanes // piece}
            self._write_piece(0, out)
        else:
            out[:header] = head
            self._assemble(payload, stride, words, offsets, sent, out)
            out[used:] = 0.0
        if sent < blocks:
            self._restore(payload, stride, words, sent, size, residual)
        self.stats["encode"] = {"wanted_lanes": wanted, "sent_lanes": used,
                                "slot_lanes": n_lanes, "deferred_elements":
                                    max(0, size - sent * BLOCK)}
        return out

    def _write_piece(self, i, out):
        """out = lanes [i*L, (i+1)*L) of the slot the last streamed encode coded (L = out's
        length): the header, the blocks' lanes that fall there, zeros after them."""
        o = self._outgoing
        lo, hi = i * out.shape[0], (i + 1) * out.shape[0]
        out[:] = 0.0
        head = o["head"]
        if lo < head.shape[0]:
            out[:min(hi, head.shape[0]) - lo] = head[lo:hi]
        offsets, words, payload, stride = o["offsets"], o["words"], o["payload"], o["stride"]
        ends = offsets + words[:o["sent"]]
        for b in range(int(np.searchsorted(ends, lo, side="right")),
                       int(np.searchsorted(offsets, hi, side="left"))):
            a, z = max(int(offsets[b]), lo), min(int(ends[b]), hi)
            src = b * stride + a - int(offsets[b])
            out[a - lo:z - lo] = payload[src:src + z - a]

    def next_round(self, done, result, send, num_workers):
        """A streamed push: decode the blocks that piece `done` of every worker's slot
        (`result`, side by side) completes, then write this worker's next piece to `send`."""
        o = self._outgoing
        if o is None:
            raise RuntimeError("gcomp: next_round without a streamed encode (a slot in one "
                               "piece has no further round)")
        n = check_num_workers(num_workers)
        piece = self.piece_lanes(o["size"])
        check_vector("result", result, self.wire_dtype, length=n * piece)
        check_vector("send", send, self.wire_dtype, writeable=True, length=piece)
        if not 0 <= done < o["pieces"] - 1:
            raise ValueError("gcomp: round %d of a slot in %d pieces has no next round"
                             % (done, o["pieces"]))
        self._receive(done, result, n, o["size"])
        self._write_piece(done + 1, send)
        return send

    # ------------------------------------------------------------ decode
    def decode(self, slots, size, num_workers, out=None):
        """Sum over workers of the decoded values, float32 (size,), from every worker's slot
        side by side (a streamed push: every worker's last piece, after next_round took
        the others). Updates the shared state as every worker does: the exponent
        histogram, the code table every `refresh` pushes, the next push's slot class."""
        n_workers = check_num_workers(num_workers)
        n_lanes = self.lane_count(size, n_workers)
        piece = self.piece_lanes(size)
        streamed = piece and n_lanes > piece and isinstance(slots, np.ndarray) \
            and slots.shape == (n_workers * piece,)
        check_vector("slots", slots, self.wire_dtype,
                     length=n_workers * (piece if streamed else n_lanes))
        out = output(out, size, np.float32)
        check_disjoint(slots=slots, out=out)
        if streamed:
            return self._receive(n_lanes // piece - 1, slots, n_workers, size, out)
        starts, words, wanted, used = self._parse(slots, size, n_workers, n_lanes)
        histogram = self._decode_into(slots, starts, words, size, out)
        self._agree(histogram, wanted, size)
        self.stats["decode"] = {"wanted_lanes": wanted, "sent_lanes": used,
                                "slot_lanes": n_lanes}
        return out

    def _receive(self, i, result, n, size, out=None):
        """Piece i of every worker's slot: decode the blocks that every worker's pieces so
        far hold whole, in worker order as decode does (bit for bit its sums); keep each
        worker's lanes of a block cut by the piece's end. The last piece writes `out`,
        with the blocks decoded before it (kept in the scratch's spent blocks)."""
        blocks, header, _, _, _ = self._layout(size)
        n_lanes = self.lane_count(size, n)
        piece = self.piece_lanes(size)
        pieces = result.reshape(n, piece)
        if i == 0:
            rel, words, wanted, used = self._parse_heads(pieces[:, :header], size, n_lanes)
            self._incoming = {"rel": rel, "words": words, "wanted": wanted, "used": used,
                              "next": 0, "done": 0, "carry": [pieces[j, :0] for j in range(n)],
                              "base": [0] * n, "histogram": np.zeros(256, np.int64)}
        st = self._incoming
        if st is None or st["next"] != i or len(st["base"]) != n:
            raise RuntimeError("gcomp: piece %d of a streamed slot arrived out of order" % i)
        st["next"] = i + 1
        final = i + 1 == n_lanes // piece
        received = (i + 1) * piece
        rel, words = st["rel"], st["words"]
        complete = (words == 0) | (rel + words <= received)
        b0 = st["done"]
        b1 = int(np.where(complete.all(axis=1), blocks, np.argmin(complete, axis=1)).min()) \
            if blocks else 0
        segs, starts, at = [], np.zeros((n, b1 - b0), np.int64), 0
        for j in range(n):
            carry, base = st["carry"][j], st["base"][j]
            seg = np.concatenate((carry, pieces[j])) if carry.size else pieces[j]
            starts[j] = at + rel[j, b0:b1] - base
            keep = min(int(rel[j, b1]) if b1 < blocks else received, received)
            st["carry"][j], st["base"][j] = seg[keep - base:].copy(), keep
            segs.append(seg)
            at += seg.shape[0]
        lo, hi = min(b0 * BLOCK, size), min(b1 * BLOCK, size)
        if b1 > b0:
            stage = np.concatenate(segs) if n > 1 else segs[0]
            target = out[lo:hi] if final else np.empty((b1 - b0) * BLOCK, np.float32)
            st["histogram"] += self._decode_into(stage, starts,
                                                 np.ascontiguousarray(words[:, b0:b1]),
                                                 hi - lo, target[:hi - lo])
            if not final:
                self._decoded_blocks(size)[b0:b1] = target.reshape(b1 - b0, BLOCK)
        st["done"] = b1
        if not final:
            return None
        if b1 != blocks:
            raise ValueError("gcomp: the slots' blocks do not end within the slot: corrupted "
                             "data")
        if lo:
            out[:lo] = self._decoded_blocks(size)[:b0].reshape(-1)[:lo]
        self._incoming = self._outgoing = None
        self._agree(st["histogram"], st["wanted"], size)
        self.stats["decode"] = {"wanted_lanes": st["wanted"], "sent_lanes": st["used"],
                                "slot_lanes": n_lanes}
        return out

    def _decoded_blocks(self, size):
        """(blocks, BLOCK) float32 for a streamed push's decoded blocks before its last
        piece: the first BLOCK lanes of each block's stride of this worker's scratch, whose
        lanes were sent by the time every worker's block is decoded."""
        st = self._incoming
        if "blocks" not in st:
            blocks = -(-size // BLOCK)
            o = self._outgoing
            if o is not None and o["size"] == size \
                    and o["payload"].shape[0] >= blocks * o["stride"]:
                st["blocks"] = o["payload"][:blocks * o["stride"]].reshape(
                    blocks, o["stride"])[:, :BLOCK]
            else:
                st["blocks"] = np.empty((blocks, BLOCK), np.float32)
        return st["blocks"]

    def _parse(self, slots, size, n_workers, n_lanes):
        """Check every worker's header; (block starts, block lengths: (N, blocks) int64,
        wanted lanes, sent lanes per worker)."""
        header = self._geometry(size)[1]
        heads = slots.reshape(n_workers, n_lanes)[:, :header]
        rel, words, wanted, used = self._parse_heads(heads, size, n_lanes)
        starts = rel + (np.arange(n_workers, dtype=np.int64) * n_lanes)[:, None]
        return starts, words, wanted, used

    def _parse_heads(self, heads, size, n_lanes):
        """Check every worker's header (N, header lanes); (block starts within the slot,
        block lengths: (N, blocks) int64, wanted lanes, sent lanes per worker)."""
        blocks, header, _, _ = self._geometry(size)
        bad = ~((heads >= 0) & (heads < LANE_LIMIT) & (heads == np.floor(heads)))
        if bad.any():
            j = int(np.flatnonzero(bad.any(axis=1))[0])
            raise ValueError("gcomp: worker %d's slot header holds values that are not "
                             "integers in [0, 2**24): not a gcomp payload (wrong codec, worker "
                             "count or corrupted data)" % j)
        h = heads.astype(np.int64)
        for j in range(h.shape[0]):
            if h[j, 0] != self.table.id:
                raise ValueError("gcomp: worker %d coded with table %06x, this worker holds %06x: "
                                 "the workers' codec states differ (restore the same "
                                 "checkpoint on every worker)" % (j, h[j, 0], self.table.id))
        sent = h[:, 1]
        used = h[:, 2] + h[:, 3] * LANE_LIMIT
        wanted = h[:, 4] + h[:, 5] * LANE_LIMIT
        words = h[:, HEADER:header]
        index = np.arange(blocks)
        ok = (sent <= blocks) & (header + words.sum(axis=1) == used) & (used <= n_lanes) \
            & (wanted >= used)
        ok &= np.all((words > 0) == (index[None, :] < sent[:, None]), axis=1)
        if not ok.all():
            j = int(np.flatnonzero(~ok)[0])
            raise ValueError("gcomp: worker %d's slot header is inconsistent (blocks sent %d of "
                             "%d, %d lanes used of %d): corrupted data" % (
                                 j, sent[j], blocks, used[j], n_lanes))
        rel = header + np.cumsum(words, axis=1) - words
        return rel, words, wanted.tolist(), used.tolist()

    def _agree(self, histogram, wanted, size):
        """The shared state after a decode, from what every worker received alike."""
        self.histogram += histogram
        self.histogram[ESC] = 0
        if self.pushes % self.refresh == 0:
            self._set_table(build_lengths(self.histogram, self.max_code_bits))
            self.histogram[:] = 0
        self.pushes += 1
        _, _, cols, rows = self._geometry(size)
        need = max(wanted) if wanted else 0
        target = need + math.ceil(need * self.headroom)
        fits = [c for c, r in enumerate(rows) if r * cols >= target]
        self.wire_class = fits[-1] if fits else 0

    # ------------------------------------------------------------ kernels (Cython)
    def _scratch(self, blocks, stride):
        key = ("scratch", blocks, stride)
        if key not in self._cache:
            for k in [k for k in self._cache if k[0] == "scratch"]:
                del self._cache[k]
            # Blocks start stride lanes apart; the pages a block never reaches stay unmapped.
            self._cache[key] = np.empty(max(1, blocks * stride), dtype=np.float32)
        return self._cache[key]

    def _encode_blocks(self, grad, residual, args, stride, grad_checked):
        """Encode every block into its own stride of a scratch array; (lanes per block
        (int64), the scratch). Raises NonFiniteGradientError as LaneCodec.encode does."""
        weight, s1, s2, coef, thresholds, fixed = args
        size = grad.shape[0]
        blocks = -(-size // BLOCK)
        scratch = self._scratch(blocks, stride)
        words = np.zeros(blocks, dtype=np.int64)
        f32 = [np.float32(v) for v in coef + thresholds]
        bad_grad, bad_sum = kernels().encode_gcomp(
            grad, residual, weight, s1, s2, *f32, fixed, self.table.code, self.table.length,
            scratch, words, BLOCK, stride, self.num_threads, grad_checked)
        if bad_grad:
            raise_nonfinite(grad, residual)
        if bad_sum:
            raise_nonfinite(grad, residual, residual)
        return words, scratch

    def _assemble(self, payload, stride, words, offsets, sent, out):
        kernels().gcomp_assemble(payload, stride, words, offsets, sent, out, self.num_threads)

    def _restore(self, payload, stride, words, first, size, residual):
        """residual += the values of blocks first.. (coded but not sent): the whole c again."""
        bad = kernels().gcomp_restore(payload, stride, words, first, size, BLOCK,
                                      self.table.lut, self.max_code_bits, residual,
                                      self.num_threads)
        if bad:
            raise RuntimeError("gcomp: %d unsent blocks failed to decode from the scratch "
                               "(a kernel bug)" % bad)

    def _decode_into(self, slots, starts, words, size, out):
        histogram = np.zeros(256, dtype=np.int64)
        bad = kernels().decode_gcomp(slots, starts.ravel(), words.ravel(), starts.shape[0], size,
                                     BLOCK, self.table.lut, self.max_code_bits, out, histogram,
                                     self.num_threads)
        if bad:
            raise ValueError("gcomp: %d blocks do not decode to their stated lengths: not a "
                             "gcomp payload of this table (corrupted data)" % bad)
        return histogram


# ---------------------------------------------------------------- NumPy reference
def _fields(c, args, table):
    """Per element: (exponent code, its length, the rest, its length, the value sent x)."""
    weight, s1, s2, coef, thresholds, fixed = args
    bits = c.view(np.uint32)
    e = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)
    if fixed >= 0:
        level = np.full(c.shape[0], fixed, dtype=np.int64)
    else:
        E, B, D = (np.float32(v) for v in coef)
        zero = np.float32(0.0)
        sq = np.sqrt(s2) if s2 is not None else zero
        num = weight * (sq + E) + B * (s1 if s1 is not None else zero)
        an = np.abs(num)
        den = D * np.abs(c)
        level = sum((an >= np.float32(t) * den).astype(np.int64) for t in thresholds)
    nonzero = e != 0
    t = (6 * level).astype(np.uint32)
    xbits = np.where(nonzero, bits & (np.uint32(0xFFFFFFFF) << t), np.uint32(0))
    x = xbits.astype(np.uint32).view(np.float32)
    sign = (bits >> np.uint32(31)).astype(np.uint64)
    rest = (((sign << np.uint64(2)) | level.astype(np.uint64)) << (23 - t).astype(np.uint64)) \
        | ((bits & np.uint32(0x7FFFFF)) >> t).astype(np.uint64)
    rest_len = np.where(nonzero, REST_BITS - t.astype(np.int64), 0)
    return (table.code[e].astype(np.uint64), table.length[e].astype(np.int64), rest, rest_len,
            x)


def _pack(vals, lens, count):
    """The 24-bit words of `count` elements' fields (vals, lens: (count, 2)), blocks of BLOCK
    each starting a new word; (words per block, the words)."""
    blocks = -(-count // BLOCK)
    v = np.zeros((blocks * BLOCK, 2), np.uint64)
    n = np.zeros((blocks * BLOCK, 2), np.int64)
    v[:count], n[:count] = vals, lens
    per = n.reshape(blocks, 2 * BLOCK)
    ends = np.cumsum(per, axis=1)
    block_words = (ends[:, -1] + 23) // 24
    base = 24 * (np.cumsum(block_words) - block_words)
    starts = (ends - per + base[:, None]).ravel()
    v, n = v.ravel(), n.ravel()
    field = np.repeat(np.arange(n.size), n)
    k = np.arange(field.size) - np.repeat(np.cumsum(n) - n, n)
    bit = (v[field] >> (n[field] - 1 - k).astype(np.uint64)) & np.uint64(1)
    stream = np.zeros(24 * int(block_words.sum()), np.uint64)
    stream[starts[field] + k] = bit
    weights = np.left_shift(np.uint64(1), np.arange(23, -1, -1, dtype=np.uint64))
    return block_words, (stream.reshape(-1, 24) * weights).sum(axis=1)


def _windows(words):
    """Per word of a 24-bit word stream (uint64, with 3 zero words of padding): the 64 bits
    from its first bit on (that word, the next and 16 bits of the one after), for _peek."""
    return (words[:-2] << np.uint64(40)) | (words[1:-1] << np.uint64(16)) \
        | (words[2:] >> np.uint64(8))


def _peek(windows, pos, width):
    """`width` (<= 40) bits at bit positions `pos` of a 24-bit word stream, read from its
    _windows."""
    q, s = np.divmod(pos, 24)
    w64 = windows[q]
    return ((w64 >> (np.uint64(64 - width) - s.astype(np.uint64)))
            & np.uint64((1 << width) - 1)).astype(np.int64)


def _peek_every(windows, words, width):
    """_peek at every bit position of the `words` words, in order: each window shifted by
    the 24 offsets within its word."""
    shifts = np.uint64(64 - width) - np.arange(24, dtype=np.uint64)
    return ((windows[:words, None] >> shifts) & np.uint64((1 << width) - 1)).astype(
        np.int64).ravel()


def _unpack(words, starts, counts, table):
    """Decode blocks of one contiguous word stream: block b starts at word starts[b] and
    holds counts[b] values. Every record's position comes from the record lengths at all
    bit positions by pointer doubling. (values (blocks, BLOCK), exponents, end bits)."""
    max_bits = table.max_bits
    total = 24 * words.shape[0]
    padded = _windows(np.concatenate((words.astype(np.uint64), np.zeros(3, np.uint64))))
    p = np.arange(total, dtype=np.int64)
    entry = table.lut[_peek_every(padded, words.shape[0], max_bits)].astype(np.int64)
    sym, n1 = entry & 0xFF, entry >> 8
    esc = sym == ESC
    n1 = np.minimum(n1, max_bits)  # an unassigned prefix (0xFFFF) is caught below
    e = sym.copy()  # an escape's raw exponent follows its code (read where there is one)
    at = np.flatnonzero(esc)
    e[at] = _peek(padded, np.minimum(at + n1[at], total), 8)
    n_exp = n1 + 8 * esc
    level = _peek(padded, np.minimum(p + n_exp, total), 3) & 3
    rec = np.where(e == 0, n_exp, n_exp + REST_BITS - 6 * level)
    nxt = np.concatenate((np.minimum(p + rec, total), [total]))
    pos = np.zeros((starts.shape[0], BLOCK), np.int64)
    pos[:, 0] = 24 * starts
    jump, filled = nxt, 1
    while filled < BLOCK:
        take = min(filled, BLOCK - filled)
        pos[:, filled:filled + take] = jump[pos[:, :take]]
        filled += take
        if filled < BLOCK:
            jump = jump[jump]
    live = np.arange(BLOCK)[None, :] < counts[:, None]
    q = np.minimum(pos, total - 1)
    ends = nxt[pos[np.arange(starts.shape[0]), counts - 1]]
    bad_entry = (entry[q] == 0xFFFF) & live
    ex, lv = e[q], level[q]
    after = q + n_exp[q]
    sign = _peek(padded, np.minimum(after, total), 1)
    t = 6 * lv
    mant = _peek(padded, np.minimum(after + 3, total), 23) >> t  # 23 - t bits, then shifted
    xbits = (sign << 31) | (ex << 23) | (mant << t)
    x = np.where(ex == 0, 0, xbits).astype(np.uint32).view(np.float32)
    bad = (bad_entry | ((ex == 255) & live) | ((pos >= total) & live)).any(axis=1)
    return x, np.where(live, ex, -1), ends, bad


@register(reference=True)
class GCompReference(GComp):
    """The NumPy implementation of gcomp, bitwise equal to the kernels: the test oracle."""

    TRAITS = replace(GComp.TRAITS, reference=True)

    def _encode_blocks(self, grad, residual, args, stride, grad_checked):
        c = self.feedback.compensate(grad, residual)
        if not np.isfinite(grad).all():
            raise_nonfinite(grad, residual)
        if not np.isfinite(c).all():
            raise_nonfinite(grad, residual)
        code, code_len, rest, rest_len, x = _fields(c, args, self.table)
        self.feedback.update(residual, c, x)
        size = grad.shape[0]
        blocks = -(-size // BLOCK)
        scratch = np.zeros(max(1, blocks * stride), np.float32)
        words = np.zeros(blocks, np.int64)
        step = 4 * BLOCK  # blocks packed together (bounds the reference's memory)
        for lo in range(0, size, step):
            hi = min(lo + step, size)
            vals = np.stack((code[lo:hi], rest[lo:hi]), axis=1)
            lens = np.stack((code_len[lo:hi], rest_len[lo:hi]), axis=1)
            block_words, stream = _pack(vals, lens, hi - lo)
            first = lo // BLOCK
            at = 0
            for b, w in enumerate(block_words.tolist()):
                scratch[(first + b) * stride:(first + b) * stride + w] = stream[at:at + w]
                words[first + b] = w
                at += w
        self._sent_values = x
        return words, scratch

    def _assemble(self, payload, stride, words, offsets, sent, out):
        for b in range(sent):
            out[offsets[b]:offsets[b] + words[b]] = payload[b * stride:b * stride + words[b]]

    def _restore(self, payload, stride, words, first, size, residual):
        lo = first * BLOCK
        residual[lo:] += self._sent_values[lo:]

    def _decode_into(self, slots, starts, words, size, out):
        out[...] = 0.0
        histogram = np.zeros(256, dtype=np.int64)
        n_workers, blocks = starts.shape
        payload = np.concatenate((slots, np.zeros(3, np.float32)))
        bad_lanes = ~((payload >= 0) & (payload < LANE_LIMIT) & (payload == np.floor(payload)))
        bad = 0
        counts_all = np.minimum(BLOCK, size - BLOCK * np.arange(blocks))
        for j in range(n_workers):
            sent = int(np.count_nonzero(words[j]))
            for b0 in range(0, sent, 4):
                b1 = min(b0 + 4, sent)
                first = int(starts[j, b0])
                last = int(starts[j, b1 - 1] + words[j, b1 - 1])
                if bad_lanes[first:last].any():
                    bad += b1 - b0
                    continue
                stream = payload[first:last].astype(np.uint64)
                rel = starts[j, b0:b1] - first
                counts = counts_all[b0:b1]
                x, ex, ends, wrong = _unpack(stream, rel, counts, self.table)
                used = ends - 24 * rel
                wrong |= (used > 24 * words[j, b0:b1]) | (used <= 24 * (words[j, b0:b1] - 1))
                bad += int(np.count_nonzero(wrong))
                for i, b in enumerate(range(b0, b1)):
                    lo = b * BLOCK
                    out[lo:lo + counts[i]] += x[i, :counts[i]]
                histogram += np.bincount(ex[ex >= 0], minlength=256)[:256]
        if bad:
            raise ValueError("gcomp: %d blocks do not decode to their stated lengths: not a "
                             "gcomp payload of this table (corrupted data)" % bad)
        return histogram


__all__ = ["GComp", "GCompReference", "NonFiniteGradientError", "build_lengths",
           "huffman_lengths", "geometry", "layout"]
