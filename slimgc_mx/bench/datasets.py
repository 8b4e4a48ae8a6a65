"""Datasets for the training job: two small real ones built offline, two synthetic ones.

`load()` returns NumPy arrays holding this worker's shard of the training set and
the full test set. Shards come from one permutation fixed by `seed`, split into
`num_workers` near-equal parts, so they are disjoint and together cover the set.

    mnist1d            real, (40,) float32 signals, 10 classes, 4000 train / 1000 test,
                       generated locally (the MNIST-1D procedure, its default seed),
                       standardized with the training mean/std.
    digits             real, the 8x8 handwritten digits, 10 classes, 1437 train / 360 test
                       (fixed stratified split); layout "flat" (64,) or "image" (1, 8, 8).
    synthetic-cifar    random (3, 32, 32) float32 images, 10 classes; for throughput.
    synthetic-imagenet random (3, 224, 224) float32 images (image_size= to shrink),
                       1000 classes; for throughput.

Synthetic images are a per-class low-resolution pattern plus Gaussian noise, so the
loss can fall, but they measure speed, not accuracy. Every sample depends only on
its index, so a worker generates just its own shard.
"""
import functools
import os
from dataclasses import dataclass, field

import numpy as np

from ..env import data_dir

__all__ = ["DATASETS", "Dataset", "load", "shard_indices", "info"]

# The test/train split and the synthetic pixels are fixed; `seed` only picks the shards.
_DATA_SEED = 1234


@dataclass
class Dataset:
    """One worker's view: its training shard, the full test set, and what a model needs."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple
    num_classes: int
    num_train_total: int
    rank: int = 0
    num_workers: int = 1
    train_indices: np.ndarray = field(default=None, repr=False)

    def steps_per_epoch(self, batch_size):
        """Full batches per epoch, the same on every worker (the smallest shard decides).

        Synchronous training deadlocks if workers disagree on the number of steps.
        """
        return (self.num_train_total // self.num_workers) // int(batch_size)


def shard_indices(n, rank, num_workers, seed):
    """Indices of `rank`'s shard of n samples: a seeded permutation split in near-equal parts."""
    if not 0 <= rank < num_workers:
        raise ValueError("rank %d out of range for %d workers" % (rank, num_workers))
    if num_workers > n:
        raise ValueError("more workers (%d) than training samples (%d)" % (num_workers, n))
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(np.array_split(perm, num_workers)[rank])


def _standardize(x_train, x_test):
    mean, std = x_train.mean(), x_train.std()
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _mnist1d_arrays():
    # make_dataset reseeds NumPy's global generator; keep the caller's state intact.
    from mnist1d.data import get_dataset_args, make_dataset
    state = np.random.get_state()
    try:
        d = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(state)
    x, xt = _standardize(d["x"], d["x_test"])
    return x, d["y"].astype(np.int32), xt, d["y_test"].astype(np.int32)


def _mnist1d(cache_dir=None, **unused):
    """MNIST-1D arrays, optionally cached as .npz (generation takes a few seconds)."""
    cache_dir = cache_dir or data_dir()
    path = os.path.join(cache_dir, "mnist1d.npz") if cache_dir else None
    if path and os.path.exists(path):
        with np.load(path) as z:
            return z["x"], z["y"], z["x_test"], z["y_test"]
    arrays = _mnist1d_arrays()
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = "%s.%d.tmp.npz" % (path[:-4], os.getpid())
        np.savez(tmp, **dict(zip(("x", "y", "x_test", "y_test"), arrays)))
        os.replace(tmp, path)
    return arrays


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    from sklearn.datasets import load_digits
    d = load_digits()
    x, y = d.data.astype(np.float64) / 16.0, d.target.astype(np.int32)
    # Stratified 80/20 split with a fixed seed: 1437 train, 360 test.
    rng = np.random.default_rng(_DATA_SEED)
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:36] for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    xtr, xte = _standardize(x[train], x[np.sort(test)])
    return xtr, y[train], xte, y[np.sort(test)]


def _digits(layout="flat", **unused):
    if layout not in ("flat", "image"):
        raise ValueError("digits layout must be 'flat' or 'image', got %r" % (layout,))
    x, y, xt, yt = _digits_arrays()
    if layout == "image":
        x, xt = x.reshape(-1, 1, 8, 8), xt.reshape(-1, 1, 8, 8)
    return x, y, xt, yt


class _Synthetic:
    """Index-addressable random images: sample i of a split depends only on (split, i)."""

    def __init__(self, shape, num_classes, num_train, num_test, pattern=4):
        self.shape, self.num_classes = tuple(shape), num_classes
        self.num_train, self.num_test = num_train, num_test
        rng = np.random.default_rng(_DATA_SEED)
        c = shape[0]
        # One low-resolution (C, pattern, pattern) template per class, upsampled on use.
        self.templates = rng.standard_normal((num_classes, c, pattern, pattern)).astype(np.float32)
        self.labels = {"train": rng.integers(0, num_classes, num_train).astype(np.int32),
                       "test": rng.integers(0, num_classes, num_test).astype(np.int32)}

    def images(self, split, indices):
        c, h, w = self.shape
        p = self.templates.shape[-1]
        ry, rx = -(-h // p), -(-w // p)
        out = np.empty((len(indices),) + self.shape, dtype=np.float32)
        labels = self.labels[split][indices]
        split_id = 0 if split == "train" else 1
        for k, (i, y) in enumerate(zip(indices, labels)):
            noise = np.random.default_rng([_DATA_SEED, split_id, int(i)]).standard_normal(
                self.shape, dtype=np.float32)
            up = np.repeat(np.repeat(self.templates[y], ry, axis=1), rx, axis=2)[:, :h, :w]
            out[k] = 0.5 * up + noise
        return out, labels


def _synthetic(shape, num_classes, default_train, default_test):
    def make(num_train=None, num_test=None, image_size=None, **unused):
        s = tuple(shape)
        if image_size is not None:
            s = (s[0], int(image_size), int(image_size))
        return _Synthetic(s, num_classes, int(num_train or default_train),
                          int(num_test or default_test))
    return make


# name -> (builder, input_shape given the options, num_classes)
DATASETS = {
    "mnist1d": _mnist1d,
    "digits": _digits,
    "synthetic-cifar": _synthetic((3, 32, 32), 10, 4096, 512),
    "synthetic-imagenet": _synthetic((3, 224, 224), 1000, 512, 64),
}


def _check_name(name):
    if name not in DATASETS:
        raise ValueError("unknown dataset %r; valid names: %s"
                         % (name, ", ".join(sorted(DATASETS))))


def info(name, layout="flat", image_size=None):
    """(input_shape, num_classes) of dataset `name` without building it."""
    _check_name(name)
    if name == "mnist1d":
        return (40,), 10
    if name == "digits":
        return ((64,) if layout == "flat" else (1, 8, 8)), 10
    c, h, w = (3, 32, 32) if name == "synthetic-cifar" else (3, 224, 224)
    if image_size is not None:
        h = w = int(image_size)
    return (c, h, w), (10 if name == "synthetic-cifar" else 1000)


def load(name, rank=0, num_workers=1, seed=0, layout="flat", num_train=None, num_test=None,
         image_size=None, cache_dir=None):
    """This worker's shard of `name`'s training set plus the full test set, as a Dataset.

    layout: digits only ("flat" or "image"). num_train/num_test/image_size: synthetic
    sets only (defaults: cifar 4096/512 at 32x32, imagenet 512/64 at 224x224).
    cache_dir (or $SLIMGC_DATA_DIR): where mnist1d keeps its generated arrays.
    """
    _check_name(name)
    rank, num_workers = int(rank), int(num_workers)
    if name.startswith("synthetic-"):
        syn = DATASETS[name](num_train=num_train, num_test=num_test, image_size=image_size)
        idx = shard_indices(syn.num_train, rank, num_workers, seed)
        x, y = syn.images("train", idx)
        xt, yt = syn.images("test", np.arange(syn.num_test))
        return Dataset(name, x, y, xt, yt, syn.shape, syn.num_classes, syn.num_train,
                       rank, num_workers, idx)
    if name == "mnist1d":
        x, y, xt, yt = DATASETS[name](cache_dir=cache_dir)
    else:
        x, y, xt, yt = DATASETS[name](layout=layout)
    input_shape, num_classes = info(name, layout)
    idx = shard_indices(len(y), rank, num_workers, seed)
    return Dataset(name, x[idx], y[idx], xt, yt, input_shape, num_classes, len(y),
                   rank, num_workers, idx)
