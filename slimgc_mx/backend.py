"""The backend protocol: what SlimGC's engine needs of a framework (docs/backend.md).

The engine (CTTab, planner, grad_buf/fp_buf/bit_buf pipeline, loc_buf/glo_buf backup,
codecs, checkpoint) works on host arrays through these seams, each a Protocol here, and
each framework is one adapter that implements them: MXNet's dist_sync today, PyTorch's
torch.distributed next. This module imports neither framework, nor NumPy beyond typing.

    HostArray   a CPU buffer the Cython codecs read and write through a NumPy view
    Work        a collective in flight; wait() returns once its result is in place
    Collective  sums of lanes, gathers, broadcast and small allgathers over the workers
    Readiness   a callback per host array once the framework has written it
    Arrays      the framework's own arrays <-> host arrays: copies in the framework's
                order and write holds

The last seam, the optimizer's rule on host arrays, is each framework's global_update and
local_updater (mxnet/update.py, torch/framework.py, numpy_backend.py); docs/backend.md.
"""
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple, runtime_checkable

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

    def hold(self, buf: HostArray) -> Any: ...
