"""The SlimGC kvstore in one process: Trainer integration, aggregation, CTTab, backup, errors.

Several workers are threads sharing a ThreadGroup transport (a dist_sync server
in miniature); the multi-process tests in test_distributed.py use MXNet's own.
"""
import os
import subprocess
import sys
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import slimgc_mx
import training_helpers as th
from codec_contract import combine
from slimgc_mx import codecs
from slimgc_mx.mxnet import sgd
from slimgc_mx.codecs.rng import key_seed
from slimgc_mx.engine.backup import BackupTimeout
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.engine.offload import PipelineError
from slimgc_mx.engine.cttab import NEVER
from slimgc_mx import env
from slimgc_mx.mxnet.dist import BIGARRAY_BOUND
from slimgc_mx.transport import LocalTransport, ThreadGroup


def _net(seed=0):
    """A small MLP with seeded weights: 2 Dense layers, 4 tensors."""
    return th.dense_net((32, 4), seed)


# ---------------------------------------------------------------- MXNet integration
def test_trainer_keeps_the_literal_string_with_one_context():
    net = _net()
    net(mx.nd.ones((2, 12)))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore="slimgc", compression_params={"type": "2bit"})
    th.train(trainer, net, th.batches(2))
    assert isinstance(trainer._kvstore, SlimGC)
    assert trainer._update_on_kvstore
    assert trainer._kvstore.config.compressor == "2bit"


def test_create_by_name_and_instance():
    assert isinstance(mx.kv.create("slimgc"), SlimGC)
    assert isinstance(mx.kv.create("SlimGC"), SlimGC)
    kv = SlimGC(compressor="4bit", backup=False)
    net = _net()
    net(mx.nd.ones((2, 12)))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    th.train(trainer, net, th.batches(2))
    assert trainer._kvstore is kv and kv.config.compressor == "4bit"


@pytest.mark.parametrize("backup", [False, True])
def test_none_codec_single_worker_matches_plain_trainer(backup):
    batches = th.batches(20)
    ref = _net()
    ref(batches[0][0])
    th.train(gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore=None), ref, batches)
    net = _net()
    net(batches[0][0])
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            kvstore=SlimGC(compressor="none", backup=backup))
    th.train(trainer, net, batches)
    slimgc_mx.flush(trainer)
    for a, b in zip(th.weights(ref), th.weights(net)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- aggregation
@pytest.mark.parametrize("name, offload, options", [
    ("none", True, {}), ("1bit", True, {}), ("2bit", True, {}), ("4bit", True, {}),
    ("2bit", False, {}), ("4bit", False, {}), ("terngrad", True, {}), ("terngrad", False, {}),
    ("topk", True, {"ratio": 0.05}), ("topk", False, {"ratio": 0.05}),
    ("dgc", True, {"ratio": 0.01, "warmup_stage_steps": 1}),
    ("dgc", False, {"ratio": 0.01, "warmup_stage_steps": 1}),
    ("qsgd", True, {}), ("qsgd", True, {"levels": 2, "bucket_size": 64}),
    ("thc", True, {}), ("thc", True, {"granularity": 4, "hadamard": True})])
def test_allreduce_over_threads_equals_the_codec_reference(name, offload, options):
    """Without an optimizer pushpull returns the summed (decoded) gradient, exactly.

    offload=False encodes with NDArray ops on the gradient's context instead (a codec
    without them: its CPU kernel on the training thread). topk and dgc gather every
    worker's slot; dgc's warm-up moves through a gather key per stage.
    """
    n, size, steps = 3, 5000, 6
    rng = np.random.RandomState(7)
    grads = rng.randn(steps, n, size).astype(np.float32)

    results = th.pushpull_workers(grads, compressor=name, comm_threshold="off", backup=False,
                                  offload=offload, **options)
    ref = codecs.create(name, reference=True, **options) if name != "none" else None
    if ref is not None:
        ref.seed = key_seed(0, 0)  # what the kvstore gives key #0 of a job with seed 0
        memories = [np.zeros(ref.memory_size(size), np.float32) for _ in range(n)]
    pushed = pulled = 0
    for s in range(steps):
        if ref is None:
            expected = grads[s].sum(axis=0)
        else:
            wires = [ref.encode(grads[s, r], memories[r], n, rank=r) for r in range(n)]
            total = combine(ref, wires, range(n), n)  # summed, or gathered side by side
            pushed, pulled = pushed + wires[0].nbytes, pulled + total.nbytes
            expected = ref.decode(total, size, n)
            assert s == 0 or expected.any()  # a shared scale agreed at step 0 sends after it
        for r in range(n):
            if name == "none":
                np.testing.assert_allclose(results[r][0][s], expected, rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(results[r][0][s], expected)
    if ref is not None:
        stats = results[0][1]
        assert (stats["bytes_pushed"], stats["bytes_pulled"]) == (pushed, pulled)


@pytest.mark.parametrize("backup", [True, False])
def test_global_weights_bitwise_equal_across_workers(backup):
    (w0, s0), (w1, s1) = th.slimgc_workers(2, _net, th.batches(12), compressor="2bit",
                                           threshold=0.01, backup=backup, comm_threshold=256,
                                           warmup_steps=2)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    assert s0["bytes_pushed"] < s0["bytes_fp32"]  # the 32x12 weight went compressed
    assert s0["comm_threshold_bytes"] == 256


@pytest.mark.parametrize("name,lane_dtype", [("1bit", "float64"), ("2bit", "float64"),
                                             ("4bit", "float64"), ("2bit", "float32")])
def test_sgd_update_decodes_compressed_sums_with_the_same_weights(monkeypatch, name,
                                                                  lane_dtype):
    """After warm-up MXNet's SGD decodes compressed keys inside the kernel's update, on lanes
    the pipeline's check (or the float32 join) found in range, so the kernel reads them
    once; an SGD subclass takes MXNet's ops on the aggregate decoded first, and gets the
    same weights."""
    checked = []
    original = sgd.SGDKernel.global_step_decoding
    monkeypatch.setattr(sgd.SGDKernel, "global_step_decoding",
                        lambda self, *args: checked.append(args[4]) or original(self, *args))

    class SubclassedSGD(mx.optimizer.SGD):
        pass

    runs = {}
    for cls in (mx.optimizer.SGD, SubclassedSGD):
        runs[cls] = th.slimgc_workers(2, _net, th.batches(12), sgd_class=cls, compressor=name,
                                      threshold=0.01, comm_threshold=256, warmup_steps=2,
                                      lane_dtype=lane_dtype)
        assert runs[cls][0][1]["compressed_transfers"] > 0
        if cls is mx.optimizer.SGD:
            assert checked  # the fused path ran (the 32x12 weight is compressed)
            assert all(c is True for c in checked)
            del checked[:]
    assert not checked
    for (fused, _), (plain, _) in zip(runs[mx.optimizer.SGD], runs[SubclassedSGD]):
        for a, b in zip(fused, plain):
            np.testing.assert_array_equal(a, b)


def test_backup_local_step_then_global_weights():
    """Backup on, plain SGD: params hold w_i - lr*N*g_own until flush() writes w_{i+1}."""
    lr, size = 0.5, 6
    g = [np.arange(size, dtype=np.float32), -2 * np.ones(size, np.float32)]
    w0 = np.linspace(-1, 1, size).astype(np.float32)

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="none", backup=True)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=lr))
        param = mx.nd.array(w0)
        kv.broadcast(0, param, out=param)
        kv.pushpull(0, mx.nd.array(g[rank]), out=param)
        local = param.asnumpy().copy()
        kv.flush()
        glob = param.asnumpy().copy()
        kv.close()
        return local, glob

    (l0, g0), (l1, g1) = th.in_threads(2, worker)
    np.testing.assert_allclose(l0, w0 - lr * 2 * g[0], rtol=1e-6)
    np.testing.assert_allclose(l1, w0 - lr * 2 * g[1], rtol=1e-6)
    np.testing.assert_allclose(g0, w0 - lr * (g[0] + g[1]), rtol=1e-6)
    np.testing.assert_array_equal(g0, g1)


# ---------------------------------------------------------------- threshold table
def _link(nbytes):
    """A fake timed link: 2 ms latency, 40 MB/s (reported, not slept)."""
    return 0.002 + nbytes / 40e6


def test_cttab_warmup_picks_a_threshold_between_small_and_large_tensors():
    sizes = [16, 64, 400_000, 800_000]

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit", warmup_steps=8, backup=False)
        for k, n in enumerate(sizes):
            kv.init(k, mx.nd.zeros(n))
        rng = np.random.RandomState(rank)
        for _ in range(9):
            for k, n in enumerate(sizes):
                kv.pushpull(k, mx.nd.array(rng.randn(n)), out=mx.nd.zeros(n))
        table = kv.cttab
        kv.close()
        return table.best_ct, table.rows

    group = ThreadGroup(2, link=_link)
    results = [None, None]

    def run(rank):
        results[rank] = worker(rank, group.transport(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    (best0, rows0), (best1, _) = results
    assert best0 == best1
    assert 64 * 4 < best0 <= 400_000 * 4, rows0
    assert [r["size"] for r in rows0] == [n * 4 for n in sizes]
    assert rows0[-1]["ratio"] > 1 > rows0[0]["ratio"]


def test_every_worker_adopts_rank0s_threshold(monkeypatch):
    """Workers that would choose differently still agree: rank 0's BestCT is broadcast."""
    from slimgc_mx.engine import cttab

    def per_thread_choice(rows, rule="fit", margin=0.0):
        return 4096 if threading.current_thread().name.endswith("0") else 8

    monkeypatch.setattr(cttab.CTTab, "choose", staticmethod(per_thread_choice))

    def worker(rank, transport):
        threading.current_thread().name = "worker-%d" % rank
        kv = SlimGC(transport=transport, compressor="2bit", warmup_steps=2, backup=False)
        kv.init(0, mx.nd.zeros(100))
        for _ in range(3):
            kv.pushpull(0, mx.nd.ones(100), out=mx.nd.zeros(100))
        best = kv.cttab.best_ct
        kv.close()
        return best

    assert th.in_threads(2, worker) == [4096, 4096]


def test_forced_modes():
    for mode, expect_compressed in (("off", True), (1 << 40, False)):
        kv = SlimGC(compressor="2bit", comm_threshold=mode, backup=False)
        kv.init(0, mx.nd.zeros(1000))
        kv.pushpull(0, mx.nd.ones(1000), out=mx.nd.zeros(1000))
        stats = kv.stats()
        assert (stats["bytes_pushed"] < stats["bytes_fp32"]) == expect_compressed
        assert kv.cttab.phase == "trained"
        kv.close()
    kv = SlimGC(compressor="none")
    kv.init(0, mx.nd.zeros(10))
    kv.pushpull(0, mx.nd.ones(10), out=mx.nd.zeros(10))
    assert kv.stats()["comm_threshold_bytes"] is None and kv.cttab.best_ct == NEVER
    kv.close()


# ---------------------------------------------------------------- bad input and failures
def test_bad_input_errors():
    kv = SlimGC(compressor="2bit")
    kv.init(0, mx.nd.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"pushed shape \(4, 3\) differs from the initialized"):
        kv.pushpull(0, mx.nd.zeros((4, 3)), out=mx.nd.zeros((4, 3)))
    with pytest.raises(KeyError, match="was not initialized"):
        kv.pushpull(7, mx.nd.zeros(3))
    with pytest.raises(ValueError, match="already initialized"):
        kv.init(0, mx.nd.zeros((3, 4)))
    with pytest.raises(TypeError, match="dense"):
        kv.init(1, mx.nd.zeros((3, 4)).tostype("row_sparse"))
    with pytest.raises(RuntimeError, match="before any key is initialized"):
        kv.set_gradient_compression({"type": "1bit"})
    with pytest.raises(ValueError, match="unknown compressor"):
        SlimGC(compressor="8bit")
    kv.close()


class _BrokenLink(LocalTransport):
    """A transport whose every transfer fails."""

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        raise OSError("link down (injected)")


def test_background_error_surfaces_in_the_training_thread():
    kv = SlimGC(transport=_BrokenLink(), compressor="2bit", backup=True)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w = mx.nd.zeros(10)
    kv.broadcast(0, w, out=w)
    kv.pushpull(0, mx.nd.ones(10), out=w)  # backup: returns before the transfer
    with pytest.raises(PipelineError) as info:
        kv.pushpull(0, mx.nd.ones(10), out=w)
    assert isinstance(info.value.__cause__, OSError)
    assert "injected" in str(info.value.__cause__)
    kv.close()


def test_stuck_transfer_times_out_in_the_training_thread():
    class Stuck(LocalTransport):
        def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
            time.sleep(30)

    kv = SlimGC(transport=Stuck(), compressor="none", backup=False, timeout=0.5)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w = mx.nd.zeros(10)
    kv.broadcast(0, w, out=w)
    start = time.time()
    kv.pushpull(0, mx.nd.ones(10), out=w)  # returns: the engine, not this thread, waits
    np.testing.assert_array_equal(w.asnumpy(), 0)  # released after the timeout, unchanged
    with pytest.raises(BackupTimeout, match="did not arrive within"):
        kv.pushpull(0, mx.nd.ones(10), out=w)
    assert time.time() - start < 5


@pytest.mark.parametrize("comm_threshold, lane_dtype", [
    ("off", "float64"), ("off", "float32"),  # compressed route, float64 / float32 lanes
    (1 << 40, "auto")])  # full-precision route
def test_nan_on_one_worker_fails_every_worker_without_updating(comm_threshold, lane_dtype):
    from slimgc_mx.engine.offload import NonFiniteAggregateError

    size = 50

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit", comm_threshold=comm_threshold,
                    backup=False, timeout=30, lane_dtype=lane_dtype)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        w = mx.nd.ones(size)
        kv.broadcast(0, w, out=w)
        kv.pushpull(0, mx.nd.ones(size), out=w)
        before = w.asnumpy().copy()  # reading waits for step 0's global weights
        grad = np.ones(size, np.float32)
        if rank == 1:
            grad[7] = np.nan
        kv.pushpull(0, mx.nd.array(grad), out=w)  # the failure surfaces at the next call
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.ones(size), out=w)
        after = kv._agg.backup.glo_buf(0).asnumpy()
        param = w.asnumpy()
        kv.close()
        return info.value, before, after, param

    for err, before, after, param in th.in_threads(2, worker):
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert "key 0, step 1" in str(err) or "key 0 (fused), step 1" in str(err)
        assert "sent by worker rank 1" in str(err)
        np.testing.assert_array_equal(before, after)
        np.testing.assert_array_equal(param, before)
        assert np.isfinite(after).all()


def test_a_sum_of_lanes_out_of_range_fails_every_worker_without_updating(monkeypatch):
    """The finisher's check reads the summed lanes once for NaN/Inf and range; lanes it
    finds out of range are left to the SGD kernel's own check, which refuses them before
    writing any weight (nothing is decoded from a sum that is not one)."""
    from slimgc_mx.transport.threads import ThreadHandle

    corrupt, barrier, size = threading.Event(), threading.Barrier(2), 3000
    wait = ThreadHandle.wait

    def corrupted(self):
        wait(self)
        lanes = self._recv.for_write()
        if corrupt.is_set() and lanes.dtype == np.float64:
            lanes[5] = -4.0  # finite, and no sum of lanes

    monkeypatch.setattr(ThreadHandle, "wait", corrupted)

    def worker(rank, transport):
        kv, w = th.compressed_sgd_store(transport, size)
        grad = mx.nd.array(np.linspace(-1, 1, size).astype(np.float32) * (rank + 1))
        kv.pushpull(0, grad, out=w)
        kv.pushpull(0, grad, out=w)
        kv._agg.pipeline.wait_idle(30)
        glo = kv._agg.backup.glo_buf(0).asnumpy()
        barrier.wait()
        corrupt.set()
        kv.pushpull(0, grad, out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, grad, out=w)
        after = kv._agg.backup.glo_buf(0).asnumpy()
        kv.close()
        return info.value, glo, after

    for err, glo, after in th.in_threads(2, worker):
        assert "outside [0, 2**53)" in str(err) and "no weight was written" in str(err)
        np.testing.assert_array_equal(glo, after)


@pytest.mark.parametrize("name, options", [("2bit", {}), ("thc", {"hadamard": True})])
def test_backup_local_update_checks_the_gradient_for_the_encoder(name, options):
    """With backup and MXNet's SGD the local update reads grad_buf for the encoder: 2bit
    encodes in the local update's own pass (local=LocalSGD), thc with its rotation gets the
    local update's count of NaN/Inf and skips its pre-check. A NaN fails every worker
    without updating the weights; the fused pass has written the residual of that step
    (NaN where the gradient was), the separate encoder never ran."""
    from slimgc_mx.engine.offload import NonFiniteAggregateError

    size = 3000
    fused = name == "2bit"

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor=name, comm_threshold="off",
                    backup=True, timeout=30, codec_options=options)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        w = mx.nd.ones(size)
        kv.broadcast(0, w, out=w)
        b = kv._agg.planner.keys[0]
        assert b.codec.traits.fuses_local_update == fused
        checked, encode = [], b.codec.encode
        b.codec.encode = lambda *a, **k: (
            checked.append(k.get("local") is not None if fused else k.get("grad_checked")),
            encode(*a, **k))[1]
        grad = np.linspace(-1, 1, size).astype(np.float32) * (rank + 1)
        kv.pushpull(0, mx.nd.array(grad), out=w)
        kv.pushpull(0, mx.nd.array(grad), out=w)
        kv._agg.pipeline.wait_idle(30)
        residual = b.residual.for_read().copy()
        glo = kv._agg.backup.glo_buf(0).asnumpy()
        if rank == 1:
            grad[7] = np.nan
        kv.pushpull(0, mx.nd.array(grad), out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.ones(size), out=w)
        after = (b.residual.for_read().copy(), kv._agg.backup.glo_buf(0).asnumpy())
        kv.close()
        return checked, info.value, residual, glo, after

    for rank, (checked, err, residual, glo, after) in enumerate(th.in_threads(2, worker)):
        # Every encode was fused / skipped the pre-check; with the separate encoder rank 1's
        # NaN step never reached encode.
        assert checked == [True] * (2 if rank == 1 and not fused else 3), checked
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert ("own gradient did" if rank == 1 else "own gradient was finite") in str(err)
        if rank == 1 and fused:
            assert not np.isfinite(after[0][7]) and np.isfinite(np.delete(after[0], 7)).all()
        elif rank == 1:
            np.testing.assert_array_equal(after[0], residual)
        else:  # rank 0 encoded its finite gradient
            assert np.isfinite(after[0]).all() and not np.array_equal(after[0], residual)
        np.testing.assert_array_equal(after[1], glo)


@pytest.mark.parametrize("comm_threshold", ["off", 256])  # all compressed; biases fused
def test_checkpoint_resume_is_bitwise_identical(tmp_path, comm_threshold):
    """2 workers, 2bit, backup on: stop after k steps, resume in new objects, same weights."""
    batches = th.batches(16, seed=3)
    k = 8

    def make(transport):
        net = _net()
        net(batches[0][0])
        kv = SlimGC(transport=transport, compressor="2bit", threshold=0.05, backup=True,
                    comm_threshold=comm_threshold)
        trainer = gluon.Trainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
        return net, kv, trainer

    def uninterrupted(rank, transport):
        net, kv, trainer = make(transport)
        th.train(trainer, net, batches[rank::2][:k // 2] * 2)
        trainer.save_states(str(tmp_path / ("full%d.states" % rank)))
        th.train(trainer, net, batches[rank::2][k // 2:] * 2)
        slimgc_mx.flush(trainer)
        assert kv.stats()["fused_keys"] == (0 if comm_threshold == "off" else 2)
        kv.close()
        return th.weights(net)

    def first_half(rank, transport):
        net, kv, trainer = make(transport)
        th.train(trainer, net, batches[rank::2][:k // 2] * 2)
        trainer.save_states(str(tmp_path / ("half%d.states" % rank)))
        net.save_parameters(str(tmp_path / ("half%d.params" % rank)))
        kv.close()

    def second_half(rank, transport):
        net, kv, trainer = make(transport)
        net.load_parameters(str(tmp_path / ("half%d.params" % rank)))
        trainer.load_states(str(tmp_path / ("half%d.states" % rank)))
        th.train(trainer, net, batches[rank::2][k // 2:] * 2)
        slimgc_mx.flush(trainer)
        kv.close()
        return th.weights(net)

    full = th.in_threads(2, uninterrupted)
    th.in_threads(2, first_half)
    resumed = th.in_threads(2, second_half)
    for rank in range(2):
        for a, b in zip(full[rank], resumed[rank]):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(resumed[0], resumed[1]):
        np.testing.assert_array_equal(a, b)


def test_loading_a_foreign_or_mismatched_checkpoint_is_refused(tmp_path):
    kv = SlimGC(compressor="2bit", backup=False)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w = mx.nd.zeros(10)
    kv.broadcast(0, w, out=w)
    kv.pushpull(0, mx.nd.ones(10), out=w)
    path = str(tmp_path / "ok.states")
    kv.save_optimizer_states(path)
    bad = tmp_path / "bad.states"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match="slimgc checkpoint|pickle|load"):
        kv.load_optimizer_states(str(bad))
    other = SlimGC(compressor="4bit", backup=False)
    other.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w2 = mx.nd.zeros(10)
    other.broadcast(0, w2, out=w2)
    with pytest.raises(ValueError, match="compressor='2bit' but this job uses '4bit'"):
        other.load_optimizer_states(path)
    kv.close()
    other.close()


def test_keys_enter_the_pipeline_as_their_gradients_become_ready(monkeypatch):
    """Key 0's gradient is still being computed by the engine; key 1 goes first."""
    from slimgc_mx.engine.offload import Pipeline

    order = []
    original = Pipeline._encode

    def recording(self, job):
        order.append(job.pushes[0].key)
        return original(self, job)

    monkeypatch.setattr(Pipeline, "_encode", recording)
    kv = SlimGC(compressor="2bit", comm_threshold="off", backup=True)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w = [mx.nd.zeros(100), mx.nd.zeros(100)]
    for k in range(2):
        kv.broadcast(k, w[k], out=w[k])
    a = mx.nd.random.uniform(shape=(1200, 1200))
    slow = mx.nd.dot(mx.nd.dot(a, a), a).sum(axis=0)[:100]  # queued, not finished
    kv.pushpull(0, slow, out=w[0])
    kv.pushpull(1, mx.nd.ones(100), out=w[1])
    kv.flush()
    kv.close()
    assert order == [1, 0]


def test_consistency_audit_names_the_first_diverging_parameter():
    from slimgc_mx.engine.agreement import WeightDivergenceError

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="none", backup=False, audit_every=1)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        ws = [mx.nd.zeros(4), mx.nd.zeros(3)]
        for k in range(2):
            kv.broadcast(k, ws[k], out=ws[k])
        for step in range(2):
            for k in range(2):
                kv.pushpull(k, mx.nd.ones(ws[k].shape), out=ws[k])
        ok = [w.asnumpy().copy() for w in ws]
        if rank == 1:  # corrupt this worker's global copy of key 1
            kv._agg.backup.glo_buf(1)[:] = 5
        with pytest.raises(WeightDivergenceError, match=r"parameter 1 differ") as info:
            kv.pushpull(0, mx.nd.ones(4), out=ws[0])  # step 2: the audit runs first
        kv.close()
        return ok, str(info.value)

    (ok0, msg0), (ok1, msg1) = th.in_threads(2, worker)
    np.testing.assert_array_equal(ok0[0], ok1[0])
    assert "ranks [0]" in msg0 and "ranks [1]" in msg0
    assert "step 2" in msg1


def test_a_step_after_a_failure_names_the_original_error():
    """Whichever call meets the failure first (a wait or the next submit), it names the cause."""
    kv = SlimGC(transport=_BrokenLink(), compressor="none", backup=True)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    ws = [mx.nd.zeros(10), mx.nd.zeros(10)]
    for k in range(2):
        kv.broadcast(k, ws[k], out=ws[k])
    kv.pushpull(0, mx.nd.ones(10), out=ws[0])
    with pytest.raises(PipelineError):
        kv.flush()
    for k in range(2):  # key 1 never failed itself: the submit refuses, naming the cause
        with pytest.raises(PipelineError, match=r"\(key 0, step 0\): link down \(injected\)"):
            kv.pushpull(k, mx.nd.ones(10), out=ws[k])
    kv.close()


@pytest.mark.parametrize("raw", ["lots", "0", "-5", ""])
def test_a_bad_bigarray_bound_names_the_variable(raw):
    with pytest.raises(ValueError, match="MXNET_KVSTORE_BIGARRAY_BOUND=%r: expected a positive"
                       % raw):
        _bigarray_bound(raw)
    assert _bigarray_bound(" 32 ") == 32


def _bigarray_bound(raw):
    return env.bigarray_bound(BIGARRAY_BOUND, {env.BIGARRAY_BOUND_VAR: raw})


_ENGINE_JOB = """
import mxnet as mx
from slimgc_mx.mxnet.kvstore import SlimGC
for backup in (True, False):
    kv = SlimGC(compressor="2bit", comm_threshold=0, backup=backup, timeout=20)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    w = mx.nd.ones((1000,))
    kv.broadcast(0, w, out=w)
    for step in range(4):
        kv.pushpull(0, mx.nd.arange(1000) / 1000 - 0.2, out=w)
    kv.flush()
    print(repr(w.asnumpy().tolist()))
    kv.close()
"""


@pytest.mark.slow
def test_naive_engine_trains_the_same_weights():
    """Engine operators (the SGD kernel's local update, write holds) also run under
    MXNet's NaiveEngine, which executes every operator at once in the pushing thread."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for engine in ("ThreadedEnginePerDevice", "NaiveEngine"):
        env = dict(os.environ, MXNET_ENGINE_TYPE=engine, PYTHONPATH=root)
        r = subprocess.run([sys.executable, "-c", _ENGINE_JOB], env=env, cwd=root,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out[engine] = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert len(out["NaiveEngine"]) == 2
    assert out["NaiveEngine"] == out["ThreadedEnginePerDevice"]
    assert out["NaiveEngine"][0] == out["NaiveEngine"][1]  # backup on and off: one weight series


# ---------------------------------------------------------------- MXNet's semantics, clear errors
def test_workers_with_different_optimizer_settings_are_stopped_at_start():
    from slimgc_mx.engine.agreement import ConfigMismatchError

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit", backup=False)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1 * (rank + 1), momentum=0.9))
        w = mx.nd.zeros(10)
        with pytest.raises(ConfigMismatchError) as info:
            kv.broadcast(0, w, out=w)
        kv.close()
        return str(info.value)

    for rank, msg in enumerate(th.in_threads(2, worker)):
        assert "workers disagree on the optimizer settings: lr=%s on ranks [%d] differs from " \
               "ranks [%d]" % (0.1 * (rank + 1), rank, 1 - rank) in msg


def test_plain_sums_are_exact_unless_a_compressor_was_chosen():
    """No optimizer: pushes of 37.0 come back as 74.0 at every step of the warm-up when the
    compressor is only the default; with a chosen 2bit they are quantized."""
    def worker(rank, transport, **options):
        kv = SlimGC(transport=transport, warmup_steps=4, **options)
        kv.init(0, mx.nd.zeros(3))
        sums = []
        for _ in range(6):
            out = mx.nd.zeros(3)
            kv.pushpull(0, mx.nd.full(3, 37.0), out=out)
            sums.append(float(out.asnumpy()[0]))
        kv.close()
        return sums

    default = th.in_threads(2, worker)
    assert default[0] == [74.0] * 6 and default[1] == default[0]
    # (the 'measured' rule: under 'fit' a tensor this small skips the warm-up, uncompressed)
    chosen = th.in_threads(2, lambda r, t: worker(r, t, compressor="2bit",
                                                  cttab_rule="measured"))
    assert chosen[0][0] == 1.0  # two workers' +0.5 levels: it was compressed


def test_a_key_leaving_the_compressed_route_sends_its_residual():
    """Warm-up: step 0 compressed (0.3 < t keeps all of it in the residual), step 1 in
    full precision carries the residual along: nothing is lost."""
    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit", threshold=0.5, warmup_steps=4,
                    cttab_rule="measured")  # ('fit' runs no warm-up for a key this small)
        kv.init(0, mx.nd.zeros(4))
        sums = []
        for _ in range(2):
            out = mx.nd.zeros(4)
            kv.pushpull(0, mx.nd.full(4, 0.3), out=out)
            sums.append(out.asnumpy()[0])
        kv.close()
        return sums

    for sums in th.in_threads(2, worker):
        assert sums[0] == 0.0
        np.testing.assert_allclose(sums[1], 2 * 0.6, rtol=1e-6)


@pytest.mark.parametrize("comm_threshold", ["off", 1 << 40])  # compressed route, fp route
def test_a_nan_is_traced_to_the_worker_that_sent_it(comm_threshold):
    from slimgc_mx.engine.offload import NonFiniteAggregateError

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit", comm_threshold=comm_threshold,
                    backup=False, timeout=30)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        w = mx.nd.ones(50)
        kv.broadcast(0, w, out=w)
        grad = np.ones(50, np.float32)
        if rank == 1:
            grad[3] = np.inf
        kv.pushpull(0, mx.nd.array(grad), out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.ones(50), out=w)
        kv.close()
        return info.value

    for err in th.in_threads(2, worker):
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert "sent by worker rank 1" in str(err)


def test_bad_loc_optimizer_and_sparse_gradients_name_the_problem():
    kv = SlimGC(compressor="2bit", loc_optimizer="bogus")
    w = mx.nd.zeros(4)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="loc_optimizer 'bogus' .*SLIMGC_LOC_OPTIMIZER.* not an "
                                         "MXNet optimizer; valid: .*sgd"):
        kv.broadcast(0, w, out=w)
    kv.close()
    net = gluon.nn.Embedding(10, 4, sparse_grad=True)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore="slimgc")
    with mx.autograd.record():
        loss = net(mx.nd.array([1, 2])).sum()
    loss.backward()
    with pytest.raises(TypeError, match="slimgc aggregates dense gradients only, but parameter "
                                        ".*weight has sparse weights or gradients; use "
                                        "kvstore='dist_sync'"):
        trainer.step(1)


def test_row_sparse_pull_reads_rows_and_refuses_dense_outputs():
    kv = SlimGC(compressor="none")
    kv.init(0, mx.nd.array(np.arange(12).reshape(4, 3)))
    rows = mx.nd.sparse.zeros("row_sparse", (4, 3))
    kv.row_sparse_pull(0, out=rows, row_ids=mx.nd.array([0, 2]))
    expected = np.arange(12).reshape(4, 3) * np.array([[1], [0], [1], [0]])
    np.testing.assert_array_equal(rows.asnumpy(), expected)
    with pytest.raises(TypeError, match="use pull"):
        kv.row_sparse_pull(0, out=mx.nd.zeros((4, 3)), row_ids=mx.nd.array([0]))
    with pytest.raises(ValueError, match="needs row_ids"):
        kv.row_sparse_pull(0, out=rows)
    kv.close()
