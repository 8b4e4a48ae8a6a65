"""Device codec for PyTorch: a lane codec's encode/decode as torch ops on the gradient's device.

The twin of MXNet's DeviceCodec (offload off, "compression on the GPU") for torch tensors:
a CUDA gradient is compensated, levelled and packed on the card, where its error-feedback
residual stays, and only the lanes cross to the host, in one copy. The lanes and the
residual are bitwise those of the Cython kernels given the same state, so some keys may
be compressed here and others on the CPU and the sums still decode exactly; the trailer
lane (1bit's scale, 4bit's group) excepted, a float64 mean summed in another order. Each
codec gives its levels once in DeviceOps (LaneCodec.device_levels, in the codec's own
file), here TorchOps; a codec with gathered values (terngrad, qsgd, thc) gives its whole
push there (LaneCodec.device_state ... device_agree), its gathered values bitwise the
kernel's too (their sums added in the kernels' order, its random draws the kernels' RNG).
This module compensates, feeds back, packs and unpacks. The codec instance holds the
shared state; decode() updates it exactly like LaneCodec.decode() (a gathered codec's may
stay on the device instead: TorchDeviceCodec). randomk sends float32 values, not lanes:
its device_encode and device_decode (codecs/randomk.py) run here alike.

Host synchronisations: encode reads one value (is every grad + residual finite: the
NaN/Inf policy must raise before residual or out is touched; thc's rotation a second: is
it finite) and copies the lanes out; decode reads one (are the lanes in range; the
gathered values too) and copies the values out. With encode's `flag` and decode's
checked=False (the device path) neither reads anything, 1bit's and 4bit's trailer apart.
"""
import time
import warnings

import numpy as np
import torch

from .. import codecs
from ..codecs import rng
from ..codecs.base import check_num_workers, raise_nonfinite
from ..codecs.lanes import EXACT_LIMIT, ConstCache, LaneCodec
from ..codecs.layout import CHUNK_LANES

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
#: Elements per piece where encode and decode run a large tensor piece by piece: their
#: int64 temporaries (about 28 bytes per element) stay near 0.2 GB whatever the tensor's
#: size, which matters where a bucket's pass runs beside backward's activations.
PIECE_ELEMENTS = 1 << 23


def _flat(x, name, dtype, size=None, written=False):
    """A flat torch view of `x` (a torch tensor, or a NumPy array on the host) of `dtype`,
    optionally of `size` elements; `written`: results are written through the view."""
    want = np.dtype(dtype)
    if isinstance(x, np.ndarray):
        if x.dtype != want:
            raise TypeError("%s must have dtype %s, got %s; convert with .astype(np.%s)"
                            % (name, want, x.dtype, want))
        if not x.flags.c_contiguous:
            raise TypeError("%s must be C-contiguous; pass np.ascontiguousarray(%s)"
                            % (name, name))
        if written and not x.flags.writeable:
            raise TypeError("%s is read-only, and the result is written into it" % name)
        with warnings.catch_warnings():  # a read-only input is only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(x.reshape(-1))
    elif isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError("%s must be a dense tensor, got layout %s; pass %s.to_dense()"
                            % (name, x.layout, name))
        if x.dtype != _DTYPES[want]:
            raise TypeError("%s must have dtype %s, got %s; convert with .to(torch.%s)"
                            % (name, _DTYPES[want], x.dtype, want))
        if written and not x.is_contiguous():
            raise TypeError("%s must be contiguous: the result is written into it in place"
                            % name)
        t = x.reshape(-1)
    else:
        raise TypeError("%s must be a torch tensor or a NumPy array, got %s"
                        % (name, type(x).__name__))
    if size is not None and t.numel() != size:
        raise ValueError("%s must have %d elements, got %d" % (name, size, t.numel()))
    return t


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _signed(x):
    """The int64 whose bits are those of the uint64 x."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _srl(x, s):
    """Logical right shift of int64 bits: the arithmetic shift with the sign bits masked off."""
    return (x >> s) & ((1 << (64 - s)) - 1)


_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLDEN = _signed(rng._GOLDEN)


def _mix64(x):
    """rng._hash (SplitMix64's finalizer) on int64 tensors: int64 products wrap as uint64's."""
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


class TorchOps:
    """codecs.lanes.DeviceOps in torch ops on `device`: levels are int64 tensors.

    Float arithmetic stays in the dtype of its operands, one rounding per op as in the
    kernels (eager torch fuses nothing); a division is always of two device tensors (CUDA
    multiplies by the reciprocal of a host scalar). Ordered sums rely on torch.cumsum along
    a dimension that is not the last: a plain loop per column on the CPU and in ATen's CUDA
    scan of an outer dimension, so each sum is added in order as the kernels add it.
    """

    def __init__(self, consts, device, state=None, k=None):
        self._consts, self._device = consts, device
        self.state, self.k = state, k

    @staticmethod
    def level(mask):
        return mask.long()

    abs = staticmethod(torch.abs)
    where = staticmethod(torch.where)

    @staticmethod
    def take(table, index):
        return table[index]

    def table(self, kind, params, values):
        return self._consts.get(kind, self._device, params, lambda: torch.tensor(
            values, dtype=torch.int64, device=self._device))

    # -- the gathered codecs' ops
    def array(self, values, dtype):
        values = np.asarray(values, dtype=dtype)
        if not values.any():  # made on the device: no copy (the first push's zeros)
            return torch.zeros(values.shape, dtype=_DTYPES[values.dtype], device=self._device)
        return torch.as_tensor(values, device=self._device)

    def _tensor(self, x, like):
        if isinstance(x, torch.Tensor):
            return x
        return torch.full((), x, dtype=like.dtype, device=like.device)

    def divide(self, a, b):
        if not isinstance(a, torch.Tensor):
            a = self._tensor(a, b)
        return torch.div(a, self._tensor(b, a))

    def minimum(self, a, b):
        return torch.minimum(a, self._tensor(b, a))

    def maximum(self, a, b):
        return torch.maximum(a, self._tensor(b, a))

    copysign = staticmethod(torch.copysign)
    floor = staticmethod(torch.floor)
    sqrt = staticmethod(torch.sqrt)
    stack = staticmethod(torch.stack)

    @staticmethod
    def max(x, axis=None):
        return torch.amax(x) if axis is None else torch.amax(x, dim=axis)

    @staticmethod
    def float32(x):
        return x.to(torch.float32)

    @staticmethod
    def float64(x):
        return x.to(torch.float64)

    @staticmethod
    def to_level(x):
        return x.to(torch.int64)

    @staticmethod
    def to_host(x):
        return x.detach().cpu().numpy()

    def arange(self, count):
        return torch.arange(count, dtype=torch.int64, device=self._device)

    @staticmethod
    def pad(x, count):
        n = x.shape[0]
        return torch.cat([x, x.new_zeros(count - n)]) if count > n else x

    @staticmethod
    def repeat(x, times, count):
        return x.repeat_interleave(times)[:count]

    def scatter(self, count, index, values):
        out = values.new_zeros(count)
        out[index] = values
        return out

    def uniform(self, seed, count):
        """rng.uniform(seed, 0, count): one hash per pair of elements, its bits 0..23 for
        the even element and 40..63 for the odd one, times 2**-24."""
        pairs = self.arange(-(-count // 2))
        h = _mix64(_signed(seed) + pairs * _GOLDEN)
        drawn = torch.stack((h & 0xFFFFFF, _srl(h, 40)), dim=1).reshape(-1)[:count]
        return drawn.to(torch.float32) * (2.0 ** -24)

    @staticmethod
    def run_sums(x, run, width):
        rows = -(-x.shape[0] // width)
        runs = -(-rows // run)
        x = TorchOps.pad(x.reshape(-1), runs * run * width).view(runs, run, width)
        if runs * width == 1:  # a scan over every element would be CUDA's parallel one
            x = torch.cat([x, torch.zeros_like(x)], dim=2)
        return torch.cumsum(x, dim=1)[:, -1, :width]

    def chunk_sums(self, columns, k):
        n, w = columns.shape
        if n == 0:
            return columns.new_zeros(w)
        parts = self.run_sums(columns.reshape(-1), CHUNK_LANES * k, w)
        return self.run_sums(parts.reshape(-1), parts.shape[0], w)[0]

    @staticmethod
    def butterfly(x, h):
        v = x.view(-1, 2, h)
        a, b = v[:, 0, :], v[:, 1, :]
        return torch.stack((a + b, a - b), dim=1).reshape(-1)


class TorchDeviceCodec:
    """Runs `codec`'s encode/decode with torch ops; the codec keeps the shared state.

    As a key's `device` (encode_key / decode_key) it also keeps the key's residual on the
    gradient's device: see residual_to_host() for when the host copy is current.

    A codec with gathered values (terngrad's and thc's maximum, qsgd's norms) gets its next
    push's state from the summed slots. decode() with checked=True reads them to the host
    and sets the codec's state as Codec.decode() does; with checked=False (the device path)
    the state stays a device tensor that the next encode reads, no host synchronisation,
    and the codec's own copy of it is brought up to date only by state_dict() (a host
    read, at a checkpoint).
    """

    rounds = 1  # one summed exchange per push (lowrank.TorchPowerSGD has two)

    def __init__(self, codec, copies=None):
        if not self.supports(codec):
            name = getattr(codec, "name", type(codec).__name__)
            raise ValueError("TorchDeviceCodec supports lane codecs with torch levels (1bit, "
                             "2bit, 4bit, terngrad, qsgd, thc, randomk), got %r; compress it on "
                             "the CPU (offload on)" % (name,))
        self.codec = codec
        self.copies = copies  # a device model's copies.Copies: encode_key's work counted
        self.residual = None  # the key's residual on a CUDA device (encode_key), or None
        self.device = torch.device("cpu")  # where the last encode ran: decode_key runs there
        self._consts = ConstCache()
        self._state = None  # a gathered codec's shared state on the device, or None
        self._stale = False  # the codec's host state lags self._state (device_agree's)
        self.encode_syncs = 0  # host synchronisations of the last encode (finite checks)

    @staticmethod
    def supports(codec):
        """True for a float64 lane codec with torch levels (its gathered values, if any,
        agreed on the device: device_agree), or a codec whose one summed round of values
        has device_encode and device_decode (randomk)."""
        if isinstance(codec, LaneCodec):
            return (codec.levels is not None
                    and type(codec).device_levels is not LaneCodec.device_levels
                    and (not codec.gathered
                         or type(codec).device_agree is not LaneCodec.device_agree)
                    and codec.rounds == 1 and codec.wire_dtype == np.float64)
        return (callable(getattr(codec, "device_encode", None))
                and callable(getattr(codec, "device_decode", None))
                and getattr(codec, "rounds", None) == 1
                and getattr(codec, "wire_dtype", None) in _DTYPES)

    def __repr__(self):
        return "TorchDeviceCodec(%r)" % (self.codec,)

    # ------------------------------------------------------------ shared state
    def state_dict(self):
        """The codec's state_dict(), its gathered state first read from the device where
        decode kept it there (one host synchronisation)."""
        if self._stale:
            self.codec.adopt_device_state(self._state.detach().cpu().numpy())
            self._stale = False
        return self.codec.state_dict()

    def load_state_dict(self, state):
        """The codec's load_state_dict(); the next encode takes the state from it."""
        self.codec.load_state_dict(state)
        self._state, self._stale = None, False

    def _device_state(self, size, device):
        """The shared state of the next push on `device` (a gathered codec's), or None."""
        if self._state is not None and self._stale:
            if self._state.device != device:
                self._state = self._state.to(device)
            return self._state
        return self.codec.device_state(size, TorchOps(self._consts, device))

    # ------------------------------------------------------------ as a key's device
    def encode_key(self, b, grad, num_workers, rank, send):
        """Encode key buffers `b`'s gradient `grad` (a tensor) into `send` (its bit_buf)."""
        if not isinstance(grad, torch.Tensor):
            raise TypeError("grad must be a torch tensor, got %s" % type(grad).__name__)
        residual = self._key_residual(b, grad.device)
        out = send.for_write()
        self.encode(grad, residual, num_workers, out=out, rank=rank)
        if self.copies is not None and grad.is_cuda:  # the finite checks, the lanes' copy
            self.copies.counts.d2h_bytes += out.nbytes
            self.copies.counts.host_syncs += self.encode_syncs + 1

    def decode_key(self, b, num_workers, recv):
        """Decode the summed lanes in `recv` (its bit_sum) into its agg, on the device of
        the key's last encode; returns once agg holds the values."""
        self.decode(recv.for_read(), b.size, num_workers, out=b.agg.for_write(),
                    device=self.device)

    def residual_to_host(self, b):
        """Write the key's device residual into b.residual (host) and let go of it.

        Call it before the engine reads or writes b.residual on the host (a full-precision
        push flushes it, a checkpoint saves or loads it): until then the host copy is stale
        for a CUDA gradient. The next encode_key copies it back to the device. A CPU
        gradient's residual is b.residual itself, always current.
        """
        if self.residual is None:
            return
        host = b.residual.for_write().reshape(-1)[:b.size]
        torch.from_numpy(host).copy_(self.residual)
        self.residual = None

    def _key_residual(self, b, device):
        """The key's residual on `device`: b.residual itself on the CPU, else a device copy
        made from it once (and kept)."""
        self.device = device
        if self.residual is not None and self.residual.device == device:
            return self.residual
        self.residual_to_host(b)  # the gradient moved: carry its error feedback along
        host = torch.from_numpy(b.residual.for_write().reshape(-1)[:b.size])
        if device.type == "cpu":
            return host
        self.residual = host.to(device)
        return self.residual

    # ------------------------------------------------------------ constants
    def _const(self, kind, device, params, make):
        """Small constant tensor on `device`, rebuilt only when its parameters change."""
        return self._consts.get(kind, device, params, make)

    def _own(self, device):
        """float32 table: decoded value of each level for one worker (codec.own_values())."""
        return self._const("own", device, self.codec._affine(),
                           lambda: torch.from_numpy(self.codec.own_values().copy()).to(device))

    def _powers(self, device, radix, k):
        """int64 R**j for j < k (exact: R**j <= 2**53)."""
        return self._const("powers", device, (radix, k),
                           lambda: torch.tensor([radix ** j for j in range(k)],
                                                dtype=torch.int64, device=device))

    # ------------------------------------------------------------ encode
    @torch.no_grad()
    def encode(self, grad, residual, num_workers, out, flag=None, rank=0, on_piece=None):
        """Compensate, quantize, pack into `out` (float64 lanes); residual updated in place.

        grad: float32 tensor of any shape; residual: float32 tensor with as many elements on
        grad's device; out: a float64 tensor (any device) or NumPy array (host) of
        codec.lane_count() elements, filled by one copy. Raises NonFiniteGradientError
        before touching residual or out; with `flag` (a 0-dim tensor on grad's device) it
        writes there whether grad + residual (or thc's rotation of it) holds NaN/Inf
        instead, without a host synchronisation, and encodes anyway (the device path reads
        the flag later). rank: this worker's slot of gathered values. on_piece(lo, hi):
        called once the lanes lo..hi of a tensor encoded piece by piece are written (the
        device path starts their sum while the next piece encodes); never for one encoded
        whole.
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        lanes = isinstance(codec, LaneCodec)
        radix, k = codec.geometry(n_workers) if lanes else (None, None)
        if not isinstance(grad, torch.Tensor):
            raise TypeError("grad must be a torch tensor, got %s" % type(grad).__name__)
        g = _flat(grad, "grad", np.float32)
        size = g.numel()
        if not isinstance(residual, torch.Tensor):
            raise TypeError("residual must be a torch tensor on grad's device, got %s"
                            % type(residual).__name__)
        r = _flat(residual, "residual", np.float32, size, written=True)
        n_total = codec.lane_count(size, n_workers)
        dst = _flat(out, "out", codec.wire_dtype, n_total, written=True)
        device = g.device
        if r.device != device:
            raise ValueError("residual must be on grad's device %s, got %s; move it with "
                             "residual.to('%s')" % (device, r.device, device))
        if not lanes:
            return self._encode_values(g, r, out, dst, flag)
        t = codec.gathered_count(size)
        if t and not 0 <= rank < n_workers:
            raise ValueError("rank must be in 0..%d, got %r" % (n_workers - 1, rank))
        n_lanes = n_total - codec.trailer_lanes - n_workers * t
        if not size:
            if codec.trailer_lanes or t:  # every statistic of no element is 0
                dst.fill_(0.0)
            return out
        pieces = _pieces(codec, size, n_workers, n_lanes, k) if flag is not None else None
        if pieces is not None:
            return self._encode_pieces(g, r, out, dst, flag, pieces, radix, k, on_piece)
        c = g + r
        bad = ~torch.isfinite(c).all()
        self.encode_syncs = 0
        if flag is None:
            self.encode_syncs += 1
            if bool(bad):  # the one host synchronisation
                raise_nonfinite(g.detach().cpu().numpy(), r.detach().cpu().numpy())
        ops = TorchOps(self._consts, device, self._device_state(size, device), k)
        x = codec.device_transform(c, ops)
        if x is not None:  # thc's rotation: finite values may overflow in it
            bad_x = ~torch.isfinite(x).all()
            if flag is None:
                self.encode_syncs += 1  # a second one
                if bool(bad_x):
                    codec.transform_overflow(g.detach().cpu().numpy(),
                                             r.detach().cpu().numpy())
            bad = bad | bad_x
        else:
            x = c
        if flag is not None:
            flag.copy_(bad)
        q = codec.device_levels(x, ops)
        parts = []
        parts.append(_pack(q, n_lanes, k, self._powers(device, radix, k)))
        if codec.trailer_lanes:
            src = codec.device_statistic(g, c)
            parts.append((src.abs().to(torch.float64).sum() / size).reshape(1))
        if t:
            slots = torch.zeros(n_workers * t, dtype=torch.float64, device=device)
            slots[rank * t:(rank + 1) * t] = codec.device_gathered(g, x, ops)
            parts.append(slots)
        sent = codec.device_sent(x, q, ops)
        if sent is None:
            sent = self._own(device)[q]
        if x is not c:
            sent = codec.device_untransform(sent, size, ops)
        torch.sub(c, sent, out=r)
        dst.copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
        return out

    def _encode_pieces(self, g, r, out, dst, flag, pieces, radix, k, on_piece=None):
        """encode() of a codec that encodes element by element (2bit) with a flag (the
        device path: it encodes anyway), piece by piece: the same lanes and residual, bit
        for bit, with one piece's temporaries live at a time; on_piece(lane_lo, lane_hi)
        after each piece's lanes."""
        codec, device = self.codec, g.device
        ops = TorchOps(self._consts, device, None, k)
        powers, own = self._powers(device, radix, k), self._own(device)
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for (lane_lo, lane_hi), (lo, hi) in pieces:
            c = g[lo:hi] + r[lo:hi]
            bad |= ~torch.isfinite(c).all()
            q = codec.device_levels(c, ops)
            dst[lane_lo:lane_hi].copy_(_pack(q, lane_hi - lane_lo, k, powers))
            torch.sub(c, own[q], out=r[lo:hi])
            if on_piece is not None:
                on_piece(lane_lo, lane_hi)
        flag.copy_(bad)
        self.encode_syncs = 0
        return out

    def _encode_values(self, g, r, out, dst, flag):
        """encode() of a codec that sends values (randomk): device_encode's values into dst,
        the residual c - what they send."""
        self.encode_syncs = 0
        if not g.numel():
            return out
        c = g + r
        bad = ~torch.isfinite(c).all()
        if flag is not None:
            flag.copy_(bad)
        else:
            self.encode_syncs += 1
            if bool(bad):  # the one host synchronisation
                raise_nonfinite(g.detach().cpu().numpy(), r.detach().cpu().numpy())
        values, sent = self.codec.device_encode(c, TorchOps(self._consts, g.device))
        torch.sub(c, sent, out=r)
        dst.copy_(values)
        return out

    # ------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, lanes_sum, size, num_workers, out, device=None, checked=True):
        """Sum over workers of the decoded values into `out` (float32, `size` elements).

        lanes_sum: float64 tensor or NumPy array of codec.lane_count() elements; out: a
        float32 tensor or NumPy array; the work runs on `device` (default: lanes_sum's,
        the CPU for NumPy). Updates the codec's shared state from the trailer like
        Codec.decode(); raises ValueError, writing nothing, for lanes no sum could give,
        unless checked=False (no host synchronisation: the device path's lanes are this
        codec's own, summed by the job's group; a gathered codec's next state then stays
        on the device, see the class).
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        n_total = codec.lane_count(size, n_workers)
        x_all = _flat(lanes_sum, "lanes_sum", codec.wire_dtype, n_total)
        dst = _flat(out, "out", np.float32, size, written=True)
        device = x_all.device if device is None else torch.device(device)
        if not isinstance(codec, LaneCodec):  # values (randomk): scattered where they came
            if size:
                dst.copy_(codec.device_decode(x_all.to(device), size,
                                              TorchOps(self._consts, device)))
            codec.pushes += 1
            return out
        radix, k = codec.geometry(n_workers)
        t = codec.gathered_count(size)
        n_lanes = n_total - codec.trailer_lanes - n_workers * t
        stat = None
        if codec.trailer_lanes:
            last = float(x_all[n_total - 1])
            stat = last / n_workers
            if not (np.isfinite(stat) and stat >= 0):
                raise ValueError("%s: the trailer lane sums to %r, not a finite statistic >= 0; "
                                 "the lanes were not produced by this codec"
                                 % (codec.name, last))
        gathered = None
        if t:
            gathered = x_all[n_lanes:].to(device).view(n_workers, t)
            if checked:
                stat = gathered.cpu().numpy()
                if not np.isfinite(stat).all():
                    raise ValueError("%s: the gathered trailer holds NaN/Inf; the lanes were "
                                     "not produced by this codec" % codec.name)
        ops = TorchOps(self._consts, device, None, k)
        if size:
            x = x_all[:n_lanes].to(device)
            bad = ~((x >= 0) & (x < float(EXACT_LIMIT))) if checked else None  # NaN too
            if bad is not None and bool(bad.any()):
                raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's "
                                 "lanes (wrong codec, worker count or corrupted data)"
                                 % int(bad.sum()))
            powers = self._powers(device, radix, k)
            if not codec.gathered:  # the affine codecs, piece by piece: one piece's temporaries
                scale, a, b = codec._affine()
                step = max(1, PIECE_ELEMENTS // k)
                for lo in range(0, n_lanes, step):
                    hi = min(lo + step, n_lanes)
                    d = _digits(x[lo:hi], powers, radix)
                    m = min(hi * k, size) - lo * k
                    # float32(double(scale) * (a*D + N*b)), the integer part exact
                    # (affine_values).
                    dst[lo * k:lo * k + m].copy_(
                        ((d[:m] * a + n_workers * b).to(torch.float64) * float(scale))
                        .to(torch.float32))
            else:
                ops.state = self._device_state(size, device)
                d = _digits(x, powers, radix)[:codec.levelled_count(size)]
                values = codec.device_untransform(codec.device_values(d, n_workers, ops),
                                                  size, ops)
                dst.copy_(values.to(torch.float32))
        return self._agree_after_decode(gathered, checked, stat, ops, out)

    def _agree_after_decode(self, gathered, checked, stat, ops, out):
        """The codec's shared state after a decode: a gathered codec's from its summed slots
        (kept on the device unless checked), the trailer's statistic otherwise."""
        codec = self.codec
        if gathered is not None and not checked:
            self._state, self._stale = codec.device_agree(gathered, ops), True
            codec._agreed(None)  # the push counted; the state is self._state
        else:
            if gathered is not None:
                self._state, self._stale = None, False  # the host's from here on
            codec._agreed(stat)
        return out


def benchmark(codec_name, numel, device="cpu", num_workers=2, repeats=20, warmup=3):
    """Median seconds per encode and per decode of `numel` elements on `device`.

    The gradient is N(0, 0.1) on the device; the lanes go to (pinned, for CUDA) host memory
    as a key's bit_buf would; decode reads the N workers' sum (here N copies of one
    worker's lanes) from the host and writes the values to the host.
    Returns {"encode": seconds, "decode": seconds}.
    """
    dev = torch.device(device)
    codec = TorchDeviceCodec(codecs.create(codec_name))
    gen = torch.Generator().manual_seed(0)
    grad = (0.1 * torch.randn(int(numel), generator=gen)).to(dev)
    residual = torch.zeros(int(numel), dtype=torch.float32, device=dev)
    pin = dev.type == "cuda"
    n_total = codec.codec.lane_count(int(numel), num_workers)
    lanes = torch.empty(n_total, dtype=torch.float64, pin_memory=pin).numpy()
    agg = torch.empty(int(numel), dtype=torch.float32, pin_memory=pin).numpy()
    state = codec.codec.state_dict()  # decode moves it (4bit's group: the lane count)

    def timed(fn, setup=None):
        times = []
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            _sync(dev)
            start = time.perf_counter()
            fn()
            _sync(dev)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return float(np.median(times))

    encode = timed(lambda: codec.encode(grad, residual, num_workers, out=lanes))
    total = lanes * num_workers  # N equal workers: digit sums N*q < R, exact

    decode = timed(lambda: codec.decode(total, int(numel), num_workers, out=agg, device=dev),
                   setup=lambda: codec.codec.load_state_dict(state))
    return {"encode": encode, "decode": decode}


def _pack(levels, n_lanes, k, powers):
    """`n_lanes` float64 lanes of k base-radix digits each (`powers`: radix**j), lowest
    first. Digits past the end are 0, as the kernels pack only the real elements; the int64
    products and sums are the lanes' exact integers (below 2**53)."""
    pad = n_lanes * k - levels.numel()
    digits = torch.cat([levels, levels.new_zeros(pad)]) if pad else levels
    return (digits.view(n_lanes, k) * powers).sum(dim=1).to(torch.float64)


def _digits(lanes, powers, radix):
    """Each lane's k base-`radix` digits, lowest first, flat (int64)."""
    xi = lanes.to(torch.int64).unsqueeze(1)
    return (torch.div(xi, powers, rounding_mode="floor") % radix).reshape(-1)


def _pieces(codec, size, num_workers, n_lanes, k):
    """((lane_lo, lane_hi), (lo, hi)) pieces of about PIECE_ELEMENTS elements for a codec
    that encodes element by element (Codec.piece_elements), or None: one piece would do, or
    the codec's values depend on more than each element's own."""
    if size <= PIECE_ELEMENTS:
        return None
    step = max(1, PIECE_ELEMENTS // k)
    bounds = [(lo, min(lo + step, n_lanes)) for lo in range(0, n_lanes, step)]
    elements = codec.piece_elements(size, num_workers, bounds)
    return None if elements is None else list(zip(bounds, elements))
