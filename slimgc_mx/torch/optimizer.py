"""DistributedOptimizer: SlimGC's engine behind a torch optimizer (docs/pytorch.md).

It replaces DDP rather than hooking into it: DDP waits for every communication hook before
backward() returns, so model backup (the next step starting while this one's aggregation is
in flight) must live in the optimizer. step() hands each parameter's gradient to the engine:
with backup the parameter gets loc_buf (this rank's gradient applied to glo_buf by the
optimizer's own rule) at once, and glo_buf gets the mean gradient's step when the sum arrives.
"""
import atexit
import dataclasses
import datetime
import time

import torch
import torch.distributed as dist

from .. import env, notice
from ..engine import agreement, checkpoint
from ..engine.aggregator import Aggregator
from ..engine.planner import check_momentum
from ..engine.config import SlimGCConfig
from ..transport.local import LocalTransport
from . import device_path
from .collective import TorchTransport
from .framework import StepSettings, TorchFramework
from .state import from_tensors, to_tensors
from .step_check import StepSettingsCheck

#: How messages name the constructor's keywords (config.SlimGCConfig.from_sources).
SOURCE = "DistributedOptimizer keywords"


def _split_options(options):
    """(SlimGC settings, codec options) of the constructor's keywords."""
    fields = set(SlimGCConfig.field_names())
    settings = {k: v for k, v in options.items() if k in fields}
    codec = {k: v for k, v in options.items() if k not in fields}
    if codec:
        settings["codec_options"] = dict(settings.get("codec_options") or {}, **codec)
    return settings


def init_process_group(backend="gloo", timeout=None):
    """torch.distributed's default group from the launcher's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), its keys under one prefix per torchrun attempt: a group
    made again after a restart must not find the dead attempt's addresses in the store
    (torchrun's store outlives its workers). Does nothing when a group exists.

    timeout: seconds to wait for every rank, and Gloo's timeout (default: SLIMGC_TIMEOUT,
    else SlimGCConfig's); a rank still missing then fails naming how many came."""
    if dist.is_initialized():
        return
    job = env.torch_rendezvous()
    if timeout is None:
        timeout = SlimGCConfig.from_sources({}, None, SOURCE).timeout
    host, port, world = job.master_addr, job.master_port, job.world_size
    span = datetime.timedelta(seconds=timeout)
    who, start = "rank %d of %d" % (job.rank, world), time.monotonic()
    try:
        store = dist.TCPStore(host, port, world, is_master=job.rank == 0 and not job.agent_store,
                              timeout=span, wait_for_workers=False)
    except (RuntimeError, TimeoutError) as exc:  # torch's client tries twice
        raise RuntimeError("%s: no rendezvous at %s:%d after %.0f s (rank 0 hosts it; timeout "
                           "%g s): start every rank (torchrun --nproc-per-node %d), or raise "
                           "timeout (%s)" % (who, host, port, time.monotonic() - start,
                                             timeout, world, exc)) from None
    store = dist.PrefixStore("slimgc/attempt_%s" % job.attempt, store)
    _rendezvous(store, world, timeout, "%s: the rendezvous at %s:%d" % (who, host, port))
    dist.init_process_group(backend, store=store, rank=job.rank, world_size=world, timeout=span)
    atexit.register(_destroy_own_group)


def _destroy_own_group():
    """At exit, the group init_process_group made is destroyed while the interpreter is
    alive: a group and its store torn down during the interpreter's finalization can abort
    the process ('terminate called without an active exception') after the job is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous(store, world, timeout, where):
    """Count this process in and wait until `world` are, at most `timeout` seconds."""
    came, deadline = store.add("slimgc_arrived", 1), time.monotonic() + timeout
    while came < world:
        if time.monotonic() > deadline:
            raise RuntimeError("%s got %d of %d processes within %g s; start every rank "
                               "(torchrun --nproc-per-node %d), or raise timeout"
                               % (where, came, world, timeout, world))
        time.sleep(0.05)
        came = store.add("slimgc_arrived", 0)


#: How to train parameters added after wrapping (add_param_group, step()'s check).
_GROUPS_FIX = ("Add every group to the inner optimizer before wrapping it "
               "(inner.add_param_group(...) first, then build the DistributedOptimizer); to "
               "train a head later, give it to the optimizer from the start with lr=0 and "
               "raise its lr when it should learn")


def _group_sizes(optimizer):
    """(param groups, parameters) of `optimizer`: what step() compares, cheaply."""
    return len(optimizer.param_groups), sum(len(g["params"]) for g in optimizer.param_groups)


def _init_process_group(timeout):
    """True once torch.distributed is initialized (from the launcher's variables, waiting
    `timeout` seconds for every rank, when the script has not), False for a job of one."""
    if dist.is_initialized():
        return True
    if not env.torch_launched():
        return False
    init_process_group(timeout=timeout)
    return True


class DistributedOptimizer(torch.optim.Optimizer):
    """`optimizer` with SlimGC's aggregation of `model`'s gradients over torch.distributed.

    compression: a codec name (codecs.available(), 'none' for full precision); other
    keywords are SlimGC's settings (backup, comm_threshold, offload, warmup_steps, ...)
    or the codec's own options (threshold, levels, ratio, ...), as on the MXNet side.
    broadcast_buffers: rank 0's buffers (BatchNorm statistics) before each forward, as DDP.
    data_path: where the step runs: 'device' (every stage in torch ops on the parameters'
    device, device_path.py), 'host' (the engine's pipeline over host memory), or 'auto'
    (the device path for a CUDA model whose settings it serves, else the host path).
    bucket_cap_mb: the device path's bucket size (DDP's meaning).
    state_on: where the device path keeps glo_buf, the optimizer's state and the residuals:
    'device' (the default: fastest) or 'host' (offloaded to pinned host memory and staged
    on the device for each bucket's pass: less device memory, two copies a step); the host
    path keeps them on the host.
    overlap: the device path starts each bucket from backward, as DDP does, unless the
    first step shows a gradient changing between backward and step() (False: in step()).
    """

    def __init__(self, optimizer, model, compression="2bit", broadcast_buffers=True,
                 data_path="auto", bucket_cap_mb=device_path.BUCKET_CAP_MB, overlap=True,
                 state_on=None, **options):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("DistributedOptimizer wraps a torch.optim.Optimizer, got %s"
                            % type(optimizer).__name__)
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError("pass the model itself, not a DistributedDataParallel wrapper: "
                            "SlimGC aggregates the gradients in place of DDP (DDP would sum "
                            "them a second time); use model.module")
        if not isinstance(model, torch.nn.Module):
            raise TypeError("model must be a torch.nn.Module, got %s" % type(model).__name__)
        if not (isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
                and 0 < bucket_cap_mb < float("inf")):
            raise ValueError("bucket_cap_mb must be a positive number of MiB (DDP's meaning; "
                             "default %g), got %r" % (device_path.BUCKET_CAP_MB, bucket_cap_mb))
        if state_on is not None:
            device_path.check_state_on(state_on)
        if not isinstance(overlap, bool):
            raise TypeError("overlap must be True (buckets start during backward) or False "
                            "(in step()), got %r" % (overlap,))
        settings = _split_options(dict(options, compressor=compression))
        config = SlimGCConfig.from_sources(settings, None, SOURCE)
        config.validate()
        self._inner = optimizer
        self._clip = None  # slimgc.clip_grad_norm_'s request for the coming step
        named = self._parameters_of(model, optimizer)
        distributed = _init_process_group(config.timeout)
        transport = TorchTransport(config.timeout) if distributed else LocalTransport()
        cuda = any(p.is_cuda for _, p in named)
        self.data_path = device_path.choose(
            data_path, config, optimizer, cuda,
            offload_given="offload" in options or bool(env.option_variables(["offload"])))
        # torch.optim.Optimizer's own attributes (hooks), then the wrapped one's groups/state
        super().__init__([torch.zeros(1, requires_grad=True)], {})
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        group_by_id = {id(q): g for g, group in enumerate(optimizer.param_groups)
                       for q in group["params"]}  # one pass, not one per parameter
        group_of = {i: group_by_id[id(p)] for i, (_, p) in enumerate(named)}
        self._named = named
        self._last_step = (None, None)  # step()'s seconds and copy counts, for stats()
        self._model = model
        self._transport = transport
        self._config = config
        self._check = None  # every step's hyperparameters compared across ranks
        self._agg = self._device = None
        if self.data_path == "device":
            self._device_path(optimizer, named, group_of, config, transport, distributed, cuda,
                              bucket_cap_mb, overlap, state_on or "device")
        elif state_on == "device":
            raise ValueError("state_on='device' is the device path's, and this optimizer runs "
                             "on the host path (data_path=%r, a %s model), which keeps glo_buf "
                             "and the optimizer's state on the host: drop state_on, or give "
                             "data_path='device'" % (data_path, "CUDA" if cuda else "CPU"))
        else:
            self._host_path(optimizer, named, group_of, config, transport, cuda)
        if cuda and transport.rank == 0:
            notice.tell(self._where_state_lives(), once=True)
        self._buffers = [b for b in model.buffers()] if broadcast_buffers else []
        if self._buffers and transport.num_workers > 1:
            transport.broadcast_tensors([b.data for b in self._buffers])
        self._hook = model.register_forward_pre_hook(lambda module, args: (
            self._broadcast_buffers())) if self._buffers and transport.num_workers > 1 else None
        self._groups = _group_sizes(optimizer)  # the keys are fixed from here on

    def _where_state_lives(self):
        """Where a CUDA model's step runs and its state lives, said once at start."""
        if self._device is not None:
            return self._device.describe()
        return ("data path: host: gradients copied to pinned host memory, glo_buf and the "
                "optimizer's state offloaded there, the codecs on the CPU (offload=%r)"
                % (self._config.offload,))

    def _host_path(self, optimizer, named, group_of, config, transport, cuda):
        """The engine's aggregator over these parameters, with rank 0's weights."""
        framework = self._framework([p for _, p in named], group_of, transport.num_workers, cuda)
        self._agg = Aggregator(config, transport, framework=framework)
        momentum = max(float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups)
        check_momentum(self._agg.codec, momentum, "compression=%r, momentum=%r")
        self._agg.set_optimizer(optimizer)
        if transport.num_workers > 1:
            self._check = self._agg.update.check = StepSettingsCheck(
                transport, StepSettings.of(optimizer))
        for name, p in named:
            self._agg.add_key(name, p.detach().cpu().numpy())
            with torch.no_grad():
                p.copy_(self._agg.backup.glo_buf(name).view(p.shape))  # rank 0's weights
        for name, _ in named:  # the global update's optimizer of each parameter made here,
            # not in the first step's update (500 tiny parameters: 25 ms of that step)
            self._agg.update.shadow(self._agg.planner.keys[name].index,
                                    self._agg.backup.glo_buffer(name))

    def _device_path(self, optimizer, named, group_of, config, transport, distributed, cuda,
                     cap_mb, overlap, state_on):
        """device_path.DevicePath over these parameters, once the ranks agree on it."""
        momentum = max(float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups)
        check_momentum(device_path.make_codec(config), momentum, "compression=%r, momentum=%r")
        if transport.num_workers > 1:
            agreement.check(transport, dict(
                config.agreement_fields(), num_workers=transport.num_workers,
                data_path="device", bucket_cap_mb=float(cap_mb), overlap=bool(overlap),
                state_on=state_on,
                keys=[(n, tuple(p.shape)) for n, p in named],
                optimizer=(type(optimizer).__name__, repr(StepSettings.of(optimizer)))))
        group = device_path.lane_group(transport.group, cuda) if distributed else None
        self._device = device_path.DevicePath(optimizer, named, group_of, config, transport,
                                              group, cap_mb, state_on)
        if overlap:
            self._device.hook([p for _, p in named])
        if transport.num_workers > 1:
            self._check = self._device.check = StepSettingsCheck(
                device_path.TailRides(transport, self._device), StepSettings.of(optimizer))

    def add_param_group(self, param_group):
        """Refused once built: the engine's keys are declared on every rank at construction,
        so a group added now would never be trained (torch.optim.Optimizer's own call in
        __init__ adds its placeholder)."""
        if "_groups" not in self.__dict__:
            return super().add_param_group(param_group)
        raise ValueError("add_param_group on a DistributedOptimizer: its parameters are "
                         "fixed when it is built, so this group would never be trained. "
                         + _GROUPS_FIX)

    @staticmethod
    def _framework(params, group_of, num_workers, cuda):
        """The adapter's seams for these parameters (a test gives a device model's copies
        to a CPU model by overriding it: tests/test_torch_copies.py)."""
        return TorchFramework(params, group_of, num_workers, cuda)

    @staticmethod
    def _parameters_of(model, optimizer):
        """The (name, parameter) pairs to aggregate: the model's trainable ones, each of
        which the optimizer must hold, float32 and dense."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n, p in named if id(p) not in held]
        if missing:
            raise ValueError("parameters %s of the model are not in the optimizer: give the "
                             "optimizer every trainable parameter, or freeze them "
                             "(requires_grad=False)" % ", ".join(missing[:5]))
        mine = {id(p) for _, p in named}
        extra = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
        if extra:
            raise ValueError("the optimizer holds %d parameters that are not trainable "
                             "parameters of the model: pass the model whose parameters it "
                             "updates" % extra)
        for n, p in named:
            if p.is_meta:
                raise ValueError("parameter %s is on the meta device (a shape without values): "
                                 "materialize the model with model.to_empty(device=...) and "
                                 "initialize its weights (e.g. each module's "
                                 "reset_parameters()) before wrapping it" % n)
            if p.dtype != torch.float32:
                raise TypeError("parameter %s is %s: slimgc aggregates float32 parameters only "
                                "(keep the model in float32; torch.autocast computes in lower "
                                "precision without changing them)" % (n, p.dtype))
        if not named:
            raise ValueError("the model has no trainable parameters")
        return named

    def _broadcast_buffers(self):
        """Rank 0's buffers everywhere, at a training forward (as DDP: not under no_grad, so a
        forward on one rank alone, such as an evaluation, sends nothing)."""
        if not (self._model.training and torch.is_grad_enabled()):
            return
        if self._buffers and self._transport.num_workers > 1:
            self._transport.broadcast_tensors([b.data for b in self._buffers])

    # -- the step --------------------------------------------------------------------------
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale and found_inf

    def step(self, closure=None):
        """Aggregate every parameter's gradient; the parameters get loc_buf (backup) or the
        global weights. Under a GradScaler a step whose gradients hold inf/NaN on any rank
        is skipped on every rank."""
        start = time.perf_counter()
        counts = self._counts()
        before = dataclasses.replace(counts) if counts is not None else None
        try:
            return self._step(closure)
        except BaseException:
            self._mark_if_broken()
            raise
        finally:
            self._last_step = (time.perf_counter() - start,
                               counts.since(before) if counts is not None else None)

    def _mark_if_broken(self):
        """A failed aggregation of the host path leaves the ranks at different collectives
        of the group (each stops at its own point): no later optimizer may use it."""
        mark = getattr(self._transport, "mark_uneven", None)
        if self._agg is not None and self._agg.broken and mark is not None:
            mark()

    def _counts(self):
        """The copy accounting of a device model (copies.CopyCounts), else None."""
        if self._device is not None:
            return self._device.counts
        copies = self._agg.framework.copies
        return copies.counts if copies is not None else None

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if _group_sizes(self._inner) != self._groups:
            raise ValueError("the optimizer has %d param groups of %d parameters, %d of %d when "
                             "it was wrapped: its parameters are fixed when the "
                             "DistributedOptimizer is built, so added ones would never be "
                             "trained. %s" % (_group_sizes(self._inner) + self._groups
                                              + (_GROUPS_FIX,)))
        device = self._device
        step = device.step_count if device else self._agg.planner.steps[self._named[0][0]]
        self._raise_mismatch(step)
        clip, self._clip = self._clip, None
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        grads = []
        for name, p in self._named:
            if p.grad is None:
                raise RuntimeError(
                    "parameter %s has no gradient at this step: every rank must push every "
                    "trainable parameter; freeze parameters the loss does not reach "
                    "(requires_grad=False) before creating the DistributedOptimizer" % name)
            if p.grad.is_sparse:
                raise TypeError("parameter %s has a sparse gradient: slimgc aggregates dense "
                                "gradients (use a dense embedding)" % name)
            grads.append(p.grad)
        if found_inf is not None:
            if device is not None:  # the unscale does not bump .grad's version: say so here
                device.no_overlap("GradScaler unscales the gradients after backward")
            if scale is not None:  # not unscaled by the user: unscale as GradScaler would
                inv = scale.double().reciprocal().float()
                found_inf = torch.zeros_like(found_inf)
                for g in grads:
                    torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv)
            mine = bool(found_inf.detach().cpu().item() > 0)
            if found_inf.is_cuda and self._counts() is not None:
                self._counts().host_syncs += 1
            if self._transport.any(mine) if self._transport.num_workers > 1 else mine:
                return loss  # skipped alike on every rank; GradScaler lowers its scale
        settings = StepSettings.of(self._inner)
        if self._check is not None:
            self._check.start(step, settings)
        update = self._agg.update if device is None else None
        try:
            if update is not None:
                update.hold(settings)
            if device is not None:
                device.step(grads, clip)
            elif clip is not None:
                self._clipped_pushes(grads, *clip)
            else:  # every key pushed before any waits: fused buckets travel whole
                self._agg.start_step()
                for (name, p), g in zip(self._named, grads):
                    self._agg.push(name, [g], [p])
                self._agg.end_step()
        except BaseException:
            if self._check is not None:
                self._check.drop(step)
            raise
        finally:
            if update is not None:
                update.hold(None)
        self._inner._opt_called = True  # what an LR scheduler built on it looks for
        return loss

    def _raise_mismatch(self, before=None):
        """ConfigMismatchError if the ranks' settings differed at a step started (before
        `before`): raised where every rank calls alike, so none waits in a collective."""
        if self._check is not None:
            self._check.raise_found(before)

    # -- clipping by the global norm (slimgc.clip_grad_norm_, clip.py) ----------------------
    def _request_clip(self, max_norm, norm_type, local_scale):
        """Clip the coming step; `local_scale`: the local update's own clip (backup), or None."""
        self._clip = (max_norm, norm_type, local_scale)

    def _clipped_pushes(self, grads, max_norm, norm_type, local_scale):
        """step()'s pushes as one clipped step of the engine (Aggregator.clip_step)."""
        local = self._agg.local_updater() if self._agg.config.backup else None
        self._agg.clip_step(max_norm, norm_type)
        if local is not None:
            local.scale = local_scale
        try:
            for (name, p), g in zip(self._named, grads):
                self._agg.push(name, [g], [p])
        finally:
            if local is not None:
                local.scale = None
        self._agg.end_step()

    @property
    def global_grad_norm(self):
        """The mean gradient's norm that slimgc.clip_grad_norm_ clipped at the latest step
        applied to the global weights (after flush(), the last step), else None."""
        if self._device is not None:
            last = self._device.last_norm  # a tensor on the device: read now
            return None if last is None else float(last)
        last = self._agg.clip.last
        return None if last is None else last.total_norm

    def zero_grad(self, set_to_none=True):
        self._inner.zero_grad(set_to_none=set_to_none)

    # -- reading weights -------------------------------------------------------------------
    def flush(self):
        """Wait for the aggregations in flight and write the global weights into the model."""
        self._raise_mismatch()
        if self._device is not None:
            self._device.flush()
        else:
            self._agg.flush()

    def stats(self):
        """Bytes, times and the CTTab's decision, as the MXNet kvstore's stats(); and the last
        step()'s own seconds (step_s) and, for a device model, what its copies moved
        (step_copies: h2d_bytes, d2h_bytes, pageable_bytes, host_syncs; None otherwise)."""
        from ..engine.aggregator import report
        out = (report(self._agg, self._agg.config.compressor, 0) if self._agg is not None
               else self._device.stats())
        out["data_path"] = self.data_path
        seconds, counts = self._last_step
        out["step_s"] = seconds
        out["step_copies"] = dataclasses.asdict(counts) if counts is not None else None
        return out

    @property
    def cttab(self):
        """The CTTab (cttab.CTTab): its rows, BestCT and save(prefix) for the table files;
        None on the device path (no warm-up there yet)."""
        return self._agg.cttab if self._agg is not None else None

    @property
    def rank(self):
        return self._transport.rank

    @property
    def num_workers(self):
        return self._transport.num_workers

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self):
        """Everything a resumed job needs (glo_buf, residuals, codec and optimizer states, the
        CTTab's decision, and under backup the parameters, which hold loc_buf), as tensors
        and plain values: torch.save/torch.load(weights_only=True) keep it without pickling
        code. It waits for the aggregations in flight and writes nothing into the model, so
        taking it changes no step that follows."""
        self._raise_mismatch()
        if self._device is not None:
            state = {"device_path": self._device.state_dict()}
        else:
            self._agg.send_pending()
            self._agg.pipeline.wait_idle(self._agg.config.timeout)
            state = to_tensors(checkpoint.state(self._agg))
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]  # lr as a scheduler left it
        if self._device is not None and self._config.backup or \
                self._agg is not None and self._agg.params_local:  # the forward reads loc_buf
            state["parameters"] = {name: p.detach().cpu().clone() for name, p in self._named}
        return state

    def load_state_dict(self, state_dict):
        """Restore state_dict(); the model gets the parameters it had when it was taken
        (loc_buf under backup, else the global weights)."""
        state = dict(state_dict)
        groups = state.pop("param_groups", None)
        params = state.pop("parameters", None)
        if groups is None or len(groups) != len(self.param_groups):
            raise ValueError("state_dict holds %s param groups; this optimizer has %d: a state "
                             "of another optimizer" % (None if groups is None else len(groups),
                                                       len(self.param_groups)))
        if ("device_path" in state) != (self._device is not None):
            raise ValueError("state_dict was taken on the %s path and this optimizer runs on "
                             "the %s path: give it data_path=%r" % (
                                 "device" if "device_path" in state else "host",
                                 self.data_path, "device" if "device_path" in state else "host"))
        if self._device is not None:
            self._device.wait()
            self._device.load_state_dict(state["device_path"])
            for group, saved in zip(self.param_groups, groups):
                group.update(saved)
            for b in self._device.buckets:
                if params is None:
                    b.write_back()
                else:
                    with torch.no_grad():
                        for name, p in zip(b.names, b.params):
                            p.copy_(params[name].view(p.shape))
            return
        state = from_tensors(state)
        self._agg.send_pending()
        self._agg.pipeline.wait_idle(self._agg.config.timeout)
        checkpoint.check(state, self._agg, "state_dict")
        checkpoint.load(state, self._agg, "state_dict")
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)
        for name, p in self._named:
            with torch.no_grad():
                p.copy_(params[name].view(p.shape) if params is not None else
                        self._agg.backup.glo_buf(name).view(p.shape))
        self._agg.params_local = params is not None

    # -- lifecycle -------------------------------------------------------------------------
    def close(self):
        """Finish the aggregations in flight and stop the engine's threads."""
        if self._device is not None:
            try:
                self._device.flush()
            finally:
                self._device.close()
                self._device = None
                if self._hook is not None:
                    self._hook.remove()
                self._transport.close(timeout=5)
            return
        if self._agg is None:
            return
        try:
            if not self._agg.broken:
                self._agg.flush()
        finally:
            if self._hook is not None:
                self._hook.remove()
            self._mark_if_broken()
            self._agg.close(join=not self._agg.broken)
            self._transport.close(timeout=5)
            self._agg = None


def flush(optimizer):
    """The global weights into the model (for evaluation or saving)."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError("flush() takes a slimgc DistributedOptimizer, got %s"
                        % type(optimizer).__name__)
    optimizer.flush()
