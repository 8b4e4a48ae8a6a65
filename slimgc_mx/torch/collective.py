"""TorchTransport: the engine's collectives over torch.distributed (Gloo), no server process.

torch.distributed pairs collectives by the order each rank issues them, while the engine's
pipeline reaches the transport in whichever order keys become ready (a CUDA copy, a codec's
second round). So every exchange is announced by the training thread when it is submitted
(Transport.announce: the same order on every rank) and one issuing thread starts them in
that order as each is handed over, asynchronously; the rest of the engine waits on a Work.
Sums of lanes are float64 sums of integers below 2**53 (exact, as on MXNet's servers);
gathers are allgathers. The training thread's own collectives (broadcast, small allgathers,
AMP's agreement) go through the same issuing thread, announced where they are called.
A rider (ride(): a few integers, the per-step settings check's hash) takes a place in that
order and travels appended to the next exchange, so it costs no collective of its own.
Every tensor handed to a collective is kept until Gloo has let go of it (Collectives), and
close() waits for that, so that no Gloo thread frees a Python object at interpreter exit.
"""
import atexit
import collections
import datetime
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..transport.base import TransferHandle, Transport


#: The wire key of the training thread's own collectives (never a key of the engine's).
_SYNC = ("training thread",)
#: The wire key of the riders' places in the order (TorchTransport.ride).
_RIDE = ("rider",)
#: The largest exchange, in bytes, that carries a rider (it is copied once each way).
RIDE_BYTES = 1 << 18
#: Seconds close() waits at interpreter exit for Gloo to let go of the tensors it was handed.
EXIT_SETTLE_S = 5.0


def _use_count(tensor):
    """References to the tensor's C++ object: 1 while only its Python object holds it."""
    count = getattr(tensor, "_use_count", None)
    return count() if count is not None else 0


class Collectives:
    """torch.distributed's collectives on `group`, started asynchronously: each returns a
    Lent, which holds the collective's tensors until its torch Work is gone.

    A Gloo worker thread lets go of a finished collective a moment after wait() has
    returned; where it holds the last reference to the Work, it frees the tensors that
    Python made, which takes the GIL. Were the interpreter exiting meanwhile, that thread
    would be ended inside a C++ destructor and the process abort ('terminate called without
    an active exception') after its work was done. So the tensors are kept until Gloo has
    let go, and settle() waits for that while the interpreter is alive."""

    def __init__(self, group):
        self.group = group
        self._lent = []  # Lent not gone yet
        self._lock = threading.Lock()

    def _start(self, tensors, start):
        counts = [_use_count(t) for t in tensors]  # before the Work holds them
        lent = Lent(start(), list(zip(tensors, counts)))
        with self._lock:
            self._lent = [x for x in self._lent if not x.gone()]
            self._lent.append(lent)
        return lent

    def held(self, done=False):
        """How many collectives Gloo may still hold; done: let go of the Works of those
        finished that no one waited for."""
        with self._lock:
            if done:
                for lent in self._lent:
                    work = lent.work
                    if work is not None and work.is_completed():
                        lent.work = None
            self._lent = [x for x in self._lent if not x.gone()]
            return len(self._lent)

    def settle(self, timeout):
        """Wait (at most `timeout` seconds) until Gloo holds none of the collectives it was
        given; False if it still does."""
        deadline = time.monotonic() + timeout
        while self.held(done=True):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)  # (a worker needs the GIL to let go)
        return True

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        return self._start([tensor], lambda: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=True))

    def all_gather(self, rows, mine):
        """Every rank's `mine` into its row of `rows` (ranks x mine.numel()): a list of the
        rows, not one flat output, as Gloo would hold views of it that it made itself."""
        outputs = list(rows.unbind(0))
        return self._start(outputs + [mine], lambda: dist.all_gather(
            outputs, mine, group=self.group, async_op=True))

    def broadcast(self, tensor):
        """Rank 0's values of `tensor`."""
        return self._start([tensor], lambda: dist.broadcast(
            tensor, src=0, group=self.group, async_op=True))


class Lent:
    """A collective started by Collectives: its torch Work until waited, and its tensors
    with their use counts from before, until the Work is gone."""

    __slots__ = ("work", "tensors")

    def __init__(self, work, tensors):
        self.work = work
        self.tensors = tensors

    def wait(self):
        work = self.work
        if work is not None:
            work.wait()
            self.work = None  # (Gloo may hold it a moment longer: gone() says when not)

    def gone(self):
        return self.work is None and all(_use_count(t) <= n for t, n in self.tensors)


class TorchWork(TransferHandle):
    """An exchange handed to the issuing thread; wait() returns once its result is in recv.

    start(wire) starts its collective on `wire` (Collectives) and returns its Lent;
    carry(wire, rider), where given, starts it with a Rider's slots appended instead and
    returns (Lent, what to run once it is done), or None where it cannot carry them."""

    def __init__(self, recv, start, carry=None, after=None):
        super().__init__(recv)
        self._start = start  # (wire) -> Lent, run by the issuing thread
        self._carry = carry
        self._after = after  # run once, by the first wait() after the collective is done
        self._lock = threading.Lock()
        self._issued = threading.Event()
        self._work = None
        self._error = None

    def issue(self, wire, rider=None):
        """Start the collective, carrying `rider` where it can; True when it does."""
        carried = False
        try:
            started = self._carry(wire, rider) if rider is not None and self._carry else None
            if started is not None:
                (self._work, self._after), carried = started, True
            else:
                self._work = self._start(wire)
        except BaseException as exc:  # raised where the pipeline waits
            self._error = exc
        self._start = self._carry = None  # (their tensors are lent: Collectives)
        self._issued.set()
        if carried:
            rider.carried_by(self)
        return carried

    def fail(self, exc):
        self._error = exc
        self._issued.set()

    def issued(self, timeout):
        """True once the issuing thread has started it (or failed it), within `timeout` s."""
        return self._issued.wait(timeout)

    def wait(self):
        self._issued.wait()
        if self._error is not None:
            raise self._error
        work = self._work
        if work is not None:
            work.wait()
        with self._lock:  # (a second waiter returns once `after` has run)
            if self._after is not None:
                self._after()
                self._after = None
            self._work = None  # done (its tensors are let go once Gloo has: Lent)


class Rider:
    """Integers below 2**52 that every rank sends with its next exchange
    (TorchTransport.ride); same() says, alike on every rank, whether all ranks sent equal
    ones. They travel as pieces and their squares, whose sums over N ranks are exact: equal
    everywhere iff N * sum(p**2) == sum(p)**2 for every piece."""

    def __init__(self, values, num_workers):
        self.values = [int(v) for v in values]
        self.num_workers = num_workers
        self.sums = None  # of the slots over the ranks, once the carrier is done
        self._carrier = None
        self._placed = threading.Event()
        self._lock = threading.Lock()  # one caller of same() reads the exchange at a time
        self._same = None

    _slots = {}  # (values, dtype, ranks) -> slots(): a step's are mostly the last one's

    def slots(self, dtype):
        """The pieces, then their squares, as a NumPy array of `dtype` (not to be written)
        whose sums over the ranks are exact; None for a dtype that cannot hold them."""
        dtype = np.dtype(dtype)
        key = (tuple(self.values), dtype, self.num_workers)
        made = self._slots.get(key)
        if made is None and key not in self._slots:
            mantissa = {np.dtype(np.float32): 24, np.dtype(np.float64): 53}.get(dtype, 0)
            bits = min(26, (mantissa - self.num_workers.bit_length()) // 2)
            if bits >= 1:
                pieces = np.array([(v >> shift) & ((1 << bits) - 1) for v in self.values
                                   for shift in range(0, 52, bits)], dtype=np.float64)
                made = np.concatenate([pieces, pieces * pieces]).astype(dtype)
            if len(self._slots) >= 16:
                self._slots.clear()
            self._slots[key] = made
        return made

    def carried_by(self, work):
        self._carrier = work
        self._placed.set()

    def alone(self, wire):
        """Send it in a collective of its own (the next exchange could not carry it)."""
        slots = self.slots(np.float64).copy()
        work = TorchWork(None, lambda w: w.all_reduce(torch.from_numpy(slots)),
                         after=lambda: setattr(self, "sums", slots))
        work.issue(wire)
        self.carried_by(work)

    def fail(self, exc=None):
        """Sent by no rank (the step that placed it raised, or the transport closed):
        same() says True at once."""
        self._placed.set()

    def same(self):
        """Wait for its exchange; True when every rank sent the same values. Either thread
        (the global update's, the training thread's flush): the verdict is made under a
        lock, so a second caller never finds the carrier let go before the verdict is set
        (it read that as 'sent by no rank' and missed a difference)."""
        self._placed.wait()
        with self._lock:
            if self._same is None:
                if self._carrier is None:  # failed: sent by no rank
                    self._same = True
                else:
                    self._carrier.wait()
                    k = len(self.sums) // 2
                    s1 = [int(x) for x in self.sums[:k]]
                    s2 = [int(x) for x in self.sums[k:]]
                    self._same = all(self.num_workers * b == a * a for a, b in zip(s1, s2))
                    self._carrier = None
            return self._same


class TorchTransport(Transport):
    """One rank's collectives over one Gloo group of all ranks: the job's default group when
    it is Gloo (a group made after it would not survive torchrun's restarts), else a new one."""

    kind = "torch.distributed (gloo)"

    def __init__(self, timeout=600.0):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.num_workers = dist.get_world_size()
        self.timeout = timeout
        if dist.get_backend() == "gloo":
            self._group = dist.group.WORLD
        else:  # NCCL cannot sum host lanes
            self._group = dist.new_group(backend="gloo",
                                         timeout=datetime.timedelta(seconds=timeout))
        if self._group in _UNEVEN:
            raise RuntimeError(
                "an aggregation of an earlier DistributedOptimizer failed on this process "
                "group, in this process: its ranks may have stopped at different collectives, "
                "so a new optimizer's would pair with those left over and wait forever. Start "
                "the processes afresh (a job per trial, or torchrun --max-restarts) after "
                "such an error")
        self._wire = Collectives(self._group)
        self._cond = threading.Condition()
        self._order = collections.deque()  # (wire key, occurrence) in the announced order
        self._announced = collections.Counter()
        self._called = collections.Counter()
        self._handed = {}  # (wire key, occurrence) -> TorchWork not yet issued
        self._closed = False
        self._thread = threading.Thread(target=self._issue_loop, name="slimgc-collectives",
                                        daemon=True)
        self._thread.start()
        _closed_at_exit(self)

    @property
    def group(self):
        """The Gloo group of all ranks that this transport's collectives run on."""
        return self._group

    def mark_uneven(self):
        """Its aggregation failed: each rank stopped at its own point of the order, so no
        later transport in this process may use the group (_UNEVEN)."""
        if self._group is not None:
            _UNEVEN[self._group] = True

    # -- the pipeline's exchanges, in the announced order ---------------------------------
    def announce(self, wire_keys):
        with self._cond:
            for key in wire_keys:
                self._order.append((key, self._announced[key]))
                self._announced[key] += 1
            self._cond.notify_all()

    def _hand(self, wire_key, work):
        with self._cond:
            if self._closed:
                work.fail(RuntimeError("the transport is closed: no collective is issued"))
                return work
            slot = (wire_key, self._called[wire_key])
            self._called[wire_key] += 1
            if self._called[wire_key] > self._announced[wire_key]:  # not announced: call order
                self._order.append(slot)
                self._announced[wire_key] += 1
            self._handed[slot] = work
            self._cond.notify_all()
        return work

    def _issue_loop(self):
        rider = None  # a Rider waiting for the next exchange
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (
                    self._order and self._order[0] in self._handed))
                if self._closed:
                    pending = list(self._handed.values()) + [rider] * (rider is not None)
                    self._handed.clear()
                    break
                work = self._handed.pop(self._order.popleft())
            if isinstance(work, Rider):
                if rider is not None:  # no exchange between two riders
                    rider.alone(self._wire)
                rider = work
                continue
            if rider is None:
                work.issue(self._wire)
            elif not work.issue(self._wire, rider):
                rider.alone(self._wire)  # right after the exchange that could not carry it
            rider = None
        for work in pending:
            work.fail(RuntimeError("the transport was closed before this exchange started"))

    def declare(self, wire_key, buf):
        pass

    def declare_gather(self, wire_key, send, recv):
        pass

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        if in_pieces:
            raise ValueError("torch.distributed sends buffers whole (pieces() is None)")
        out = recv.for_write()
        np.copyto(out, send.for_read())
        tensor = torch.from_numpy(out)

        def carry(wire, rider):  # the sum of the tensor and the rider's slots, then apart
            extra = rider.slots(out.dtype)
            if extra is None or out.nbytes > RIDE_BYTES:
                return None
            both = np.concatenate([out, extra])

            def after():
                np.copyto(out, both[:out.size])
                rider.sums = both[out.size:]
            return wire.all_reduce(torch.from_numpy(both)), after
        return self._hand(wire_key, TorchWork(recv, lambda wire: wire.all_reduce(tensor),
                                              carry))

    def gather(self, wire_key, send, recv, priority=0):
        mine_np = send.for_read()
        mine = torch.from_numpy(mine_np)
        slots = torch.from_numpy(recv.for_write())[:mine.numel() * self.num_workers]

        def carry(wire, rider):  # each rank's row with the rider's slots, then apart
            extra = rider.slots(mine_np.dtype)
            if extra is None or slots.numel() * slots.element_size() > RIDE_BYTES:
                return None
            m, n = mine.numel(), self.num_workers
            rows = torch.empty((n, m + extra.size), dtype=mine.dtype)

            def after():
                slots.view(n, m).copy_(rows[:, :m])
                rider.sums = rows[:, m:].numpy().sum(0, dtype=np.float64)
            return wire.all_gather(rows, torch.from_numpy(np.concatenate([mine_np, extra]))), \
                after
        return self._hand(wire_key, TorchWork(recv, lambda wire: wire.all_gather(
            slots.view(self.num_workers, mine.numel()), mine), carry))

    def ride(self, values):
        """A Rider of `values` (integers below 2**52): sent with the next exchange in the
        training thread's order (alone where that one cannot carry it), so every rank
        learns whether all sent the same without a collective of its own."""
        rider = Rider(values, self.num_workers)
        with self._cond:  # announced and handed at once; no need to wake the issuing thread
            if self._closed:
                rider.fail()
                return rider
            slot = (_RIDE, self._announced[_RIDE])
            self._announced[_RIDE] += 1
            self._called[_RIDE] += 1
            self._order.append(slot)
            self._handed[slot] = rider
        return rider

    # -- the training thread's collectives, in its order among the pipeline's --------------
    def run(self, start):
        """Issue `start(wire)` (a collective of Collectives `wire`) after every exchange
        announced before it, and wait for it: for the training thread's own collectives.
        TimeoutError when it is not issued within the timeout: an exchange announced
        before it was never handed over, and the training thread must not wait forever."""
        self.announce([_SYNC])
        work = self._hand(_SYNC, TorchWork(None, start))
        if not work.issued(self.timeout):
            with self._cond:
                waiting = self._order[0][0] if self._order else None
            raise TimeoutError(
                "rank %d: a collective of the training thread (a buffer broadcast, a settings "
                "check, AMP's agreement) did not start in %g s (timeout): this rank's "
                "exchange %r, announced before it, was never handed to the transport, so "
                "an aggregation on this rank failed or stalled; the error of the rank that "
                "failed names the cause" % (self.rank, self.timeout, waiting))
        work.wait()

    def broadcast(self, wire_key, buf):
        tensor = torch.from_numpy(buf.for_write())
        self.run(lambda wire: wire.broadcast(tensor))

    def broadcast_tensors(self, tensors):
        """Rank 0's values of `tensors` (module buffers, on any device) on every rank."""
        for t in tensors:
            self.run(lambda wire, t=t: wire.broadcast(t))

    def any(self, flag):
        """True on every rank when `flag` is true on any (AMP's inf/NaN agreement)."""
        t = torch.tensor([1.0 if flag else 0.0])
        self.run(lambda wire: wire.all_reduce(t, op=dist.ReduceOp.MAX))
        return bool(t.item() > 0)

    def allgather(self, values):
        mine = torch.from_numpy(np.asarray(values, dtype=np.float64).ravel().copy())
        out = torch.zeros((self.num_workers, mine.numel()), dtype=torch.float64)
        self.run(lambda wire: wire.all_gather(out, mine))
        return out.numpy()

    def close(self, timeout=None):
        """Stop issuing, wait until Gloo has let go of every tensor it was handed
        (Collectives.settle: at most `timeout` seconds, default the transport's), and let go
        of the group, so that destroy_process_group() frees it while the interpreter is
        alive. False when the issuing thread or Gloo did not finish in time."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if not self._wire.settle(self.timeout if timeout is None else timeout):
            return False  # (the tensors stay held: a Gloo thread must not free them)
        self._group = self._wire.group = None
        return True


#: The groups on which an aggregation failed in this process (TorchTransport.mark_uneven).
_UNEVEN = weakref.WeakKeyDictionary()
#: The transports not closed yet, closed at interpreter exit (_close_at_exit).
_OPEN = weakref.WeakSet()
_exit_handler = []


def _closed_at_exit(transport):
    """Close `transport` at exit unless closed before. The first one registers the exit
    handler, after the group it uses was made, so that it runs before the group's own
    (optimizer.init_process_group's destroy)."""
    if not _exit_handler:
        _exit_handler.append(atexit.register(_close_at_exit))
    _OPEN.add(transport)


def _close_at_exit():
    for transport in list(_OPEN):
        if transport._group is not None:
            transport.close(timeout=EXIT_SETTLE_S)
