"""TorchFramework: the aggregator's seams served by PyTorch (docs/backend.md, docs/pytorch.md).

Host buffers are NumPy memory (pinned through torch for CUDA models) that torch tensors
view without a copy; a CPU model's gradient is copied into grad_buf on the training thread
(or encoded in place in the local update's pass), a CUDA model's by an asynchronous copy
(copies.py) whose event admits its buffer to the pipeline. loc_buf is the parameter itself (the local
update writes it in place, on the parameter's device), glo_buf stays on the host, and the
global update runs the user's optimizer with the hyperparameters of the step's push:
torch.optim.SGD as a Cython kernel, any other class as one instance per parameter.
"""
import copy
import dataclasses
from typing import Tuple

import numpy as np
import torch

from ..engine import stages
from ..codecs.base import kernels
from ..env import check_num_threads
from ..transport.host import HostBuffer, HostReadiness
from .copies import CudaCopies, EventReadiness


def host_buffer(shape, copies=None, dtype=np.float32):
    """A HostBuffer of zeros; with a device model's `copies`, in the memory they copy at
    full speed without blocking (page-locked for CUDA)."""
    buf = HostBuffer(shape, dtype)
    if copies is not None:
        tensor = copies.host_zeros(buf._np.size, torch.from_numpy(buf._np[:0]).dtype)
        buf._np = tensor.numpy()
        buf.tensor = tensor  # keeps the allocation alive
    return buf


def tensor_of(buf, shape=None):
    """The torch tensor over a HostArray's memory (no copy), in `shape` (default its own).
    A HostBuffer's is made once (its memory never moves): a step of 500 tiny parameters
    asks 1000 times."""
    if type(buf) is HostBuffer:
        flat = buf.__dict__.get("_flat")
        if flat is None:
            flat = buf._flat = torch.from_numpy(buf.for_read())
    else:
        flat = torch.from_numpy(buf.for_read())
    shape = shape if shape is not None else buf.shape
    return flat if shape == (-1,) or tuple(shape) == tuple(flat.shape) else flat.view(shape)


class TorchArrays:
    """backend.Arrays over host buffers and torch tensors: loc_buf is the parameter."""

    can_hold = False
    loc_in_params = True  # the local update writes the parameters themselves

    def __init__(self, copies=None):
        self.copies = copies  # a device model's: host -> parameter without blocking

    def new(self, shape):
        return host_buffer(shape, self.copies)

    @staticmethod
    def array(buf):
        return tensor_of(buf)

    def copy(self, src, dst):
        if src is dst:
            return
        src = torch.as_tensor(src)
        with torch.no_grad():
            if self.copies is not None and self.copies.crosses_to_device(src, dst):
                self.copies.to_device(src, dst)
            else:
                dst.copy_(_shaped(src, dst))

    def copy_many(self, pairs):
        """Several copies (a fused bucket's write-backs): one multi-tensor copy on the host,
        where each copy would cost more in Python than in memory."""
        if self.copies is not None:
            for src, dst in pairs:
                self.copy(src, dst)
            return
        srcs, dsts = [], []
        for src, dst in pairs:
            if src is not dst:
                srcs.append(_shaped(torch.as_tensor(src), dst))
                dsts.append(dst)
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)

    def hold(self, buf):
        raise RuntimeError("torch arrays have no engine to hold a writer in (can_hold is False)")


def _shaped(src, dst):
    """`src` (a tensor) in `dst`'s shape, viewed only where the shapes differ."""
    return src if src.shape == dst.shape else src.view(dst.shape)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The hyperparameters of every param group when a key was pushed (the rate of an LR
    scheduler in push order, as the trainer left it for this step)."""

    groups: Tuple[Tuple[Tuple[str, object], ...], ...]

    @classmethod
    def of(cls, optimizer):
        return cls(tuple(tuple(sorted((k, _plain(v)) for k, v in g.items() if k != "params"))
                         for g in optimizer.param_groups))


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(value, list):
        return tuple(value)
    return value


class TorchUpdate:
    """glo_buf <- one step of the user's optimizer with the mean gradient, on the
    aggregation thread: torch.optim.SGD's rule as one kernel pass (kernels.TorchSGD, the
    compressed sum decoded inside it), another optimizer's own step on one instance per
    parameter over its glo_buf; either way the state lives in those instances, on the host.
    """

    def __init__(self, optimizer, groups_of, num_workers, num_threads=None, copies=None):
        self.optimizer = optimizer
        self.copies = copies  # a device model's: its state pinned, its reads waited for
        self._group_of = groups_of  # index -> the param group of that parameter
        self._num_workers = num_workers
        self.num_threads = check_num_threads(num_threads)  # of the SGD kernel
        self._shadow = {}  # index -> optimizer instance over the glo_buf tensor
        self._local = {}  # index -> optimizer instance over the parameter (local update)
        self._scratch = {}  # index -> the local step's copies of the global state tensors
        self._pending_states = {}  # index -> a checkpoint's state, loaded at first use
        self.check = None  # a step_check.StepSettingsCheck, verified before each update
        self.held = None  # the StepSettings of the step being pushed (hold())

    def settings(self, index):
        return self.held if self.held is not None else StepSettings.of(self.optimizer)

    def hold(self, settings):
        """The settings every push of the step now pushed carries (read once per step, not
        once per key: no user code runs between a step's pushes); None when it is pushed."""
        self.held = settings

    def decodes_in_update(self, buffers):
        """True when torch.optim.SGD's kernel runs the update, which decodes a sum inside
        it (Planner.plan asks for host-encoded keys of codecs that decode by table)."""
        return _plain_sgd(self.optimizer,
                          self.optimizer.param_groups[self._group_of[buffers.index]])

    @staticmethod
    def codec_view(index, glo, settings):
        return None  # codecs that read the optimizer use their default level (docs/pytorch.md)

    def prepare(self, transfer, num_workers):
        """The codec's decode table where the kernel decodes the sum in the update, else
        None (the sum decoded into agg, where the plan decodes in the update)."""
        index = transfer.pushes[0].buffers.index
        kernel = self._kernel(transfer.settings.groups[self._group_of[index]], num_workers)
        return stages.decode_in_update(transfer, num_workers, kernel is not None)

    def _kernel(self, group, div=1.0):
        """The TorchSGD kernel of one param group's settings (pairs), or None where the
        optimizer's own step runs."""
        group = dict(group)
        if not _plain_sgd(self.optimizer, group):
            return None
        return kernels().TorchSGD(group["lr"], group["weight_decay"], group["momentum"],
                                  group["dampening"], group["nesterov"], div)

    def shadow(self, index, glo):
        """The optimizer instance of `index`, over glo_buf's memory (made on first use)."""
        opt = self._shadow.get(index)
        if opt is None:
            weight = tensor_of(glo)
            group = {k: v for k, v in self.optimizer.param_groups[self._group_of[index]].items()
                     if k != "params"}
            opt = type(self.optimizer)([weight], **_constructor_args(self.optimizer, group))
            self._shadow[index] = opt
            if index in self._pending_states:
                opt.load_state_dict(self._pending_states.pop(index))
        return opt

    def __call__(self, transfer, table, glos):
        if self.check is not None and self.check.differs(transfer.step):
            return  # no global weight of a step the ranks disagree on; step() raises
        kernels = {}  # param group -> its kernel: one per group, not per key of a bucket
        for push, glo in zip(transfer.pushes, glos):
            b = push.buffers
            opt = self.shadow(b.index, glo)
            g = self._group_of[b.index]
            group = transfer.settings.groups[g]
            opt.param_groups[0].update(group)
            weight = opt.param_groups[0]["params"][0]
            self._wait_readers(glo, opt.state[weight])
            if g not in kernels:
                kernels[g] = self._kernel(group, self._num_workers)
            kernel = kernels[g]
            if kernel is not None:
                self._kernel_step(kernel, opt, b, glo, transfer, table)
                continue
            grad = tensor_of(b.agg, weight.shape)
            grad.div_(self._num_workers)  # the sum over workers -> DDP's mean gradient
            weight.grad = grad
            with torch.no_grad():
                opt.step()
            weight.grad = None
            self._pin_state(opt.state[weight])

    def _wait_readers(self, glo, state):
        """A device model: wait for the copies still reading glo_buf or the state (the
        local step's, on the device's stream) before the update writes them."""
        if self.copies is None:
            return
        self.copies.wait_readers(glo)
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                self.copies.wait_readers(value)

    def _pin_state(self, state):
        """A device model: the optimizer's state tensors moved into the copies' memory
        once (torch made them pageable), so the local step reads them without blocking."""
        if self.copies is None:
            return
        for k, v in state.items():
            if torch.is_tensor(v) and v.numel() > 1 and not self.copies.is_pinned(v):
                pinned = self.copies.host_zeros(v.numel(), v.dtype).view(v.shape)
                pinned.copy_(v)
                state[k] = pinned

    def _kernel_step(self, kernel, opt, b, glo, transfer, table):
        """glo_buf <- the kernel's step with the mean of the sum (agg, or decoded from the
        lanes by `table` on the fly); the momentum kept in the shadow optimizer's state,
        where torch keeps it."""
        weight = opt.param_groups[0]["params"][0]
        state = opt.state[weight]
        self._pin_state(state)  # a checkpoint's state, loaded pageable
        mom = _host_flat(state, "momentum_buffer", weight)
        first = mom is None
        if first and opt.param_groups[0]["momentum"] != 0:  # torch makes it at step 1
            state["momentum_buffer"] = (torch.zeros_like(weight) if self.copies is None else
                                        self.copies.host_zeros(weight.numel()).view(weight.shape))
            mom = state["momentum_buffer"].view(-1).numpy()
        w = glo.for_write()
        if table is not None:
            k, m, rows = table
            kernel.decode_step(transfer.exchange.recv.for_read(), rows, k, m, w, mom, first,
                               self.num_threads, transfer.lanes_checked)
        else:
            kernel.step(w, b.agg.for_read(), None if first else mom, mom, w, self.num_threads)

    def local_step(self, index, glo, param, grad, encoder=None):
        """loc_buf (the parameter) <- one step of the same rule from glo_buf with this
        worker's gradient, reading the global state and writing none of it; `encoder` (a
        grad_buf.FusedEncode) encodes the gradient, in the kernel's pass where it runs."""
        opt = self.shadow(index, glo)  # made here when the local step comes first (a resume)
        state = opt.state[opt.param_groups[0]["params"][0]]
        current = StepSettings.of(self.optimizer).groups[self._group_of[index]]
        host = self.copies is None and _host_contiguous(param, grad)  # else on the device
        kernel = self._kernel(current) if host else None
        if kernel is None:
            self._local_ops(index, glo, param, grad, state, dict(current))
            if encoder is not None:
                encoder(GradInPlace(grad), None)
            return
        mom = _host_flat(state, "momentum_buffer", param)
        w, out = glo.for_read(), param.detach().view(-1).numpy()
        if encoder is not None:
            encoder(GradInPlace(grad), kernel.local(w, mom, out))
        else:
            kernel.step(w, grad.view(-1).numpy(), mom, None, out, self.num_threads)

    def _local_ops(self, index, glo, param, grad, state, current):
        """local_step in torch ops on the parameter's device: glo_buf copied into it, then
        SGD's rule (_sgd_local) or the optimizer's own step with a copy of the state."""
        local = self._local.get(index)
        if local is None:
            group = {k: v for k, v in self.optimizer.param_groups[self._group_of[index]].items()
                     if k != "params"}
            local = type(self.optimizer)([param], **_constructor_args(self.optimizer, group))
            self._local[index] = local
        with torch.no_grad():
            self._into(param, tensor_of(glo, param.shape))  # the update waits for this read
            if _plain_sgd(self.optimizer, current):
                self._sgd_local(index, param, grad, state.get("momentum_buffer"), current)
                return
        local.param_groups[0].update(current)
        local.state[param] = self._local_state(index, param, state)
        saved, param.grad = param.grad, grad
        with torch.no_grad():
            local.step()
        param.grad = saved
        local.state.pop(param, None)

    def _into(self, dst, src):
        """dst (on the parameter's device) <- src (host): a device model's copy does not
        block, and the global update waits for it before writing src again; otherwise a
        plain copy, which returns once done."""
        if self.copies is not None and self.copies.crosses_to_device(src, dst):
            self.copies.to_device(src, dst)
        else:
            dst.copy_(src)

    def _sgd_local(self, index, param, grad, momentum_buffer, group):
        """torch.optim.SGD's rule on the parameter (which holds glo_buf), op for op as its
        single-tensor step, without allocating: the weight-decayed gradient and the momentum
        go into buffers kept per key, the global momentum is read, not written."""
        scratch = self._scratch.setdefault(index, {})

        def buffer(name):
            if name not in scratch:
                scratch[name] = torch.empty_like(param)
            return scratch[name]

        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        d = grad
        if wd != 0:
            d = torch.add(grad, param, alpha=wd, out=buffer("d"))
        if mu != 0:
            if momentum_buffer is None:  # the first step: the buffer is the gradient
                buf = d
            else:
                buf = buffer("momentum_buffer")
                self._into(buf, momentum_buffer)
                buf.mul_(mu).add_(d, alpha=1 - group["dampening"])
            if group["nesterov"]:
                d = torch.add(d, buf, alpha=mu, out=buffer("d"))
            else:
                d = buf
        param.add_(d, alpha=-lr)

    def _local_state(self, index, param, state):
        """A copy of the global state for the local step: tensors of the parameter's shape
        copied into buffers kept per key on its device (allocating them each step costs
        several times the copy), the rest (step counts) copied anew."""
        scratch = self._scratch.setdefault(index, {})
        out = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == param.shape:
                buf = scratch.get(k)
                if buf is None:
                    buf = scratch[k] = torch.empty_like(v, device=param.device)
                self._into(buf, v)
                out[k] = buf
            else:
                out[k] = copy.deepcopy(v)
        return out

    def check_state(self, state, where):
        """Raise ValueError unless `state` (a state()) is of this optimizer's class."""
        if state.get("optimizer") != type(self.optimizer).__name__:
            raise ValueError("%s holds the state of optimizer %s; this job's is %s"
                             % (where, state.get("optimizer"), type(self.optimizer).__name__))

    def state(self):
        """Per index the shadow optimizer's state_dict (tensors and plain values)."""
        return {"optimizer": type(self.optimizer).__name__,
                "states": {i: opt.state_dict() for i, opt in self._shadow.items()}}

    def load_state(self, state, where):
        """Restore state(): each shadow optimizer's, now or when it is made."""
        self.check_state(state, where)
        self._pending_states = dict(state["states"])
        for index in list(self._pending_states):
            if index in self._shadow:
                self._shadow[index].load_state_dict(self._pending_states.pop(index))


def _plain_sgd(optimizer, group):
    """True for torch.optim.SGD itself with settings its single-tensor rule covers as
    kernels.TorchSGD and TorchUpdate._sgd_local write it (not maximize or differentiable)."""
    return (type(optimizer) is torch.optim.SGD and not group.get("maximize")
            and not group.get("differentiable"))


def _host_contiguous(*tensors):
    """True when every tensor is on the host and contiguous (a flat NumPy view is it)."""
    return all(not t.is_cuda and t.is_contiguous() for t in tensors)


def _host_flat(state, name, like):
    """The flat NumPy view of an optimizer state tensor, or None when the state has none;
    ValueError unless it is a contiguous host tensor of the parameter's shape."""
    value = state.get(name)
    if value is None:
        return None
    if not _host_contiguous(value) or value.shape != like.shape:
        raise ValueError("optimizer state %r has shape %s on %s, its parameter %s"
                         % (name, tuple(value.shape), value.device, tuple(like.shape)))
    return value.view(-1).numpy()


def _constructor_args(optimizer, group):
    """The keyword arguments that rebuild `optimizer`'s class with one group's settings."""
    import inspect
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in group.items() if k in accepted}


class GradInPlace:
    """A host gradient tensor as grad_buf.FusedEncode reads it (held(): a flat NumPy view),
    so a fused push encodes it without a copy into grad_buf."""

    def __init__(self, grad):
        self._flat = grad.detach().reshape(-1).numpy()  # (a copy if it is not contiguous)

    def held(self):
        return self._flat


class TorchLocalUpdate:
    """The backup's local update (aggregator.local_updater) for torch parameters.

    `fused` on a CPU model with torch.optim.SGD: the local step is the TorchSGD kernel's
    pass, in which a lane codec encodes bit_buf (grad_buf.FusedEncode) from the gradient
    in place; where no codec encodes there, the gradient's NaN/Inf are counted instead,
    so the encoder skips its own pass.
    """

    def __init__(self, update, host):
        self._update = update
        self._fused = host and type(update.optimizer) is torch.optim.SGD
        self.scale = None  # clip_grad_norm_ with backup: this rank's own clip coefficient

    @property
    def fused(self):
        """Whether the local pass may encode the gradient: not while `scale` clips what it
        reads (what is sent is the unclipped gradient)."""
        return self._fused and self.scale is None

    def __call__(self, index, grad, glo, out, check=None, encoder=None):
        if self.scale is not None:
            grad = grad * self.scale  # the step's pushes are not fused: encoder is None
        if check is not None:
            check.ready = glo  # a host buffer: admitted at once, this thread has done it all
        self._update.local_step(index, glo, out, grad, encoder)
        if check is not None and encoder is None:
            check.nonfinite = kernels().count_nonfinite(GradInPlace(grad).held(),
                                                        self._update.num_threads)

    @staticmethod
    def state():
        return None

    def load_state(self, state, where):
        pass


class TorchFramework:
    """One rank's torch seams: host buffers, gradients in, the optimizer's own rule.

    A device model's gradients reach grad_buf through `copies` (asynchronous copies whose
    events admit each buffer: copies.CudaCopies for a CUDA model, or a stand-in such as
    copies.DeferredCopies on CPU tensors); a host model's are copied on the training thread.
    """

    engine_where = "a CUDA copy"
    pushes_every_key = True  # step() pushes every trainable parameter or raises

    def __init__(self, params, group_of, num_workers, cuda=False, copies=None):
        self.params = params  # index -> parameter, in key order
        self.group_of = group_of  # index -> its param group in the optimizer
        self.num_workers = num_workers
        self.cuda = cuda
        self.copies = CudaCopies() if copies is None and cuda else copies
        self.device = self.copies is not None  # gradients arrive by asynchronous copies
        self.has_device = self.device  # offload='auto' places codecs on the device or CPU
        self.readiness = EventReadiness() if self.device else HostReadiness()
        self.arrays = TorchArrays(self.copies)

    def new_buffer(self, shape, dtype=np.float32):
        return host_buffer(shape, self.copies, dtype)

    def on_error(self, callback):
        """Copies and optimizer steps run on the calling thread: their errors raise there."""

    def device_codec(self, codec):
        from .device import TorchDeviceCodec
        return TorchDeviceCodec(codec, self.copies)

    def weight(self, key, value):
        """glo_buf's first value from a NumPy copy of the parameter (optimizer.py checked it)."""
        weight = self.new_buffer(value.shape)
        np.copyto(weight.for_write(), np.reshape(value, -1))
        return weight

    def gradient(self, b, grads, fused=False, device_encoded=False):
        """(the gradient tensor, what the local update reads: the same tensor); grad_buf gets
        a copy at once for a host model, none on a fused push (its local update encodes the
        gradient in place) nor where the device encodes it, else an asynchronous copy whose
        event admits grad_buf (or the fused bucket it is a view of) to the pipeline."""
        grad = grads[0]
        if fused or device_encoded:
            return grad, grad
        dst = tensor_of(b.grad_buf, (-1,))
        if not self.device:
            dst.copy_(grad if grad.dim() == 1 else grad.reshape(-1))
            return grad, grad
        self.readiness.copied(b.grad_buf, self.copies.to_host(grad, dst))
        return grad, grad

    def optimizer_settings(self, optimizer, loc_optimizer):
        if loc_optimizer is not None:
            raise ValueError("loc_optimizer=%r: the PyTorch adapter's local update is the "
                             "global rule; leave loc_optimizer unset" % (loc_optimizer,))
        settings = {"optimizer": "%s.%s" % (type(optimizer).__module__,
                                            type(optimizer).__name__)}
        for i, (group, values) in enumerate(zip(optimizer.param_groups,
                                                StepSettings.of(optimizer).groups)):
            settings["param group %d size" % i] = len(group["params"])
            settings.update(("param group %d %s" % (i, k), v) for k, v in values)
        return settings

    def global_update(self, optimizer, num_threads):
        return TorchUpdate(optimizer, self.group_of, self.num_workers, num_threads, self.copies)

    def local_updater(self, update, num_workers, config):
        if config.loc_lr is not None:
            raise ValueError("loc_lr=%r: the PyTorch adapter's local update takes the "
                             "optimizer's own rate; leave loc_lr unset" % (config.loc_lr,))
        return TorchLocalUpdate(update, host=not self.device)
