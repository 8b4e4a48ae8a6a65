"""A device model's gradients into grad_buf by asynchronous copies, and the readiness that
admits a host buffer only once every copy into its memory has landed.

CudaCopies issues each copy on a side stream into pinned memory and returns its CUDA
event. DeferredCopies is a stand-in on CPU tensors whose copies land only when released, so
that a CPU machine can check what a GPU would do: no buffer is read before its producer's
event, fused or not, and no event is left behind (tests/test_torch_copies.py).
"""
import queue
import threading

import torch


def _span(buf):
    """(first address, end address) of a host buffer's memory."""
    flat = buf.held()
    start = flat.__array_interface__["data"][0]
    return start, start + flat.nbytes


class EventReadiness:
    """backend.Readiness for host buffers written by asynchronous copies: a buffer is admitted
    once the last copy into each part of its memory has landed, whichever view it was
    copied through (a fused bucket's members copy into views of the bucket's grad_buf);
    one thread waits for the events and calls back in the order buffers are asked for."""

    ordered = True  # serial (warm-up) transfers may wait here and keep their order

    def __init__(self):
        self._lock = threading.Lock()
        self._events = {}  # (start, end) of a copy's destination -> its event (the latest)
        self._waiting = 0  # buffers asked for whose callback has not run yet
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="slimgc-copies-ready",
                                        daemon=True)
        self._thread.start()

    def copied(self, buf, event):
        """Record that `event` completes the copy into `buf`'s memory (a later copy into the
        same memory, on the same stream, supersedes an earlier one)."""
        with self._lock:
            self._events[_span(buf)] = event

    def when_readable(self, buf, callback, priority=0):
        start, end = _span(buf)
        with self._lock:
            spans = [s for s in self._events if s[0] < end and start < s[1]]
            events = [self._events.pop(s) for s in spans]
            self._waiting += 1
        self._queue.put((events, callback))  # even with none: after those asked before

    def pending(self):
        """How many copies no buffer has been asked for yet (0 once a step has drained)."""
        with self._lock:
            return len(self._events)

    def waiting(self):
        """How many buffers asked for are not admitted yet."""
        with self._lock:
            return self._waiting

    def _run(self):
        while True:
            events, callback = self._queue.get()
            for event in events:
                event.synchronize()
            with self._lock:
                self._waiting -= 1
            callback()


class CudaCopies:
    """Non-blocking device-to-host copies on one side stream, after the work queued so far
    on the gradient's stream; each returns the CUDA event recorded after it."""

    def __init__(self):
        self._stream = torch.cuda.Stream()

    def to_host(self, src, dst):
        """Queue dst (a flat pinned host tensor) <- src (a CUDA tensor); its event."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src.reshape(-1), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # the allocator must not reuse it before the copy is done
        return event


class DeferredCopy:
    """One copy of DeferredCopies: lands (writes its destination) when released."""

    def __init__(self, data, dst):
        self._data, self._dst = data, dst
        self._landed = threading.Event()

    def land(self):
        if not self._landed.is_set():
            self._dst.copy_(self._data)
            self._landed.set()

    def synchronize(self):
        """As a CUDA event's: wait until the copy has landed."""
        self._landed.wait()

    def query(self):
        return self._landed.is_set()


class DeferredCopies:
    """A stand-in for CudaCopies on CPU tensors: a copy takes the source's value when it is
    queued (as a stream would), fills its destination with NaN until it lands (memory not
    yet written), and lands only when release() is called, in the order queued."""

    def __init__(self):
        self._lock = threading.Lock()
        self.queued = []  # copies not landed yet, oldest first
        self.copies = 0  # copies queued so far

    def to_host(self, src, dst):
        copy = DeferredCopy(src.detach().reshape(-1).clone(), dst)
        dst.fill_(float("nan"))
        with self._lock:
            self.queued.append(copy)
            self.copies += 1
        return copy

    def release(self, count=None):
        """Land the `count` oldest copies (default: all); how many landed."""
        with self._lock:
            count = len(self.queued) if count is None else min(count, len(self.queued))
            landing, self.queued = self.queued[:count], self.queued[count:]
        for copy in landing:
            copy.land()
        return len(landing)
