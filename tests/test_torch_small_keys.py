"""Many small parameters without backup: a torch step pushes every key before it waits, so
the fused buckets travel whole (each key's write-back used to send its partial bucket at
once: one transfer per key, 12x DDP's step with 500 tiny parameters); inside the CTTab's
warm-up too, where only a few keys of each size are timed alone."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # two-rank jobs under torchrun

from torch_launch import Batch, results  # noqa: E402

from slimgc_mx.engine.cttab import SAMPLES_PER_SIZE  # noqa: E402

OPTIONS = [
    {"compression": "none"},
    # the large tensors are compressed (unfused), the tiny ones fused at full precision
    {"compression": "2bit", "comm_threshold": 1024, "large": 2},
    # inside the CTTab's warm-up (the large tensors, 64 KiB, give its fit a span to read):
    # SAMPLES_PER_SIZE keys of each size timed alone, the rest fused
    {"compression": "2bit", "large": 3},
]


def timed_keys(options):
    """The keys the CTTab's warm-up times alone (cttab.SAMPLES_PER_SIZE of each size)."""
    if options["compression"] == "none" or "comm_threshold" in options:
        return 0
    return SAMPLES_PER_SIZE + min(SAMPLES_PER_SIZE, options.get("large", 0))


STEPS, PARAMS = 6, 60
#: The CTTab decides after two steps: tiny tensors alone in the table.
DECIDED = {"compression": "2bit", "warmup_steps": 2, "backup": False, "steps": STEPS,
           "params": PARAMS}
#: Every job in one torchrun.
SHARED = Batch(*[("tiny.py", "ddp,slimgc", json.dumps(
    dict(options, backup=False, steps=STEPS, params=PARAMS))) for options in OPTIONS]
    + [("tiny.py", "slimgc", json.dumps(DECIDED))])


@pytest.mark.parametrize("options", OPTIONS)
def test_a_step_sends_each_bucket_once_not_each_key(tmp_path, options):
    steps, params = STEPS, PARAMS
    code, text = SHARED.run("tiny.py", tmp_path, "ddp,slimgc", json.dumps(
        dict(options, backup=False, steps=steps, params=params)))
    assert code == 0, text[-4000:]
    mine = results(tmp_path, "slimgc")
    keys = params + options.get("large", 0)
    for r in mine:
        # fixed routes: the tiny keys fused; warm-up: every key it does not time
        fused = keys - timed_keys(options) if timed_keys(options) else params
        assert r["fused_keys"] == fused
        assert r["fused_buckets"] >= 1
        # every step, the first too (the adapter pushes every key): the buckets whole
        per_step = np.diff([0] + r["transfers"])
        assert list(per_step) == [r["fused_buckets"] + keys - r["fused_keys"]] * steps
    if options["compression"] == "none":  # still DDP's weights
        ddp = results(tmp_path, "ddp")
        assert np.abs(np.subtract(ddp[0]["weights"], mine[0]["weights"])).max() <= 1e-6


def test_tiny_tensors_alone_skip_the_warm_up_and_stay_fused_in_full_precision(tmp_path):
    """A table of 16 B tensors alone has no bandwidth to read (their timings differ by
    noise, not bytes), and fused they pay no latency of their own: the CTTab keeps them in
    full precision, fused, every run (noise used to compress all 500 of the job's tiny
    tensors at times, each in a transfer of its own: 15-18x DDP's step); knowing that from
    the sizes alone, it decides at the first step and times nothing (the warm-up's timed
    key was a second, serial transfer every warm-up step)."""
    code, text = SHARED.run("tiny.py", tmp_path, "slimgc", json.dumps(DECIDED))
    assert code == 0, text[-4000:]
    assert "BestCT = never" in text and "there is no warm-up" in text
    for r in results(tmp_path, "slimgc"):
        per_step = list(np.diff([0] + r["transfers"]))
        assert per_step == [1] * STEPS  # one bucket from the first step
        assert r["fused_keys"] == PARAMS and r["fused_buckets"] == 1
