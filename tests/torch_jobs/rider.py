"""A rank sends riders (TorchTransport.ride) with exchanges of each kind, with values alike
on every rank and different on rank 1, and records what each rank found and whether the
exchanges' own results came back intact."""
import sys

import numpy as np
import torch.distributed as dist

from common import record
from slimgc_mx.torch.collective import RIDE_BYTES, TorchTransport
from slimgc_mx.transport.host import HostBuffer

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
transport = TorchTransport(timeout=60)
result = {}
VALUE = 2 ** 52 - 12345  # every piece's bits in use


def exchange(kind, dtype, size):
    """Start one exchange of `kind`; returns a function that waits and says if it is right."""
    send = HostBuffer((size,), dtype)
    send.for_write()[:] = np.arange(size) + 1000 * rank
    if kind == "sum":
        recv = HostBuffer((size,), dtype)
        work = transport.push_pull(("k", kind, str(dtype), size), send, recv)
        want = world * np.arange(size) + 1000 * sum(range(world))
        return lambda: work.wait() or np.array_equal(recv.for_read(), want)
    recv = HostBuffer((size * world,), dtype)
    work = transport.gather(("k", kind, str(dtype), size), send, recv)
    want = np.concatenate([np.arange(size) + 1000 * r for r in range(world)])
    return lambda: work.wait() or np.array_equal(recv.for_read(), want)


for kind, dtype, size in [("sum", np.float64, 100), ("sum", np.float32, 7),
                          ("gather", np.float32, 50), ("sum", np.float32, RIDE_BYTES),
                          ("none", None, 0)]:
    for differ in (False, True):
        mine = VALUE - (rank if differ and rank == 1 else 0) * (1 << 30)
        rider = transport.ride([mine, 7])
        check = exchange(kind, dtype, size) if kind != "none" else (lambda: True)
        if kind == "none":
            transport.allgather([1.0])  # a collective that carries no rider: it goes alone
        result["%s %s %d %s" % (kind, dtype and np.dtype(dtype).name, size, differ)] = {
            "same": rider.same(), "intact": bool(check())}
record(out, "rider", rank, **result)
transport.close()
dist.destroy_process_group()
