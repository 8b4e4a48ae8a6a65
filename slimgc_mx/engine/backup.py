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

The state machine knows nothing of a framework: it keeps host arrays (backend.HostArray)
and reaches the framework's arrays through `arrays` (backend.Arrays: mxnet.buffers.ArrayOps for
MXNet, transport.HostArrays for plain NumPy), so it runs and is tested on any arrays.
"""
import threading
import time

import numpy as np

from .offload import PipelineError


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

    def stage(self):
        """Copy glo_buf into the staging buffer: runs under its WriteHold, glo_buf already read-ready."""
        np.copyto(self.staged.held(), self.glo.held())


class ModelBackup:
    """glo_buf per key and the loc_buf status flag; the two threads meet only here.

    `arrays` makes host arrays (`new(shape)`), gives the framework's array over one
    (`array(buf)`), queues copies between framework arrays in the framework's order
    (`copy(src, dst)`) and, when the framework runs asynchronously, holds an array's
    writers back (`hold(buf)`; `can_hold`): then write_back returns without waiting;
    otherwise it waits for the global weights.
    """

    def __init__(self, enabled, timeout, arrays):
        self.enabled = enabled
        self.timeout = timeout
        self._arrays = arrays
        self._holds = not enabled and arrays.can_hold
        # loc_buf is the parameter itself (one array per key), written by the local update
        self._loc_in_params = getattr(arrays, "loc_in_params", False)
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
        arrays = self._arrays
        glo = arrays.new(weight.shape)
        arrays.copy(weight, arrays.array(glo))
        slot = self._slots[key] = _Slot(glo)
        if self.enabled and not self._loc_in_params:
            slot.loc = arrays.new(weight.shape)
        if self._holds:
            slot.staged = arrays.new(weight.shape)
            arrays.copy(arrays.array(glo), arrays.array(slot.staged))

    def glo_buf(self, key):
        """glo_buf of `key` as the framework's array (MXNet: an NDArray)."""
        return self._arrays.array(self._slots[key].glo)

    def glo_buffer(self, key):
        """glo_buf of `key` as its Buffer (NDArray and NumPy view of the same memory)."""
        return self._slots[key].glo

    def version(self, key):
        return self._slots[key].version

    def local_step(self, key, step, grad, params, local_update):
        """Training thread, backup on: loc_buf = glo_step - loc_lr * grad into params, flag 0 -> 1.

        `local_update(grad, glo, loc)` writes the locally updated weights into the
        Buffer loc (loc_buf) from the Buffer glo (glo_buf); loc_buf is then copied
        into every array of `params`. Where the framework keeps loc_buf in the parameter
        (arrays.loc_in_params: one array per key), the local update writes it there.
        The caller has waited for glo_buf to hold w_step (wait_version).
        """
        slot = self._slots[key]
        if slot.version < step:
            raise RuntimeError("key %r: local step %d before glo_buf holds w_%d (call "
                               "wait_version first)" % (key, step, step))
        slot.params = params
        if slot.loc is None:
            if len(params) != 1:
                raise ValueError("key %r: loc_buf is the parameter, so one array per key is "
                                 "pushed, got %d" % (key, len(params)))
            local_update(grad, slot.glo, params[0])
        else:
            local_update(grad, slot.glo, slot.loc)
            loc = self._arrays.array(slot.loc)
            for out in params:
                self._arrays.copy(loc, out)
        with self._cond:
            slot.flag = 1
            self._cond.notify_all()

    def write_back(self, key, step, params):
        """Training thread, backup off: the parameters get glo_step once it is published.

        With the engine it returns at once: a WriteHold on the staging buffer sits
        between the aggregation and the copies into the parameters, so the next
        forward pass waits in the engine, while this thread queues more work.
        """
        if not self._holds:
            self.write_back_many([(key, step, params)])
            return
        slot = self._slots[key]
        slot.params = params
        hold = self._arrays.hold(slot.staged)
        staged = self._arrays.array(slot.staged)
        for out in params:
            self._arrays.copy(staged, out)
        with self._cond:
            failed = self._error is not None
            waiting = slot.version < step and not failed
            if waiting:
                slot.pending = (step, hold, time.monotonic() + self.timeout)
        if waiting:
            self._watch()
        else:
            hold.release(None if failed else slot.stage)

    def write_back_many(self, entries):
        """write_back() of several (key, step, params) entries; without the engine's holds,
        each waits for its glo_step and the parameters' copies are made by one call of the
        framework (a step's deferred write-backs, backup off)."""
        if self._holds:
            for key, step, params in entries:
                self.write_back(key, step, params)
            return
        pairs = []
        for key, step, params in entries:
            self._slots[key].params = params
            self.wait_version(key, step)
            glo = self.glo_buf(key)
            pairs.extend((glo, out) for out in params)
        self._arrays.copy_many(pairs)

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
        if slot.version >= version and self._error is None:
            return  # published already (versions only grow while this thread waits)
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
                    self._arrays.copy(self.glo_buf(key), out)

    def state_dict(self):
        """Per key: glo_buf (a flat float32 array), version and flag."""
        return {key: {"glo_buf": s.glo.for_read().copy(), "version": s.version, "flag": s.flag}
                for key, s in self._slots.items()}

    def load_state_dict(self, state):
        for key, s in state.items():
            slot = self._slots[key]
            np.copyto(slot.glo.for_write(), np.asarray(s["glo_buf"], np.float32).reshape(-1))
            if slot.staged is not None:
                self._arrays.copy(self.glo_buf(key), self._arrays.array(slot.staged))
            slot.version = s["version"]
            slot.flag = s["flag"]


def _late(key, version, timeout):
    return ("key %r: global weights of step %d did not arrive within %.0f s; a worker or server "
            "may have died (set SLIMGC_TIMEOUT to wait longer)" % (key, version, timeout))

