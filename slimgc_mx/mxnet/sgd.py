"""MXNet's SGD step as one Cython pass over CPU buffers: the global and the local update.

With MXNet's SGD (the paper's optimizer) each worker updates every weight twice
per step, glo_buf with the aggregate and, with backup, loc_buf with its own
gradient. MXNet's update ops take 2x (sgd_mom_update) to 4.5x (the multi-tensor
op its Updater uses) the CPU time of this kernel on one thread
(docs/benchmarks.md), and on a communication-bound model those updates are a
large share of a worker's CPU.
The kernel computes the same float32 expressions as sgd_update / sgd_mom_update,
so the weights are bitwise the same (tested). For a compressed key it can also
decode the summed lanes inside the global update, so the aggregate never goes
to memory.
"""
from functools import partial

import mxnet as mx
import numpy as np

from ..engine import sgd_rule
from ..env import check_num_threads
from .buffers import Buffer, wait_to_write


def supports(optimizer):
    """True for MXNet's own SGD (not a subclass, whose update may differ)."""
    return type(optimizer) is mx.optimizer.SGD


class SGDKernel:
    """Runs the SGD rule of `updater.optimizer` on Buffers, keeping the momentum in `updater`.

    The momentum of index i lives in a Buffer whose NDArray is `updater.states[i]`,
    so MXNet's get_states / set_states (checkpoints) see it as the Updater's own;
    a state put there by set_states is copied into the Buffer at its next use.
    """

    def __init__(self, updater, num_threads=None):
        self.updater = updater
        self.num_threads = check_num_threads(num_threads)
        self._momentum = {}  # index -> Buffer

    def momentum(self, index, shape):
        """The momentum Buffer of `index` (zeros before its first update), or None without momentum."""
        if self.updater.optimizer.momentum <= 0:
            return None
        buf = self._momentum.get(index)
        state = self.updater.states.get(index)
        if buf is not None and state is buf.nd:
            return buf
        if buf is None:
            buf = self._momentum[index] = Buffer(shape, np.float32)
        if state is None:
            buf.for_write().fill(0)
        else:  # loaded by set_states
            if tuple(state.shape) != tuple(shape):
                raise ValueError("optimizer state of index %r has shape %s, the weight %s"
                                 % (index, tuple(state.shape), tuple(shape)))
            np.copyto(buf.for_write(), state.asnumpy().reshape(-1))
        self.updater.states[index] = buf.nd
        self.updater.states_synced[index] = True
        return buf

    def global_step(self, indices, grads, weights):
        """weights[j] (glo_buf) <- one SGD step with grads[j] (the aggregates), momentum kept."""
        opt = self.updater.optimizer
        for index, grad, weight, step in zip(indices, grads, weights, _steps(opt, indices)):
            sgd_rule.global_step(step, grad, weight, self.momentum(index, weight.nd.shape),
                                 self.num_threads)

    def global_step_decoding(self, index, lanes, table, weight, checked=False):
        """global_step of one key whose aggregate is decoded from `lanes` on the fly.

        table: (k, m, rows) from the codec's decode_table. The weights are bitwise
        those of decode + global_step, without writing the aggregate to memory.
        checked: the lanes were found in range (kernels.count_lanes_outside) by the caller.
        """
        step, = _steps(self.updater.optimizer, [index])
        sgd_rule.global_step_decoding(step, lanes, table, weight,
                                      self.momentum(index, weight.nd.shape), self.num_threads,
                                      checked)

    def local_step(self, opt, index, grad, weight, out, engine=None, check=None, encoder=None):
        """out <- one step of `opt`'s settings from `weight`, reading the global momentum.

        Neither `weight` nor the momentum is written: the local update of the backup.
        With `engine` (an EngineNotifier) the pass runs as an operator once `grad` is
        ready, so the calling thread does not wait for backward; without, it runs here.
        `check` (a grad_buf.GradCheck) gets the count of NaN/Inf in `grad`, set before
        `out` is readable, and `out` as the array to wait for. `encoder` (a
        grad_buf.FusedEncode) encodes `grad` in the same pass, filling `check`, with one
        operator per piece when it has pieces; `grad` may then be MXNet's own gradient
        (buffers.ArrayInPlace).
        """
        step, = _steps(opt, [index])
        mom = self.momentum(index, weight.nd.shape)
        reads = [buf.nd for buf in [grad, weight] + ([mom] if mom is not None else [])]
        if check is not None:
            check.ready = out
        run = sgd_rule.local_pass(step, grad, weight, out, mom, self.num_threads, check, encoder)
        for piece in encoder.parts() if encoder is not None else [None]:
            writes = [out.nd]
            if encoder is not None:  # the residual, and the lanes of the key or its piece
                writes += [encoder.buffers.residual.nd,
                           encoder.send.nd if piece is None else piece.send]
            if engine is None:
                for nd in reads:
                    nd.wait_to_read()
                for nd in writes:
                    wait_to_write(nd)
                run(piece)
            else:
                engine.run(partial(run, piece), reads, writes)


def _steps(opt, indices):
    """Count an update of `indices`, as MXNet's optimizer does; their SGDSteps."""
    clip = sgd_rule.clip_bound(opt.clip_gradient)
    return [sgd_rule.SGDStep(lr, wd, opt.rescale_grad, opt.momentum, clip)
            for lr, wd in _count(opt, indices)]


def _count(opt, indices):
    """Count an update of `indices`, as MXNet's optimizer does; their (lr, wd) pairs."""
    opt._update_count(indices)
    return list(zip(opt._get_lrs(indices), opt._get_wds(indices)))

