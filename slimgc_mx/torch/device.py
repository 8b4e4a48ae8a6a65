"""Device codec for PyTorch: a lane codec's encode/decode as torch ops on the gradient's device.

The twin of MXNet's DeviceCodec (offload off, "compression on the GPU") for torch tensors:
a CUDA gradient is compensated, levelled and packed on the card, where its error-feedback
residual stays, and only the lanes cross to the host, in one copy. The lanes and the
residual are bitwise those of the Cython kernels given the same state, so some keys may
be compressed here and others on the CPU and the sums still decode exactly; the trailer
lane (1bit's scale, 4bit's group) excepted, a float64 mean summed in another order. Each
codec gives its levels once in DeviceOps (LaneCodec.device_levels, in the codec's own
file), here TorchOps;
this module compensates, feeds back, packs and unpacks. The codec instance holds the
shared state; decode() updates it exactly like LaneCodec.decode().

Host synchronisations: encode reads one value (is every grad + residual finite: the
NaN/Inf policy must raise before residual or out is touched) and copies the lanes out;
decode reads one (are the lanes in range) and copies the values out.
"""
import time
import warnings

import numpy as np
import torch

from .. import codecs
from ..codecs.base import check_num_workers, raise_nonfinite
from ..codecs.lanes import EXACT_LIMIT, ConstCache, LaneCodec

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


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


class TorchOps:
    """codecs.lanes.DeviceOps in torch ops on `device`: levels are int64 tensors."""

    def __init__(self, consts, device):
        self._consts, self._device = consts, device

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


class TorchDeviceCodec:
    """Runs `codec`'s encode/decode with torch ops; the codec keeps the shared state.

    As a key's `device` (encode_key / decode_key) it also keeps the key's residual on the
    gradient's device: see residual_to_host() for when the host copy is current.
    """

    def __init__(self, codec, copies=None):
        if not self.supports(codec):
            name = getattr(codec, "name", type(codec).__name__)
            raise ValueError("TorchDeviceCodec supports lane codecs with torch levels (1bit, "
                             "2bit, 4bit), got %r; compress it on the CPU (offload on)"
                             % (name,))
        self.codec = codec
        self.copies = copies  # a device model's copies.Copies: encode_key's work counted
        self.residual = None  # the key's residual on a CUDA device (encode_key), or None
        self.device = torch.device("cpu")  # where the last encode ran: decode_key runs there
        self._consts = ConstCache()

    @staticmethod
    def supports(codec):
        """True for a float64 lane codec with torch levels and no gathered trailer."""
        return (isinstance(codec, LaneCodec) and codec.levels is not None
                and type(codec).device_levels is not LaneCodec.device_levels
                and not codec.gathered and codec.rounds == 1
                and codec.wire_dtype == np.float64)

    def __repr__(self):
        return "TorchDeviceCodec(%r)" % (self.codec,)

    # ------------------------------------------------------------ as a key's device
    def encode_key(self, b, grad, num_workers, rank, send):
        """Encode key buffers `b`'s gradient `grad` (a tensor) into `send` (its bit_buf)."""
        if not isinstance(grad, torch.Tensor):
            raise TypeError("grad must be a torch tensor, got %s" % type(grad).__name__)
        residual = self._key_residual(b, grad.device)
        out = send.for_write()
        self.encode(grad, residual, num_workers, out=out)
        if self.copies is not None and grad.is_cuda:  # the finite check, the lanes' copy
            self.copies.counts.d2h_bytes += out.nbytes
            self.copies.counts.host_syncs += 2

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
    def encode(self, grad, residual, num_workers, out, flag=None):
        """Compensate, quantize, pack into `out` (float64 lanes); residual updated in place.

        grad: float32 tensor of any shape; residual: float32 tensor with as many elements on
        grad's device; out: a float64 tensor (any device) or NumPy array (host) of
        codec.lane_count() elements, filled by one copy. Raises NonFiniteGradientError
        before touching residual or out; with `flag` (a 0-dim tensor on grad's device) it
        writes there whether grad + residual holds NaN/Inf instead, without a host
        synchronisation, and encodes anyway (the device path reads the flag later).
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        radix, k = codec.geometry(n_workers)
        if not isinstance(grad, torch.Tensor):
            raise TypeError("grad must be a torch tensor, got %s" % type(grad).__name__)
        g = _flat(grad, "grad", np.float32)
        size = g.numel()
        if not isinstance(residual, torch.Tensor):
            raise TypeError("residual must be a torch tensor on grad's device, got %s"
                            % type(residual).__name__)
        r = _flat(residual, "residual", np.float32, size, written=True)
        n_total = codec.lane_count(size, n_workers)
        dst = _flat(out, "out", np.float64, n_total, written=True)
        device = g.device
        if r.device != device:
            raise ValueError("residual must be on grad's device %s, got %s; move it with "
                             "residual.to('%s')" % (device, r.device, device))
        n_lanes = n_total - codec.trailer_lanes
        if not size:
            if codec.trailer_lanes:
                dst.fill_(0.0)
            return out
        c = g + r
        if flag is not None:
            flag.copy_(~torch.isfinite(c).all())
        elif not bool(torch.isfinite(c).all()):  # the one host synchronisation
            raise_nonfinite(g.detach().cpu().numpy(), r.detach().cpu().numpy())
        q = codec.device_levels(c, TorchOps(self._consts, device))
        parts = []
        pad = n_lanes * k - size
        # Digits past the end are 0, as the kernels pack only the real elements; the
        # int64 products and sums are the lanes' exact integers (below 2**53).
        digits = torch.cat([q, q.new_zeros(pad)]) if pad else q
        parts.append((digits.view(n_lanes, k) * self._powers(device, radix, k))
                     .sum(dim=1).to(torch.float64))
        if codec.trailer_lanes:
            src = codec.device_statistic(g, c)
            parts.append((src.abs().to(torch.float64).sum() / size).reshape(1))
        torch.sub(c, self._own(device)[q], out=r)
        dst.copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
        return out

    # ------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, lanes_sum, size, num_workers, out, device=None, checked=True):
        """Sum over workers of the decoded values into `out` (float32, `size` elements).

        lanes_sum: float64 tensor or NumPy array of codec.lane_count() elements; out: a
        float32 tensor or NumPy array; the work runs on `device` (default: lanes_sum's,
        the CPU for NumPy). Updates the codec's shared state from the trailer lane like
        Codec.decode(); raises ValueError, writing nothing, for lanes no sum could give,
        unless checked=False (no host synchronisation: the device path's lanes are this
        codec's own, summed by the job's group).
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        radix, k = codec.geometry(n_workers)
        n_total = codec.lane_count(size, n_workers)
        x_all = _flat(lanes_sum, "lanes_sum", np.float64, n_total)
        dst = _flat(out, "out", np.float32, size, written=True)
        device = x_all.device if device is None else torch.device(device)
        n_lanes = n_total - codec.trailer_lanes
        stat = None
        if codec.trailer_lanes:
            last = float(x_all[n_total - 1])
            stat = last / n_workers
            if not (np.isfinite(stat) and stat >= 0):
                raise ValueError("%s: the trailer lane sums to %r, not a finite statistic >= 0; "
                                 "the lanes were not produced by this codec"
                                 % (codec.name, last))
        if size:
            x = x_all[:n_lanes].to(device)
            bad = ~((x >= 0) & (x < float(EXACT_LIMIT))) if checked else None  # NaN too
            if bad is not None and bool(bad.any()):
                raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's "
                                 "lanes (wrong codec, worker count or corrupted data)"
                                 % int(bad.sum()))
            xi = x.to(torch.int64).unsqueeze(1)
            d = (torch.div(xi, self._powers(device, radix, k), rounding_mode="floor")
                 % radix).reshape(-1)[:size]
            scale, a, b = codec._affine()
            # float32(double(scale) * (a*D + N*b)), the integer part exact (affine_values).
            values = ((d * a + n_workers * b).to(torch.float64) * float(scale))
            dst.copy_(values.to(torch.float32))
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
