"""SGD's update rules on host arrays, as the Cython kernels run them: one place for the
kernel calls that every framework's SGD shares (sgd.SGDKernel for MXNet's optimizer,
numpy_backend for plain settings), and the NumPy reference of PyTorch's rule, the oracle
of its kernel (kernels.TorchSGD, which torch/framework.py runs).

The kernels compute the float32 expressions of MXNet's sgd_update / sgd_mom_update, so
weights are bitwise those of MXNet's own SGD (tests/test_sgd.py).
"""
from dataclasses import dataclass

import numpy as np

from ..codecs.base import kernels


@dataclass(frozen=True)
class SGDStep:
    """The numbers of one SGD update of one key (lr and wd already times its multipliers)."""

    lr: float
    wd: float
    rescale_grad: float
    momentum: float
    clip: float  # MXNet's convention: negative means no clipping


def clip_bound(clip_gradient):
    """SGDStep.clip of an optimizer's clip_gradient: None or 0 (no clipping) becomes -1."""
    return float(clip_gradient) if clip_gradient else -1.0


def global_step(step, grad, weight, mom, num_threads):
    """weight <- one SGD step with `grad` (host arrays), momentum `mom` (or None) kept."""
    w = weight.for_write()
    m = mom.for_write() if mom is not None else None
    kernels().sgd_step(w, grad.for_read(), m, m, w, step.lr, step.wd, step.rescale_grad,
                       step.momentum, step.clip, num_threads)


def global_step_decoding(step, lanes, table, weight, mom, num_threads, checked=False):
    """global_step with the aggregate decoded from summed `lanes` by the codec's decode
    table (k, m, rows) on the fly: bitwise decode + global_step, the sum never in memory."""
    k, m, rows = table
    kernels().decode_sgd_step(lanes.for_read(), rows, k, m, weight.for_write(),
                              mom.for_write() if mom is not None else None, step.lr, step.wd,
                              step.rescale_grad, step.momentum, step.clip, num_threads, checked)


def local_pass(step, grad, weight, out, mom, num_threads, check=None, encoder=None):
    """A function of a piece (None: the whole key) that writes out <- one step from `weight`
    with `grad`, reading `mom` and writing neither: the local update of the backup.

    It reads the arrays without waiting (held()): the caller has the access. `check`
    (grad_buf.GradCheck) gets the count of NaN/Inf in grad; `encoder` (grad_buf.FusedEncode)
    encodes grad in the same pass."""
    def run(piece):
        try:
            _local_piece(step, grad, weight, out, mom, num_threads, check, encoder, piece)
        except BaseException as exc:  # kept for the pipeline: this push goes out as NaN
            if check is not None and check.error is None:
                check.error = exc
            raise

    return run


def _local_piece(step, grad, weight, out, mom, num_threads, check, encoder, piece):
    m = mom.held() if mom is not None else None
    if encoder is not None:
        w, o = weight.held(), out.held()
        if piece is not None:
            part = slice(piece.lo, piece.hi)
            w, o, m = w[part], o[part], (m[part] if m is not None else None)
        encoder(grad, kernels().LocalSGD(w, m, o, step.lr, step.wd, step.rescale_grad,
                                         step.momentum, step.clip), piece)
        return
    bad = kernels().sgd_step(weight.held(), grad.held(), m, None, out.held(), step.lr,
                             step.wd, step.rescale_grad, step.momentum, step.clip,
                             num_threads, check is not None)
    if check is not None:
        check.nonfinite = bad


def torch_sgd_reference(weight, grad, mom, lr, weight_decay, momentum, dampening, nesterov,
                        div=1.0):
    """(new weight, new momentum) of torch.optim.SGD's step in float32, one rounding per
    operation: what kernels.TorchSGD computes, bitwise. mom None: the first step."""
    f = np.float32
    d = grad.astype(f) / f(div) if div != 1 else grad.astype(f)
    if weight_decay != 0:
        d = d + f(weight_decay) * weight
    b = mom
    if momentum != 0:
        b = d if mom is None else f(momentum) * mom + f(1.0 - dampening) * d
        d = d + f(momentum) * b if nesterov else b
    return weight + f(-lr) * d, b
