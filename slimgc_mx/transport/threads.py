"""N in-process workers (threads) that sum through a shared dict: tests and demos."""
import threading

import numpy as np

from .base import TransferHandle, Transport, TransportTimeout, piece_bounds


class ThreadGroup:
    """N workers as threads; each gets `group.transport(rank)`.

    A push_pull completes once all N workers pushed that wire key for that round, like
    a dist_sync server.
    """

    def __init__(self, num_workers, link=None, piece_bytes=0):
        self.num_workers = num_workers
        self.piece_bytes = piece_bytes  # buffers larger than this go as pieces (as dist's)
        # Optional callable(nbytes) -> seconds: an emulated link whose modeled time is
        # reported as the transfer time (TransferHandle.elapsed), so timings are reproducible.
        self.link = link
        self._cond = threading.Condition()
        self._rounds = {}  # (wire_key, round) -> [sum, arrivals, results_taken]

    def transport(self, rank):
        return ThreadTransport(self, rank)

    def add(self, wire_key, rnd, array):
        """Add one worker's contribution; returns a function that waits for and takes the sum."""
        with self._cond:
            slot = self._rounds.setdefault((wire_key, rnd), [np.zeros_like(array), 0, 0])
            slot[0] += array
            slot[1] += 1
            self._cond.notify_all()

        def take():
            with self._cond:
                if not self._cond.wait_for(lambda: slot[1] == self.num_workers, timeout=60):
                    raise TransportTimeout("thread group: not every worker pushed key %r"
                                           % (wire_key,))
                slot[2] += 1
                if slot[2] == self.num_workers:
                    del self._rounds[(wire_key, rnd)]
                return slot[0].copy()
        return take

    def sum(self, wire_key, rnd, array):
        return self.add(wire_key, rnd, array)()


class ThreadHandle(TransferHandle):
    """Waits for the other workers' contributions, like a pull from a dist_sync server."""

    def __init__(self, recv, take, elapsed):
        super().__init__(recv, elapsed)
        self._take = take

    def wait(self):
        np.copyto(self._recv.for_write(), self._take())


class ThreadTransport(Transport):
    """One worker's side of a ThreadGroup."""

    kind = "threads"

    def __init__(self, group, rank):
        self._group = group
        self.rank = rank
        self.num_workers = group.num_workers
        self._round = {}
        self._pieces = {}  # wire key -> element bounds of its pieces

    def _next_round(self, key):
        rnd = self._round.get(key, 0)
        self._round[key] = rnd + 1
        return rnd

    def declare(self, wire_key, buf):
        view = buf.held()
        bounds = piece_bounds(view.size, view.itemsize, self._group.piece_bytes)
        if bounds is not None:
            self._pieces[wire_key] = bounds

    def pieces(self, wire_key):
        return self._pieces.get(wire_key)

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        if in_pieces:  # summed whole, once every piece's writer is done
            for nd in send.pieces(self._pieces[wire_key]):
                nd.wait_to_read()
            values = send.held()
        else:
            values = send.for_read()
        take = self._group.add(wire_key, self._next_round(wire_key), values)
        link = self._group.link
        return ThreadHandle(recv, take, None if link is None else link(send.nbytes))

    def declare_gather(self, wire_key, send, recv):
        pass

    def gather(self, wire_key, send, recv, priority=0):
        mine = send.for_read()
        slots = np.zeros(recv.nbytes // mine.itemsize, dtype=mine.dtype)
        slots[self.rank * mine.size:(self.rank + 1) * mine.size] = mine
        take = self._group.add(("gather", wire_key), self._next_round(("gather", wire_key)),
                               slots)
        link = self._group.link
        return ThreadHandle(recv, take, None if link is None else link(send.nbytes))

    def broadcast(self, wire_key, buf):
        view = buf.for_read()
        contribution = view if self.rank == 0 else np.zeros_like(view)
        total = self._group.sum(("bcast", wire_key), self._next_round(("bcast", wire_key)),
                                contribution)
        np.copyto(buf.for_write(), total)

    def allgather(self, values):
        values = np.asarray(values, dtype=np.float64).ravel()
        slots = np.zeros((self.num_workers, values.size))
        slots[self.rank] = values
        key = ("gather", values.size)
        return self._group.sum(key, self._next_round(key), slots)
