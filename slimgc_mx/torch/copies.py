"""A device model's copies between the device and host memory, their accounting, and the
readiness that admits a host buffer only once every copy into its memory has landed.

CudaCopies issues device-to-host copies on a side stream into pinned memory and
host-to-device copies from pinned memory on the compute stream, none of them blocking the
host; each returns a CUDA event. DeferredCopies is a stand-in on CPU tensors whose
device-to-host copies land only when released, so that a CPU machine can check what a GPU
would do: no buffer is read before its producer's event, fused or not, no event is left
behind, and a step copies no pageable byte (tests/test_torch_copies.py). Both count what
they move (CopyCounts), which stats() and `bench gpu` report per step.
"""
import dataclasses
import queue
import threading

import torch


def _span(x):
    """(first address, end address) of the memory of a host buffer, NumPy array or tensor."""
    if isinstance(x, torch.Tensor):
        start = x.data_ptr()
        return start, start + x.numel() * x.element_size()
    flat = x.held() if hasattr(x, "held") else x
    start = flat.__array_interface__["data"][0]
    return start, start + flat.nbytes


def _overlapping(table, x):
    """Pop and return the values of `table` ({span: value}) whose span overlaps x's."""
    start, end = _span(x)
    spans = [s for s in table if s[0] < end and start < s[1]]
    return [table.pop(s) for s in spans]


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
        with self._lock:
            events = _overlapping(self._events, buf)
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


@dataclasses.dataclass
class CopyCounts:
    """What a device model's copies moved: bytes each way, the bytes of those from or to
    pageable host memory (a pageable copy blocks the host and runs at a fraction of the
    speed), and host synchronisations made on the training thread."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    pageable_bytes: int = 0
    host_syncs: int = 0

    def since(self, earlier):
        """The counts added after `earlier` (a copy of these)."""
        return CopyCounts(*(getattr(self, f.name) - getattr(earlier, f.name)
                            for f in dataclasses.fields(self)))


class Copies:
    """The copies of a device model, counted. Subclasses say how a copy is issued, how host
    memory is pinned and how an event is recorded."""

    def __init__(self):
        self.counts = CopyCounts()
        self._lock = threading.Lock()
        self._readers = {}  # span of host memory -> event after the last copy that read it

    def host_zeros(self, numel, dtype=torch.float32):
        """A flat tensor of zeros in host memory that copies read and write at full speed."""
        raise NotImplementedError

    def is_pinned(self, tensor):
        raise NotImplementedError

    def on_device(self, tensor):
        """True for the model's memory (the device's), False for host memory."""
        raise NotImplementedError

    def crosses_to_device(self, src, dst):
        """True when dst <- src is a host-to-device copy (to_device's); host-to-host and
        device-to-device copies are plain ones."""
        return self.on_device(dst) and not self.on_device(src)

    def to_host(self, src, dst):
        """Queue dst (flat host tensor) <- src (device tensor); the event after the copy."""
        self._count(dst, src, "d2h_bytes")
        return self._to_host(src, dst)

    def to_device(self, src, dst):
        """Queue dst (device tensor) <- src (host tensor of dst's size) on the compute
        stream, without blocking the host where src is pinned."""
        self._count(src, dst, "h2d_bytes")
        self._to_device(src.view(dst.shape), dst)
        event = self.record(dst.device)
        with self._lock:
            self._readers[_span(src)] = event

    def wait_readers(self, host):
        """Block until every copy that read `host` memory (or part of it) has run: call it
        before writing that memory (the global update, on the aggregation thread)."""
        with self._lock:
            events = _overlapping(self._readers, host)
        for event in events:
            event.synchronize()

    def sync(self):
        """Count a host synchronisation the training thread makes (a value read back)."""
        self.counts.host_syncs += 1

    def _count(self, host, device, direction):
        nbytes = device.numel() * device.element_size()
        setattr(self.counts, direction, getattr(self.counts, direction) + nbytes)
        if not self.is_pinned(host):
            self.counts.pageable_bytes += nbytes
            self.counts.host_syncs += 1  # a pageable copy returns once it is done


class CudaCopies(Copies):
    """Device-to-host copies on one side stream, after the work queued so far on the
    gradient's stream; host-to-device copies on the compute stream; pinned host memory."""

    def __init__(self):
        super().__init__()
        self._stream = torch.cuda.Stream()

    def host_zeros(self, numel, dtype=torch.float32):
        return torch.zeros(int(numel), dtype=dtype).pin_memory()

    def is_pinned(self, tensor):
        return tensor.is_pinned()

    @staticmethod
    def on_device(tensor):
        return tensor.is_cuda

    def _to_host(self, src, dst):
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src.reshape(-1), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # the allocator must not reuse it before the copy is done
        return event

    @staticmethod
    def _to_device(src, dst):
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def record(device):
        """An event after the work queued so far on `device`'s compute stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
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


class _Done:
    """An event that has completed (the stand-in's compute stream runs at once)."""

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def query():
        return True


class DeferredCopies(Copies):
    """A stand-in for CudaCopies on CPU tensors: a device-to-host copy takes the source's
    value when it is queued (as a stream would), fills its destination with NaN until it
    lands (memory not yet written), and lands only when release() is called, in the order
    queued. Host-to-device copies land at once. host_zeros() is its 'pinned' memory."""

    def __init__(self):
        super().__init__()
        self._pinned = []  # the tensors host_zeros made (kept alive, so ids stay theirs)
        self.queued = []  # copies not landed yet, oldest first
        self.copies = 0  # device-to-host copies queued so far

    def host_zeros(self, numel, dtype=torch.float32):
        tensor = torch.zeros(int(numel), dtype=dtype)
        self._pinned.append(tensor)
        return tensor

    def is_pinned(self, tensor):
        """True for memory inside a tensor host_zeros made (views, NumPy ones included)."""
        ptr = tensor.data_ptr()
        return any(t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size()
                   for t in self._pinned)

    def on_device(self, tensor):
        """The stand-in's device memory: any tensor not in its 'pinned' host memory."""
        return not self.is_pinned(tensor)

    def _to_host(self, src, dst):
        copy = DeferredCopy(src.detach().reshape(-1).clone(), dst)
        dst.fill_(float("nan"))
        with self._lock:
            self.queued.append(copy)
            self.copies += 1
        return copy

    @staticmethod
    def _to_device(src, dst):
        dst.copy_(src)

    @staticmethod
    def record(device):
        return _Done()

    def release(self, count=None):
        """Land the `count` oldest copies (default: all); how many landed."""
        with self._lock:
            count = len(self.queued) if count is None else min(count, len(self.queued))
            landing, self.queued = self.queued[:count], self.queued[count:]
        for copy in landing:
            copy.land()
        return len(landing)
