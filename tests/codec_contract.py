"""What every codec must keep (docs/extending.md), as checks a codec's test file calls.

    from codec_contract import *
    check_kernel_equals_reference("terngrad", n_workers=3, size=4097, options={...})

Workers are simulated in one process: one codec instance per worker (as the kvstore
keeps one per key and worker), their wire arrays summed (or gathered) as the servers do.
A codec that wants the optimizer's view gets `views(step, rank, size)` before each encode
(an OptimizerView, or None), as the kvstore sets one before each push.
"""
import numpy as np

from slimgc_mx import codecs
from slimgc_mx.codecs.rng import key_seed


def bits(a):
    """Bit pattern of a float array: equality that tells -0.0 from 0.0 and NaNs apart."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def assert_same(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bad = np.flatnonzero(bits(a) != bits(b))
    assert bad.size == 0, "%s differs at %d places, first %d: %r vs %r" % (
        what, bad.size, bad[0], a.ravel()[bad[0]], b.ravel()[bad[0]])


def gradient(rng, n, scale=1.0):
    """float32 values: normal, with some zeros, -0.0 and outliers."""
    g = (scale * rng.standard_normal(n)).astype(np.float32)
    g[rng.random(n) < 0.05] = 0.0
    g[rng.random(n) < 0.01] = -0.0
    g[rng.random(n) < 0.01] *= 50
    return g


def same_state(a, b):
    """state_dict() equality that compares ndarray values bit for bit."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and (bits(a) == bits(b)).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return a == b


def make(name, n_workers, reference, options, num_threads=1, key=0, size=None, shape=None):
    """One codec instance per worker, seeded as the kvstore seeds key `key` of a job; with
    `shape`, each learns the key's shape through wire_rounds as KeyBuffers does."""
    out = []
    for _ in range(n_workers):
        c = codecs.create(name, reference=reference, num_threads=num_threads, **options)
        c.seed = key_seed(0, key)
        if shape is not None:
            c.wire_rounds(size, shape, n_workers)
        out.append(c)
    return out


def combine(codec, wires, order, num_workers, route=None):
    """What the servers return: the sum of the workers' arrays in `order` (float adds), or
    for a gathering round, every worker's slot side by side."""
    if route is None:
        route = codec.wire_rounds(1, (1,), num_workers)[0][0]
    if route == "gather":
        return np.concatenate([wires[j] for j in range(num_workers)])
    total = np.zeros_like(wires[0])
    for j in order:
        total += wires[j]
    return total


def push(cs, grads, residuals, size, shape=None, order=None):
    """One push of every worker, all its rounds (next_round between them): (per worker the
    concatenation of what it sent in every round, per worker the decoded sum). order(round)
    gives the servers' order of addition (default: rank order)."""
    n = len(cs)
    routes = cs[0].wire_rounds(size, shape if shape is not None else (size,), n)
    wires = [c.encode(g, r, n, rank=j) for j, (c, g, r) in enumerate(zip(cs, grads, residuals))]
    sent = [[w.copy()] for w in wires]
    for done in range(cs[0].rounds):
        total = combine(cs[0], wires, order(done) if order else range(n), n, routes[done][0])
        if done + 1 == cs[0].rounds:
            break
        wires = [c.next_round(done, total, np.empty(routes[done + 1][1], c.wire_dtype), n)
                 for c in cs]
        for j, w in enumerate(wires):
            sent[j].append(w.copy())
    decoded = [c.decode(total, size, n) for c in cs]
    return [np.concatenate(s) for s in sent], decoded


def run_steps(name, n_workers, size, steps, options, seed=0, num_threads=1, reference=False,
              shape=None, order_seed=None, views=None):
    """Simulate `steps` pushes: per step the wire arrays, residuals and decoded sums.
    shape: the tensor's shape (a codec whose wire depends on it); order_seed: the servers
    add in a random order per round (else in rank order); views(step, rank, size): the
    optimizer's view each worker's codec gets before the push (wants_optimizer)."""
    rng = np.random.default_rng(seed)
    cs = make(name, n_workers, reference, options, num_threads, size=size, shape=shape)
    residuals = [np.zeros(cs[0].memory_size(size), np.float32) for _ in range(n_workers)]
    orders = np.random.default_rng(order_seed) if order_seed is not None else None
    history = []
    for step in range(steps):
        grads = [gradient(rng, size) for _ in range(n_workers)]
        if views is not None:
            for j, c in enumerate(cs):
                c.set_optimizer_view(views(step, j, size))
        order = None if orders is None else (lambda done: orders.permutation(n_workers))
        wires, decoded = push(cs, grads, residuals, size, shape, order)
        history.append({"grads": grads, "wires": wires, "residuals": [r.copy() for r in residuals],
                        "decoded": decoded, "state": cs[0].state_dict()})
        for d in decoded[1:]:
            assert_same(d, decoded[0], "workers decoded differently")
        assert all(same_state(c.state_dict(), cs[0].state_dict()) for c in cs), \
            "shared state differs"
    return history


def check_kernel_equals_reference(name, n_workers, size, steps=3, options=None, seed=0,
                                  num_threads=1, shape=None, views=None):
    """Compiled kernels and NumPy reference: bitwise the same wires, residuals, sums, states."""
    options = options or {}
    got = run_steps(name, n_workers, size, steps, options, seed, num_threads, shape=shape,
                    views=views)
    ref = run_steps(name, n_workers, size, steps, options, seed, reference=True, shape=shape,
                    views=views)
    for step, (a, b) in enumerate(zip(got, ref)):
        for j in range(n_workers):
            assert_same(a["wires"][j], b["wires"][j], "wire of worker %d step %d" % (j, step))
            assert_same(a["residuals"][j], b["residuals"][j], "residual %d step %d" % (j, step))
        assert_same(a["decoded"][0], b["decoded"][0], "decoded sum step %d" % step)
        assert same_state(a["state"], b["state"]), step


def check_threads_bitwise_equal(name, n_workers=2, size=300_001, options=None, shape=None,
                                views=None):
    """1 thread and several give the same wires, residuals and sums, bit for bit."""
    runs = [run_steps(name, n_workers, size, 2, options or {}, seed=3, num_threads=t,
                      shape=shape, views=views)
            for t in (1, 2, 5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            for x, y in zip(a["wires"] + a["residuals"] + a["decoded"],
                            b["wires"] + b["residuals"] + b["decoded"]):
                assert_same(x, y, "threads")


def check_sums_in_any_order_decode_alike(name, n_workers=5, size=4097, options=None):
    """The servers add in arrival order: every order gives the same sum, hence decode."""
    options = options or {}
    rng = np.random.default_rng(9)
    cs = make(name, n_workers, False, options)
    residuals = [np.zeros(cs[0].memory_size(size), np.float32) for _ in range(n_workers)]
    for _ in range(2):  # the second push uses state agreed through the first
        wires = [c.encode(gradient(rng, size), r, n_workers, rank=j)
                 for j, (c, r) in enumerate(zip(cs, residuals))]
        state = cs[0].state_dict()
        outs = []
        for order in (range(n_workers), reversed(range(n_workers)),
                      rng.permutation(n_workers)):
            d = codecs.create(name, **options)
            d.load_state_dict(state)
            outs.append(d.decode(combine(cs[0], wires, list(order), n_workers), size,
                                 n_workers))
        for out in outs[1:]:
            assert_same(out, outs[0], "order")
        total = combine(cs[0], wires, range(n_workers), n_workers)
        for c in cs:
            c.decode(total, size, n_workers)


def check_error_feedback_identity(name, size=4097, steps=4, options=None, shape=None,
                                  views=None):
    """One worker: g + r_before == decoded + r_after, up to the float32 roundings of
    c = g + r and c - x (the seam of codecs/feedback.py); r is the first `size` elements
    of the codec's memory."""
    options = options or {}
    history = run_steps(name, 1, size, steps, options, seed=4, shape=shape,
                        views=views)
    for step, h in enumerate(history):
        before = history[step - 1]["residuals"][0][:size] if step else np.zeros(size, np.float32)
        after = h["residuals"][0][:size]
        c32 = h["grads"][0] + before
        lhs = h["grads"][0].astype(np.float64) + before
        rhs = h["decoded"][0].astype(np.float64) + after
        tol = np.spacing(np.abs(c32)) / 2 + np.spacing(np.abs(after)) / 2
        assert np.all(np.abs(lhs - rhs) <= tol), "step %d" % step


def check_unbiased(name, state, variance, size=2000, draws=400, options=None,
                   tolerance=5.0):
    """Stochastic rounding is unbiased: the mean decode of one gradient over many pushes
    (each its own random draws) is the gradient, within `tolerance` standard errors.

    state: a state_dict that sets the shared scale so that nothing is clipped;
    variance(g): an upper bound of one decode's variance per element (e.g. s * |g| for
    rounding to {-s, 0, s}). Returns the largest |mean - g|.
    """
    options = options or {}
    rng = np.random.default_rng(6)
    g = (0.5 * rng.standard_normal(size)).astype(np.float32)
    total = np.zeros(size, np.float64)
    c = codecs.create(name, **options)
    for push in range(draws):
        c.load_state_dict(dict(state, pushes=push))
        wire = c.encode(g, np.zeros(size, np.float32), 1)
        c.load_state_dict(dict(state, pushes=push))
        total += c.decode(wire, size, 1)
    mean = total / draws
    std_err = np.sqrt(np.maximum(variance(g.astype(np.float64)), 1e-30) / draws)
    assert np.all(np.abs(mean - g) <= tolerance * std_err + 1e-7), np.max(
        np.abs(mean - g) / std_err)
    # no systematic bias: the mean error over elements is within its own standard error
    assert abs(np.mean(mean - g)) <= tolerance * np.sqrt(np.sum(std_err ** 2)) / size
    return float(np.max(np.abs(mean - g)))


def check_workers_agree_in_any_order(name, n_workers=5, size=4097, options=None, shape=None):
    """For a codec whose sums are float adds (the order changes the last bits): in any order
    of every round, all workers decode alike and keep equal state, because decode and
    next_round use only what every worker receives (run_steps asserts both)."""
    for order_seed in (1, 2, 3):
        run_steps(name, n_workers, size, 3, options or {}, seed=9, shape=shape,
                  order_seed=order_seed)


def check_state_round_trip(name, options=None, shape=None):
    """clone() starts fresh; load_state_dict(state_dict()) restores what decode agreed, and
    workers restored from it (with their residuals) continue bit for bit as before."""
    options = options or {}
    size = 1000 if shape is None else int(np.prod(shape))
    h = run_steps(name, 2, size, 2, options, seed=8, shape=shape)
    c = codecs.create(name, **options)
    c.load_state_dict(h[-1]["state"])
    assert same_state(c.state_dict(), h[-1]["state"])
    fresh = c.clone()
    assert fresh.pushes == 0 and fresh.option_values == c.option_values
    cs = make(name, 2, False, options, size=size, shape=shape)
    for c in cs:
        c.load_state_dict(h[0]["state"])
    residuals = [r.copy() for r in h[0]["residuals"]]
    wires, decoded = push(cs, h[1]["grads"], residuals, size, shape)
    for j in range(2):
        assert_same(wires[j], h[1]["wires"][j], "resumed wire %d" % j)
        assert_same(residuals[j], h[1]["residuals"][j], "resumed residual %d" % j)
        assert_same(decoded[j], h[1]["decoded"][j], "resumed decode %d" % j)
    assert same_state(cs[0].state_dict(), h[1]["state"])
