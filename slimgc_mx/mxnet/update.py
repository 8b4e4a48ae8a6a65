"""The updates of the weights: the global one (glo_buf, on every worker) and the local one
of the model backup (loc_buf = glo_buf - loc_lr * g_loc, SlimGC Strategy 3).

The optimizer runs on every worker on the aggregated gradient, so all workers hold the
same global weights bit for bit. For MXNet's SGD (the paper's optimizer) both updates
run as one Cython pass each (sgd.SGDKernel), and a compressed key's sum is decoded
inside the global update; any other optimizer runs through MXNet's own Updater.
"""
import copy
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from ..engine import stages
from ..codecs import OptimizerView
from . import sgd
from .buffers import copy_array


@dataclass
class OptSettings:
    """The optimizer settings of one step, as the trainer left them when it pushed.

    The training thread may change lr or rescale_grad for the next step while this
    step is still being aggregated; the global update applies the ones of its step.
    """

    lr: float  # the step's rate: the lr scheduler's, when the optimizer has one
    wd: float
    rescale_grad: float
    param_dict: dict

    @classmethod
    def of(cls, optimizer, lr=None):
        return cls(optimizer.lr if lr is None else lr, optimizer.wd, optimizer.rescale_grad,
                   optimizer.param_dict)

    def apply(self, optimizer):
        optimizer.lr, optimizer.wd = self.lr, self.wd
        optimizer.rescale_grad, optimizer.param_dict = self.rescale_grad, self.param_dict


#: Optimizer attributes that are counters or references, not settings workers must share.
_NOT_SETTINGS = {"num_update", "begin_num_update", "_index_update_count",
                 "_all_index_update_counts", "param_dict", "idx2name", "sym_info", "lr_scheduler"}
_PLAIN = (bool, int, float, str, type(None))


def optimizer_settings(opt):
    """The settings of an MXNet optimizer that every worker must share, as plain values:
    its class, every plain attribute (lr, momentum, wd, rescale_grad, clip_gradient, ...),
    its lr scheduler's class and state, and each parameter's lr_mult and wd_mult."""
    out = {"optimizer": "%s.%s" % (type(opt).__module__, type(opt).__name__)}
    for name, value in sorted(vars(opt).items()):
        if name not in _NOT_SETTINGS and isinstance(value, _PLAIN):
            out[name] = value
    sched = getattr(opt, "lr_scheduler", None)
    if sched is not None:
        out["lr_scheduler"] = type(sched).__name__
        for name, value in sorted(vars(sched).items()):
            if isinstance(value, _PLAIN) or isinstance(value, (list, tuple)) and all(
                    isinstance(v, _PLAIN) for v in value):
                out["lr_scheduler." + name] = value
    params = getattr(opt, "param_dict", None) or {}
    mults = sorted((str(k), p.lr_mult, p.wd_mult) for k, p in params.items())
    if any(lr != 1.0 or wd != 1.0 for _, lr, wd in mults):
        out["lr_mult, wd_mult"] = mults
    return out


def optimizer_state(opt):
    """What a resumed job needs of an optimizer, as data: its class, plain settings, its lr
    scheduler's class and plain state, and its update counters."""
    sched = getattr(opt, "lr_scheduler", None)
    return {"class": _class_name(opt),
            "attributes": {k: v for k, v in vars(opt).items()
                           if k not in _NOT_SETTINGS and isinstance(v, _PLAIN)},
            "scheduler": None if sched is None else {
                "class": _class_name(sched),
                "attributes": {k: (list(v) if isinstance(v, tuple) else v)
                               for k, v in vars(sched).items() if isinstance(v, _PLAIN)
                               or isinstance(v, (list, tuple))
                               and all(isinstance(x, _PLAIN) for x in v)}},
            "counters": {"num_update": opt.num_update, "begin_num_update": opt.begin_num_update,
                         "index_update_count": dict(opt._index_update_count)}}


def restore_optimizer(opt, state, where):
    """Put optimizer_state() back into `opt`, which must be of the same class (and its
    scheduler too); a ValueError names what differs."""
    for obj, data, what in ((opt, state, "optimizer"),
                            (getattr(opt, "lr_scheduler", None), state["scheduler"],
                             "lr scheduler")):
        if (obj is None) != (data is None) or obj is not None and _class_name(obj) != data["class"]:
            raise ValueError("%s holds the %s %s, this job has %s; create the same %s as the "
                             "job that saved it" % (where, what, data and data["class"],
                                                    obj is not None and _class_name(obj), what))
    for name, value in state["attributes"].items():
        setattr(opt, name, value)
    if state["scheduler"] is not None:
        for name, value in state["scheduler"]["attributes"].items():
            setattr(opt.lr_scheduler, name, value)
    counters = state["counters"]
    opt.num_update, opt.begin_num_update = counters["num_update"], counters["begin_num_update"]
    opt._index_update_count.clear()
    opt._index_update_count.update(counters["index_update_count"])


def _class_name(obj):
    return "%s.%s" % (type(obj).__module__, type(obj).__name__)


def updater_states(updater):
    """{index: state} of an MXNet Updater as NumPy arrays (tuples kept as {'tuple': [...]})."""
    return {index: _state_data(state) for index, state in updater.states.items()}


def set_updater_states(updater, states):
    """Put updater_states() back; MXNet moves them to the weights' context when it uses them."""
    updater.states = {index: _state_array(state) for index, state in states.items()}
    updater.states_synced = dict.fromkeys(updater.states, False)


def _state_data(state):
    if isinstance(state, mx.nd.NDArray):
        return state.asnumpy()
    if isinstance(state, (list, tuple)):
        items = [_state_data(s) for s in state]
        return {"tuple": items} if isinstance(state, tuple) else items
    return state


def _state_array(state):
    if isinstance(state, np.ndarray):
        return mx.nd.array(state, dtype=state.dtype)
    if isinstance(state, dict) and "tuple" in state:
        return tuple(_state_array(s) for s in state["tuple"])
    if isinstance(state, list):
        return [_state_array(s) for s in state]
    return state


#: MXNet optimizers whose update rule an OptimizerView names (codecs/base.py).
_VIEW_KINDS = {mx.optimizer.SGD: "sgd", mx.optimizer.NAG: "nag", mx.optimizer.Adam: "adam"}


def _mult(opt, index, attr):
    """lr_mult or wd_mult of `index`, found as MXNet's _get_lrs / _get_wds find it."""
    param = (opt.param_dict or {}).get(index)
    if param is not None:
        return float(getattr(param, attr))
    table = getattr(opt, attr, None) or {}
    if index in table:
        return float(table[index])
    name = (getattr(opt, "idx2name", None) or {}).get(index)
    return float(table.get(name, 1.0)) if name is not None else 1.0


def optimizer_view(opt, index, arrays, settings=None):
    """The codecs.OptimizerView of key `index` under MXNet optimizer `opt`, or None for an
    optimizer the view has no kind for (the codec then uses its default).

    arrays: () -> (w_i, state1, state2) as float32 NumPy arrays, called on the encoding
    thread. lr and wd: the step's settings (OptSettings, default `opt`'s own: its base rate
    when it has an lr scheduler) times the parameter's lr_mult / wd_mult.
    """
    kind = _VIEW_KINDS.get(type(opt))
    if kind is None:
        return None
    s = settings if settings is not None else OptSettings.of(opt)
    count = opt._index_update_count.get(index, opt.begin_num_update)
    return OptimizerView(kind, arrays, lr=float(s.lr) * _mult(opt, index, "lr_mult"),
                         wd=float(s.wd) * _mult(opt, index, "wd_mult"),
                         rescale_grad=float(s.rescale_grad),
                         momentum=float(getattr(opt, "momentum", 0.0) or 0.0),
                         beta1=float(getattr(opt, "beta1", 0.9)),
                         beta2=float(getattr(opt, "beta2", 0.999)),
                         epsilon=float(getattr(opt, "epsilon", 1e-8)), t=int(count) + 1)


def state_arrays(state):
    """An MXNet optimizer state (NDArray, tuple of them, or None) as (state1, state2):
    flat float32 NumPy copies, None where absent."""
    if state is None:
        return None, None
    if isinstance(state, (list, tuple)):
        parts = [None if x is None else x.asnumpy().ravel() for x in state[:2]]
        return tuple(parts + [None] * (2 - len(parts)))
    return state.asnumpy().ravel(), None


def check_loc_optimizer(name):
    """Raise ValueError unless `name` (option loc_optimizer) is None or an MXNet optimizer."""
    registry = mx.optimizer.Optimizer.opt_registry
    if name is not None and name.lower() not in registry:
        raise ValueError("loc_optimizer %r (option loc_optimizer, SLIMGC_LOC_OPTIMIZER) is not an "
                         "MXNet optimizer; valid: %s, or leave it unset to use the global one"
                         % (name, ", ".join(sorted(registry))))


def clone_optimizer(opt):
    """A shallow copy of an MXNet optimizer with its own update counters and settings.

    Shared: param_dict, idx2name, lr_scheduler. Separate: lr, rescale_grad and the
    per-index update counts, so two threads can each drive their own copy.
    """
    twin = copy.copy(opt)
    counts = {dev: dict(c) for dev, c in opt._all_index_update_counts.items()}
    current = next((dev for dev, c in opt._all_index_update_counts.items()
                    if c is opt._index_update_count), 0)
    twin._all_index_update_counts = counts
    twin._index_update_count = counts.setdefault(current, {})
    return twin


def _unscheduled_clone(opt):
    """The clone that drives the global updates: without the lr scheduler, so that its
    rate is the one OptSettings carries (GlobalUpdate.settings)."""
    twin = clone_optimizer(opt)
    twin.lr_scheduler = None
    return twin


class GlobalUpdate:
    """glo_buf <- one optimizer step with the aggregate, on the aggregation thread.

    `optimizer` is the trainer's (it sets lr / rescale_grad on it); the update drives a
    clone of it through MXNet's Updater, whose states (momentum) checkpoints save, or
    through the SGD kernel, which keeps its momentum in those same states.
    """

    def __init__(self, optimizer, num_threads):
        self.optimizer = optimizer
        self.num_threads = num_threads
        self.updater = mx.optimizer.get_updater(_unscheduled_clone(optimizer))
        self._num_update = self.updater.optimizer.num_update
        self.kernel = self._kernel()

    def settings(self, index):
        """The settings of the push of `index` the training thread is making (the key's last
        update has published): the trainer's, with lr from the lr scheduler at the update
        count MXNet's Updater would be at, num_update = the most updates of any index.

        The scheduler is called here, in push order, the same on every worker; keys finish
        aggregating in whichever order their sums arrive, and an update there that called
        it would take the rate of whichever keys had finished (workers would differ).
        """
        opt, driven = self.optimizer, self.updater.optimizer
        count = driven._index_update_count.get(index, driven.begin_num_update) + 1
        self._num_update = max(self._num_update, count)
        scheduler = opt.lr_scheduler
        return OptSettings.of(opt, None if scheduler is None else scheduler(self._num_update))

    def _kernel(self):
        """The CPU kernel for MXNet's SGD, or None for other optimizers."""
        if not sgd.supports(self.updater.optimizer):
            return None
        return sgd.SGDKernel(self.updater, self.num_threads)

    def decodes_in_update(self, buffers):
        """True when the SGD kernel runs the update, which decodes a sum inside it
        (Planner.plan asks for host-encoded keys of codecs that decode by table)."""
        return self.kernel is not None

    def codec_view(self, index, glo, settings):
        """What a codec that wants_optimizer may read of key `index` at this push: glo
        (the Buffer of glo_buf, w_i) and the optimizer's state, read on the encoding
        thread once the last update has written them (the SGD kernel's momentum in place;
        an Updater's states as copies)."""
        opt = self.updater.optimizer

        def arrays():
            weight = glo.for_read()
            if self.kernel is not None:
                mom = self.kernel.momentum(index, glo.nd.shape)
                return weight, (mom.for_read() if mom is not None else None), None
            s1, s2 = state_arrays(self.updater.states.get(index))
            return weight, s1, s2

        return optimizer_view(opt, index, arrays, settings)

    def prepare(self, transfer, num_workers):
        """What update() needs of a transfer, read before it waits for the loc_buf flag.
        Without the kernel (set_optimizer left SGD since this transfer was planned) the
        sum is decoded, then updated."""
        return stages.decode_in_update(transfer, num_workers, self.kernel is not None)

    def __call__(self, transfer, table, glos):
        """Write the new global weights of the transfer's keys into `glos` (Buffers)."""
        opt = self.updater.optimizer
        transfer.settings.apply(opt)
        indices = [p.buffers.index for p in transfer.pushes]
        # A bucket of small keys takes one multi-tensor op in MXNet's engine: cheaper
        # than the kernel's per-key engine waits (scripts/per_key_cost.py).
        kernel = self.kernel if len(transfer.pushes) == 1 else None
        if table is not None:
            kernel.global_step_decoding(indices[0], transfer.exchange.recv, table, glos[0],
                                        transfer.lanes_checked)
        elif kernel is not None:
            kernel.global_step(indices, [p.buffers.agg for p in transfer.pushes], glos)
        else:
            # MXNet's Updater takes lists (a bucket: its multi-tensor ops, as
            # gluon.Trainer uses); it turns a single key into a list of one itself.
            self.updater(indices, [p.buffers.agg.nd for p in transfer.pushes],
                         [g.nd for g in glos])

    def state(self):
        """The optimizer (its counters as it drives the updates, the trainer's lr scheduler)
        and its per-index states, as data."""
        state = optimizer_state(self.updater.optimizer)
        state["scheduler"] = optimizer_state(self.optimizer)["scheduler"]
        return {"optimizer": state, "states": updater_states(self.updater)}

    def check_state(self, state, where):
        """Raise ValueError unless `state` (a state()) restores into this job's optimizer."""
        restore_optimizer(clone_optimizer(self.optimizer), state["optimizer"], where)

    def load_state(self, state, where):
        """Restore state(): into the trainer-facing optimizer, which a fresh clone drives."""
        restore_optimizer(self.optimizer, state["optimizer"], where)
        self._drive(self.optimizer)
        set_updater_states(self.updater, state["states"])

    def _drive(self, optimizer):
        self.updater.optimizer = _unscheduled_clone(optimizer)
        self._num_update = self.updater.optimizer.num_update
        self.kernel = self._kernel()  # takes the loaded momentum at its first use


class LocalUpdater:
    """The local update of the backup: one step of the global optimizer from glo_buf.

    By default it applies the global optimizer's rule with a copy of the global
    optimizer state (e.g. momentum) as it stands after w_i, and the local gradient
    scaled by num_workers in place of the sum over workers: the best local guess of
    w_{i+1}, exact when every worker's gradient is the same (always with one
    worker). It keeps no recursion of its own, so it is as stable as the global
    optimizer. `loc_optimizer` (a name) instead runs that optimizer with its own
    state; `loc_lr` replaces the learning rate.

    For MXNet's SGD (the paper's optimizer) the default rule runs as one pass of
    `kernel` (the SGDKernel of the global update, which holds the momentum): it
    reads glo_buf and the global momentum in place and writes neither. With
    `engine` (an EngineNotifier) that pass runs in MXNet's engine once the
    gradient exists.
    """

    def __init__(self, global_optimizer, num_workers, loc_lr=None, loc_optimizer=None,
                 global_updater=None, kernel=None, engine=None):
        self._global = global_optimizer
        self._num_workers = num_workers
        self._loc_lr = loc_lr
        self._global_updater = global_updater if loc_optimizer is None else None
        if loc_optimizer is None:
            opt = clone_optimizer(global_optimizer)
        else:
            opt = mx.optimizer.create(loc_optimizer, learning_rate=global_optimizer.lr,
                                      wd=global_optimizer.wd,
                                      param_dict=global_optimizer.param_dict)
        self.optimizer = opt
        self._updater = mx.optimizer.get_updater(opt)
        self._kernel = kernel if self._global_updater is not None else None
        self._engine = engine

    @classmethod
    def for_update(cls, update, num_workers, config, engine):
        """The local updater of a GlobalUpdate, with the options loc_lr / loc_optimizer."""
        return cls(update.optimizer, num_workers, config.loc_lr, config.loc_optimizer,
                   update.updater, update.kernel, engine)

    @property
    def fused(self):
        """True when the update runs as the SGD kernel."""
        return self._kernel is not None

    def __call__(self, index, grad, glo, out, check=None, encoder=None):
        """out <- glo after one local step with `grad` (all Buffers; glo is not written).

        `check` (a grad_buf.GradCheck) is filled when the SGD kernel runs the step;
        `encoder` (a grad_buf.FusedEncode) runs in that pass and needs the kernel.
        """
        if encoder is not None and not self.fused:
            raise ValueError("the local update encodes only as the SGD kernel")
        opt = self.optimizer
        opt.lr = self._loc_lr if self._loc_lr is not None else self._global.lr
        opt.rescale_grad = self._global.rescale_grad * self._num_workers
        source = self._global_updater
        if source is not None:
            glo_opt = source.optimizer
            opt._index_update_count[index] = glo_opt._index_update_count.get(
                index, glo_opt.begin_num_update)
            if self._kernel is not None:
                self._kernel.local_step(opt, index, grad, glo, out, self._engine, check,
                                        encoder)
                return
            if index in source.states:
                self._updater.states[index] = _copy_state(source.states[index])
                self._updater.states_synced[index] = True
            else:
                self._updater.states.pop(index, None)
        copy_array(glo.nd, out.nd)
        self._updater(index, grad.nd, out.nd)

    def state(self):
        return {"optimizer": optimizer_state(self.optimizer),
                "states": updater_states(self._updater)}

    def load_state(self, state, where):
        restore_optimizer(self.optimizer, state["optimizer"], where)
        set_updater_states(self._updater, state["states"])


def _copy_state(state):
    """A copy of an optimizer state: NDArrays copied (engine ops), nesting kept."""
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return state

