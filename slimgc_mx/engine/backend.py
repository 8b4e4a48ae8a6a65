"""The backend protocol: what SlimGC's engine needs of a framework (docs/backend.md).

The engine (CTTab, planner, grad_buf/fp_buf/bit_buf pipeline, loc_buf/glo_buf backup,
codecs, checkpoint) works on host arrays through these seams, each a Protocol here, and
each framework is one adapter that implements them (slimgc_mx.mxnet, slimgc_mx.torch;
numpy_backend.py on plain NumPy). This module imports neither framework, nor NumPy beyond
typing.

    HostArray     a CPU buffer the Cython codecs read and write through a NumPy view
    Work          a collective in flight; wait() returns once its result is in place
    Collective    sums of lanes, gathers, broadcast and small allgathers over the workers
    Readiness     a callback per host array once the framework has written it
    Arrays        the framework's own arrays <-> host arrays: copies in the framework's
                  order and write holds
    GlobalUpdate  the update rule on glo_buf: the optimizer's step with the summed gradient
    LocalUpdate   the update rule on loc_buf: the same step with this worker's gradient
    Framework     the adapter's object the Aggregator is built with: all of the above
    DeviceBucket  a device-path bucket: the stages of its pass on the parameters' device,
                  which stages.py's encode_bucket / exchange_bucket / decode_bucket run at
                  the sites of its plan (push_plan.bucket_plan)
    ScheduledBucket  the same bucket as the step's schedule (bucket_step.py) drives it
    DeviceStep    the device under that schedule: sums, timing marks, the tail, the clip

tests/test_backend_protocol.py checks every adapter's objects against them.
"""
from typing import (Any, Callable, Generic, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

import numpy as np


@runtime_checkable
class HostArray(Protocol):
    """A CPU array with a flat NumPy view that the codecs and kernels use without the GIL.

    for_read / for_write wait for the framework's pending writers (and, for writing, its
    readers) of the same memory; held() does not wait, for code that already holds the
    access (an operator of MXNet's engine, a fill under a write hold).
    """

    @property
    def nbytes(self) -> int: ...

    def for_read(self) -> np.ndarray: ...

    def for_write(self) -> np.ndarray: ...

    def held(self) -> np.ndarray: ...

    def view(self, offset: int, shape: Sequence[int]) -> "HostArray": ...


@runtime_checkable
class Work(Protocol):
    """A collective in flight (MXNet: an engine pull; torch.distributed: its Work)."""

    elapsed: Optional[float]  # an emulated link's modelled seconds, else None

    def wait(self) -> None: ...


@runtime_checkable
class Collective(Protocol):
    """Collectives over the job's workers, keyed by wire keys declared in the same order
    on every worker. Each returns a Work at once; the training thread enforces timeouts."""

    rank: int
    num_workers: int
    kind: str

    def declare(self, wire_key: int, buf: HostArray) -> None: ...

    def announce(self, wire_keys: Sequence[int]) -> None: ...

    def push_pull(self, wire_key: int, send: HostArray, recv: HostArray, priority: int = 0,
                  in_pieces: bool = False) -> Work: ...

    def declare_gather(self, wire_key: int, send: HostArray, recv: HostArray) -> None: ...

    def gather(self, wire_key: int, send: HostArray, recv: HostArray,
               priority: int = 0) -> Work: ...

    def broadcast(self, wire_key: int, buf: HostArray) -> None: ...

    def allgather(self, values: Sequence[float]) -> np.ndarray: ...

    def pieces(self, wire_key: int) -> Optional[Sequence[Tuple[int, int]]]: ...

    def close(self, timeout: Optional[float] = None) -> bool: ...


@runtime_checkable
class Readiness(Protocol):
    """Per array, a callback once the framework's pending writes of it are done, in
    whichever order they finish (MXNet: an engine operator; a device model: the events of
    every asynchronous copy into the array's memory, views included). The pipeline admits
    a transfer through it. An optional `ordered = True` says callbacks come in the order
    asked, so serial (warm-up) transfers wait here too; else they enter at once and the
    array's own for_read() must wait for its writers."""

    def when_readable(self, buf: HostArray, callback: Callable[[], None],
                      priority: int = 0) -> None: ...


@runtime_checkable
class Arrays(Protocol):
    """The framework's arrays as the engine sees them: host buffers and the framework's
    array over one (`array`), copies queued in the framework's order (a gradient into
    grad_buf, loc_buf or w_i into the parameters), and, where the framework runs
    asynchronously, write holds that make its next reader wait for the global weights
    without blocking the training thread."""

    can_hold: bool  # (an optional loc_in_params = True: loc_buf is the parameter itself)

    def new(self, shape: Sequence[int]) -> HostArray: ...

    def array(self, buf: HostArray) -> Any: ...

    def copy(self, src: Any, dst: Any) -> None: ...

    def copy_many(self, pairs: Sequence[Tuple[Any, Any]]) -> None: ...

    def hold(self, buf: HostArray) -> Any: ...


@runtime_checkable
class GlobalUpdate(Protocol):
    """glo_buf <- one step of the job's optimizer with the mean (sum / N) of a transfer's
    summed gradients, on the aggregation thread, every worker alike (sgd_rule.py holds the
    arithmetic shared by the adapters' SGD kernels).

    The engine calls, per push on the training thread: settings(index) (the optimizer's
    hyperparameters as the push sees them, carried by the transfer), decodes_in_update
    (whether the kernel decodes a compressed sum inside the update) and codec_view; per
    transfer on the finisher thread: prepare() then the update itself (__call__) with one
    glo_buf per push; and state / check_state / load_state for checkpoints."""

    optimizer: Any

    def settings(self, index: int) -> Any: ...

    def decodes_in_update(self, buffers: Any) -> bool: ...

    def codec_view(self, index: int, glo: HostArray, settings: Any) -> Any: ...

    def prepare(self, transfer: Any, num_workers: int) -> Any: ...

    def __call__(self, transfer: Any, table: Any, glos: Sequence[HostArray]) -> None: ...

    def state(self) -> Any: ...

    def check_state(self, state: Any, where: str) -> None: ...

    def load_state(self, state: Any, where: str) -> None: ...


@runtime_checkable
class LocalUpdate(Protocol):
    """loc_buf (`out`) <- one step of the global rule from glo_buf with N times this worker's
    gradient (model backup, Strategy 3), on the training thread, reading the global state
    and writing none of it; `encoder` (grad_buf.FusedEncode) encodes bit_buf in the same
    pass where `fused`; `check` (grad_buf.GradCheck) gets its NaN/Inf count."""

    fused: bool

    def __call__(self, index: int, grad: Any, glo: HostArray, out: Any, check: Any = None,
                 encoder: Any = None) -> None: ...

    def state(self) -> Any: ...

    def load_state(self, state: Any, where: str) -> None: ...


@runtime_checkable
class Framework(Protocol):
    """What an adapter gives the Aggregator: its Readiness and Arrays, host buffers, the
    gradient of a push into grad_buf (or read in place), and the update rule's two halves."""

    readiness: Readiness
    arrays: Arrays
    engine_where: str  # how a failure reported through on_error is named
    pushes_every_key: bool  # every step pushes every key (fused buckets from the first step)

    def new_buffer(self, shape: Sequence[int], dtype: Any = ...) -> HostArray: ...

    def on_error(self, callback: Callable[[BaseException, str], None]) -> None: ...

    def device_codec(self, codec: Any) -> Any: ...

    def weight(self, key: Any, value: Any) -> HostArray: ...

    def gradient(self, b: Any, grads: Sequence[Any], fused: bool = False,
                 device_encoded: bool = False) -> Tuple[Any, Any]: ...

    def optimizer_settings(self, optimizer: Any, loc_optimizer: Any) -> dict: ...

    def global_update(self, optimizer: Any, num_threads: Optional[int]) -> GlobalUpdate: ...

    def local_updater(self, update: GlobalUpdate, num_workers: int,
                      config: Any) -> LocalUpdate: ...


@runtime_checkable
class DeviceBucket(Protocol):
    """One device-path bucket's stages (the PyTorch adapter's torch/buckets.py Bucket), each
    called by engine/stages.py where the pass's Plan places it, on the training thread.

    fill_full_precision  Plan.encode None: lanes <- the flat gradient (+ a residual a
                         compressed route left, then flushed); flag <- not finite
    flat_for_codec       a compressed plan: the flat gradient, the codec's lanes sized; the
                         residual watch's norms into `watch` where given
    encode_on_device     Plan.encode DEVICE: the device codec, error feedback included
    encode_on_host       Plan.encode HOST_CODEC: the Cython codec on this thread
    round_parts          a plan of several rounds: each round's lanes, in order
    next_round           round i's sum in: round i + 1's lanes made from it
    wait_sums            the sums in flight (works) waited for (on the device where it can)
    average              Plan.decode None: the summed lanes / workers -> the mean gradient
    decode_sum           Plan.decode DEVICE: the device codec's decode -> the mean gradient
    """

    lanes: Any  # what the pass's exchange sums (its rounds' parts: round_parts())
    works: list  # the sums in flight
    sent: Any  # the Plan of the lanes last encoded (set by stages.encode_bucket)

    def fill_full_precision(self, grads: Sequence[Any], flag: Any) -> None: ...

    def flat_for_codec(self, grads: Sequence[Any], num_workers: int,
                       watch: Any = None) -> Any: ...

    def encode_on_device(self, flat: Any, num_workers: int, flag: Any, rank: int = 0,
                         on_piece: Optional[Callable[[int, int], None]] = None) -> None: ...

    def encode_on_host(self, flat: Any, num_workers: int, flag: Any, rank: int = 0,
                       counts: Any = None) -> None: ...

    def round_parts(self) -> Sequence[Any]: ...

    def next_round(self, i: int, flag: Any) -> None: ...

    def wait_sums(self) -> None: ...

    def average(self, num_workers: int) -> None: ...

    def decode_sum(self, num_workers: int, counts: Any = None) -> None: ...


@runtime_checkable
class ScheduledBucket(DeviceBucket, Protocol):
    """A device-path bucket as the step's schedule (engine/bucket_step.py) drives it: its
    stages (DeviceBucket) and what the schedule reads and calls around them.

    plan            the Plan of its next pass on its route (push_plan.bucket_plan)
    settings        the user's current settings of its param group into its optimizers
    stage/unstage   offloaded state (state_on='host'): `parts` on the device for a pass,
                    and put back; prefetch queues a stage-in ahead of the pass
    local_step      loc_buf <- one step of the rule from glo_buf with this rank's gradient
                    (times `scale`: a clipped step), the global state only read
    global_step     glo_buf <- one step of the rule with the decoded mean gradient
    write_back      the parameters <- glo_buf
    settle          the CTTab's decision: the route it keeps
    """

    names: Sequence[str]  # its parameters' names, for messages
    indices: Sequence[int]  # its parameters' indices in the model's (backward order)
    numel: int
    codec: Any  # the device codec, None for a full-precision bucket
    base_codec: Any  # the codecs package's codec whose rule it runs (the residual watch's)
    watch: Any  # the residual watch's Series (compressed buckets), else None
    pushes: int  # compressed pushes so far
    route: str  # the route of the next encode (bucket_cttab)
    timing: Any  # the warm-up: (index, route, step, marks) until its sum is decoded
    mean: Any  # the decoded mean gradient, until global_step
    step: Optional[int]  # the step whose sum the lanes hold (None: nothing pending)
    offloaded: bool  # its state lives in host memory between passes
    lane_bytes: int  # the bytes of the lanes last encoded

    def plan(self, timed: bool = False) -> Any: ...

    def settings(self) -> None: ...

    def stage(self, parts: Any) -> bool: ...

    def unstage(self) -> None: ...

    def prefetch(self, parts: Any) -> None: ...

    def local_step(self, grads: Sequence[Any], scale: Any = None) -> None: ...

    def global_step(self) -> None: ...

    def write_back(self) -> None: ...

    def settle(self, route: str) -> None: ...


@runtime_checkable
class DeviceStep(Protocol):
    """The adapter's device under the device path's step (engine/bucket_step.py): the
    job's sums, timing marks, the step's tail (a float64 vector summed over the ranks after
    the buckets, read on the host one step later) and the clip, in the framework's ops.

    start_sum     the sum of a tensor over the ranks started: its Work (None: no group)
    mark          a timing mark on the stream that runs the passes (a GPU: an event)
    span_seconds  each span's seconds, (b - a) + (d - c) of its marks [a, b, c, d], read
                  together at the CTTab's decision (a GPU: one host synchronisation)
    tail_slot(s)  views of the tail a stage writes (a bucket's flag, the watch's norms)
    zero_tail     the tail's slots from `lo` on <- 0
    send_tail     slot n <- overlap, slots [0, n] *= scale, the rider's values at rider_at;
                  the tail's sum started, its copy to the host queued after it
    read_tail     the summed tail as a host float64 array: the step's one host wait
    clip          the mean gradients scaled as clip_grad_norm_; their norm (on the device)
    """

    sums: bool  # whether there is a group to sum over (False: a job of one process)
    counts: Any  # copies.CopyCounts: the bytes copied each way, host synchronisations

    def start_sum(self, tensor: Any) -> Optional[Work]: ...

    def mark(self) -> Any: ...

    def span_seconds(self, spans: Sequence[Sequence[Any]]) -> Sequence[float]: ...

    def tail_slot(self, i: int) -> Any: ...

    def tail_slots(self, lo: int, hi: int) -> Any: ...

    def zero_tail(self, lo: int) -> None: ...

    def send_tail(self, n: int, overlap: float, scale: float, rider_at: int,
                  rider: Optional[np.ndarray]) -> None: ...

    def read_tail(self) -> np.ndarray: ...

    def clip(self, means: Sequence[Any], max_norm: float, norm_type: float) -> Any: ...


def missing(obj, proto):
    """The members of Protocol `proto` that `obj` lacks (a method: not callable there), in
    the order the Protocol declares them; [] when obj implements it."""
    out = []
    for klass in reversed(proto.__mro__):
        if klass in (object, Protocol, Generic) or not getattr(klass, "_is_protocol", False):
            continue
        for name in getattr(klass, "__annotations__", {}):
            if not hasattr(obj, name) and name not in out:
                out.append(name)
        for name, value in vars(klass).items():
            if callable(value) and (not name.startswith("_") or name == "__call__"):
                if not callable(getattr(obj, name, None)) and name not in out:
                    out.append(name)
    return out


def check(obj, proto, what):
    """Raise TypeError naming what `obj` (called `what`) lacks of `proto`."""
    absent = missing(obj, proto)
    if absent:
        raise TypeError("%s (%s) does not implement backend.%s: it lacks %s (docs/backend.md)"
                        % (what, type(obj).__name__, proto.__name__, ", ".join(absent)))
