"""Model backup (SlimGC Strategy 3): glo_buf, loc_buf and the status flag of paper §3.6.

Per key, glo_buf holds the global weights w_i and `version` says which i. At
step i the training thread waits for version i, computes
loc_buf = w_i - loc_lr * g_loc (the local update), copies it into the parameters
and sets the flag 0 -> 1; it then returns and computes step i+1 while step i is
still being aggregated. The aggregation thread may overwrite glo_buf with w_{i+1}
only while the flag is 1 (the local update has read w_i, or is queued in MXNet's
engine, which orders it before that write); it then sets it 1 -> 0 and
publishes version i+1. With backup off the parameters get w_{i+1} (synchronous
SGD); the training thread does not wait for it: a write hold in MXNet's engine
makes the next forward pass wait instead, as MXNet's own kvstore does.
"""
import copy
import threading
import time

import mxnet as mx
import numpy as np

from .transport import Buffer, async_engine, copy_array


class BackupTimeout(TimeoutError):
    """The training thread waited longer than the configured timeout for an aggregation."""


class _Slot:
    __slots__ = ("glo", "loc", "version", "flag", "params", "staged", "pending")

    def __init__(self, glo):
        self.glo = glo  # glo_buf, a Buffer
        self.version = 0
        self.flag = 0
        self.loc = None  # backup on: loc_buf, the local update's result, a Buffer
        self.params = None  # the parameter arrays the trainer reads (loc_buf or w_i is copied there)
        self.staged = None  # backup off: what the parameters copy from once the hold is released
        self.pending = None  # backup off: (version, WriteHold, deadline) not yet published

    @property
    def glo_buf(self):
        return self.glo.nd

    def stage(self):
        """Copy glo_buf into the staging buffer: runs under its WriteHold, glo_buf already read-ready."""
        np.copyto(self.staged.held(), self.glo.held())


class ModelBackup:
    """glo_buf per key and the loc_buf status flag; the two threads meet only here.

    `engine` (an EngineNotifier) lets write_back return without waiting; without
    it, or under MXNet's NaiveEngine, write_back waits for the global weights.
    """

    def __init__(self, enabled, timeout, engine=None):
        self.enabled = enabled
        self.timeout = timeout
        self._engine = engine if engine is not None and not enabled and async_engine() else None
        self._slots = {}
        self._cond = threading.Condition()
        self._error = None
        self._error_where = None
        self._closed = threading.Event()
        self._watchdog = None
        self.blocked_s = 0.0  # training-thread time spent waiting for global weights
        self.failed = False  # a wait raised: an aggregation failed or never completed

    def add(self, key, weight):
        """Register `key` with initial global weights (copied to a CPU, default-layout glo_buf)."""
        glo = Buffer(weight.shape, np.float32)
        weight.copyto(glo.nd)
        slot = self._slots[key] = _Slot(glo)
        if self.enabled:
            slot.loc = Buffer(weight.shape, np.float32)
        if self._engine is not None:
            slot.staged = Buffer(weight.shape, np.float32)
            glo.nd.copyto(slot.staged.nd)

    def glo_buf(self, key):
        return self._slots[key].glo_buf

    def version(self, key):
        return self._slots[key].version

    def local_step(self, key, step, grad, params, local_update):
        """Training thread, backup on: loc_buf = glo_step - loc_lr * grad into params, flag 0 -> 1.

        `local_update(grad, glo, loc)` writes the locally updated weights into the
        Buffer loc (loc_buf) from the Buffer glo (glo_buf); loc_buf is then copied
        into every array of `params`.
        """
        slot = self._slots[key]
        self.wait_version(key, step)
        slot.params = params
        local_update(grad, slot.glo, slot.loc)
        for out in params:
            copy_array(slot.loc.nd, out)
        with self._cond:
            slot.flag = 1
            self._cond.notify_all()

    def write_back(self, key, step, params):
        """Training thread, backup off: the parameters get glo_step once it is published.

        With the engine it returns at once: a WriteHold on the staging buffer sits
        between the aggregation and the copies into the parameters, so the next
        forward pass waits in the engine, while this thread queues more work.
        """
        slot = self._slots[key]
        slot.params = params
        if self._engine is None:
            self.wait_version(key, step)
            for out in params:
                copy_array(slot.glo_buf, out)
            return
        hold = self._engine.hold(slot.staged.nd)
        for out in params:
            copy_array(slot.staged.nd, out)
        with self._cond:
            failed = self._error is not None
            waiting = slot.version < step and not failed
            if waiting:
                slot.pending = (step, hold, time.monotonic() + self.timeout)
        if waiting:
            self._watch()
        else:
            hold.release(None if failed else slot.stage)

    def publish(self, entries, global_update):
        """Aggregation thread: glo_buf <- w_{step+1}, flag 1 -> 0, for each entry.

        entries: (key, step, local_step_done). `global_update(glos)` writes all of
        them (glo_buf Buffers) at once, so one multi-tensor optimizer call can serve
        a fused bucket.
        """
        slots = [self._slots[key] for key, _, _ in entries]
        with self._cond:
            for slot, (_, _, local_step_done) in zip(slots, entries):
                if local_step_done:
                    # Normally already 1: the local update of `step` runs before its job is queued.
                    self._cond.wait_for(lambda: slot.flag == 1 or self._error is not None)
            if self._error is not None:
                return
        global_update([slot.glo for slot in slots])
        for slot in slots:
            if slot.staged is not None:
                slot.glo.for_read()  # the fill below copies it without waiting
        released = []
        with self._cond:
            for slot, (_, step, _) in zip(slots, entries):
                slot.version = step + 1
                slot.flag = 0
                if slot.pending is not None:
                    released.append((slot.pending[1], slot))
                slot.pending = None
            self._cond.notify_all()
        for hold, slot in released:
            hold.release(slot.stage)

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
                self._raise()
            if not ok:
                raise BackupTimeout(_late(key, version, self.timeout))

    def _raise(self):
        if isinstance(self._error, BackupTimeout):
            raise BackupTimeout(str(self._error))
        from .pipeline import PipelineError
        raise PipelineError.of(self._error, self._error_where)

    def fail(self, exc, where):
        """Wake every waiter and release every hold: the aggregation of `where` failed with `exc`."""
        with self._cond:
            if self._error is None:
                self._error = exc
                self._error_where = where
            self._cond.notify_all()
        self._release_all()

    def _release_all(self):
        """Let the engine go on without the global weights (they are not coming)."""
        with self._cond:
            pending = [s.pending for s in self._slots.values() if s.pending is not None]
            for s in self._slots.values():
                s.pending = None
        for _, hold, _ in pending:
            hold.release()

    def _watch(self):
        """Start the thread that fails holds whose aggregation is later than the timeout."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watchdog_loop, name="slimgc-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _watchdog_loop(self):
        poll = max(0.05, min(1.0, self.timeout / 4))
        while not self._closed.wait(poll):
            now = time.monotonic()
            with self._cond:
                late = [(k, s.pending[0]) for k, s in self._slots.items()
                        if s.pending is not None and s.pending[2] <= now]
            if late:
                key, version = late[0]
                self.failed = True
                self.fail(BackupTimeout(_late(key, version, self.timeout)),
                          "key %r, step %d" % (key, version - 1))

    def close(self):
        """Stop the watchdog and release any hold left, so the engine never waits on it."""
        self._closed.set()
        self._release_all()

    def flush(self):
        """Write the newest global weights into every key's parameters (the checkpointable state)."""
        for key, slot in self._slots.items():
            self.wait_version(key, slot.version)
            if slot.params is not None:
                for out in slot.params:
                    slot.glo_buf.copyto(out)

    def state_dict(self):
        return {key: {"glo_buf": s.glo_buf.asnumpy(), "version": s.version, "flag": s.flag}
                for key, s in self._slots.items()}

    def load_state_dict(self, state):
        for key, s in state.items():
            slot = self._slots[key]
            slot.glo_buf[:] = s["glo_buf"]
            if slot.staged is not None:
                slot.glo_buf.copyto(slot.staged.nd)
            slot.version = s["version"]
            slot.flag = s["flag"]


def _late(key, version, timeout):
    return ("key %r: global weights of step %d did not arrive within %.0f s; a worker or server "
            "may have died (set SLIMGC_TIMEOUT to wait longer)" % (key, version, timeout))


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

    @property
    def fused(self):
        """True when the update runs as the SGD kernel."""
        return self._kernel is not None

    def __call__(self, index, grad, glo, out, check=None):
        """out <- glo after one local step with `grad` (all Buffers; glo is not written).

        `check` (a pipeline.GradCheck) is filled when the SGD kernel runs the step.
        """
        opt = self.optimizer
        opt.lr = self._loc_lr if self._loc_lr is not None else self._global.lr
        opt.rescale_grad = self._global.rescale_grad * self._num_workers
        source = self._global_updater
        if source is not None:
            glo_opt = source.optimizer
            opt._index_update_count[index] = glo_opt._index_update_count.get(
                index, glo_opt.begin_num_update)
            if self._kernel is not None:
                self._kernel.local_step(opt, index, grad, glo, out, self._engine, check)
                return
            if index in source.states:
                self._updater.states[index] = _copy_state(source.states[index])
                self._updater.states_synced[index] = True
            else:
                self._updater.states.pop(index, None)
        copy_array(glo.nd, out.nd)
        self._updater(index, grad.nd, out.nd)


def _copy_state(state):
    """A copy of an optimizer state: NDArrays copied (engine ops), nesting kept."""
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return state
