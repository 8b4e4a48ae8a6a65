"""Clipping by the global norm in the engine (step_clip.py): the gate that holds a step's
global updates until its last sum, and the engine's weights against a NumPy reference."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

import numpy_engine
from slimgc_mx.engine.step_clip import ClipRound, StepClip, power_sum
from slimgc_mx.transport import HostBuffer


def _transfer(*members):
    """A stand-in transfer of (key, step, values) pushes sharing one agg (a bucket's)."""
    values = np.concatenate([np.asarray(v, np.float32) for _, _, v in members])
    agg = HostBuffer(values.shape)
    agg.for_write()[:] = values
    pushes = [SimpleNamespace(key=k, step=s) for k, s, _ in members]
    return SimpleNamespace(pushes=pushes, buffers=SimpleNamespace(agg=agg), label="t",
                           step=members[0][1])


def _arrive(gate, transfer, log):
    r = gate.take(transfer)
    assert r is not None
    gate.arrive(r, transfer, lambda: log.append(transfer.buffers.agg.for_read().copy()))


@pytest.mark.parametrize("seal_first", [True, False])
def test_a_clipped_step_releases_every_update_once_its_last_sum_is_in(seal_first):
    """Sums of 2 workers: mean [3, 0] and [0, 4], norm 5, clipped to 1 (coefficient ~0.2)."""
    gate, log = StepClip(2), []
    gate.start(1.0, 2.0)
    for key in "abc":
        gate.add(key, 7)
    a, bucket = _transfer(("a", 7, [6.0, 0.0])), _transfer(("b", 7, [0.0]), ("c", 7, [8.0]))
    if seal_first:
        gate.seal()
    _arrive(gate, a, log)
    assert log == []  # held: the norm is not known yet
    _arrive(gate, bucket, log)
    if not seal_first:
        assert log == []  # every sum is in, but the step may still push more keys
        gate.seal()
    coef = 1.0 / (5.0 + 1e-6)
    assert gate.last.total_norm == 5.0 and gate.last.coef == pytest.approx(coef, rel=1e-12)
    np.testing.assert_allclose(log[0], [6 * coef, 0], rtol=1e-7)
    np.testing.assert_allclose(log[1], [0, 8 * coef], rtol=1e-7)
    assert not gate.active and gate.take(_transfer(("a", 8, [1.0]))) is None


def test_a_step_below_max_norm_is_not_scaled():
    gate, log = StepClip(1), []
    gate.start(10.0, 2.0)
    gate.add("a", 0)
    gate.seal()
    _arrive(gate, _transfer(("a", 0, [3.0, 4.0])), log)
    assert gate.last.coef == 1.0 and log[0].tolist() == [3.0, 4.0]


def test_the_norm_is_the_same_whatever_order_the_sums_arrive_in():
    """Ranks see a step's sums arrive in different orders (a multi-round codec's transfers
    finish out of order); their norms, and so their weights, must still agree bitwise."""
    powers = [1.0] + [2.0 ** -53] * 4
    norms = []
    for order in (powers, powers[::-1], powers[1:] + powers[:1]):
        r = ClipRound(1.0, 2.0, 2)
        for p in order:
            r.add_power(p)
        r.decide()
        norms.append(r.total_norm)
    assert sum(powers) != sum(powers[::-1])  # plain addition would differ
    assert norms[0] == norms[1] == norms[2]


def test_the_norm_types_are_torchs():
    x = np.array([3.0, -4.0, 1.0], np.float32)
    assert power_sum(x, 2.0) == 26.0 and power_sum(x, 1.0) == 8.0
    assert power_sum(x, math.inf) == 4.0 and power_sum(x, 3.0) == pytest.approx(92.0)
    r = ClipRound(1.0, math.inf, 2)
    r.add_power(4.0), r.add_power(6.0)
    r.decide()
    assert r.total_norm == 3.0
    with pytest.raises(ValueError, match="norm_type"):
        ClipRound(1.0, 0, 2)
    with pytest.raises(ValueError, match="max_norm"):
        ClipRound(-1.0, 2.0, 2)


def test_a_transfer_across_two_clipped_steps_is_refused():
    gate = StepClip(1)
    gate.start(1.0, 2.0)
    gate.add("a", 0)
    gate.seal()
    gate.start(1.0, 2.0)
    gate.add("b", 0)
    with pytest.raises(RuntimeError, match="not all in one clipped step"):
        gate.take(_transfer(("a", 0, [1.0]), ("b", 0, [1.0])))


LR = 0.1


def _reference(w0, grads, max_norm):
    """Global weights per step: SGD (no momentum) with the mean gradient clipped by its norm
    over all keys, as torch's clip_grad_norm_ after DDP's averaging."""
    w, out, norms = [x.astype(np.float64) for x in w0], [], []
    for step in grads:
        mean = [np.mean([rank[k] for rank in step], axis=0, dtype=np.float64)
                for k in range(len(w0))]
        norm = math.sqrt(sum(float((m * m).sum()) for m in mean))
        coef = min(1.0, max_norm / (norm + 1e-6))
        w = [x - LR * coef * m for x, m in zip(w, mean)]
        out.append(w)
        norms.append(norm)
    return out, norms


@pytest.mark.parametrize("backup", [False, True])
def test_full_precision_clipped_steps_are_the_reference(backup):
    """Two workers, fused buckets from step 2 on: every step's global weights are those of
    the mean gradient clipped by its global norm (active at every step)."""
    w0, grads = numpy_engine.problem(2, 6, seed=5)
    config = dict(compressor="none", backup=backup, warmup_steps=2)
    got = numpy_engine.run("numpy", w0, grads, (LR, 0.0, 0.0, 0.5), config, clip=(3.0, 2.0))
    want, norms = _reference(w0, grads, 3.0)
    keys = len(w0)
    assert min(norms) > 3.0
    for rank in range(2):
        history, stats = got[rank]
        np.testing.assert_allclose(stats["clip_norms"], norms, rtol=1e-6)
        for step, (h, w) in enumerate(zip(history, want)):
            for k in range(keys):
                np.testing.assert_allclose(h[keys + k], w[k], rtol=1e-5, atol=1e-6,
                                           err_msg="rank %d step %d key %d" % (rank, step, k))
    assert got[0][1]["transfers"] < 6 * keys  # some steps went as fused buckets


@pytest.mark.parametrize("name", ["2bit", "topk", "powersgd"])
def test_compressed_clipped_steps_move_the_weights_by_at_most_max_norm(name):
    """The decoded sums' mean is clipped: each step's global update, over all keys, is
    lr * min(norm, max_norm) long, and the ranks agree bitwise."""
    w0, grads = numpy_engine.problem(2, 6, seed=6)
    config = dict(compressor=name, backup=True, warmup_steps=2, comm_threshold=256,
                  threshold=0.5)
    got = numpy_engine.run("numpy", w0, grads, (LR, 0.0, 0.0, 0.5), config, clip=(2.0, 2.0))
    keys = len(w0)
    history, stats = got[0]
    assert got[0][1]["compressed_transfers"] > 0
    assert got[1][1]["clip_norms"] == stats["clip_norms"]
    before = [w.astype(np.float64) for w in w0]
    for step, h in enumerate(history):
        after = [x.astype(np.float64) for x in h[keys:]]
        moved = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(after, before)))
        norm = stats["clip_norms"][step]
        assert moved / LR == pytest.approx(min(norm, 2.0 * norm / (norm + 1e-6)), rel=1e-4)
        before = after
        for k in range(keys):
            assert np.array_equal(h[keys + k], got[1][0][step][keys + k])
    assert max(stats["clip_norms"]) > 2.0
