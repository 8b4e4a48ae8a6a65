"""Datasets: shards disjoint and covering, determinism, shapes, and name errors."""
import numpy as np
import pytest

from slimgc_mx.bench.datasets import DATASETS, info, load, shard_indices


@pytest.mark.parametrize("n,workers", [(10, 1), (10, 3), (1437, 2), (4000, 4), (7, 7)])
def test_shards_disjoint_and_covering(n, workers):
    parts = [shard_indices(n, r, workers, seed=5) for r in range(workers)]
    joined = np.concatenate(parts)
    assert len(joined) == n and set(joined.tolist()) == set(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_shards_depend_on_seed_only():
    a = shard_indices(100, 1, 4, seed=0)
    assert np.array_equal(a, shard_indices(100, 1, 4, seed=0))
    assert not np.array_equal(a, shard_indices(100, 1, 4, seed=1))


def test_bad_rank_or_too_many_workers():
    with pytest.raises(ValueError):
        shard_indices(10, 3, 3, seed=0)
    with pytest.raises(ValueError):
        shard_indices(2, 0, 3, seed=0)


def test_unknown_name_lists_valid_names():
    for fn in (lambda: load("cifar10"), lambda: info("cifar10")):
        with pytest.raises(ValueError) as e:
            fn()
        for name in DATASETS:
            assert name in str(e.value)


def _check_real(name, **kw):
    full = load(name, seed=3, **kw)
    shards = [load(name, rank=r, num_workers=3, seed=3, **kw) for r in range(3)]
    assert len(full.y_test) == len(shards[0].y_test)
    x = np.concatenate([s.x_train for s in shards])
    idx = np.concatenate([s.train_indices for s in shards])
    assert sorted(idx.tolist()) == list(range(full.num_train_total))
    # Each shard holds exactly the samples its indices name, from the same full set.
    np.testing.assert_array_equal(x[np.argsort(idx)], full.x_train)
    assert len({s.steps_per_epoch(32) for s in shards}) == 1
    assert (full.input_shape, full.num_classes) == info(name, kw.get("layout", "flat"))
    assert full.x_train.dtype == np.float32 and full.x_train.shape[1:] == full.input_shape
    assert set(np.unique(full.y_train)) == set(range(10))
    return full


def test_mnist1d():
    state = np.random.get_state()
    d = _check_real("mnist1d")
    assert np.array_equal(np.random.get_state()[1], state[1])  # global RNG untouched
    assert d.x_train.shape == (4000, 40) and d.x_test.shape == (1000, 40)
    assert abs(d.x_train.mean()) < 1e-3 and abs(d.x_train.std() - 1) < 1e-3


@pytest.mark.parametrize("layout,shape", [("flat", (64,)), ("image", (1, 8, 8))])
def test_digits(layout, shape):
    d = _check_real("digits", layout=layout)
    assert d.input_shape == shape
    assert len(d.y_train) + len(d.y_test) == 1797 and len(d.y_test) == 360
    assert np.bincount(d.y_test).tolist() == [36] * 10


def test_digits_bad_layout():
    with pytest.raises(ValueError):
        load("digits", layout="nhwc")


def test_mnist1d_cache_roundtrip(tmp_path):
    a = load("mnist1d", cache_dir=str(tmp_path))
    assert (tmp_path / "mnist1d.npz").exists()
    b = load("mnist1d", cache_dir=str(tmp_path))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)


def test_synthetic_cifar_shards_match_full_set():
    full = load("synthetic-cifar", num_train=40, num_test=8)
    assert full.x_train.shape == (40, 3, 32, 32) and full.num_classes == 10
    parts = [load("synthetic-cifar", rank=r, num_workers=2, seed=9, num_train=40, num_test=8)
             for r in range(2)]
    for p in parts:
        np.testing.assert_array_equal(p.x_train, full.x_train[p.train_indices])
        np.testing.assert_array_equal(p.y_train, full.y_train[p.train_indices])
        np.testing.assert_array_equal(p.x_test, full.x_test)
    assert not set(parts[0].train_indices) & set(parts[1].train_indices)


def test_synthetic_imagenet_shape():
    assert info("synthetic-imagenet") == ((3, 224, 224), 1000)
    d = load("synthetic-imagenet", num_train=4, num_test=2)
    assert d.x_train.shape == (4, 3, 224, 224) and d.x_train.dtype == np.float32
    small = load("synthetic-imagenet", num_train=4, num_test=2, image_size=64)
    assert small.input_shape == (3, 64, 64) == info("synthetic-imagenet", image_size=64)[0]


def test_synthetic_labels_carry_signal():
    """Class means differ, so the loss can fall (else throughput runs would be all noise)."""
    d = load("synthetic-cifar", num_train=400, num_test=8)
    means = np.stack([d.x_train[d.y_train == c].mean(axis=0) for c in range(3)])
    assert np.abs(means[0] - means[1]).mean() > 0.1


def test_all_registered_names_have_info():
    for name in DATASETS:
        shape, k = info(name)
        assert len(shape) >= 1 and k in (10, 1000)
