"""TorchTransport: the engine's collectives over torch.distributed (Gloo), no server process.

torch.distributed pairs collectives by the order each rank issues them, while the engine's
pipeline reaches the transport in whichever order keys become ready (a CUDA copy, a codec's
second round). So every exchange is announced by the training thread when it is submitted
(Transport.announce: the same order on every rank) and one issuing thread starts them in
that order as each is handed over, asynchronously; the rest of the engine waits on a Work.
Sums of lanes are float64 sums of integers below 2**53 (exact, as on MXNet's servers);
gathers are allgathers. The training thread's own collectives (broadcast, small allgathers,
AMP's agreement) go through the same issuing thread, announced where they are called.
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


class TorchWork(TransferHandle):
    """An exchange handed to the issuing thread; wait() returns once its result is in recv."""

    def __init__(self, recv, start):
        super().__init__(recv)
        self._start = start  # (group) -> torch Work, run by the issuing thread
        self._issued = threading.Event()
        self._work = None
        self._error = None

    def issue(self, group):
        try:
            self._work = self._start(group)
        except BaseException as exc:  # raised where the pipeline waits
            self._error = exc
        self._issued.set()

    def fail(self, exc):
        self._error = exc
        self._issued.set()

    def wait(self):
        self._issued.wait()
        if self._error is not None:
            raise self._error
        self._work.wait()


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
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (
                    self._order and self._order[0] in self._handed))
                if self._closed:
                    pending = list(self._handed.values())
                    self._handed.clear()
                    break
                work = self._handed.pop(self._order.popleft())
            work.issue(self._group)
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
        return self._hand(wire_key, TorchWork(recv, lambda group: dist.all_reduce(
            tensor, group=group, async_op=True)))

    def gather(self, wire_key, send, recv, priority=0):
        mine = torch.from_numpy(send.for_read())
        slots = torch.from_numpy(recv.for_write())[:mine.numel() * self.num_workers]
        return self._hand(wire_key, TorchWork(recv, lambda group: dist.all_gather_single(
            slots, mine, group=group, async_op=True)))

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
        self.run(lambda group: dist.all_gather_single(out, mine, group=group,
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
