"""Where each stage of a push runs, read from its Plan here and nowhere else.

Planner.plan decides the sites (push_plan.py); this module is the one place that reads
them and runs each stage at its site, one entry point per thread:

    any thread        place            'device' or 'host', for the CTTab's timings
    training thread   in_local_update  the FusedEncode a local update encodes bit_buf with
                                       (Plan.encode LOCAL_UPDATE, PIECES)
                      on_device        the device codec encodes bit_buf (DEVICE)
                      reads_gradient   whether grad_buf needs the gradient at all
    encoder thread    encode           fp_buf checked (None), bit_buf encoded (ENCODER), the
                                       local update's report taken (LOCAL_UPDATE, PIECES),
                                       float32 lanes split (any compressed site)
    finisher thread   decode           the sum decoded into agg (FINISHER, DEVICE); UPDATE
                                       leaves it to the global update (decode_in_update)
    any thread        ready_array      what a transfer waits for before it enters
                      streamed         whether its pieces are sent as they are encoded

A device-path bucket's pass (push_plan.bucket_plan) is the same stages placed on the
parameters' device, run on the training thread through the adapter's bucket
(backend.DeviceBucket): encode_bucket, exchange_bucket, decode_bucket.
"""
import time

import numpy as np

from ..codecs import NonFiniteGradientError
from ..codecs.base import kernels
from .grad_buf import FusedEncode, mark_nonfinite
from .push_plan import DEVICE, ENCODER, FINISHER, HOST_CODEC, LOCAL_UPDATE, PIECES, UPDATE


class Stages:
    """The stages of one worker's pushes at the sites their plans name."""

    def __init__(self, transport):
        self.transport = transport

    @staticmethod
    def place(plan):
        """Where the plan compresses, as the CTTab's placement names it: 'device' or 'host'."""
        return "device" if plan.encode == DEVICE else "host"

    @staticmethod
    def streamed(plan):
        """True when engine operators encode the push piece by piece (PIECES) and the
        transport sends each piece as soon as it is encoded."""
        return plan.encode == PIECES

    @staticmethod
    def ready_array(t):
        """The host array a transfer waits for before it enters the pipeline: the output of
        the stage that produces what it sends (Plan.grad_check, Plan.encode)."""
        if t.plan.grad_check == LOCAL_UPDATE:
            return t.check.ready
        if t.plan.encode == DEVICE:
            return t.exchange.send  # encoded on the training thread
        return t.buffers.grad_buf

    # -- the training thread -------------------------------------------------------------
    @staticmethod
    def reads_gradient(transfer):
        """False where nothing reads grad_buf: the device codec encodes from the gradient
        itself (a fused push reads it in place too, which the framework is told apart)."""
        return transfer is None or transfer.plan.encode != DEVICE

    def in_local_update(self, transfer):
        """The FusedEncode with which the local update encodes `transfer`'s bit_buf in its
        pass over the gradient (whole, or piece by piece), where the plan encodes it there;
        else None."""
        if transfer is None or transfer.plan.encode not in (LOCAL_UPDATE, PIECES):
            return None
        return FusedEncode(transfer.buffers, transfer.exchange.send,
                           self.transport.num_workers, self.transport.rank, transfer.check,
                           transfer.plan.pieces, transfer.plan.measure)

    def on_device(self, transfer, grad):
        """Where the plan encodes on the device: the framework's ops encode the gradient on
        its own device, on this thread, before the transfer is queued."""
        if transfer.plan.encode != DEVICE:
            return
        b, send = transfer.buffers, transfer.exchange.send
        try:
            b.device.encode_key(b, grad, self.transport.num_workers, self.transport.rank, send)
            b.residual_pending = True
        except NonFiniteGradientError:
            mark_nonfinite(send.for_write(), self.transport.rank)
            transfer.nonfinite = True

    # -- the encoder thread --------------------------------------------------------------
    def encode(self, t):
        """What is sent made ready where the plan encodes it (Plan.encode)."""
        site = t.plan.encode
        if t.check is not None and t.check.error is not None and site != PIECES:
            self._refused(t)
        elif site is None:
            self._check_full_precision(t)
        elif site == ENCODER:
            self._encode_here(t)
        elif site == LOCAL_UPDATE:
            self._encoded_in_local_update(t)
        elif site == PIECES:  # engine operators encode its pieces; the transport sends each
            t.buffers.residual_pending = True
        else:  # DEVICE: encoded on the training thread
            t0 = time.perf_counter()
            t.exchange.send.for_read()
            self._split(t)
            t.t_proc += time.perf_counter() - t0

    def _check_full_precision(self, t):
        """fp_buf (grad_buf itself) goes as it is: flush residuals a compressed route left,
        and send NaN naming this worker when the gradient holds NaN/Inf."""
        b = t.buffers
        for push in t.pushes:
            if push.buffers.residual_pending:
                flush_residual(push.buffers)
        grad = b.grad_buf.for_read()
        if kernels().count_nonfinite(grad, 1 if grad.size < 1 << 16 else 2):
            mark_nonfinite(b.grad_buf.for_write(), self.transport.rank)
            t.nonfinite = True

    def _refused(self, t):
        """The local update's operator failed (t.check.error): bit_buf may hold an earlier
        step. Send NaN naming this worker, so that every worker fails this sum instead of
        adding it or waiting for it; this worker raises the error once the round is back."""
        mark_nonfinite(t.exchange.send.for_write(), self.transport.rank)
        t.nonfinite = True
        self._split(t)

    def _encoded_in_local_update(self, t):
        """bit_buf was encoded by the local update (grad_buf.FusedEncode): take its report."""
        check = t.check
        if not check.encoded:  # its operator never encoded (it failed before): encode here
            self._encode_here(t)
            return
        t.buffers.residual_pending = True
        t.t_proc += check.seconds
        if check.nonfinite:
            mark_nonfinite(t.exchange.send.for_write(), self.transport.rank)
            t.nonfinite = True
        self._split(t)

    def _encode_here(self, t):
        """The codec encodes grad_buf into bit_buf; its own pre-check finds NaN/Inf unless
        the local update has counted them (Plan.grad_check LOCAL_UPDATE)."""
        b = t.buffers
        grad, residual, lanes = (b.grad_buf.for_read(), b.residual.for_write(),
                                 t.exchange.send.for_write())
        counted = t.check.nonfinite if t.plan.grad_check == LOCAL_UPDATE else None
        t0 = time.perf_counter()
        try:
            if t.plan.measure:
                b.watch.add(grad, residual)
            if counted:
                raise NonFiniteGradientError("the local update counted NaN/Inf in grad_buf")
            b.codec.encode(grad, residual, self.transport.num_workers, out=lanes,
                           grad_checked=counted == 0, rank=self.transport.rank)
            b.residual_pending = True
        except NonFiniteGradientError:
            mark_nonfinite(lanes, self.transport.rank)
            t.nonfinite = True
        self._split(t)
        t.t_proc += time.perf_counter() - t0

    def _split(self, t):
        """float32 lanes: the round's float64 lanes into the float32 lanes that travel
        (a worker with a non-finite gradient sends NaN naming its rank, as in float64)."""
        wire = t.exchange.lanes32
        if wire is None:
            return
        out = wire.send.for_write()
        if t.nonfinite:
            mark_nonfinite(out, self.transport.rank)
        else:
            wire.layout.split(t.exchange.send.for_read(), out, self.transport.rank)

    # -- the finisher thread -------------------------------------------------------------
    def decode(self, t):
        """The sum decoded into agg where the plan decodes it here (Plan.decode FINISHER or
        DEVICE); True when it was. UPDATE leaves it to the global update, and a
        full-precision sum is agg already."""
        site = t.plan.decode
        if site != FINISHER and site != DEVICE:
            return False
        b, n = t.buffers, self.transport.num_workers
        if site == DEVICE:
            t0 = time.perf_counter()
            b.device.decode_key(b, n, t.exchange.recv)
            b.agg.for_read()
        else:
            lanes, agg = t.exchange.recv.for_read(), b.agg.for_write()
            t0 = time.perf_counter()
            b.codec.decode(lanes, b.size, n, out=agg)
        t.t_proc += time.perf_counter() - t0
        return True


def decode_in_update(transfer, num_workers, kernel=True):
    """What the global update needs of a transfer whose plan decodes its sum in the update
    (push_plan.UPDATE): the codec's decode table (k, m, rows) for the kernel, or None, with
    the aggregate decoded into agg, when no kernel runs the update (the optimizer changed
    since the push was planned); None for any other plan. Decoding the table advances the
    codec's shared state, as decode does."""
    if transfer.plan.decode != UPDATE:
        return None
    b = transfer.buffers
    lanes = transfer.exchange.recv.for_read()
    if kernel:
        return b.codec.decode_table(lanes, b.size, num_workers)
    b.codec.decode(lanes, b.size, num_workers, out=b.agg.for_write())
    return None


def flush_residual(b):
    """grad_buf += residual, memory = 0: the key left the compressed route, and the error
    feedback it kept goes out with this full-precision push (codecs/feedback.py); further
    per-worker state after the residual (dgc's velocity) starts again from zero."""
    grad = b.grad_buf.for_write()
    memory = b.host_residual().for_write()
    np.add(grad, memory[:grad.size], out=grad)
    memory.fill(0)
    b.residual_pending = False


# -- a device-path bucket's pass (the training thread) -------------------------------------
def encode_bucket(plan, bucket, grads, num_workers, flag, rank=0, counts=None, watch=None,
                  on_piece=None):
    """`bucket`'s lanes made from this rank's `grads` where `plan` encodes them: the flat
    gradient (None), the device codec (DEVICE) or the host codec (HOST_CODEC), error
    feedback included; `flag` gets 1 where the gradient (+ residual) is not finite. watch:
    two slots for the residual watch's norms (compressed plans); on_piece(lo, hi): the
    device codec's, where it encodes a large tensor by pieces."""
    bucket.sent = plan
    if plan.encode is None:
        bucket.fill_full_precision(grads, flag)
        return
    flat = bucket.flat_for_codec(grads, num_workers, watch)
    if plan.encode == HOST_CODEC:
        bucket.encode_on_host(flat, num_workers, flag, rank, counts)
    elif plan.encode == DEVICE:
        bucket.encode_on_device(flat, num_workers, flag, rank, on_piece)
    else:
        raise ValueError("a device-path bucket is not encoded at %r" % (plan.encode,))


def exchange_bucket(plan, bucket, start_sum, flag):
    """The sums of the lanes `plan` sends started with start_sum(part) (its Work), round
    after round: a round's lanes are made from the previous round's sum (powersgd's Q from
    the summed P), which is waited for first (on the device where the group can). Returns
    how many sums were started."""
    parts = bucket.round_parts() if len(plan.rounds) > 1 else (bucket.lanes,)
    for i, part in enumerate(parts):
        if i:
            bucket.wait_sums()
            bucket.next_round(i - 1, flag)
        bucket.works = [start_sum(part)]
    return len(parts)


def decode_bucket(plan, bucket, num_workers, counts=None):
    """The summed lanes of `plan`'s pass into the bucket's mean gradient: decoded by the
    device codec (DEVICE), or the sum divided by the workers (None)."""
    if plan.decode is None:
        bucket.average(num_workers)
    elif plan.decode == DEVICE:
        bucket.decode_sum(num_workers, counts)
    else:
        raise ValueError("a device-path bucket is not decoded at %r" % (plan.decode,))
