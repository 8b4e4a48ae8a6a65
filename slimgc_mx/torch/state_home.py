"""Where a device-path bucket's glo_buf, global optimizer state and error-feedback residual
live between its passes (state_on): on the device, or offloaded to host memory (pinned on a
GPU) and staged on the device for the pass that reads them (Fig. 14's saving, at the price
of two copies a step).

A staged bucket's glo_buf views and state tensors are swapped in place (`.data`, and the
optimizer's state dict), so the user's optimizer steps on the device without knowing; the
staging copies run on one copy stream, whose order puts each stage-in after the stage-out
of the same host memory, and the compute stream waits for a stage-in only where it reads
it (prefetch: the next bucket's comes in while this one's pass runs). On the CPU the copies
are plain copies: the same swaps and the same bytes counted as a device would move.
"""
import torch

from ..engine.bucket_step import BOTH, RESIDUAL, STATE


def _per_element(value, like):
    """True for a state tensor of the parameter's shape (momentum, Adam's moments): staged;
    a scalar (Adam's step count) stays where the optimizer keeps it."""
    return torch.is_tensor(value) and value.shape == like.shape and value.numel() > 1


class StateCopies:
    """The staging copies of one device: a copy stream on a GPU, counted in `counts`
    (copies.CopyCounts)."""

    def __init__(self, device, counts):
        self.device = device
        self.cuda = device.type == "cuda"
        self.counts = counts
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def host_empty(self, shape, dtype=torch.float32):
        """Host memory that the copies read and write without blocking (pinned on a GPU)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, host):
        """A device copy of `host`, queued (GPU: on the copy stream, its memory that
        stream's; ready() makes the compute stream wait)."""
        self.counts.h2d_bytes += host.numel() * host.element_size()
        if not self.cuda:
            return host.clone()
        with torch.cuda.stream(self.stream):
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
        return out

    def mark(self):
        """An event after the copies queued so far (GPU; None on the CPU): what a stage-in's
        reader waits for, rather than every copy queued since (the last bucket's stage-out,
        the next one's stage-in)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def ready(self, event, tensors):
        """The compute stream waits for `event` (mark()), and `tensors` (made on the copy
        stream) are kept from reuse until the compute stream is done with them."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors:
                t.record_stream(current)

    def to_host(self, dev, host):
        """`host` <- `dev`, queued after the compute stream's work so far (GPU: on the copy
        stream; dev's memory is not reused before the copy has read it)."""
        self.counts.d2h_bytes += dev.numel() * dev.element_size()
        if not self.cuda:
            host.copy_(dev)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
        dev.record_stream(self.stream)

    def settle(self):
        """Wait (the host) until every staging copy is done: before the host reads host
        memory the copies write (a checkpoint, a flush)."""
        if self.cuda:
            self.stream.synchronize()
            self.counts.host_syncs += 1


class StateHome:
    """One bucket's glo_buf (flat, and the views its global optimizer steps), that
    optimizer's per-element state and the residual, kept in host memory and staged on the
    device: fetch() queues the stage-in of some parts, use() swaps the device copies in,
    put_back() queues the stage-out and swaps the host memory back."""

    def __init__(self, bucket, copies):
        self.bucket = bucket
        self.copies = copies
        b = bucket
        with torch.no_grad():
            host = copies.host_empty(b.numel)
            host.copy_(b.glo)
        self.glo = host
        self.views = b._views(host)
        self.state = {}  # (view index, state key) -> its host tensor
        for w, hv in zip(b.glo_views, self.views):
            w.data = hv  # the optimizer's parameters now read host memory
        b.glo = host
        self.residual = None  # the residual's host memory (None: the bucket has none)
        self.adopt_state()
        self._fetched = None  # (parts, device flat, {(i, key): device tensor}, residual,
        #                       the event after their copies)
        self.staged = None  # (parts, device flat, device residual) swapped in

    def adopt_state(self):
        """The optimizer's per-element state and the residual into host memory of their own
        (at the start, or a checkpoint's, loaded pageable)."""
        b = self.bucket
        if b.residual is None:
            self.residual = None
        elif b.residual is not self.residual:
            self.residual = self.copies.host_empty(b.numel)
            self.residual.copy_(b.residual)
            b.residual = self.residual
        shadow = self.bucket.shadow
        for i, w in enumerate(self.bucket.glo_views):
            for k, v in shadow.state.get(w, {}).items():
                if _per_element(v, w) and self.state.get((i, k)) is not v:
                    host = self.copies.host_empty(v.shape, v.dtype)
                    host.copy_(v)
                    self.state[(i, k)] = shadow.state[w][k] = host

    def fetch(self, parts=BOTH):
        """Queue the stage-in of `parts` (no wait), unless queued or staged already."""
        if self.staged is not None or (self._fetched is not None and
                                       self._fetched[0] == parts):
            return
        flat, state, residual = None, {}, None
        if STATE in parts:
            flat = self.copies.to_device(self.glo)
            state = {key: self.copies.to_device(host) for key, host in self.state.items()}
        if RESIDUAL in parts and self.residual is not None:
            residual = self.copies.to_device(self.residual)
        self._fetched = (parts, flat, state, residual, self.copies.mark())

    def discard(self):
        """Forget a queued stage-in (its host memory is about to be overwritten)."""
        self._fetched = None

    def use(self, parts=BOTH):
        """The device copies of `parts` swapped in (the compute stream waits for them); True
        where this call staged the bucket, False where it was staged already."""
        if self.staged is not None:
            return False
        self.fetch(parts)
        parts, flat, state, residual, event = self._fetched
        self._fetched = None
        self.copies.ready(event, [t for t in [flat, residual] + list(state.values())
                                  if t is not None])
        b = self.bucket
        if flat is not None:
            for w, dv in zip(b.glo_views, b._views(flat)):
                w.data = dv
            for (i, k), dev in state.items():
                b.shadow.state[b.glo_views[i]][k] = dev
        if residual is not None:
            b.residual = residual
        self.staged = (parts, flat, residual)
        return True

    def put_back(self):
        """Queue the stage-out of what use() staged (a state the step made first too) and
        swap the host memory back in."""
        if self.staged is None:
            return
        _, flat, residual = self.staged
        self.staged = None
        b = self.bucket
        if residual is not None:
            if b.residual is None:  # flushed for good by the encode (a full-precision route)
                self.residual = None
            else:
                self.copies.to_host(b.residual, self.residual)
                b.residual = self.residual
        if flat is None:
            return
        self.copies.to_host(flat, self.glo)
        for i, (w, hv) in enumerate(zip(b.glo_views, self.views)):
            entry = b.shadow.state.get(w, {})
            for k, v in list(entry.items()):
                if not _per_element(v, w):
                    continue
                host = self.state.get((i, k))
                if host is None:
                    host = self.state[(i, k)] = self.copies.host_empty(v.shape, v.dtype)
                self.copies.to_host(v, host)
                entry[k] = host
            w.data = hv
