"""powersgd (Vogels et al. 2019): rank-r approximation of each matrix gradient, warm-started,
in two summed float32 rounds per step, with error feedback.

Matrix view: M = g + r as shape[0] x (the rest), the key's shape as wire_rounds gets it.
Round 0 sends P = M Q; every worker orthonormalizes the summed P alike (P_hat, float64
Gram-Schmidt with sums in a fixed order); round 1 (next_round) sends Q_j = M^T P_hat and
leaves M - P_hat Q_j^T in the residual; decode gives P_hat Q_sum^T and keeps Q_sum as the
next step's Q (warm start; the first Q, and any column that sums to zeros, is drawn from
the push's seed). The matrix products are BLAS calls (the same in the reference); the
per-element passes are kernels. A tensor with fewer than two dimensions, or whose rank-r
factors would be no smaller than it, goes full precision (compresses()).
"""
import math

import numpy as np

from . import rng
from .base import (Codec, NonFiniteGradientError, Option, Traits, check_disjoint,
                   check_num_workers, check_vector, kernels, output, raise_nonfinite)
from .registry import register


def _ordered_dot(x, y):
    """sum(x * y) of float64 vectors, added in element order (the same on every machine)."""
    return float(np.cumsum(x * y)[-1]) if x.size else 0.0


def orthonormalize(p):
    """Orthonormal columns spanning those of p (n, r) float32, as float32 (n, r).

    Modified Gram-Schmidt in float64 with sums in element order, so every worker turns
    the same summed P into the same P_hat bit for bit; a column with nothing left after
    the projections becomes zeros.
    """
    cols = p.T.astype(np.float64)  # (r, n): column t is row t
    for t in range(cols.shape[0]):
        v = cols[t]
        for s in range(t):
            v -= _ordered_dot(cols[s], v) * cols[s]
        norm = math.sqrt(_ordered_dot(v, v))
        if norm > 0:
            v /= norm
        else:
            v.fill(0.0)
    return np.ascontiguousarray(cols.T, dtype=np.float32)


@register
class PowerSGD(Codec):
    """P then Q, each summed in float32; the shared Q is the last step's summed Q."""

    name = "powersgd"
    wire_dtype = np.dtype(np.float32)
    rounds = 2
    options = {"rank": Option(int, 4, lambda v: 1 <= v <= 1024, "an integer in 1..1024")}

    def __init__(self, threshold=None, num_threads=None, **options):
        super().__init__(threshold=threshold, num_threads=num_threads, **options)
        self.matrix = None  # (n, m): this key's matrix view, fixed by wire_rounds
        self.q = None  # (m, r) float32: the shared Q of the next step
        self._m = None  # the residual array holding M between encode and next_round
        self._p_hat = None  # (n, r) float32 of the step in flight
        self._stage = 0  # 1 after encode, 2 after next_round

    # ------------------------------------------------------------ shape
    def view(self, shape):
        """(n, m, r) of a tensor of `shape`: rows, columns and the rank used, or None when
        it has fewer than two dimensions (or no elements)."""
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or not all(shape):
            return None
        n, m = shape[0], int(np.prod(shape[1:]))
        return n, m, min(self.rank, n, m)

    def compresses(self, shape):
        """True for a matrix whose rank-r factors are smaller than it: r (n + m) < n m."""
        v = self.view(shape)
        return v is not None and v[2] * (v[0] + v[1]) < v[0] * v[1]

    def _matrix(self, size):
        """(n, m, r) of this key, checked against `size` elements."""
        if self.matrix is None:
            raise ValueError("codec 'powersgd' needs the tensor's shape: call wire_rounds(size, "
                             "shape, num_workers) first (the kvstore does, once per key)")
        n, m = self.matrix
        if size != n * m:
            raise ValueError("codec 'powersgd' serves a %dx%d matrix (%d elements), got %r "
                             "elements" % (n, m, n * m, size))
        return n, m, min(self.rank, n, m)

    # ------------------------------------------------------------ the wire
    def wire_rounds(self, size, shape, num_workers):
        """Two 'sum' rounds of float32: P (n*r), then Q (m*r). Fixes this instance's matrix."""
        check_num_workers(num_workers)
        if int(np.prod(tuple(shape))) != size:
            raise ValueError("shape %s does not hold %r elements" % (tuple(shape), size))
        if not self.compresses(shape):
            raise ValueError("codec 'powersgd' sends a tensor of shape %s in full precision "
                             "(fewer than two dimensions, or rank-%d factors no smaller than "
                             "the matrix): route it to fp_buf (compresses() is False)"
                             % (tuple(shape), self.rank))
        n, m, r = self.view(shape)
        if self.matrix is not None and self.matrix != (n, m):
            raise ValueError("one powersgd instance serves one key (a %dx%d matrix), not "
                             "%dx%d; use clone()" % (self.matrix + (n, m)))
        self.matrix = (n, m)
        return [("sum", (n * r,), (n * r,), self.wire_dtype),
                ("sum", (m * r,), (m * r,), self.wire_dtype)]

    def lane_count(self, size, num_workers):
        """float32 values sent per step, both rounds: r (n + m)."""
        check_num_workers(num_workers)
        n, m, r = self._matrix(size)
        return r * (n + m)

    def wire_bits_per_element(self, num_workers, shape=None):
        """32 r (n + m) / (n m) for `shape` or this key's matrix, independent of N; NaN
        while neither is known (the bits depend on the matrix)."""
        check_num_workers(num_workers)
        if shape is not None:
            if not self.compresses(shape):
                return 32.0  # sent in full precision
            v = self.view(shape)
        elif self.matrix is not None:
            v = self.matrix + (min(self.rank, *self.matrix),)
        else:
            return math.nan
        n, m, r = v
        return 32.0 * r * (n + m) / (n * m)

    # ------------------------------------------------------------ a step
    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0):
        """Round 0: residual = M = grad + residual, out = P = M Q (n*r float32).

        NaN/Inf in grad raise before anything is written (unless grad_checked); a
        non-finite M raises after residual was written, as for the lane codecs.
        """
        check_num_workers(num_workers)
        check_vector("grad", grad, np.float32)
        n, m, r = self._matrix(grad.shape[0])
        check_vector("residual", residual, np.float32, writeable=True, length=n * m)
        out = output(out, n * r, self.wire_dtype)
        check_disjoint(grad=grad, residual=residual, out=out)
        if self.q is None:
            self.q = np.empty((m, r), dtype=np.float32)
            self._draw(range(r))
        self._stage = 0
        self._compensate(grad, residual, out, grad_checked)
        np.matmul(residual.reshape(n, m), self.q, out=out.reshape(n, r))
        self._m, self._stage = residual, 1
        return out

    def next_round(self, done, result, send, num_workers):
        """Round 1: P_hat = orthonormalize(P summed); send = Q_j = M^T P_hat; the residual
        becomes M - P_hat Q_j^T."""
        check_num_workers(num_workers)
        if done != 0 or self._stage != 1:
            raise ValueError("codec 'powersgd': next_round(0, ...) follows encode; got done=%r "
                             "at stage %d" % (done, self._stage))
        n, m, r = self._matrix(self._m.shape[0])
        check_vector("result", result, self.wire_dtype, length=n * r)
        check_vector("send", send, self.wire_dtype, writeable=True, length=m * r)
        if not np.isfinite(result).all():
            raise NonFiniteGradientError("codec 'powersgd': the summed P holds NaN/Inf; "
                                         "nothing was sent for Q")
        self._p_hat = orthonormalize(result.reshape(n, r))
        qj = send.reshape(m, r)
        np.matmul(self._m.reshape(n, m).T, self._p_hat, out=qj)
        self._outer(self._m, self._p_hat, qj, subtract=True)
        self._m, self._stage = None, 2
        return send

    def decode(self, wire_sum, size, num_workers, out=None):
        """P_hat Q_sum^T, float32 (size,); Q_sum becomes the next step's Q on every worker."""
        check_num_workers(num_workers)
        n, m, r = self._matrix(size)
        check_vector("wire_sum", wire_sum, self.wire_dtype, length=m * r)
        if self._stage != 2:
            raise ValueError("codec 'powersgd': decode needs the step's P round first "
                             "(encode, then next_round)")
        if not np.isfinite(wire_sum).all():
            raise ValueError("codec 'powersgd': the summed Q holds NaN/Inf")
        out = output(out, size, np.float32)
        check_disjoint(wire_sum=wire_sum, out=out)
        q_sum = wire_sum.reshape(m, r)
        self._outer(out, self._p_hat, q_sum, subtract=False)
        self.q = q_sum.copy()
        self._draw(np.flatnonzero(~self.q.any(axis=0)))
        self.pushes += 1
        return out

    def _draw(self, columns):
        """Columns of Q from the push's seed, uniform in [-0.5, 0.5): the first Q, and a
        column that summed to zeros (it would stay zero forever)."""
        m = self.q.shape[0]
        for t in columns:
            self.q[:, t] = rng.uniform(self.push_seed(), int(t) * m, m) - np.float32(0.5)

    # ------------------------------------------------------------ state
    def state_dict(self):
        state = super().state_dict()
        state["matrix"] = list(self.matrix) if self.matrix is not None else None
        state["q"] = self.q.copy() if self.q is not None else None
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        matrix = state.get("matrix")
        matrix = tuple(int(d) for d in matrix) if matrix is not None else None
        if matrix is not None and self.matrix is not None and matrix != self.matrix:
            raise ValueError("powersgd state of a %dx%d matrix cannot load into a %dx%d one"
                             % (matrix + self.matrix))
        q = state.get("q")
        if q is not None:
            q = np.asarray(q)
            shape = (matrix[1], min(self.rank, *matrix)) if matrix is not None else None
            if q.dtype != np.float32 or q.shape != shape or not np.isfinite(q).all():
                raise ValueError("powersgd state: q must be a finite float32 array of shape "
                                 "%s, got %s %s" % (shape, q.dtype, q.shape))
            q = q.copy()
        self.matrix = matrix if matrix is not None else self.matrix
        self.q = q
        self._m, self._p_hat, self._stage = None, None, 0

    # ------------------------------------------------------------ kernels (Cython)
    def _compensate(self, grad, residual, out, grad_checked):
        bad_grad, bad_sum = kernels().powersgd_compensate(grad, residual, self.num_threads,
                                                          grad_checked)
        if bad_grad:
            raise_nonfinite(grad, residual)
        if bad_sum:
            raise_nonfinite(grad, residual, out)

    def _outer(self, x, p, q, subtract):
        """x = P Q^T, or x -= P Q^T, rounded once per element (see codec_powersgd.pxi)."""
        kernels().powersgd_outer(x, p.astype(np.float64), np.ascontiguousarray(q.T, np.float64),
                                 subtract, self.num_threads)


@register(reference=True)
class PowerSGDReference(PowerSGD):
    """The NumPy oracle: the same BLAS products, the per-element passes in NumPy."""

    TRAITS = Traits(reference=True)

    def _compensate(self, grad, residual, out, grad_checked):
        c = self.compensated(grad, residual)
        residual[...] = c

    def _outer(self, x, p, q, subtract):
        p, qt = p.astype(np.float64), q.T.astype(np.float64)
        acc = p[:, 0:1] * qt[0][None, :]
        for t in range(1, p.shape[1]):
            acc += p[:, t:t + 1] * qt[t][None, :]
        x2 = x.reshape(p.shape[0], qt.shape[1])
        if subtract:
            self.feedback.update(x2, x2.copy(), acc.astype(np.float32))
        else:
            x2[...] = acc.astype(np.float32)
