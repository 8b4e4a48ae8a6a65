"""The gather route on stock servers: every worker receives every worker's slot, exactly;
topk and dgc train on it with the same weights on every worker.

tests/gather_job.py pushes, on keys of several slot shapes, a header holding the payload's
true length and a payload of random length (integers below 2**24, or plain floats down to
subnormals) that changes every round; every worker checks every slot bit for bit. A
bound of 64 elements makes MXNet split the larger keys over the servers, at row
boundaries that fall inside workers' slots.
"""
import json
import sys

import numpy as np
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


@pytest.mark.parametrize("compressor, options, momentum", [
    ("topk", "ratio=0.05", "0.9"), ("dgc", "ratio=0.02,warmup_stage_steps=2", "0")])
def test_gathering_codecs_train_the_same_weights_on_every_worker(tmp_path, compressor, options,
                                                                  momentum):
    # Every tensor compressed; a bound of 64 elements splits the larger slots over both
    # servers; dgc's warm-up uses a gather key per stage.
    steps = 12
    _launch(2, 2, [sys.executable, "tests/dist_job.py", "--out", str(tmp_path), "--compressor",
                   compressor, "--comm-threshold", "off", "--momentum", momentum,
                   "--steps", str(steps)], 180,
            ["--env", "MXNET_KVSTORE_BIGARRAY_BOUND:64",
             "--env", "SLIMGC_COMPRESSOR:" + compressor,
             "--env", "SLIMGC_CODEC_OPTIONS:" + options])
    info = [json.loads((tmp_path / ("rank%d.json" % r)).read_text()) for r in range(2)]
    weights = [dict(np.load(tmp_path / ("weights_rank%d.npz" % r))) for r in range(2)]
    assert info[0]["sha256"] == info[1]["sha256"]
    for name in weights[0]:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    stats = info[0]["stats"]
    assert stats["compressed_transfers"] == stats["transfers"] == 4 * steps
    assert stats["bytes_pulled"] == 2 * stats["bytes_pushed"]
