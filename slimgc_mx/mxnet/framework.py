"""MXNetFramework: the aggregator's seams served by MXNet (docs/backend.md).

Host buffers are CPU NDArrays with a NumPy view (buffers.Buffer), readiness and write
holds come from MXNet's engine (engine.EngineNotifier), gradients come in as NDArrays
(one per device), and the optimizer is an MXNet optimizer, run by update.GlobalUpdate and
update.LocalUpdater (the Cython SGD kernel for MXNet's SGD).
"""
import numpy as np

from .buffers import ArrayInPlace, ArrayOps, Buffer, LayoutError, copy_array
from .engine import EngineNotifier
from .update import GlobalUpdate, LocalUpdater, check_loc_optimizer, optimizer_settings


class MXNetFramework:
    """One worker's MXNet seams: buffers, engine, gradients in, optimizer rules."""

    #: How a failure of an operator run by `readiness` is named.
    engine_where = "an operator run by MXNet's engine"
    pushes_every_key = False  # gluon.Trainer initializes keys it never pushes (BatchNorm's)

    def __init__(self):
        self.readiness = EngineNotifier()
        self.arrays = ArrayOps(self.readiness)

    new_buffer = staticmethod(Buffer)

    def on_error(self, callback):
        """Where an exception raised in an engine operator goes."""
        self.readiness.on_error = callback

    @staticmethod
    def device_codec(codec):
        """The codec on the training thread (offload off): NDArray ops, or the CPU kernel."""
        from .device import DeviceCodec, InlineCodec
        return DeviceCodec(codec) if DeviceCodec.supports(codec) else InlineCodec(codec)

    @staticmethod
    def weight(key, value):
        """glo_buf's first value: rank 0's initial weights of `key` in a new Buffer."""
        if value.stype != "default":
            raise TypeError("key %r: slimgc supports dense (default storage) arrays only, "
                            "got stype %r; use kvstore='dist_sync' for sparse gradients"
                            % (key, value.stype))
        if np.dtype(value.dtype) != np.float32:
            raise TypeError("key %r is %s: slimgc aggregates float32 parameters only; cast the "
                            "model with net.cast('float32')" % (key, np.dtype(value.dtype)))
        weight = Buffer(value.shape, np.float32)
        value.copyto(weight.nd)  # also brings MKLDNN-layout arrays to the default layout
        return weight

    def gradient(self, b, grads, fused=False, device_encoded=False):
        """(the gradient summed over devices, what the push reads it from).

        On a fused push MXNet's own array in place once an operator has found it in the
        default layout (ArrayInPlace; every fused operator checks again), else grad_buf
        after a copy (an engine operator; also where the device encodes the push)."""
        grad = _sum(grads)
        if fused and b.grad_in_place:
            return grad, ArrayInPlace(grad)
        if fused and b.grad_in_place is None:
            self._probe_layout(b, grad)
        copy_array(grad, b.grad_buf.nd)
        return grad, b.grad_buf

    def _probe_layout(self, b, grad):
        """Set b.grad_in_place from an operator that reads `grad` after backward has written
        it: the layout is known there without waiting, and backward keeps it step to step."""
        if not ArrayInPlace.supports(grad):
            b.grad_in_place = False
            return
        view = ArrayInPlace(grad)

        def probe():
            try:
                view.held()
                b.grad_in_place = True
            except LayoutError:
                b.grad_in_place = False

        self.readiness.run(probe, [grad], [])

    @staticmethod
    def optimizer_settings(optimizer, loc_optimizer):
        """The settings every worker's optimizer must share; checks loc_optimizer's name."""
        check_loc_optimizer(loc_optimizer)
        return optimizer_settings(optimizer)

    @staticmethod
    def global_update(optimizer, num_threads):
        return GlobalUpdate(optimizer, num_threads)

    def local_updater(self, update, num_workers, config):
        return LocalUpdater.for_update(update, num_workers, config, self.readiness)


def _sum(arrays):
    """Sum of the per-context arrays, on the first one's context."""
    total = arrays[0]
    if len(arrays) > 1:
        total = arrays[0].copy()
        for a in arrays[1:]:
            total += a.as_in_context(total.context)
    return total
