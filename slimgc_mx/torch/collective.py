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
"""
import collections
import datetime
import threading

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


class TorchWork(TransferHandle):
    """An exchange handed to the issuing thread; wait() returns once its result is in recv.

    start(group) starts its collective; carry(group, rider), where given, starts it with a
    Rider's slots appended instead and returns (torch Work, what to run once it is done),
    or None where it cannot carry them."""

    def __init__(self, recv, start, carry=None, after=None):
        super().__init__(recv)
        self._start = start  # (group) -> torch Work, run by the issuing thread
        self._carry = carry
        self._after = after  # run once, by the first wait() after the collective is done
        self._lock = threading.Lock()
        self._issued = threading.Event()
        self._work = None
        self._error = None

    def issue(self, group, rider=None):
        """Start the collective, carrying `rider` where it can; True when it does."""
        carried = False
        try:
            started = self._carry(group, rider) if rider is not None and self._carry else None
            if started is not None:
                (self._work, self._after), carried = started, True
            else:
                self._work = self._start(group)
        except BaseException as exc:  # raised where the pipeline waits
            self._error = exc
        self._start = self._carry = None  # (their tensors are the Work's now)
        self._issued.set()
        if carried:
            rider.carried_by(self)
        return carried

    def fail(self, exc):
        self._error = exc
        self._issued.set()

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
            self._work = None  # done: let go of the Work and its tensors


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

    def alone(self, group):
        """Send it in a collective of its own (the next exchange could not carry it)."""
        slots = self.slots(np.float64).copy()
        work = TorchWork(None, lambda g: dist.all_reduce(torch.from_numpy(slots), group=g,
                                                         async_op=True),
                         after=lambda: setattr(self, "sums", slots))
        work.issue(group)
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
        self._cond = threading.Condition()
        self._order = collections.deque()  # (wire key, occurrence) in the announced order
        self._announced = collections.Counter()
        self._called = collections.Counter()
        self._handed = {}  # (wire key, occurrence) -> TorchWork not yet issued
        self._closed = False
        self._thread = threading.Thread(target=self._issue_loop, name="slimgc-collectives",
                                        daemon=True)
        self._thread.start()

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
                    rider.alone(self._group)
                rider = work
                continue
            if rider is None:
                work.issue(self._group)
            elif not work.issue(self._group, rider):
                rider.alone(self._group)  # right after the exchange that could not carry it
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

        def carry(group, rider):  # the sum of the tensor and the rider's slots, then apart
            extra = rider.slots(out.dtype)
            if extra is None or out.nbytes > RIDE_BYTES:
                return None
            both = np.concatenate([out, extra])

            def after():
                np.copyto(out, both[:out.size])
                rider.sums = both[out.size:]
            return dist.all_reduce(torch.from_numpy(both), group=group, async_op=True), after
        return self._hand(wire_key, TorchWork(recv, lambda group: dist.all_reduce(
            tensor, group=group, async_op=True), carry))

    def gather(self, wire_key, send, recv, priority=0):
        mine_np = send.for_read()
        mine = torch.from_numpy(mine_np)
        slots = torch.from_numpy(recv.for_write())[:mine.numel() * self.num_workers]

        def carry(group, rider):  # each rank's row with the rider's slots, then apart
            extra = rider.slots(mine_np.dtype)
            if extra is None or slots.numel() * slots.element_size() > RIDE_BYTES:
                return None
            m, n = mine.numel(), self.num_workers
            rows = torch.empty((n, m + extra.size), dtype=mine.dtype)

            def after():
                slots.view(n, m).copy_(rows[:, :m])
                rider.sums = rows[:, m:].numpy().sum(0, dtype=np.float64)
            return dist.all_gather_into_tensor(rows.view(-1), torch.from_numpy(np.concatenate(
                [mine_np, extra])), group=group, async_op=True), after
        return self._hand(wire_key, TorchWork(recv, lambda group: dist.all_gather_into_tensor(
            slots, mine, group=group, async_op=True), carry))

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
        """Issue `start(group)` (a collective with async_op=True) after every exchange
        announced before it, and wait for it: for the training thread's own collectives."""
        self.announce([_SYNC])
        self._hand(_SYNC, TorchWork(None, start)).wait()

    def broadcast(self, wire_key, buf):
        tensor = torch.from_numpy(buf.for_write())
        self.run(lambda group: dist.broadcast(tensor, src=0, group=group, async_op=True))

    def broadcast_tensors(self, tensors):
        """Rank 0's values of `tensors` (module buffers, on any device) on every rank."""
        for t in tensors:
            self.run(lambda group, t=t: dist.broadcast(t, src=0, group=group, async_op=True))

    def any(self, flag):
        """True on every rank when `flag` is true on any (AMP's inf/NaN agreement)."""
        t = torch.tensor([1.0 if flag else 0.0])
        self.run(lambda group: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group,
                                               async_op=True))
        return bool(t.item() > 0)

    def allgather(self, values):
        mine = torch.from_numpy(np.asarray(values, dtype=np.float64).ravel().copy())
        out = torch.zeros(self.num_workers * mine.numel(), dtype=torch.float64)
        self.run(lambda group: dist.all_gather_into_tensor(out, mine, group=group,
                                                           async_op=True))
        return out.numpy().reshape(self.num_workers, -1)

    def close(self, timeout=None):
        """Stop issuing and let go of the group, so that destroy_process_group() frees it
        while the interpreter is alive (a group freed at interpreter exit may abort)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._group = None
        return True
