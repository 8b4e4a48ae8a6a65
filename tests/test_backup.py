"""ModelBackup: each transition of the loc_buf / glo_buf state machine, and the local updater."""
import threading
import time

import mxnet as mx
import numpy as np
import pytest

from slimgc_mx.backup import BackupTimeout, LocalUpdater, ModelBackup, clone_optimizer
from slimgc_mx.pipeline import PipelineError
from slimgc_mx.transport import EngineNotifier


def _backup(enabled=True, timeout=5.0, engine=None):
    b = ModelBackup(enabled, timeout, engine)
    b.add("w", mx.nd.array([1.0, 2.0, 3.0]))
    return b


def _sub(delta):
    def update(glos):
        glos[0][:] = glos[0] - delta
    return update


def test_local_step_writes_loc_buf_and_sets_the_flag():
    b = _backup()
    loc = [mx.nd.zeros(3), mx.nd.zeros(3)]
    b.local_step("w", 0, mx.nd.ones(3), loc, lambda g, glo, w: (glo - 0.5 * g).copyto(w))
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
    b.local_step("w", 0, mx.nd.zeros(3), [mx.nd.zeros(3)], lambda g, glo, w: None)
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
    b.local_step("w", 0, mx.nd.ones(3), loc, lambda g, glo, w: (glo - g).copyto(w))
    b.publish([("w", 0, True)], _sub(2.0))
    b.flush()
    np.testing.assert_allclose(loc[0].asnumpy(), [-1.0, 0.0, 1.0])
    state = b.state_dict()
    other = _backup()
    other.load_state_dict(state)
    assert other.version("w") == 1
    np.testing.assert_array_equal(other.glo_buf("w").asnumpy(), b.glo_buf("w").asnumpy())


def _local(updater, grad, glo):
    out = mx.nd.zeros(glo.shape)
    updater(0, grad, glo, out)
    return out.asnumpy()


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
def test_fused_sgd_local_update_equals_the_optimizer_step(momentum):
    """The fused op gives what copying glo_buf and running MXNet's SGD on it gives."""
    rng = np.random.RandomState(0)
    params = {0: mx.gluon.Parameter("w", shape=(50,), lr_mult=0.5, wd_mult=2.0)}
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=momentum, wd=1e-3, rescale_grad=0.25,
                           clip_gradient=2.0, param_dict=params,
                           lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, factor=0.5))
    glo_updater = mx.optimizer.get_updater(clone_optimizer(opt))
    fused = LocalUpdater(opt, 2, global_updater=glo_updater)
    plain = LocalUpdater(opt, 2, global_updater=glo_updater)
    plain.fused = False
    assert fused.fused
    glo = mx.nd.array(rng.randn(50))
    for _ in range(4):  # global steps build momentum and advance the lr schedule
        grad = mx.nd.array(rng.randn(50) * 3)
        a, b = _local(fused, grad, glo), _local(plain, grad, glo)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not np.allclose(a, glo.asnumpy())
        glo_updater(0, mx.nd.array(rng.randn(50)), glo)
    mom = glo_updater.states.get(0)
    before = None if mom is None else mom.asnumpy().copy()
    _local(fused, mx.nd.ones(50), glo)
    if before is not None:  # the global momentum is read, never written
        np.testing.assert_array_equal(glo_updater.states[0].asnumpy(), before)


def test_clone_optimizer_has_its_own_counters():
    opt = mx.optimizer.SGD(learning_rate=0.1)
    opt._update_count(3)
    twin = clone_optimizer(opt)
    twin._update_count(3)
    twin.lr = 7.0
    assert opt._index_update_count[3] == 1 and twin._index_update_count[3] == 2
    assert opt.lr == 0.1
