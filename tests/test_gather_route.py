"""The gather route on stock servers: every worker receives every worker's slot, exactly.

tests/gather_job.py pushes, on keys of several slot shapes, a header holding the payload's
true length and a payload of random length (integers below 2**24, or plain floats down to
subnormals) that changes every round; every worker checks every slot bit for bit. A
bound of 64 elements makes MXNet split the larger keys over the servers, at row
boundaries that fall inside workers' slots.
"""
import json
import sys

import pytest

from gather_job import SHAPES
from test_distributed import _launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 3), (3, 2), (4, 3)])
def test_every_worker_receives_every_payload_every_round(tmp_path, workers, servers):
    rounds = 6
    _launch(workers, servers, [sys.executable, "tests/gather_job.py", "--out", str(tmp_path),
                               "--rounds", str(rounds), "--seed", str(workers * 10 + servers)],
            120, ["--env", "MXNET_KVSTORE_BIGARRAY_BOUND:64"])
    for rank in range(workers):
        info = json.loads((tmp_path / ("rank%d.json" % rank)).read_text())
        assert (info["num_workers"], info["num_servers"]) == (workers, servers)
        assert info["bigarray_bound"] == 64
        assert info["slots_checked"] == rounds * len(SHAPES) * workers
    split = [shape for shape in SHAPES if workers * shape[0] * shape[1] >= 64]
    assert len(split) >= 2  # keys MXNet splits over the servers
