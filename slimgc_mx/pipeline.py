"""The aggregation pipeline (SlimGC Strategy 2): grad_buf -> fp_buf / bit_buf -> wire -> sum.

Three threads, each a FIFO stage, so that one key's encoding overlaps another
key's transfer and a third key's decoding:

    encoder       wait for grad_buf, encode bit_buf with the codec (no GIL held)
    communicator  push + pull on the transport (MXNet's engine sends asynchronously)
    finisher      wait for the sum, decode it into the aggregate, hand it to `finish`
                  (or, for a job marked decode_in_update, leave decoding to `finish`)

Any exception in a stage is kept and raised in the training thread at its next
wait, chained to the original traceback; later jobs are dropped.

Non-finite gradients: a worker whose gradient holds NaN/Inf still takes part in
the transfer (it sends NaN, so no other worker waits forever), and every worker
finds the non-finite sum before decoding and fails that key without updating
any weights.
"""
import queue
import threading
import time

import numpy as np

from .codecs import NonFiniteGradientError


class PipelineError(RuntimeError):
    """A background stage failed; the original exception is chained as __cause__."""

    @classmethod
    def of(cls, error, where):
        """The error the training thread raises for `error`, which happened at `where`."""
        exc = cls("aggregation failed in a background thread (%s): %s" % (where, error))
        exc.__cause__ = error
        return exc


class NonFiniteAggregateError(NonFiniteGradientError):
    """The sum over workers of a key's gradient holds NaN/Inf; no weight was updated."""


class KeyBuffers:
    """Everything the pipeline holds for one key: the paper's grad_buf, fp_buf and bit_buf.

    grad_buf  float32 copy of the local gradient (the fp_buf route sends it as is)
    bit_send  the codec's lanes for this worker (bit_buf)
    bit_recv  the lanes summed over workers
    agg       float32 sum over workers of the gradient (pulled, or decoded from bit_recv)
    residual  the codec's error-feedback memory
    device    a DeviceCodec when encoding runs as NDArray ops (offload off), else None
    """

    def __init__(self, index, shape, codec, num_workers, make_buffer):
        self.index = index
        self.shape = tuple(shape)
        self.size = size = int(np.prod(shape))
        self.nbytes = 4 * size
        self.codec = codec
        self.grad_buf = make_buffer(shape, np.float32)
        self.agg = make_buffer(shape, np.float32)
        self.device = None
        if codec is not None:
            self.residual = make_buffer((size,), np.float32)
            lanes = max(1, codec.lane_count(size, num_workers))
            self.bit_send = make_buffer((lanes,), codec.wire_dtype)
            self.bit_recv = make_buffer((lanes,), codec.wire_dtype)
        else:  # compressor 'none': full precision only, no error feedback
            self.residual = self.bit_send = self.bit_recv = None

    # Wire keys: fp route, compressed route and the weight broadcast of key `index`.
    @property
    def fp_key(self):
        return 3 * self.index

    @property
    def bit_key(self):
        return 3 * self.index + 1

    @property
    def weight_key(self):
        return 3 * self.index + 2


class GradCheck:
    """The local update's count of NaN/Inf in grad_buf, so that the encoder need not read
    grad_buf a second time (its pre-check is a full pass over the gradient).

    `ready`: the array the local update writes; `nonfinite` is set before it is readable.
    """

    __slots__ = ("ready", "nonfinite")

    def __init__(self):
        self.ready = None
        self.nonfinite = None


class Job:
    """One key's aggregation for one step."""

    __slots__ = ("buffers", "step", "compressed", "serial", "context", "key", "handle",
                 "t_start", "t_comm", "t_proc", "nonfinite", "decode_in_update", "check")

    def __init__(self, buffers, step, compressed, serial=False, context=None, key=None):
        self.buffers = buffers  # a KeyBuffers, or a fusion.Bucket on the full-precision route
        self.step = step
        self.compressed = compressed
        self.serial = serial  # transfer alone (warm-up timing) instead of overlapped
        self.context = context  # whatever `finish` needs (optimizer settings of this step)
        self.key = key  # what messages name: the user key, or the bucket
        self.handle = None
        self.t_start = self.t_comm = None
        self.t_proc = 0.0
        self.nonfinite = False  # this worker's gradient held NaN/Inf: it sends NaN
        self.decode_in_update = False  # `finish` decodes bit_recv inside the optimizer step
        self.check = None  # a GradCheck: submitted once its `ready` array is readable


class Pipeline:
    """Runs jobs through encoder -> communicator -> finisher threads."""

    def __init__(self, transport, finish, on_error, notifier=None):
        self.transport = transport
        self._notifier = notifier
        self._finish = finish
        self._on_error = on_error
        self.error = None
        self.error_where = None
        self.timed_out = False
        self._pending = 0
        self._idle = threading.Condition()
        self._queues = [queue.Queue(), queue.Queue(), queue.Queue()]
        stages = [(self._encode, "encoder"), (self._communicate, "communicator"),
                  (self._complete, "finisher")]
        self._threads = []
        for i, (fn, name) in enumerate(stages):
            out = self._queues[i + 1] if i + 1 < len(stages) else None
            t = threading.Thread(target=self._run, args=(fn, self._queues[i], out),
                                 name="slimgc-" + name, daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, job, ready=None):
        """Queue `job`; with `ready` (an NDArray) it enters once the engine has written it."""
        if self.error is not None:
            raise PipelineError.of(self.error, self.error_where)
        with self._idle:
            self._pending += 1
        if ready is None:
            self._queues[0].put(job)
        else:
            self._notifier.when_readable(ready, lambda: self._queues[0].put(job))

    def wait_idle(self, timeout):
        """Block until every submitted job has finished; raise on failure or timeout."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0 or self.error is not None,
                                       timeout):
                self.timed_out = True
                raise TimeoutError("the aggregation pipeline did not drain in %.0f s: a worker "
                                   "or server may have died" % timeout)
        if self.error is not None:
            raise PipelineError.of(self.error, self.error_where)

    def close(self, join=True):
        """Stop the threads; join=False leaves threads stuck on a dead peer behind."""
        self._queues[0].put(None)
        if join:
            for t in self._threads:
                t.join(timeout=5)

    def _run(self, fn, inbox, outbox):
        while True:
            job = inbox.get()
            if job is None:
                if outbox is not None:
                    outbox.put(None)
                return
            if self.error is None:
                try:
                    fn(job)
                except BaseException as exc:  # kept for the training thread
                    self._fail(exc, job)
            if self.error is not None:
                self._done()
                continue
            if outbox is not None:
                outbox.put(job)
            else:
                self._done()

    def _done(self):
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _fail(self, exc, job):
        if self.error is None:
            self.error_where = "%s, step %d" % (_label(job.key), job.step)
            self.error = exc
            self._on_error(exc, self.error_where)
        with self._idle:
            self._idle.notify_all()

    def _encode(self, job):
        b = job.buffers
        if not job.compressed:
            b.grad_buf.for_read()
        elif b.device is not None:
            t0 = time.perf_counter()
            b.bit_send.for_read()  # encoded by NDArray ops queued on the training thread
            job.t_proc += time.perf_counter() - t0
        else:
            grad, residual, lanes = (b.grad_buf.for_read(), b.residual.for_write(),
                                     b.bit_send.for_write())
            checked = job.check is not None and job.check.nonfinite == 0
            t0 = time.perf_counter()
            try:
                if job.check is not None and job.check.nonfinite:
                    raise NonFiniteGradientError("the local update counted NaN/Inf in grad_buf")
                b.codec.encode(grad, residual, self.transport.num_workers, out=lanes,
                               grad_checked=checked)
            except NonFiniteGradientError:
                lanes.fill(np.nan)
                job.nonfinite = True
            job.t_proc += time.perf_counter() - t0

    def _communicate(self, job):
        b = job.buffers
        if job.compressed:
            wire, send, recv = b.bit_key, b.bit_send, b.bit_recv
        else:
            wire, send, recv = b.fp_key, b.grad_buf, b.agg
        job.t_start = time.perf_counter()
        job.handle = self.transport.push_pull(wire, send, recv)
        if job.serial:
            job.handle.wait()
            job.t_comm = job.handle.elapsed or time.perf_counter() - job.t_start

    def _complete(self, job):
        b = job.buffers
        job.handle.wait()
        if job.t_comm is None:
            job.t_comm = job.handle.elapsed or time.perf_counter() - job.t_start
        n = self.transport.num_workers
        received = b.bit_recv if job.compressed else b.agg
        if not np.isfinite(received.for_read()).all():
            raise NonFiniteAggregateError(
                "%s, step %d: the gradient summed over workers holds NaN/Inf (this worker's "
                "own gradient %s); no weights were updated. Lower the learning rate or clip "
                "gradients." % (_label(job.key), job.step,
                                "did" if job.nonfinite else "was finite"))
        if job.compressed and b.device is not None:
            t0 = time.perf_counter()
            b.device.decode(b.bit_recv.nd, b.size, n, out=b.agg.nd)
            b.agg.for_read()
            job.t_proc += time.perf_counter() - t0
        elif job.compressed and not job.decode_in_update:
            lanes, agg = b.bit_recv.for_read(), b.agg.for_write()
            t0 = time.perf_counter()
            b.codec.decode(lanes, b.size, n, out=agg)
            job.t_proc += time.perf_counter() - t0
        self._finish(job)


def _label(key):
    """How messages name a job: 'key 3', or a fused bucket's own label."""
    return getattr(key, "label", None) or "key %r" % (key,)
