"""Model backup (SlimGC Strategy 3): glo_buf, loc_buf and the status flag of paper §3.6.

Per key, glo_buf holds the global weights w_i and `version` says which i. At
step i the training thread waits for version i, writes
loc_buf = w_i - loc_lr * g_loc into the parameters (the local update) and sets
the flag 0 -> 1; it then returns and computes step i+1 while step i is still
being aggregated. The aggregation thread may overwrite glo_buf with w_{i+1} only
while the flag is 1 (the local update has read w_i); it then sets it 1 -> 0 and
publishes version i+1. With backup off the training thread waits for w_{i+1}
and copies it into the parameters (synchronous SGD).
"""
import copy
import threading
import time

import mxnet as mx


class BackupTimeout(TimeoutError):
    """The training thread waited longer than the configured timeout for an aggregation."""


class _Slot:
    __slots__ = ("glo_buf", "version", "flag", "loc_bufs")

    def __init__(self, glo_buf):
        self.glo_buf = glo_buf
        self.version = 0
        self.flag = 0
        self.loc_bufs = None  # the parameter arrays the trainer reads (loc_buf)


class ModelBackup:
    """glo_buf per key and the loc_buf status flag; the two threads meet only here."""

    def __init__(self, enabled, timeout):
        self.enabled = enabled
        self.timeout = timeout
        self._slots = {}
        self._cond = threading.Condition()
        self._error = None
        self._error_where = None
        self.blocked_s = 0.0  # training-thread time spent waiting for global weights
        self.failed = False  # a wait raised: an aggregation failed or never completed

    def add(self, key, weight):
        """Register `key` with initial global weights (copied to a CPU, default-layout glo_buf)."""
        glo = mx.nd.zeros(weight.shape, ctx=mx.cpu(), dtype="float32")
        weight.copyto(glo)
        self._slots[key] = _Slot(glo)

    def glo_buf(self, key):
        return self._slots[key].glo_buf

    def version(self, key):
        return self._slots[key].version

    def local_step(self, key, step, grad, loc_bufs, local_update):
        """Training thread, backup on: loc_buf = glo_step - loc_lr * grad, flag 0 -> 1."""
        slot = self._slots[key]
        self.wait_version(key, step)
        slot.loc_bufs = loc_bufs
        first = loc_bufs[0]
        slot.glo_buf.copyto(first)
        local_update(grad, first)
        for other in loc_bufs[1:]:
            first.copyto(other)
        with self._cond:
            slot.flag = 1
            self._cond.notify_all()

    def write_back(self, key, step, loc_bufs):
        """Training thread: wait for glo_step and copy it into the parameters."""
        slot = self._slots[key]
        self.wait_version(key, step)
        slot.loc_bufs = loc_bufs
        for out in loc_bufs:
            slot.glo_buf.copyto(out)

    def publish(self, key, step, global_update, local_step_done):
        """Aggregation thread: glo_buf <- w_{step+1} via `global_update(glo_buf)`, flag 1 -> 0."""
        slot = self._slots[key]
        with self._cond:
            if local_step_done:
                # Normally already 1: the local update of `step` runs before its job is queued.
                self._cond.wait_for(lambda: slot.flag == 1 or self._error is not None)
            if self._error is not None:
                return
        global_update(slot.glo_buf)
        with self._cond:
            slot.version = step + 1
            slot.flag = 0
            self._cond.notify_all()

    def wait_version(self, key, version):
        """Block until glo_buf of `key` holds w_version; raise on pipeline failure or timeout."""
        slot = self._slots[key]
        start = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(lambda: slot.version >= version or self._error is not None,
                                     self.timeout)
            self.blocked_s += time.perf_counter() - start
            if self._error is not None or not ok:
                self.failed = True
            if self._error is not None:
                from .pipeline import PipelineError
                raise PipelineError.of(self._error, self._error_where)
            if not ok:
                raise BackupTimeout(
                    "key %r: global weights of step %d did not arrive within %.0f s; a worker or "
                    "server may have died (set SLIMGC_TIMEOUT to wait longer)"
                    % (key, version, self.timeout))

    def fail(self, exc, where):
        """Wake every waiter: the aggregation of `where` failed with `exc`."""
        with self._cond:
            self._error = exc
            self._error_where = where
            self._cond.notify_all()

    def flush(self):
        """Write the newest global weights into every key's parameters (the checkpointable state)."""
        for key, slot in self._slots.items():
            self.wait_version(key, slot.version)
            if slot.loc_bufs is not None:
                for out in slot.loc_bufs:
                    slot.glo_buf.copyto(out)

    def state_dict(self):
        return {key: {"glo_buf": s.glo_buf.asnumpy(), "version": s.version, "flag": s.flag}
                for key, s in self._slots.items()}

    def load_state_dict(self, state):
        for key, s in state.items():
            slot = self._slots[key]
            slot.glo_buf[:] = s["glo_buf"]
            slot.version = s["version"]
            slot.flag = s["flag"]


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


class LocalUpdater:
    """The local update of the backup: one step of the global optimizer from glo_buf.

    By default it applies the global optimizer's rule with a copy of the global
    optimizer state (e.g. momentum) as it stands after w_i, and the local gradient
    scaled by num_workers in place of the sum over workers: the best local guess of
    w_{i+1}, exact when every worker's gradient is the same (always with one
    worker). It keeps no recursion of its own, so it is as stable as the global
    optimizer. `loc_optimizer` (a name) instead runs that optimizer with its own
    state; `loc_lr` replaces the learning rate.
    """

    def __init__(self, global_optimizer, num_workers, loc_lr=None, loc_optimizer=None,
                 global_updater=None):
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

    def __call__(self, index, grad, weight):
        opt = self.optimizer
        opt.lr = self._loc_lr if self._loc_lr is not None else self._global.lr
        opt.rescale_grad = self._global.rescale_grad * self._num_workers
        source = self._global_updater
        if source is not None:
            glo_opt = source.optimizer
            opt._index_update_count[index] = glo_opt._index_update_count.get(
                index, glo_opt.begin_num_update)
            if index in source.states:
                self._updater.states[index] = _copy_state(source.states[index])
                self._updater.states_synced[index] = True
            else:
                self._updater.states.pop(index, None)
        self._updater(index, grad, weight)


def _copy_state(state):
    """A copy of an optimizer state: NDArrays copied (engine ops), nesting kept."""
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return state
