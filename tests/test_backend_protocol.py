"""The backend protocol (backend.py, docs/backend.md): the engine's host side runs on plain
NumPy host arrays over a thread Collective with no framework loaded, every codec's sums
bitwise its NumPy reference's; MXNet's classes are implementations of the same seams."""
import numpy as np
import pytest

import host_engine
from codec_contract import assert_same, run_steps
from thread_workers import frameworks_loaded_by
from slimgc_mx import codecs
from slimgc_mx.engine import backend
from slimgc_mx.transport import (HostArrays, HostBuffer, HostReadiness, LocalTransport,
                                 ThreadGroup, TransferHandle)

SHAPES = {"powersgd": (64, 65)}  # low-rank factors need a matrix
FLOAT_SUMS = ("randomk", "powersgd")  # send float32 values, whose sum depends on the order


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("name", [n for n in codecs.available() if n != "none"])
def test_every_codec_through_the_host_engine_is_its_reference(name, num_workers):
    shape = SHAPES.get(name, (4097,))
    size = int(np.prod(shape))
    history = run_steps(name, num_workers, size, 3, {}, seed=5, reference=True, shape=shape)
    sums = host_engine.run(name, {}, shape, num_workers, [h["grads"] for h in history])
    for step, h in enumerate(history):
        for rank in range(num_workers):
            assert_same(sums[step][rank], sums[step][0], "%s: ranks decode alike" % name)
            if name in FLOAT_SUMS and num_workers > 2:
                # float32 values added in arrival order, as servers add them: not bitwise
                np.testing.assert_allclose(sums[step][rank], h["decoded"][0], rtol=1e-3,
                                           atol=1e-4)
            else:
                assert_same(sums[step][rank], h["decoded"][0],
                            "%s: sum of step %d on rank %d" % (name, step, rank))


@pytest.mark.slow
def test_the_host_engine_loads_no_framework():
    code = ("import numpy as np, host_engine\n"
            "g = [[np.full(300, r + 1, np.float32) for r in range(2)] for _ in range(2)]\n"
            "sums = host_engine.run('2bit', {}, (300,), 2, g)\n"
            "assert sums[1][0].shape == (300,)\n")
    assert frameworks_loaded_by(code) == []


def test_host_and_thread_classes_implement_the_protocol():
    buf = HostBuffer((3, 4))
    assert isinstance(buf, backend.HostArray) and buf.nbytes == 48
    assert isinstance(buf.view(4, (2, 2)), backend.HostArray)
    buf.view(4, (2, 2)).for_write()[:] = 7
    assert buf.for_read().tolist() == [0] * 4 + [7] * 4 + [0] * 4
    with pytest.raises(ValueError, match="outside a buffer of 12 elements"):
        buf.view(10, (3,))
    assert isinstance(ThreadGroup(2).transport(1), backend.Collective)
    assert isinstance(LocalTransport(), backend.Collective)
    assert isinstance(TransferHandle(buf), backend.Work)
    assert isinstance(HostReadiness(), backend.Readiness)
    assert isinstance(HostArrays(), backend.Arrays) and not HostArrays.can_hold


def test_mxnet_classes_implement_the_protocol():
    pytest.importorskip("mxnet")
    from slimgc_mx.mxnet.buffers import ArrayOps, Buffer
    from slimgc_mx.mxnet.engine import EngineNotifier
    assert isinstance(Buffer((2, 2), np.float32), backend.HostArray)
    assert isinstance(EngineNotifier(), backend.Readiness)
    assert isinstance(ArrayOps(), backend.Arrays)


@pytest.mark.slow
def test_the_model_backup_runs_on_host_arrays():
    """backup.py's state machine over HostArrays: local step, publish after the flag,
    backup off waiting for w_{i+1}, flush and state_dict, with no framework loaded."""
    code = r'''
import threading, numpy as np
from slimgc_mx.engine.backup import ModelBackup
from slimgc_mx.transport import HostArrays
b = ModelBackup(True, 5.0, HostArrays())
b.add("w", np.array([1.0, 2.0, 3.0], np.float32))
params = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
b.local_step("w", 0, None, params, lambda g, glo, loc: np.copyto(
    loc.for_write(), glo.for_read() - 0.5))
assert all(p.tolist() == [0.5, 1.5, 2.5] for p in params)
b.publish([("w", 0, True)], lambda glos: np.copyto(glos[0].for_write(), [0, 1, 2]))
assert b.version("w") == 1 and b.glo_buf("w").tolist() == [0, 1, 2]
b.flush()
assert all(p.tolist() == [0, 1, 2] for p in params)
state = b.state_dict()
off = ModelBackup(False, 5.0, HostArrays())
off.add("w", np.zeros(3, np.float32))
off.load_state_dict(state)
out = [np.zeros(3, np.float32)]
threading.Timer(0.1, lambda: off.publish([("w", 1, False)], lambda glos: np.copyto(
    glos[0].for_write(), [7, 7, 7]))).start()
off.write_back("w", 2, out)
assert out[0].tolist() == [7, 7, 7] and off.version("w") == 2
'''
    assert frameworks_loaded_by(code) == []


# ---------------------------------------------------------------- every adapter's objects
def _check_framework(framework, optimizer, config):
    """{Protocol name: the members it lacks} over the adapter's framework object, its
    Readiness and Arrays and its update rule's two halves; {} when all implement them."""
    update = framework.global_update(optimizer, 1)
    objects = [(framework, backend.Framework), (framework.readiness, backend.Readiness),
               (framework.arrays, backend.Arrays), (update, backend.GlobalUpdate),
               (framework.local_updater(update, 2, config), backend.LocalUpdate)]
    out = {}
    for obj, proto in objects:
        absent = backend.missing(obj, proto)
        if absent or not isinstance(obj, proto):
            out[proto.__name__] = absent
    return out


def test_the_numpy_backend_implements_the_protocol():
    from slimgc_mx.engine.config import SlimGCConfig
    from slimgc_mx.engine.numpy_backend import SGD, NumpyFramework
    assert _check_framework(NumpyFramework(), SGD(learning_rate=0.1), SlimGCConfig()) == {}


def test_the_torch_adapter_implements_the_protocol():
    torch = pytest.importorskip("torch")
    from slimgc_mx.engine.config import SlimGCConfig
    from slimgc_mx.torch.copies import DeferredCopies
    from slimgc_mx.torch.framework import TorchFramework
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    for copies in (None, DeferredCopies()):  # a host model, and a device model's seams
        framework = TorchFramework(params, {0: 0}, 2, copies=copies)
        assert _check_framework(framework, opt, SlimGCConfig()) == {}


def test_the_torch_device_paths_bucket_implements_the_protocol():
    """The stages engine/stages.py runs for a device-path bucket, and what the step's
    schedule (engine/bucket_step.py) reads and calls, are the adapter's bucket's; one that
    lacks a stage or a member is refused by name when the device path is built."""
    torch = pytest.importorskip("torch")
    from slimgc_mx import codecs
    from slimgc_mx.torch import buckets, device_path
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p], lr=0.1)
    for codec in (None, codecs.create("2bit")):
        b = buckets.Bucket(buckets.BucketSpec((0,), 0, codec is not None), [("p", p)], opt,
                           codec, 2)
        assert backend.missing(b, backend.DeviceBucket) == []
        assert backend.missing(b, backend.ScheduledBucket) == []

    class Lacking(buckets.Bucket):
        encode_on_host = None  # as if misspelt: not callable

    class NoLocalStep(buckets.Bucket):
        local_step = None

    class NoLaneBytes(buckets.Bucket):
        lane_bytes = property(lambda self: self.missing_attribute)
    original = device_path.Bucket
    try:
        for klass, name in ((Lacking, "encode_on_host"), (NoLocalStep, "local_step"),
                            (NoLaneBytes, "lane_bytes")):
            device_path.Bucket = klass
            with pytest.raises(TypeError, match=r"ScheduledBucket: it lacks %s \(docs" % name):
                device_path.DevicePath(opt, [("p", p)], [0], _config(), _OneRank(), None)
    finally:
        device_path.Bucket = original


def test_the_torch_device_path_s_device_implements_the_protocol():
    """The sums, marks, tail and clip the engine's step schedule calls are TorchStep's."""
    torch = pytest.importorskip("torch")
    from slimgc_mx.torch import device_path
    step = device_path.TorchStep(torch.device("cpu"), None, 12)
    assert backend.missing(step, backend.DeviceStep) == []
    assert backend.missing(object(), backend.DeviceStep)[:2] == ["sums", "counts"]


class _OneRank:
    num_workers, rank = 1, 0


def _config():
    from slimgc_mx.engine.config import SlimGCConfig
    return SlimGCConfig(compressor="2bit", comm_threshold="off")


def test_the_mxnet_adapter_implements_the_protocol():
    mx = pytest.importorskip("mxnet")
    from slimgc_mx.engine.config import SlimGCConfig
    from slimgc_mx.mxnet.framework import MXNetFramework
    opt = mx.optimizer.SGD(learning_rate=0.1)
    assert _check_framework(MXNetFramework(), opt, SlimGCConfig()) == {}


def test_a_framework_missing_a_member_is_refused_by_name():
    from slimgc_mx.engine.aggregator import Aggregator
    from slimgc_mx.engine.config import SlimGCConfig
    from slimgc_mx.engine.numpy_backend import NumpyFramework

    class Misspelt(NumpyFramework):
        gradient = None  # as if misspelt: not callable

    class Lacking:
        readiness = HostReadiness()
        arrays = HostArrays()

    with pytest.raises(TypeError, match="gradient"):
        Aggregator(SlimGCConfig(), LocalTransport(), Misspelt())
    with pytest.raises(TypeError, match="global_update.*local_updater|new_buffer"):
        Aggregator(SlimGCConfig(), LocalTransport(), Lacking())
    assert backend.missing(Lacking(), backend.Framework)[:3] == ["engine_where",
                                                                "pushes_every_key", "new_buffer"]


def test_copy_many_is_each_copy_in_the_destinations_shape():
    """Arrays.copy_many (a step's write-backs at once) does what copy() does pair by pair."""
    dsts = [np.zeros((2, 2), np.float32), np.zeros(3, np.float32)]
    HostArrays.copy_many([(np.arange(4, dtype=np.float32), dsts[0]),
                          (np.full(3, 5, np.float32), dsts[1])])
    assert dsts[0].tolist() == [[0, 1], [2, 3]] and dsts[1].tolist() == [5, 5, 5]
    torch = pytest.importorskip("torch")
    from slimgc_mx.torch.framework import TorchArrays
    same = torch.ones(2)
    outs = [torch.zeros(2, 2), torch.zeros(3), same]
    TorchArrays().copy_many([(torch.arange(4.0), outs[0]), (np.full(3, 5, np.float32), outs[1]),
                             (same, same)])
    assert outs[0].tolist() == [[0, 1], [2, 3]] and outs[1].tolist() == [5, 5, 5]
    assert same.tolist() == [1, 1]
