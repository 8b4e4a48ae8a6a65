"""The NumPy backend: the whole engine on plain host arrays, with no framework loaded.

Parameters and gradients are float32 NumPy arrays; the optimizer is MXNet SGD's rule
(`SGD`, plain settings) run by the same Cython kernels as MXNet's adapter, so on the
same inputs it gives that adapter's weights bit for bit. It serves the test suite (the
engine without MXNet) and is the pattern of every framework adapter (docs/backend.md):

    agg = Aggregator(config, ThreadGroup(2).transport(rank), framework=NumpyFramework())
    agg.set_optimizer(SGD(learning_rate=0.1, momentum=0.9))
    agg.add_key(0, w0); agg.push(0, [grad], [param]); agg.flush()
"""
import dataclasses
from typing import Optional

import numpy as np

from . import sgd_rule, stages
from ..codecs import OptimizerView
from ..env import check_num_threads
from ..transport.host import HostArrays, HostBuffer, HostReadiness


@dataclasses.dataclass
class SGD:
    """MXNet SGD's settings for host arrays: w' = w + m', m' = momentum*m - lr*(rescale*g +
    wd*w), g clipped to +-clip_gradient when given. No scheduler: set learning_rate between
    steps; a step takes the rate it was pushed with."""

    learning_rate: float
    momentum: float = 0.0
    wd: float = 0.0
    rescale_grad: float = 1.0
    clip_gradient: Optional[float] = None

    def step(self, learning_rate=None, rescale=1.0):
        """The SGDStep of one update, at `learning_rate` (default this one's)."""
        lr = self.learning_rate if learning_rate is None else learning_rate
        return sgd_rule.SGDStep(float(lr), float(self.wd), float(self.rescale_grad) * rescale,
                                float(self.momentum), sgd_rule.clip_bound(self.clip_gradient))


class SGDUpdate:
    """glo_buf <- one SGD step with the aggregate, momentum per key in host buffers."""

    def __init__(self, optimizer, num_threads):
        if not isinstance(optimizer, SGD):
            raise TypeError("the NumPy backend runs numpy_backend.SGD, got %s"
                            % type(optimizer).__name__)
        self.optimizer = optimizer
        self.num_threads = check_num_threads(num_threads)
        self._momentum = {}  # index -> HostBuffer

    def momentum(self, index, size):
        """The momentum buffer of `index` (zeros before its first update), None without."""
        if self.optimizer.momentum <= 0:
            return None
        if index not in self._momentum:
            self._momentum[index] = HostBuffer((size,))
        return self._momentum[index]

    def settings(self, index):
        """The step's settings, taken when the key is pushed."""
        return self.optimizer.step()

    @staticmethod
    def decodes_in_update(buffers):
        """True: the SGD kernel decodes a sum inside its update (for codecs that decode by
        table, the only ones Planner.plan asks about)."""
        return True

    def codec_view(self, index, glo, step):
        def arrays():
            mom = self.momentum(index, glo.nbytes // 4)
            return glo.for_read(), (mom.for_read() if mom is not None else None), None
        return OptimizerView("sgd", arrays, lr=step.lr, wd=step.wd,
                             rescale_grad=step.rescale_grad, momentum=step.momentum)

    @staticmethod
    def prepare(transfer, num_workers):
        return stages.decode_in_update(transfer, num_workers)

    def __call__(self, transfer, table, glos):
        step = transfer.settings
        if table is not None:
            b = transfer.buffers
            sgd_rule.global_step_decoding(step, transfer.exchange.recv, table, glos[0],
                                          self.momentum(b.index, b.size), self.num_threads,
                                          transfer.lanes_checked)
            return
        for push, glo in zip(transfer.pushes, glos):
            b = push.buffers
            sgd_rule.global_step(step, b.agg, glo, self.momentum(b.index, b.size),
                                 self.num_threads)

    def state(self):
        return {"optimizer": dataclasses.asdict(self.optimizer),
                "states": {i: m.for_read().copy() for i, m in self._momentum.items()}}

    def check_state(self, state, where):
        """Raise ValueError unless `state` (a state()) holds this optimizer's fields."""
        if set(state.get("optimizer", {})) != set(dataclasses.asdict(self.optimizer)):
            raise ValueError("%s holds the state of another optimizer than %s"
                             % (where, type(self.optimizer).__name__))

    def load_state(self, state, where):
        self.check_state(state, where)
        for name, value in state["optimizer"].items():
            setattr(self.optimizer, name, value)
        for index, values in state["states"].items():
            np.copyto(self.momentum(index, len(values)).for_write(), values)


class SGDLocalUpdate:
    """The backup's local update: one step of the global rule from glo_buf with this
    worker's gradient times num_workers, reading the global momentum, writing neither."""

    fused = True

    def __init__(self, update, num_workers, loc_lr=None):
        self._update = update
        self._num_workers = num_workers
        self._loc_lr = loc_lr

    def __call__(self, index, grad, glo, out, check=None, encoder=None):
        update = self._update
        step = update.optimizer.step(self._loc_lr, rescale=self._num_workers)
        if check is not None:
            check.ready = out
        run = sgd_rule.local_pass(step, grad, glo, out, update.momentum(index, glo.nbytes // 4),
                                  update.num_threads, check, encoder)
        for piece in encoder.parts() if encoder is not None else [None]:
            run(piece)

    @staticmethod
    def state():
        return None  # it reads the global state and keeps none of its own

    def load_state(self, state, where):
        pass


class NumpyFramework:
    """The aggregator's seams on plain NumPy arrays (docs/backend.md)."""

    engine_where = "a host operation"
    pushes_every_key = False
    readiness = HostReadiness()
    arrays = HostArrays()
    new_buffer = staticmethod(HostBuffer)

    def on_error(self, callback):
        """Host operations run on the calling thread: their errors raise there."""

    @staticmethod
    def device_codec(codec):
        raise ValueError("offload=False encodes with a framework's device ops; the NumPy "
                         "backend encodes on CPU threads only (leave offload on)")

    @staticmethod
    def weight(key, value):
        value = np.asarray(value)
        if value.dtype != np.float32:
            raise TypeError("key %r is %s: slimgc aggregates float32 parameters only"
                            % (key, value.dtype))
        weight = HostBuffer(value.shape)
        np.copyto(weight.for_write(), value.reshape(-1))
        return weight

    @staticmethod
    def gradient(b, grads, fused=False, device_encoded=False):
        """(the gradient summed over devices, grad_buf holding a copy of it)."""
        grad = grads[0] if len(grads) == 1 else np.sum(grads, axis=0, dtype=np.float32)
        np.copyto(b.grad_buf.for_write(), np.reshape(grad, -1))
        return grad, b.grad_buf

    @staticmethod
    def optimizer_settings(optimizer, loc_optimizer):
        if loc_optimizer is not None:
            raise ValueError("loc_optimizer=%r: the NumPy backend's local update is the global "
                             "rule; leave loc_optimizer unset" % (loc_optimizer,))
        return {"optimizer": type(optimizer).__name__, **dataclasses.asdict(optimizer)}

    @staticmethod
    def global_update(optimizer, num_threads):
        return SGDUpdate(optimizer, num_threads)

    @staticmethod
    def local_updater(update, num_workers, config):
        return SGDLocalUpdate(update, num_workers, config.loc_lr)
