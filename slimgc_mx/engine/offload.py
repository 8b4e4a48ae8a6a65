"""Compression offload (SlimGC Strategy 2): the aggregation pipeline grad_buf -> fp_buf /
bit_buf -> wire -> sum, on CPU threads beside the training thread.

Three threads, each a FIFO stage, so that one key's encoding overlaps another
key's transfer and a third key's decoding:

    encoder       wait for grad_buf, encode bit_buf with the codec (no GIL held), unless
                  the push's plan encodes it elsewhere (push_plan.Plan.encode)
    communicator  push + pull on the transport (MXNet's engine sends asynchronously); a
                  streamed transfer comes here at once, and the engine pushes each of its
                  pieces as soon as the local update's operator has encoded it
    finisher      wait for the sum, check it, decode it into the aggregate where the plan
                  decodes it here (Plan.decode), hand it to `finish`

Any exception in a stage is kept and raised in the training thread at its next
wait, chained to the original traceback; later transfers are dropped: nothing of them is
decoded, but each exchange announced and not yet started is still made, sending NaN
naming this worker (Pipeline._drain), so that no peer waits for it and no transport that
pairs exchanges by their order (TorchTransport) waits forever for one never handed.

Non-finite gradients: a worker whose gradient holds NaN/Inf still takes part in
the transfer (it sends NaN, so no other worker waits forever), and every worker
finds the non-finite sum before decoding and fails that key without updating
any weights.
"""
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import numpy as np

from ..codecs import NonFiniteGradientError
from ..codecs.base import kernels
from .grad_buf import GradCheck, Push, mark_nonfinite, nonfinite_sender
from .push_plan import FINITE_IN_RANGE, Plan
from .stages import Stages


#: The trace row of work timed inside MXNet's engine (a streamed push's piece encodes).
ENGINE_ROW = "mxnet-engine"


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


@dataclass
class Transfer:
    """One aggregation of one step: a key, or a fused bucket of keys, through the pipeline.

    The planner fills what it carries and its `plan`; the local update fills `check`; the
    pipeline writes the fields after `check` as it runs.
    """

    buffers: object  # a grad_buf.KeyBuffers, or a planner.Bucket
    step: int
    pushes: List[Push]  # the keys' gradients it carries (one, or a bucket's members)
    settings: Optional[object]  # update.OptSettings of the step; None: a plain sum, no update
    label: str  # how messages name it: "dense0_weight", "parameters a, b, c (fused)"
    plan: Plan  # where it is encoded, decoded and checked (push_plan.py)
    priority: int = 0  # MXNet's priority of its engine operators (higher goes first)
    check: Optional[GradCheck] = None  # plan.grad_check LOCAL_UPDATE: the local update's
    #                                    report; the transfer enters once check.ready is
    handle: object = None
    t_start: Optional[float] = None
    t_comm: Optional[float] = None
    t_proc: float = 0.0  # encode + decode seconds
    nonfinite: bool = False  # this worker's gradient held NaN/Inf: it sends NaN
    round: int = 0  # the exchange under way: a position in plan.rounds
    started: int = 0  # exchanges handed to the transport so far
    round_start: Optional[float] = None  # when the exchange under way was started
    lanes_checked: bool = False  # the sum's digit lanes were found in range (FINITE_IN_RANGE)

    @property
    def exchange(self):
        """The grad_buf.WireRound under way (compressed transfers)."""
        return self.wire_rounds[self.plan.rounds[self.round]]

    @property
    def wire(self):
        """(wire key, what is sent, where the result lands) of its route and round."""
        b = self.buffers
        if self.plan.compressed:
            r = self.exchange
            return r.key, r.wire_send, r.wire_recv
        return b.wire.fp, b.fp_buf, b.agg

    @property
    def wire_rounds(self):
        """The WireRounds of its push (all rounds; compressed transfers only)."""
        return self.buffers.round_sets[self.plan.wire_class]

    @property
    def gathers(self):
        """True when this round's result is every worker's slot side by side, not a sum."""
        return self.plan.compressed and self.exchange.route == "gather"

    def wire_keys(self):
        """The wire keys of its exchanges, in the order they are made."""
        if not self.plan.compressed:
            return [self.buffers.wire.fp]
        return [self.wire_rounds[i].key for i in self.plan.rounds]

    def wire_bytes(self):
        """(bytes pushed, bytes pulled) over all its exchanges: a gather pulls N slots;
        float32 lanes count as what travels."""
        if not self.plan.compressed:
            return self.buffers.fp_buf.nbytes, self.buffers.agg.nbytes
        rounds = [self.wire_rounds[i] for i in self.plan.rounds]
        return (sum(r.wire_send.nbytes for r in rounds),
                sum(r.wire_recv.nbytes for r in rounds))


#: How long close() waits for submitted transfers to enter the pipeline.
ENTER_GRACE_S = 5.0


class Pipeline:
    """Runs transfers through encoder -> communicator -> finisher threads."""

    def __init__(self, transport, finish, on_error, notifier=None, trace=None, stages=None):
        self.transport = transport
        self.stages = stages or Stages(transport)  # encode and decode at the plan's sites
        self.trace = trace  # a trace.Trace recording each stage's spans, or None
        self._notifier = notifier
        self._finish = finish
        self._on_error = on_error
        self.error = None
        self.error_where = None
        self.timed_out = False
        self._pending = 0
        self._entering = 0  # submitted, still waiting for their ready array
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

    def submit(self, transfer):
        """Queue `transfer` once its Stages.ready_array() is written; at once when streamed, or
        serial under a readiness that may reorder (MXNet's: its engine makes the encoder's
        read wait instead), so that serial transfers keep the trainer's key order."""
        if self.error is not None:
            raise PipelineError.of(self.error, self.error_where)
        with self._idle:
            self._pending += 1
        self.transport.announce(transfer.wire_keys())
        ordered = getattr(self._notifier, "ordered", False)
        if self.stages.streamed(transfer.plan) or (transfer.plan.serial and not ordered):
            self._queues[0].put(transfer)
        else:
            with self._idle:
                self._entering += 1
            self._notifier.when_readable(self.stages.ready_array(transfer),
                                         partial(self._enter, transfer), transfer.priority)

    def _enter(self, transfer):
        self._queues[0].put(transfer)
        with self._idle:
            self._entering -= 1
            self._idle.notify_all()

    @property
    def in_flight(self):
        """Transfers submitted and not finished (waiting to enter included)."""
        with self._idle:
            return self._pending

    def wait_idle(self, timeout):
        """Block until every submitted transfer has finished; raise on failure or timeout."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0 or self.error is not None,
                                       timeout):
                self.timed_out = True
                raise TimeoutError("the aggregation pipeline did not drain in %.0f s: a worker "
                                   "or server may have died" % timeout)
        if self.error is not None:
            raise PipelineError.of(self.error, self.error_where)

    def close(self, join=True):
        """Stop the threads; join=False leaves threads stuck on a dead peer behind.

        Transfers still waiting for their ready array enter first (for at most
        ENTER_GRACE_S): a push whose local update failed goes out as NaN, which is how its
        peers learn of the failure instead of waiting for the push until their timeout."""
        with self._idle:
            self._idle.wait_for(lambda: self._entering == 0, ENTER_GRACE_S)
        self._queues[0].put(None)
        if join:
            for t in self._threads:
                t.join(timeout=5)

    def _run(self, fn, inbox, outbox):
        while True:
            transfer = inbox.get()
            if transfer is None:
                if outbox is not None:
                    outbox.put(None)
                return
            again = False
            if self.error is None:
                try:
                    again = fn(transfer)
                except BaseException as exc:  # kept for the training thread
                    self._fail(exc, transfer)
            if self.error is not None:
                self._drain(transfer)
                self._done()
                continue
            if again:  # another round of a multi-round codec
                self._queues[1].put(transfer)
            elif outbox is not None:
                outbox.put(transfer)
            else:
                self._done()

    def _done(self):
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _fail(self, exc, transfer):
        if self.error is None:
            self.error_where = "%s, step %d" % (transfer.label, transfer.step)
            self.error = exc
            self._on_error(exc, self.error_where)
        with self._idle:
            self._idle.notify_all()

    def _drain(self, t):
        """After a failure: t's exchanges not started yet are made all the same, sending NaN
        naming this worker, without waiting for them (a peer may be gone); their results
        are never read. Every peer then pairs each announced exchange, and one without a
        failure of its own fails this sum naming this worker (NonFiniteAggregateError), as
        after a NaN gradient. A streamed transfer is left alone: its operators send its
        pieces."""
        if self.stages.streamed(t.plan):
            return
        try:
            for r in range(t.started, len(t.wire_keys())):
                t.round = r
                mark_nonfinite(t.wire[1].for_write(), self.transport.rank)
                self._start(t)
        except BaseException:  # the first failure is the one raised; a peer may be gone
            pass

    def _encode(self, t):
        start = time.perf_counter()
        self.stages.encode(t)
        self._span("encode", start, t)

    def _join(self, t):
        """float32 lanes: the summed float32 lanes back into the round's float64 sum (a
        non-finite sum becomes NaN naming the same sender). True when the join has found
        every digit lane an integer in range, in the pass that joins them."""
        wire = t.exchange.lanes32
        if wire is None:
            return False
        layout = wire.layout
        summed, out = wire.recv.for_read(), t.exchange.recv.for_write()
        try:
            if np.isfinite(summed[layout.body32:]).all():
                layout.join(summed, out)
                return True
        except ValueError:  # parts out of range: NaN from a worker, or not this codec's sum
            if np.isfinite(summed).all():
                raise
        sender = nonfinite_sender(summed, self.transport.num_workers)
        if sender is None:
            out.fill(np.nan)
        else:
            mark_nonfinite(out, sender)
        return False

    def _communicate(self, t):
        """Start the round's exchange. A serial transfer waits for it, and runs the codec's
        further rounds here too: were they queued again behind the next serial transfer,
        workers could each wait on another key."""
        while True:
            start = time.perf_counter()
            t.round_start = start
            if t.round == 0:
                t.t_start = start
            t.handle = self._start(t)
            if not t.plan.serial:
                return
            t.handle.wait()
            t.t_comm = (t.t_comm or 0.0) + (t.handle.elapsed or time.perf_counter() - start)
            if not self._advance(t):
                return

    def _start(self, t):
        """Hand the exchange of t's round under way to the transport; its handle."""
        wire, send, recv = t.wire
        if t.gathers:
            handle = self.transport.gather(wire, send, recv, t.priority)
        else:
            handle = self.transport.push_pull(wire, send, recv, t.priority,
                                              in_pieces=self.stages.streamed(t.plan))
        t.started = t.round + 1
        return handle

    def _complete(self, t):
        """Wait for the round; run the codec's next round, or decode and finish. True: the
        transfer goes back to the communicator for its next round."""
        t.handle.wait()
        if not t.plan.serial:
            t.t_comm = time.perf_counter() - t.t_start if t.handle.elapsed is None \
                else (t.t_comm or 0.0) + t.handle.elapsed
        self._span("transfer", t.round_start, t, round=t.round)
        if self.stages.streamed(t.plan):  # every piece's operator has run: its pull followed its push
            if t.check.error is not None:
                raise t.check.error
            t.nonfinite = bool(t.check.nonfinite)
            t.t_proc += t.check.seconds
            for i, (begin, end) in enumerate(t.check.spans):
                self._span("encode", begin, t, end=end, thread=ENGINE_ROW, piece=i)
        if self._advance(t):
            return True
        start = time.perf_counter()
        if self.stages.decode(t):
            self._span("decode", start, t)
        start = time.perf_counter()
        self._finish(t)
        self._span("global update", start, t)
        return False

    def _span(self, stage, start, t, end=None, **args):
        """Record `stage` of transfer t from `start` to `end` (default now), when tracing."""
        if self.trace is not None:
            self.trace.span(stage, start, time.perf_counter() if end is None else end,
                            key=t.label, step=t.step, **args)

    def _advance(self, t):
        """Check the finished round's result; when the codec has a further round, write its
        payload (next_round) and return True."""
        b, n = t.buffers, self.transport.num_workers
        if t.check is not None and t.check.error is not None:
            raise t.check.error  # it went out as NaN (Stages.encode): every worker fails it
        joined = False
        if t.plan.compressed:
            joined = self._join(t)
            received = t.exchange.recv
        else:
            received = b.agg
        values = received.for_read()
        if not self._finite(t, values, joined):
            sender = nonfinite_sender(values, n)
            raise NonFiniteAggregateError(
                "%s, step %d: the gradient summed over workers holds NaN/Inf, sent by %s "
                "(this worker's own gradient %s); no weights were updated. Lower the learning "
                "rate or clip gradients, unless that worker's own error names another "
                "cause." % (
                    t.label, t.step, "worker rank %d" % sender if sender is not None
                    else "a worker this sum does not name (an overflow, or a NaN no check saw)",
                    "did" if t.nonfinite else "was finite"))
        if not (t.plan.compressed and t.round + 1 < len(t.plan.rounds)):
            return False
        nxt = t.wire_rounds[t.plan.rounds[t.round + 1]].send
        t0 = time.perf_counter()
        b.codec.next_round(t.round, values, nxt.for_write(), n)
        t.t_proc += time.perf_counter() - t0
        t.round += 1
        return True

    def _finite(self, t, values, joined):
        """True when the round's result holds no NaN/Inf. A sum the SGD kernel decodes
        (FINITE_IN_RANGE) is read once for both of its checks: digit lanes in [0, 2**53)
        (already known when the float32 join validated them) set t.lanes_checked, so that
        the kernel does not read them again, and only the lanes after them are tested."""
        if t.plan.sum_check == FINITE_IN_RANGE and t.round + 1 == len(t.plan.rounds):
            body = t.buffers.codec.body_lanes(t.buffers.size, self.transport.num_workers)
            if joined and t.exchange.lanes32.layout.body64 == body \
                    or kernels().count_lanes_outside(values[:body]) == 0:
                t.lanes_checked = True
                return bool(np.isfinite(values[body:]).all())
        return bool(np.isfinite(values).all())


@dataclass
class TransferStats:
    """Bytes and seconds of the finished transfers (each counted once, pushed and pulled)."""

    wire: int = 0  # bytes pushed
    pulled: int = 0  # bytes pulled: as many as pushed for a sum, N slots for a gather
    fp32: int = 0  # bytes the same gradients would be in float32
    comm_s: float = 0.0
    compress_s: float = 0.0
    transfers: int = 0
    compressed_transfers: int = 0
    streamed_transfers: int = 0

    def add(self, t):
        pushed, pulled = t.wire_bytes()
        self.wire += pushed
        self.pulled += pulled
        self.fp32 += t.buffers.nbytes
        self.comm_s += t.t_comm
        self.compress_s += t.t_proc
        self.transfers += 1
        self.compressed_transfers += int(t.plan.compressed)
        self.streamed_transfers += int(Stages.streamed(t.plan))
