"""TorchTransport on a one-rank Gloo group: close() lets go of the group (so that
destroy_process_group frees it while the interpreter is alive), and a collective asked of a
closed transport fails at once instead of waiting for an issuer that is gone."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from slimgc_mx.torch.collective import TorchTransport  # noqa: E402
from slimgc_mx.transport.host import HostBuffer  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_close_lets_go_of_the_group_and_refuses_later_collectives(one_rank):
    transport = TorchTransport(timeout=30)
    buf = HostBuffer((4,))
    buf.for_write()[:] = [1, 2, 3, 4]
    transport.broadcast(0, buf)
    assert np.array_equal(buf.for_read(), [1, 2, 3, 4])
    assert transport.close(timeout=5)
    assert transport._group is None
    with pytest.raises(RuntimeError, match="the transport is closed"):
        transport.broadcast(0, buf)
