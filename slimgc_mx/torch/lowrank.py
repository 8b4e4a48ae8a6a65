"""powersgd on the device: codecs/powersgd.py's rule in torch ops, for the device path's
bucket of one matrix (buckets.py).

Round 0 sends P = M Q (M = grad + residual, kept in the residual), round 1 sends
Q_j = M^T P_hat with P_hat the summed P orthonormalized (float64 Gram-Schmidt, sums in
element order), the residual becomes M - P_hat Q_j^T, and decode gives P_hat Q_sum^T and
keeps Q_sum as the next step's Q (a column that sums to zeros drawn again from the push's
seed, as the first Q is). Everything but the two matrix products is bitwise the host
codec's, on the CPU and on CUDA (tests/test_torch_lowrank.py gives both the same
products); the products are the device's BLAS, so a matrix is close to the host codec's,
not bitwise, and every rank of a job computes the same. Nothing here reads the device
from the host: a NaN/Inf in M, in the summed P or in Q_j raises the bucket's flag, which
the device path reads later. A matrix costs about r^2 small kernels (Gram-Schmidt's
ordered sums, one column after another), not measured on a GPU yet.
"""
import torch

from ..codecs.base import check_num_workers
from . import device
from .device import TorchOps


def _ordered_dot(x, y):
    """sum(x * y) of float64 vectors added in element order, as a 0-dim tensor (TorchOps'
    ordered sums: a scan along an outer dimension, in order on the CPU and on CUDA)."""
    if not x.numel():
        return x.new_zeros(())
    return TorchOps.run_sums(x * y, x.numel(), 1)[0, 0]


def orthonormalize(p):
    """codecs.powersgd.orthonormalize in torch ops: orthonormal columns spanning those of p
    (n, r) float32, as float32 (n, r); a column with nothing left becomes zeros."""
    cols = p.t().to(torch.float64).contiguous()  # (r, n): column t is row t
    for t in range(cols.shape[0]):
        v = cols[t]
        for s in range(t):
            v.sub_(_ordered_dot(cols[s], v) * cols[s])
        norm = torch.sqrt(_ordered_dot(v, v))
        v.copy_(torch.where(norm > 0, v / norm, torch.zeros_like(v)))
    return cols.t().to(torch.float32).contiguous()


def outer(x, p, q, subtract):
    """x = P Q^T, or x -= P Q^T, each element's sum over the rank in float64 in column order,
    rounded once (the kernel's powersgd_outer); row pieces bound the float64 temporaries."""
    n, m = p.shape[0], q.shape[0]
    x2 = x.view(n, m)
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    rows = max(1, device.PIECE_ELEMENTS // max(m, 1))  # (the device codec's one piece size)
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        acc = p64[lo:hi, 0:1] * q64[:, 0][None, :]
        for t in range(1, p.shape[1]):
            acc += p64[lo:hi, t:t + 1] * q64[:, t][None, :]
        if subtract:
            x2[lo:hi].sub_(acc.to(torch.float32))
        else:
            x2[lo:hi].copy_(acc.to(torch.float32))


class TorchPowerSGD:
    """A powersgd codec instance (one key's: its seed, pushes and Q) run in torch ops on the
    device of the tensors it is given; `matmul(a, b, out=)` makes the two products.

    The lanes are r (n + m) float32 values: P's first, then Q's (parts()); each is summed
    on its own, P's before next_round, Q's before decode."""

    rounds = 2
    matmul = staticmethod(torch.matmul)  # the products' maker (tests give NumPy's)

    def __init__(self, codec, shape, num_workers, matmul=None):
        self.codec = codec
        size = 1
        for d in shape:
            size *= int(d)
        codec.wire_rounds(size, tuple(shape), check_num_workers(num_workers))  # its matrix
        self.n, self.m = codec.matrix
        self.r = min(codec.rank, self.n, self.m)
        if matmul is not None:
            self.matmul = matmul
        self.q = None  # (m, r) float32 on the device, once drawn or loaded
        self._m = None  # the residual holding M between encode and next_round
        self._p_hat = None  # (n, r) float32 of the step in flight
        self._stage = 0  # 1 after encode, 2 after next_round

    @staticmethod
    def supports(codec):
        """True for a powersgd codec (codecs/powersgd.py), the one this runs."""
        return getattr(codec, "name", None) == "powersgd"

    def __repr__(self):
        return "TorchPowerSGD(%r, %dx%d, rank %d)" % (self.codec, self.n, self.m, self.r)

    def parts(self, lanes):
        """(P's lanes, Q's lanes) of the bucket's lanes, in the order they are summed."""
        k = self.n * self.r
        return lanes[:k], lanes[k:]

    # ------------------------------------------------------------ shared state
    def state_dict(self):
        """The codec's state_dict(), Q read from the device (a checkpoint's host read)."""
        if self.q is not None:
            self.codec.q = self.q.detach().cpu().numpy().copy()
        return self.codec.state_dict()

    def load_state_dict(self, state):
        self.codec.load_state_dict(state)
        self.q = None  # the next encode takes the codec's Q (or draws the first)
        self._m = self._p_hat = None
        self._stage = 0

    def _drawn(self, device):
        """(m, r): every column drawn from this push's seed, uniform in [-0.5, 0.5) (column
        t is elements t*m .. t*m+m-1 of the push's draws, as codecs.rng.uniform gives)."""
        ops = TorchOps(None, device)
        drawn = ops.uniform(self.codec.push_seed(), self.r * self.m).view(self.r, self.m)
        return (drawn - 0.5).t().contiguous()

    # ------------------------------------------------------------ a step
    @torch.no_grad()
    def encode(self, grad, residual, out, flag):
        """Round 0: residual <- M = grad + residual; out (n*r) <- P = M Q; `flag` (0-dim
        float64) <- 1 where M holds NaN/Inf, else 0."""
        n, m, r = self.n, self.m, self.r
        torch.add(grad.reshape(-1), residual, out=residual)
        flag.copy_(~torch.isfinite(residual).all())
        if self.q is None:
            self.q = (torch.from_numpy(self.codec.q).to(residual.device)
                      if self.codec.q is not None else self._drawn(residual.device))
        self.matmul(residual.view(n, m), self.q, out=out.view(n, r))
        self._m, self._stage = residual, 1

    @torch.no_grad()
    def next_round(self, p_sum, out, flag):
        """Round 1: P_hat of the summed P; out (m*r) <- Q_j = M^T P_hat; the residual <-
        M - P_hat Q_j^T; `flag` raised where the summed P or Q_j holds NaN/Inf."""
        if self._stage != 1:
            raise ValueError("powersgd on the device: next_round follows encode (stage %d)"
                             % self._stage)
        n, m, r = self.n, self.m, self.r
        bad = ~torch.isfinite(p_sum).all()
        self._p_hat = orthonormalize(p_sum.view(n, r))
        qj = out.view(m, r)
        self.matmul(self._m.view(n, m).t(), self._p_hat, out=qj)
        bad = bad | ~torch.isfinite(qj).all()
        flag.copy_(torch.maximum(flag, bad.to(flag.dtype)))
        outer(self._m, self._p_hat, qj, subtract=True)
        self._m, self._stage = None, 2

    @torch.no_grad()
    def decode(self, q_sum, out):
        """out (n*m float32) <- P_hat Q_sum^T; Q_sum becomes the next step's Q, a column of
        zeros drawn again (no host read: the draws are made and chosen on the device)."""
        if self._stage != 2:
            raise ValueError("powersgd on the device: decode needs the step's P round first "
                             "(encode, then next_round)")
        m, r = self.m, self.r
        q = q_sum.view(m, r)
        outer(out, self._p_hat, q, subtract=False)
        zero = ~(q != 0).any(dim=0)
        self.q = torch.where(zero[None, :], self._drawn(q.device), q)
        self.codec.pushes += 1
        self._p_hat, self._stage = None, 0
