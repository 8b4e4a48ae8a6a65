"""The host path's codecs on the gradient's device (offload=False: torch/device.py's torch
ops) against its CPU codecs (offload=True), every codec the torch ops serve: the same
weights bit for bit, two ranks on CPU tensors."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a two-rank job under torchrun

from torch_launch import Batch, results  # noqa: E402

CODECS = ["1bit", "2bit", "4bit", "terngrad", "qsgd", "thc", "randomk"]


#: tiny.py's gradient is one value per tensor: its std is 0, so terngrad's default clip
#: (2.5 std) would keep every scale 0 and no weight would move
OPTIONS = {"terngrad": {"clip_sigma": 0}}


def _options(codec, offload):
    return json.dumps(dict({"backup": False, "compression": codec, "comm_threshold": 0,
                            "offload": offload, "params": 20, "large": 3, "steps": 6},
                           **OPTIONS.get(codec, {})))


#: Every run in one torchrun.
SHARED = Batch(*(("tiny.py", "slimgc", _options(c, o)) for c in CODECS for o in (True, False)))


@pytest.mark.parametrize("codec", CODECS)
def test_offload_false_gives_the_cpu_codecs_weights(tmp_path, codec):
    weights = {}
    for offload in (True, False):
        out = tmp_path / str(offload)
        code, text = SHARED.run("tiny.py", out, "slimgc", _options(codec, offload))
        assert code == 0, text[-4000:]
        ranks = results(out, "slimgc")
        assert ranks[0]["weights"] == ranks[1]["weights"]
        weights[offload] = np.array(ranks[0]["weights"])
    np.testing.assert_array_equal(weights[False], weights[True])
    assert not np.array_equal(weights[True], _initial())  # the steps moved them


def _initial():
    """tiny.py's first weights (its seed, 20 tensors of 4 elements and 3 of 4096)."""
    import torch
    torch.manual_seed(0)
    return torch.cat([torch.randn(n) for n in [4] * 20 + [4096] * 3]).numpy()
