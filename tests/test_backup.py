"""ModelBackup: each transition of the loc_buf / glo_buf state machine, and the local updater."""
import threading
import time

import mxnet as mx
import numpy as np
import pytest

import training_helpers as th
from slimgc_mx.engine.backup import BackupTimeout, ModelBackup
from slimgc_mx.engine.offload import PipelineError
from slimgc_mx.mxnet.sgd import SGDKernel
from slimgc_mx.mxnet.buffers import ArrayOps
from slimgc_mx.mxnet.engine import EngineNotifier
from slimgc_mx.mxnet.update import LocalUpdater, clone_optimizer


def _backup(enabled=True, timeout=5.0, engine=None):
    b = ModelBackup(enabled, timeout, ArrayOps(engine))
    b.add("w", mx.nd.array([1.0, 2.0, 3.0]))
    return b


def _sub(delta):
    def update(glos):
        glos[0].nd[:] = glos[0].nd - delta
    return update


def test_a_local_step_before_its_global_weights_is_refused():
    b = _backup()
    with pytest.raises(RuntimeError, match="local step 1 before glo_buf holds w_1"):
        b.local_step("w", 1, mx.nd.ones(3), [mx.nd.zeros(3)], lambda g, glo, loc: None)


def test_local_step_writes_loc_buf_and_sets_the_flag():
    b = _backup()
    loc = [mx.nd.zeros(3), mx.nd.zeros(3)]
    b.local_step("w", 0, mx.nd.ones(3), loc, lambda g, glo, loc: (glo.nd - 0.5 * g).copyto(loc.nd))
    for arr in loc:
        np.testing.assert_allclose(arr.asnumpy(), [0.5, 1.5, 2.5])
    assert b._slots["w"].flag == 1
    np.testing.assert_allclose(b.glo_buf("w").asnumpy(), [1.0, 2.0, 3.0])  # glo untouched


def test_publish_waits_for_the_flag_then_clears_it():
    b = _backup()
    done = threading.Event()

    def aggregation_thread():
        b.publish([("w", 0, True)], _sub(1.0))
        done.set()

    threading.Thread(target=aggregation_thread, daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set() and b.version("w") == 0  # glo_buf not overwritten before the flag
    b.local_step("w", 0, mx.nd.zeros(3), [mx.nd.zeros(3)], lambda g, glo, loc: None)
    assert done.wait(5)
    assert b.version("w") == 1 and b._slots["w"].flag == 0
    np.testing.assert_allclose(b.glo_buf("w").asnumpy(), [0.0, 1.0, 2.0])


def test_backup_off_publishes_without_a_flag_and_write_back_waits():
    b = _backup(enabled=False)
    out = [mx.nd.zeros(3)]
    threading.Timer(0.1, lambda: b.publish([("w", 0, False)], _sub(1.0))).start()
    b.write_back("w", 1, out)
    np.testing.assert_allclose(out[0].asnumpy(), [0.0, 1.0, 2.0])
    assert b.blocked_s > 0


def _timed_read(arr):
    start = time.perf_counter()
    return arr.asnumpy(), time.perf_counter() - start


@pytest.mark.parametrize("publish_first", [False, True])
def test_backup_off_write_back_returns_at_once_and_the_engine_waits(publish_first):
    b = _backup(enabled=False, engine=EngineNotifier())
    out = [mx.nd.zeros(3), mx.nd.zeros(3)]
    if publish_first:
        b.publish([("w", 0, False)], _sub(1.0))
    else:
        threading.Timer(0.3, lambda: b.publish([("w", 0, False)], _sub(1.0))).start()
    start = time.perf_counter()
    b.write_back("w", 1, out)
    assert time.perf_counter() - start < 0.2  # the training thread does not wait ...
    later = out[1] * 2  # ... and work queued after the write-back sees the new weights
    np.testing.assert_allclose(later.asnumpy(), [0.0, 2.0, 4.0])
    for arr in out:
        np.testing.assert_allclose(arr.asnumpy(), [0.0, 1.0, 2.0])
    assert b.blocked_s == 0
    b.close()


def test_backup_off_hold_is_released_on_failure_and_keeps_the_old_weights():
    b = _backup(enabled=False, engine=EngineNotifier())
    out = [mx.nd.array([1.0, 2.0, 3.0])]
    b.write_back("w", 1, out)
    threading.Timer(0.2, lambda: b.fail(OSError("link down"), "key 'w', step 0")).start()
    values, seconds = _timed_read(out[0])
    np.testing.assert_allclose(values, [1.0, 2.0, 3.0])
    assert seconds < 4
    with pytest.raises(PipelineError, match="link down"):
        b.wait_version("w", 1)
    b.close()


def test_backup_off_late_aggregation_fails_after_the_timeout_instead_of_hanging():
    b = _backup(enabled=False, timeout=0.5, engine=EngineNotifier())
    out = [mx.nd.array([1.0, 2.0, 3.0])]
    b.write_back("w", 1, out)
    values, seconds = _timed_read(out[0])  # never published: the watchdog lets the engine go
    np.testing.assert_allclose(values, [1.0, 2.0, 3.0])
    assert 0.4 < seconds < 4
    with pytest.raises(BackupTimeout, match="key 'w': global weights of step 1"):
        b.wait_version("w", 1)
    assert b.failed
    b.close()


def test_wait_times_out_with_the_key_and_step():
    b = _backup(timeout=0.2)
    with pytest.raises(BackupTimeout, match="key 'w': global weights of step 1"):
        b.wait_version("w", 1)


def test_fail_wakes_waiters_with_the_cause():
    b = _backup()
    threading.Timer(0.1, lambda: b.fail(OSError("link down"), "key 'w', step 0")).start()
    with pytest.raises(PipelineError, match="key 'w', step 0") as info:
        b.wait_version("w", 1)
    assert isinstance(info.value.__cause__, OSError)


def test_flush_and_state_round_trip():
    b = _backup()
    loc = [mx.nd.zeros(3)]
    b.local_step("w", 0, mx.nd.ones(3), loc, lambda g, glo, loc: (glo.nd - g).copyto(loc.nd))
    b.publish([("w", 0, True)], _sub(2.0))
    b.flush()
    np.testing.assert_allclose(loc[0].asnumpy(), [-1.0, 0.0, 1.0])
    state = b.state_dict()
    other = _backup()
    other.load_state_dict(state)
    assert other.version("w") == 1
    np.testing.assert_array_equal(other.glo_buf("w").asnumpy(), b.glo_buf("w").asnumpy())


def _local(updater, grad, glo):
    out = th.buffer_of(np.zeros(glo.shape, np.float32))
    updater(0, th.buffer_of(grad.asnumpy()), th.buffer_of(glo.asnumpy()), out)
    return out.for_read().copy()


def test_local_updater_follows_the_global_lr_unless_loc_lr_is_set():
    opt = mx.optimizer.SGD(learning_rate=0.1, rescale_grad=0.5)
    ones = mx.nd.ones(2)
    np.testing.assert_allclose(_local(LocalUpdater(opt, num_workers=2), ones, ones),
                               1 - 0.1 * 0.5 * 2)  # gradient scaled by N
    opt.lr = 0.2  # e.g. Trainer.set_learning_rate
    np.testing.assert_allclose(_local(LocalUpdater(opt, num_workers=1), ones, ones), 1 - 0.2 * 0.5)
    np.testing.assert_allclose(_local(LocalUpdater(opt, num_workers=1, loc_lr=0.01), ones, ones),
                               1 - 0.01 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(
        _local(LocalUpdater(opt, num_workers=1, loc_optimizer="sgd", loc_lr=1.0), ones, ones),
        1 - 1.0 * 0.5, rtol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_kernel_updates_equal_mxnet_updater(momentum):
    """Global and local updates through the SGD kernel give what MXNet's Updater gives.

    Two chains from the same weights: MXNet's Updater and plain local update on
    NDArrays, and the kernel on Buffers; lr_mult, wd_mult, clipping and an lr
    schedule are all in play.
    """
    rng = np.random.RandomState(0)
    opt = th.sgd_with_everything(momentum)
    ref_updater = mx.optimizer.get_updater(clone_optimizer(opt))
    updater = mx.optimizer.get_updater(clone_optimizer(opt))
    kernel = SGDKernel(updater, num_threads=2)
    plain = LocalUpdater(opt, 2, global_updater=ref_updater)
    fused = LocalUpdater(opt, 2, global_updater=updater, kernel=kernel)
    assert fused.fused and not plain.fused
    start = rng.randn(50).astype(np.float32)
    ref_glo, glo = mx.nd.array(start), th.buffer_of(start)
    for _ in range(5):  # global steps build momentum and advance the lr schedule
        grad = rng.randn(50).astype(np.float32) * 3
        a, b = th.buffer_of(np.zeros(50, np.float32)), th.buffer_of(np.zeros(50, np.float32))
        fused(0, th.buffer_of(grad), glo, a)
        plain(0, th.buffer_of(grad), th.buffer_of(ref_glo.asnumpy()), b)
        np.testing.assert_allclose(a.for_read(), b.for_read(), rtol=1e-6, atol=1e-7)
        assert not np.allclose(a.for_read(), glo.for_read())
        agg = rng.randn(50).astype(np.float32)
        kernel.global_step([0], [th.buffer_of(agg)], [glo])
        ref_updater(0, mx.nd.array(agg), ref_glo)
        np.testing.assert_allclose(glo.for_read(), ref_glo.asnumpy(), rtol=1e-6, atol=1e-7)
    if momentum:  # the momentum lives in the Updater, where checkpoints read it
        np.testing.assert_allclose(updater.states[0].asnumpy(), ref_updater.states[0].asnumpy(),
                                   rtol=1e-6, atol=1e-7)
        before = updater.states[0].asnumpy().copy()
        fused(0, th.buffer_of(np.ones(50, np.float32)), glo, th.buffer_of(np.zeros(50, np.float32)))
        np.testing.assert_array_equal(updater.states[0].asnumpy(), before)  # read, not written


def test_clone_optimizer_has_its_own_counters():
    opt = mx.optimizer.SGD(learning_rate=0.1)
    opt._update_count(3)
    twin = clone_optimizer(opt)
    twin._update_count(3)
    twin.lr = 7.0
    assert opt._index_update_count[3] == 1 and twin._index_update_count[3] == 2
    assert opt.lr == 0.1


def test_engine_runs_a_function_in_order_and_reports_its_failure():
    """EngineNotifier.run: after the writes it reads, before the reads of what it writes."""
    errors = []
    engine = EngineNotifier(on_error=errors.append)
    src, dst = th.buffer_of(np.zeros(4, np.float32)), th.buffer_of(np.zeros(4, np.float32))
    a = mx.nd.random.uniform(shape=(800, 800))
    slow = mx.nd.dot(mx.nd.dot(a, a), a)  # queued, not finished
    mx.nd.broadcast_add(src.nd, slow[0, :4] * 0 + 1, out=src.nd)  # src = 1 once slow is done
    engine.run(lambda: np.copyto(dst.held(), src.held() * 2), [src.nd], [dst.nd])
    np.testing.assert_array_equal((dst.nd + 0).asnumpy(), [2, 2, 2, 2])  # read after the run
    engine.run(lambda: 1 / 0, [src.nd], [dst.nd])
    dst.nd.wait_to_read()
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
