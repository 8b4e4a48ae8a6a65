"""Checkpoints hold data only: what is refused, with what message, and that a refused file
changes nothing; the first format's pickles only behind the explicit opt-in."""
import dataclasses
import pickle

import mxnet as mx
import numpy as np
import pytest

from slimgc_mx import dataio
from slimgc_mx.mxnet.kvstore import SlimGC


def _store(shape=(10,), **options):
    kv = SlimGC(backup=False, **dict({"compressor": "2bit"}, **options))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    w = mx.nd.zeros(shape)
    kv.broadcast(0, w, out=w)
    for step in range(3):
        kv.pushpull(0, mx.nd.ones(shape) * (step + 1), out=w)
    kv.flush()
    return kv


@pytest.fixture
def saved(tmp_path):
    kv = _store()
    path = str(tmp_path / "ok.states")
    kv.save_optimizer_states(path)
    kv.close()
    return path


def _refused(path, match, **options):
    """The load fails with `match`, and the store's weights and step are untouched."""
    kv = _store(**options)
    before = kv._agg.backup.glo_buf(0).asnumpy().copy(), dict(kv._agg.planner.steps)
    with pytest.raises(ValueError, match=match):
        kv.load_optimizer_states(path)
    np.testing.assert_array_equal(kv._agg.backup.glo_buf(0).asnumpy(), before[0])
    assert kv._agg.planner.steps == before[1]
    kv.close()


def test_a_saved_file_is_data_and_loads(saved):
    tree = dataio.read(saved)
    assert tree["format"] == "slimgc-checkpoint" and tree["version"] == 2
    assert isinstance(tree["backup"][0]["glo_buf"], np.ndarray)
    kv = _store()
    kv.load_optimizer_states(saved)
    kv.close()


def test_a_truncated_file_is_refused(saved, tmp_path):
    data = open(saved, "rb").read()
    bad = tmp_path / "cut.states"
    bad.write_bytes(data[:len(data) // 2])
    _refused(str(bad), "is not a slimgc checkpoint")


def test_another_version_is_refused(saved, tmp_path):
    tree = dataio.read(saved)
    tree["version"] = 99
    bad = str(tmp_path / "v99.states")
    dataio.write(bad, tree)
    _refused(bad, "version 99; this slimgc_mx reads version 2")


def test_another_models_checkpoint_is_refused(saved):
    _refused(saved, "key 0 holds 10 values, this job's has shape \\(12,\\)", shape=(12,))


def test_another_codec_or_worker_count_is_refused(saved, tmp_path):
    _refused(saved, "written with compressor='2bit' but this job uses '4bit'",
             compressor="4bit")
    tree = dataio.read(saved)
    tree["num_workers"] = 4
    bad = str(tmp_path / "n4.states")
    dataio.write(bad, tree)
    _refused(bad, "holds 4 workers")


def test_another_optimizer_is_refused(saved):
    kv = SlimGC(backup=False, compressor="2bit")
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1))
    w = mx.nd.zeros(10)
    kv.broadcast(0, w, out=w)
    with pytest.raises(ValueError, match="holds the optimizer mxnet.optimizer.optimizer.SGD, this job has "
                                         "mxnet.optimizer.optimizer.Adam"):
        kv.load_optimizer_states(saved)
    kv.close()


def test_a_pickle_of_the_first_format_is_refused(tmp_path):
    kv = _store()
    agg = kv._agg
    old = {"format": "slimgc-checkpoint-1", "settings": {"compressor": "2bit"},
           "num_workers": 1, "global": agg.update.updater.get_states(True), "local": None,
           "keys": agg.planner.state_dict(), "backup": agg.backup.state_dict(),
           "cttab": agg.cttab.state_dict(), "counters": dataclasses.asdict(agg.stats)}
    path = str(tmp_path / "old.states")
    with open(path, "wb") as f:
        pickle.dump(old, f)
    kv.close()
    _refused(path, "is a pickle.*would run whatever code it holds.*save the checkpoint again")
