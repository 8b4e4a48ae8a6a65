"""Device codec: a lane codec's encode/decode as MXNet NDArray operators on the gradient's context.

This is the offload=False baseline ("compress on the device"): every step is an engine op
on the gradient's own context, bitwise equal to the Cython kernels given the same state
(the trailer lane, a float mean summed in another order, excepted). Each codec gives its
levels once in DeviceOps (LaneCodec.device_levels, in the codec's own file), here
NDArrayOps; this module
compensates, feeds back, packs and unpacks. The codec instance still holds the shared
state; decode() updates it exactly like LaneCodec.decode().

Host synchronisations, both reading a single value:
  - encode: one reduction of "is every grad + residual finite" (the NaN/Inf policy must
    raise before residual or out is touched, so it cannot stay asynchronous);
  - decode: the trailer lane (1bit, 4bit), which picks the next push's scale or group.
Everything else is queued asynchronously.
"""
import math

import mxnet as mx
import numpy as np

from ..codecs.base import check_num_workers, raise_nonfinite
from ..codecs.lanes import ConstCache, LaneCodec

#: Largest finite float32: |c| <= FLT_MAX is false exactly for NaN and +-Inf (as in the kernels).
FLT_MAX = float(np.finfo(np.float32).max)


def _flat(array, name, dtype, size=None):
    """A flat view of a dense NDArray of `dtype` (optionally with `size` elements)."""
    if not isinstance(array, mx.nd.NDArray):
        raise TypeError("%s must be an mxnet NDArray, got %s" % (name, type(array).__name__))
    if array.stype != "default":
        raise TypeError("%s must be a dense NDArray, got storage %r" % (name, array.stype))
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError("%s must have dtype %s, got %s; convert with .astype('%s')"
                        % (name, np.dtype(dtype), np.dtype(array.dtype), np.dtype(dtype)))
    if size is not None and array.size != size:
        raise ValueError("%s must have %d elements, got %d" % (name, size, array.size))
    return array.reshape((-1,))


def _store(result, dst):
    """dst[:] = result (both flat), a copy across contexts when they differ."""
    if dst.context == result.context:
        dst[:] = result
    else:
        result.copyto(dst)


class NDArrayOps:
    """codecs.lanes.DeviceOps in MXNet's NDArray ops on `ctx`: levels are float32."""

    def __init__(self, consts, ctx):
        self._consts, self._ctx = consts, ctx

    @staticmethod
    def level(mask):
        return mask  # a comparison already gives float32 0 and 1

    abs = staticmethod(mx.nd.abs)

    @staticmethod
    def where(mask, a, b):
        return mx.nd.where(mask, a, b)

    @staticmethod
    def take(table, index):
        return mx.nd.take(table, index)

    def table(self, kind, params, values):
        return self._consts.get(kind, self._ctx, params, lambda: mx.nd.array(
            values, ctx=self._ctx, dtype=np.float32))


class DeviceCodec:
    """Runs `codec`'s encode/decode with NDArray ops; the codec keeps the shared state."""

    def __init__(self, codec):
        if not self.supports(codec):
            name = getattr(codec, "name", type(codec).__name__)
            raise ValueError("DeviceCodec supports lane codecs with levels (1bit, 2bit, 4bit, "
                             "...), got %r" % (name,))
        self.codec = codec
        self._consts = ConstCache()

    @staticmethod
    def supports(codec):
        """True for a lane codec with NDArray levels and no gathered trailer."""
        return (isinstance(codec, LaneCodec) and codec.levels is not None
                and type(codec).device_levels is not LaneCodec.device_levels
                and not codec.gathered and codec.rounds == 1)

    def __repr__(self):
        return "DeviceCodec(%r)" % (self.codec,)

    def encode_key(self, b, grad, num_workers, rank, send):
        """Encode key buffers `b`'s gradient `grad` (an NDArray) into `send` (its bit_buf)."""
        self.encode(grad, b.residual.nd, num_workers, out=send.nd)

    def decode_key(self, b, num_workers, recv):
        """Decode the summed lanes in `recv` (its bit_sum) into its agg; waits for the result."""
        self.decode(recv.nd, b.size, num_workers, out=b.agg.nd)
        b.agg.for_read()

    # ------------------------------------------------------------ constants
    def _const(self, kind, ctx, params, make):
        """Small constant NDArray on ctx, rebuilt only when its parameters change."""
        return self._consts.get(kind, ctx, params, make)

    def _own(self, ctx):
        """float32 table: decoded value of each level for one worker (codec.own_values())."""
        return self._const("own", ctx, self.codec._affine(),
                           lambda: mx.nd.array(self.codec.own_values(), ctx=ctx,
                                               dtype=np.float32))

    def _powers(self, ctx, radix, k):
        """(1, k) float64 row of R**j, exact since R**j <= 2**53."""
        return self._const("powers", ctx, (radix, k),
                           lambda: mx.nd.array([[float(radix ** j) for j in range(k)]],
                                               ctx=ctx, dtype=np.float64))

    # ------------------------------------------------------------ levels
    def _levels(self, c, ctx):
        """float32 level q of each compensated value: the codec's rule in NDArray ops."""
        return self.codec.device_levels(c, NDArrayOps(self._consts, ctx))

    # ------------------------------------------------------------ encode
    @staticmethod
    def _check_finite(c, g, r):
        """Raise NonFiniteGradientError when c = g + r holds NaN/Inf; one host sync.

        c . c is finite exactly when every c is (squares are >= 0, so nothing cancels),
        unless it overflows: only then is the element-wise |c| <= FLT_MAX check run.
        """
        if math.isfinite(mx.nd.dot(c, c).asscalar()):
            return
        if mx.nd.min(mx.nd.abs(c) <= FLT_MAX).asscalar() != 1:
            raise_nonfinite(g.asnumpy(), r.asnumpy())

    def encode(self, grad, residual, num_workers, out):
        """Compensate, quantize, pack into `out` (float64 lanes); residual updated in place.

        grad: float32 NDArray of any shape; residual: float32 with as many elements, on
        grad's context. Raises NonFiniteGradientError before touching residual or out.
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        radix, k = codec.geometry(n_workers)
        g = _flat(grad, "grad", np.float32)
        size = g.size
        r = _flat(residual, "residual", np.float32, size)
        n_total = codec.lane_count(size, n_workers)
        lanes_out = _flat(out, "out", np.float64, n_total)
        ctx = g.context
        if r.context != ctx:
            raise ValueError("residual must be on grad's context %s, got %s"
                             % (ctx, r.context))
        n_lanes = n_total - codec.trailer_lanes
        if size:
            c = g + r
            self._check_finite(c, g, r)
            q = self._levels(c, ctx)
            stat = None
            if codec.trailer_lanes:
                src = codec.device_statistic(g, c)
                stat = mx.nd.sum(mx.nd.abs(src).astype(np.float64))
            mx.nd.elemwise_sub(c, mx.nd.take(self._own(ctx), q), out=r)
            digits = q.astype(np.float64)
            pad = n_lanes * k - size
            if pad:
                # Digits past the end are 0, as the kernels pack only the real elements.
                digits = mx.nd.concat(digits, mx.nd.zeros((pad,), ctx=ctx, dtype=np.float64),
                                      dim=0)
            # lane = digits . (R**j): every product and partial sum is an integer < 2**53,
            # so the float64 matrix product is exact in any order (FMA included).
            digits = digits.reshape((n_lanes, k))
            col = self._powers(ctx, radix, k).reshape((k, 1))
            if lanes_out.context == ctx:
                mx.nd.dot(digits, col, out=lanes_out[:n_lanes].reshape((n_lanes, 1)))
            else:
                _store(mx.nd.dot(digits, col).reshape((-1,)), lanes_out[:n_lanes])
            if stat is not None:
                _store(stat / float(size), lanes_out[n_lanes:])
        elif codec.trailer_lanes:
            lanes_out[:] = 0.0
        return out

    # ------------------------------------------------------------ decode
    def decode(self, lanes_sum, size, num_workers, out):
        """Sum over workers of the decoded values into `out` (float32, `size` elements).

        Updates the codec's shared state from the trailer lane like Codec.decode(); that
        single value is read on the host with asscalar().
        """
        codec = self.codec
        n_workers = check_num_workers(num_workers)
        radix, k = codec.geometry(n_workers)
        n_total = codec.lane_count(size, n_workers)
        x_all = _flat(lanes_sum, "lanes_sum", np.float64, n_total)
        dst = _flat(out, "out", np.float32, size)
        n_lanes = n_total - codec.trailer_lanes
        stat = None
        if codec.trailer_lanes:
            last = x_all[n_total - 1:n_total].asscalar()
            stat = float(last) / n_workers
            if not (math.isfinite(stat) and stat >= 0):
                raise ValueError("%s: the trailer lane sums to %r, not a finite statistic >= 0; "
                                 "the lanes were not produced by this codec"
                                 % (codec.name, last))
        if size:
            ctx = x_all.context
            p = self._powers(ctx, radix, k)
            x = x_all[:n_lanes].reshape((n_lanes, 1))
            # Q_j = floor(x / R**j): the float quotient's floor is within one of the exact
            # one; fix it with exact integer products (below 2**53, or above x either way).
            quo = mx.nd.floor(mx.nd.broadcast_div(x, p))
            quo = (quo - mx.nd.broadcast_greater(mx.nd.broadcast_mul(quo, p), x)
                   + mx.nd.broadcast_lesser_equal(mx.nd.broadcast_mul(quo + 1.0, p), x))
            # digit_j = Q_j - R * Q_{j+1}, with Q_k = 0 since x < R**k.
            if k > 1:
                higher = mx.nd.slice_axis(quo, axis=1, begin=1, end=None) * float(radix)
                higher = mx.nd.concat(higher, mx.nd.zeros((n_lanes, 1), ctx=ctx,
                                                          dtype=np.float64), dim=1)
                d = quo - higher
            else:
                d = quo
            scale, a, b = codec._affine()
            scale_nd = self._const("scale", ctx, float(scale),
                                   lambda: mx.nd.array([float(scale)], ctx=ctx,
                                                       dtype=np.float64))
            # float32(double(scale) * (a*D + N*b)), the integer part exact in float64.
            sums = d.reshape((-1,))[:size] * float(a) + float(n_workers * b)
            values = mx.nd.broadcast_mul(sums, scale_nd)
            if dst.context == ctx:
                mx.nd.cast(values, dtype=np.float32, out=dst)
            else:
                _store(values.astype(np.float32), dst)
        codec._agreed(stat)
        return out


class InlineCodec:
    """Offload off for a codec without NDArray levels: its CPU kernel runs on the training
    thread, after the gradient is in grad_buf, so compression is not overlapped with
    training (what compressing on the device costs the step)."""

    def __init__(self, codec):
        self.codec = codec

    def __repr__(self):
        return "InlineCodec(%r)" % (self.codec,)

    def encode_key(self, b, grad, num_workers, rank, send):
        self.codec.encode(b.grad_buf.for_read(), b.residual.for_write(), num_workers,
                          out=send.for_write(), rank=rank)

    def decode_key(self, b, num_workers, recv):
        self.codec.decode(recv.for_read(), b.size, num_workers, out=b.agg.for_write())
