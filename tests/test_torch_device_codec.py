"""Torch device codec against the Cython codecs: bitwise equal lanes, residuals and decoded
sums over several steps of N simulated workers, on the CPU and (where there is one) a CUDA
device; the key API with the residual kept on the device; NaN policy; input errors."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.codecs import fourbit  # noqa: E402
from slimgc_mx.codecs.layout import CHUNK_LANES  # noqa: E402
from slimgc_mx.codecs.rng import key_seed  # noqa: E402
from slimgc_mx.torch.device import TorchDeviceCodec, benchmark  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANE_CODECS = ["1bit", "2bit", "4bit"]
#: Every codec the torch codec serves: those above and the ones with gathered values.
SERVED = LANE_CODECS + ["qsgd", "terngrad", "thc"]
#: Gradient magnitude per step: 4bit crosses groups 3 -> 1 -> 2 -> 3 (Table 1).
STEP_SCALES = [0.02, 0.3, 2.0, 0.05]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (run on a GPU machine)"))]


def bits(a):
    """Bit pattern: equality that tells -0.0 from 0.0."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def host(x):
    """A tensor's (or array's) values as a flat NumPy array on the host."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).reshape(-1)


def assert_same(a, b, what):
    a, b = host(a), host(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bad = np.flatnonzero(bits(a) != bits(b))
    assert bad.size == 0, "%s differs at %d places, first %d: %r vs %r" % (
        what, bad.size, bad[0], a[bad[0]], b[bad[0]])


def gradient(rng, n, scale, codec):
    """float32 gradient: normal values, zeros, -0.0 and values right at the codec's thresholds."""
    g = (scale * rng.standard_normal(n)).astype(np.float32)
    special = [0.0, -0.0]
    if codec.name == "2bit":
        t = np.float32(codec.threshold)
        special += [t, -t, np.nextafter(t, np.float32(0)), -np.nextafter(t, np.float32(0))]
    elif codec.name == "4bit":
        for x in fourbit.group_thresholds(codec.group):
            special += [x, -x, np.nextafter(x, np.float32(0)), -np.nextafter(x, np.float32(0))]
    pick = rng.random(n) < 0.1
    g[pick] = rng.choice(np.array(special, dtype=np.float32), int(pick.sum()))
    return g


def shapes_for(codec, n_workers, rng):
    """Sizes around the lane packing k, odd sizes, and random shapes of 1 to 3 odd dims."""
    _, k = codec.geometry(n_workers)
    shapes = [(n,) for n in sorted({1, 7, max(1, k - 1), k, k + 1, 3 * k + 2, 4097})]
    shapes += [(37, 41), (100003,)]
    for _ in range(3):
        shapes.append(tuple(int(d) | 1 for d in rng.integers(1, 60, rng.integers(1, 4))))
    return shapes


def run_workers(name, shape, n_workers, steps, rng, device):
    """Encode every worker's gradient with both paths, sum lanes in float64, decode; compare.

    Worker 0's lanes go to a host array (a key's bit_buf), the others' to a tensor on the
    device; decode alternates the same way.
    """
    size = int(np.prod(shape))
    cy = codecs.create(name, num_threads=1)
    dev = TorchDeviceCodec(codecs.create(name))
    res_cy = [np.zeros(size, np.float32) for _ in range(n_workers)]
    res_dev = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(n_workers)]
    for step in range(steps):
        n_lanes = cy.lane_count(size, n_workers)  # 4bit's follows the group agreed so far
        body = n_lanes - cy.trailer_lanes
        scale = STEP_SCALES[step % len(STEP_SCALES)]
        total = np.zeros(n_lanes, np.float64)
        for w in range(n_workers):
            g = gradient(rng, size, scale, cy)
            lanes = cy.encode(g, res_cy[w], n_workers)
            if w == 0:
                out = np.full(n_lanes, np.nan)
            else:
                out = torch.full((n_lanes,), np.nan, dtype=torch.float64, device=device)
            grad = torch.from_numpy(g).to(device).reshape(shape)
            assert dev.encode(grad, res_dev[w], n_workers, out) is out
            what = "%s N=%d shape=%s step=%d worker=%d" % (name, n_workers, shape, step, w)
            got = host(out)
            assert_same(got[:body], lanes[:body], "lanes " + what)
            if cy.trailer_lanes:  # a float64 mean summed in another order
                np.testing.assert_allclose(got[body:], lanes[body:], rtol=1e-12, atol=0)
            assert_same(res_dev[w], res_cy[w], "residual " + what)
            assert res_dev[w].device.type == device and tuple(res_dev[w].shape) == shape
            assert_same(grad, g, "grad unchanged " + what)
            total += lanes
        decoded = cy.decode(total, size, n_workers)
        if step % 2:
            out = torch.full(shape, np.nan, dtype=torch.float32, device=device)
            dev.decode(torch.from_numpy(total).to(device), size, n_workers, out)
        else:
            out = np.full(shape, np.nan, dtype=np.float32)
            dev.decode(total, size, n_workers, out, device=device)
        assert_same(out, decoded, "decoded %s N=%d shape=%s step=%d"
                    % (name, n_workers, shape, step))
        assert dev.codec.state_dict() == cy.state_dict()
    return cy, dev


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_workers", [2, 4])
@pytest.mark.parametrize("name", LANE_CODECS)
def test_bitwise_equal_to_cython(name, n_workers, device):
    rng = np.random.default_rng([LANE_CODECS.index(name), n_workers])
    for shape in shapes_for(codecs.create(name), n_workers, rng):
        run_workers(name, shape, n_workers, 2 if np.prod(shape) > 10000 else 4, rng, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("piece", [1, 37, 4096])
def test_large_tensors_go_piece_by_piece_bit_for_bit(monkeypatch, piece, device):
    """Past PIECE_ELEMENTS a flagged encode of 2bit and the decode of 1bit, 2bit and 4bit
    run piece by piece (one piece's temporaries at a time): the same lanes, residuals and
    decoded sums as the Cython codec, bit for bit; a NaN in the last piece is flagged."""
    from slimgc_mx.torch import device as dmod
    monkeypatch.setattr(dmod, "PIECE_ELEMENTS", piece)
    rng = np.random.default_rng(piece)
    n_workers = 3
    for name in LANE_CODECS:
        for size in (5 * piece + 3, 10007):
            cy = codecs.create(name, num_threads=1)
            dev = TorchDeviceCodec(codecs.create(name))
            _, k = cy.geometry(n_workers)
            body = cy.lane_count(size, n_workers) - cy.trailer_lanes
            pieces = dmod._pieces(dev.codec, size, n_workers, body, k)
            if name == "2bit" and size > k * max(1, piece // k):
                assert pieces is not None and len(pieces) > 1, (size, piece)
            else:
                assert pieces is None or name == "2bit"
            res_cy = [np.zeros(size, np.float32) for _ in range(n_workers)]
            res_dev = [torch.zeros(size, device=device) for _ in range(n_workers)]
            for step in range(3):
                n_lanes = cy.lane_count(size, n_workers)
                total = np.zeros(n_lanes, np.float64)
                for w in range(n_workers):
                    g = gradient(rng, size, STEP_SCALES[step], cy)
                    lanes = cy.encode(g, res_cy[w], n_workers)
                    out = torch.full((n_lanes,), np.nan, dtype=torch.float64, device=device)
                    flag = torch.full((), 7.0, dtype=torch.float64, device=device)
                    dev.encode(torch.from_numpy(g).to(device), res_dev[w], n_workers, out,
                               flag=flag)
                    what = "%s size=%d step=%d worker=%d" % (name, size, step, w)
                    assert float(flag) == 0.0, what
                    assert_same(host(out)[:body], lanes[:body], "lanes " + what)
                    assert_same(res_dev[w], res_cy[w], "residual " + what)
                    total += lanes
                decoded = cy.decode(total, size, n_workers)
                out = torch.full((size,), np.nan, dtype=torch.float32, device=device)
                dev.decode(torch.from_numpy(total).to(device), size, n_workers, out,
                           checked=False)
                assert_same(out, decoded, "decoded %s size=%d step=%d" % (name, size, step))
    dev = TorchDeviceCodec(codecs.create("2bit"))
    g = torch.linspace(-1, 1, 10007, device=device)
    g[-1] = float("nan")
    flag = torch.zeros((), dtype=torch.float64, device=device)
    dev.encode(g, torch.zeros(10007, device=device), 2,
               torch.zeros(dev.codec.lane_count(10007, 2), dtype=torch.float64,
                           device=device), flag=flag)
    assert float(flag) == 1.0


_PEAK = """
import sys, torch
from slimgc_mx import codecs
from slimgc_mx.torch import device as d


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


torch.set_num_threads(1)
n, what, pieces = int(sys.argv[1]), sys.argv[2], [int(a) for a in sys.argv[3:]]
dev, small = (d.TorchDeviceCodec(codecs.create("2bit")) for _ in range(2))
g, r, out = torch.randn(n) * 0.3, torch.zeros(n), torch.zeros(n)
lanes = torch.zeros(dev.codec.lane_count(n, 2), dtype=torch.float64)
flag = torch.zeros((), dtype=torch.float64)
m = small.codec.lane_count(1000, 2)  # torch's code paths loaded before the mark
small.encode(g[:1000], torch.zeros(1000), 2, torch.zeros(m, dtype=torch.float64), flag=flag)
small.decode(torch.zeros(m, dtype=torch.float64), 1000, 2, torch.zeros(1000), checked=False)
for d.PIECE_ELEMENTS in pieces:  # each measured alone: what one freed went back (unmapped)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from what is resident now
    base = kib("VmRSS")
    if what == "encode":
        dev.encode(g, r, 2, lanes, flag=flag)
    else:
        dev.decode(lanes, n, 2, out, checked=False)
    print((kib("VmHWM") - base) * 1024 / n)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="reads the peak resident memory from Linux's /proc")
@pytest.mark.parametrize("what", ["encode", "decode"])
def test_piece_by_piece_bounds_the_temporaries(what):
    """The point of the pieces: a 2bit bucket's encode and decode of 8 Mi elements on the
    CPU raise the process's peak memory by a few bytes per element in pieces of 512 Ki,
    against the 24-28 (the int64 levels and digits of the whole tensor) in one piece.
    Large allocations are mapped and unmapped one by one (MALLOC_MMAP_THRESHOLD_), so the
    peak counts what is live at once, not what the allocator keeps; one process measures
    both piece sizes, the pieces first (as a fresh process would), then the whole tensor
    (which anything kept from the pieces could only make look smaller)."""
    n = 8 * 2 ** 20
    pieces = (2 ** 19, 2 * n)
    r = subprocess.run([sys.executable, "-c", _PEAK, str(n), what] + [str(p) for p in pieces],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_="65536"))
    assert r.returncode == 0, r.stderr[-2000:]
    peak = dict(zip(pieces, map(float, r.stdout.split()[-2:])))
    assert peak[2 * n] > 16, peak  # the measure sees the whole tensor's temporaries
    assert peak[2 ** 19] < 6, peak


#: The codecs with gathered values, each with option sets that reach its other branches:
#: terngrad without clipping and with error feedback; qsgd with buckets below 8 elements and
#: levels not a power of two, and s = 1; thc rotated, and with the most levels.
GATHERED = {
    "terngrad": [{}, {"clip_sigma": 0.0},
                 {"clip_sigma": 1.0, "error_feedback": True, "allow_unbiased_feedback": True}],
    "qsgd": [{}, {"bucket_size": 4, "levels": 3}, {"bucket_size": 8, "levels": 1}],
    "thc": [{}, {"hadamard": True, "granularity": 5}, {"granularity": 65536}],
}


def gathered_sizes(codec, n_workers):
    """0, 1, odd sizes, sizes around the lane packing k and past one kernel chunk (the
    statistics' sums run chunk by chunk), a power of two and one past it (thc's padding)."""
    _, k = codec.geometry(n_workers)
    return sorted({0, 1, 7, max(1, k - 1), k, k + 1, 3 * k + 2, 4096, 4097,
                   CHUNK_LANES * k + 5})


def make_three(name, options, key=3):
    """The Cython codec, its NumPy reference and the torch device codec, keyed alike."""
    with warnings.catch_warnings():  # error_feedback=true with the override: warned once
        warnings.simplefilter("ignore", UserWarning)
        made = [codecs.create(name, num_threads=1, **options),
                codecs.create(name, reference=True, **options), codecs.create(name, **options)]
    for c in made:
        c.seed = key_seed(11, key)
    return made[0], made[1], TorchDeviceCodec(made[2])


def run_gathered(name, options, size, n_workers, steps, rng, device):
    """N workers' pushes through the three implementations: every lane (the gathered slots
    included), residual and decoded sum bitwise the same, the states equal after each step.
    The torch codec's decode alternates between keeping the state on the device
    (checked=False) and reading it to the host (checked=True); its state is compared at
    the end, so that the pushes between use the state the device kept."""
    workers = [make_three(name, options) for _ in range(n_workers)]
    res = [[np.zeros(size, np.float32), np.zeros(size, np.float32),
            torch.zeros(size, dtype=torch.float32, device=device)] for _ in range(n_workers)]
    for step in range(steps):
        scale = STEP_SCALES[step % len(STEP_SCALES)]
        total = None
        for w, (cy, ref, dev) in enumerate(workers):
            g = (scale * rng.standard_normal(size)).astype(np.float32)
            g[rng.random(size) < 0.05] = 0.0
            what = "%s %s N=%d size=%d step=%d worker=%d" % (name, options, n_workers, size,
                                                              step, w)
            lanes = cy.encode(g, res[w][0], n_workers, rank=w)
            assert_same(ref.encode(g, res[w][1], n_workers, rank=w), lanes, "reference " + what)
            out = torch.full(lanes.shape, np.nan, dtype=torch.float64, device=device)
            dev.encode(torch.from_numpy(g).to(device), res[w][2], n_workers, out, rank=w)
            assert_same(out, lanes, "lanes " + what)
            assert_same(res[w][1], res[w][0], "reference residual " + what)
            assert_same(res[w][2], res[w][0], "residual " + what)
            total = lanes.copy() if total is None else total + lanes
        for w, (cy, ref, dev) in enumerate(workers):
            what = "%s %s N=%d size=%d step=%d worker=%d" % (name, options, n_workers, size,
                                                              step, w)
            decoded = cy.decode(total, size, n_workers)
            assert_same(ref.decode(total, size, n_workers), decoded, "reference decoded " + what)
            out = torch.full((size,), np.nan, dtype=torch.float32, device=device)
            dev.decode(torch.from_numpy(total).to(device), size, n_workers, out,
                       checked=bool((step + w) % 2))
            assert_same(out, decoded, "decoded " + what)
            assert ref.state_dict() == cy.state_dict(), what
    for cy, _, dev in workers:  # (read back only now: the pushes used the device's state)
        assert dev.state_dict() == cy.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("name", sorted(GATHERED))
def test_gathered_codecs_bitwise_equal_to_cython_and_reference(name, n_workers, device):
    rng = np.random.default_rng([sorted(GATHERED).index(name), n_workers])
    for options in GATHERED[name]:
        for size in gathered_sizes(make_three(name, options)[0], n_workers):
            run_gathered(name, options, size, n_workers, 4 if size < 10000 else 3, rng, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_randomk_bitwise_equal_to_cython_and_reference(n_workers, device):
    """randomk's values (float32, summed as they are) from the torch codec, the Cython codec
    and the reference: the same indices, values, residuals and scattered sums, bit for bit,
    over steps (the indices move with the push's seed) and ratios, sizes 0 and 1 included."""
    rng = np.random.default_rng(n_workers)
    for ratio in (0.5, 0.01, 1.0, 0.3):
        for size in (0, 1, 2, 7, 100, 4097, 70001):
            made = [make_three("randomk", {"ratio": ratio}) for _ in range(n_workers)]
            res = [[np.zeros(size, np.float32), np.zeros(size, np.float32),
                    torch.zeros(size, device=device)] for _ in range(n_workers)]
            for step in range(3):
                total = None
                for w, (cy, ref, dev) in enumerate(made):
                    what = "ratio %g size %d step %d worker %d" % (ratio, size, step, w)
                    g = rng.standard_normal(size).astype(np.float32)
                    sent = cy.encode(g, res[w][0], n_workers)
                    assert_same(ref.encode(g, res[w][1], n_workers), sent, "reference " + what)
                    out = torch.full(sent.shape, np.nan, dtype=torch.float32, device=device)
                    dev.encode(torch.from_numpy(g).to(device), res[w][2], n_workers, out,
                               rank=w)
                    assert_same(out, sent, "values " + what)
                    assert_same(res[w][1], res[w][0], "reference residual " + what)
                    assert_same(res[w][2], res[w][0], "residual " + what)
                    total = sent.copy() if total is None else total + sent
                for w, (cy, ref, dev) in enumerate(made):
                    decoded = cy.decode(total, size, n_workers)
                    assert_same(ref.decode(total, size, n_workers), decoded, "reference sum")
                    out = torch.full((size,), np.nan, device=device)
                    dev.decode(torch.from_numpy(total).to(device), size, n_workers, out,
                               checked=bool(w % 2))
                    assert_same(out, decoded, "sum ratio %g size %d step %d" % (ratio, size,
                                                                                 step))
                    assert dev.state_dict() == cy.state_dict()


@pytest.mark.parametrize("device", DEVICES)
def test_randomk_nan_policy_and_flag(device):
    g = np.linspace(-1, 1, 1000).astype(np.float32)
    g[17] = np.nan
    dev = TorchDeviceCodec(codecs.create("randomk"))
    residual = torch.full((1000,), 0.25, device=device)
    out = torch.full((dev.codec.lane_count(1000, 2),), 7.0, device=device)
    with pytest.raises(codecs.NonFiniteGradientError, match="grad\\[17\\]"):
        dev.encode(torch.from_numpy(g).to(device), residual, 2, out)
    assert (host(residual) == 0.25).all() and (host(out) == 7.0).all()
    for grad, want in ((g, 1.0), (np.nan_to_num(g), 0.0)):
        flag = torch.full((), 7.0, dtype=torch.float64, device=device)
        dev.encode(torch.from_numpy(grad).to(device), torch.zeros(1000, device=device), 2, out,
                   flag=flag)
        assert float(flag) == want
    with pytest.raises(TypeError, match="float32"):
        dev.encode(torch.zeros(10, device=device), torch.zeros(10, device=device), 2,
                   np.zeros(dev.codec.lane_count(10, 2)))


@pytest.mark.parametrize("device", DEVICES)
def test_gathered_state_stays_on_the_device_until_state_dict(device):
    """decode(checked=False) leaves the codec's host state behind (no host read) and the
    next encode uses the device's; state_dict() reads it back, load_state_dict() replaces
    it: the pushes after a reload are the Cython codec's."""
    rng = np.random.default_rng(8)
    size, n_workers = 3000, 2
    for name in sorted(GATHERED):
        cy, _, dev = make_three(name, {})
        res_cy = np.zeros(size, np.float32)
        res_dev = torch.zeros(size, device=device)
        for step in range(3):
            g = rng.standard_normal(size).astype(np.float32)
            lanes = cy.encode(g, res_cy, n_workers)
            out = torch.zeros(lanes.shape, dtype=torch.float64, device=device)
            dev.encode(torch.from_numpy(g).to(device), res_dev, n_workers, out)
            assert_same(out, lanes, "%s step %d" % (name, step))
            total = lanes * n_workers
            cy.decode(total, size, n_workers)
            dev.decode(torch.from_numpy(total).to(device), size, n_workers,
                       torch.zeros(size, device=device), checked=False)
            assert dev.codec.pushes == cy.pushes
        host = dev.codec.state_dict()
        assert host != cy.state_dict(), name  # the host copy is the first push's
        state = dev.state_dict()
        assert state == cy.state_dict() == dev.codec.state_dict(), name
        fresh = TorchDeviceCodec(codecs.create(name))
        fresh.load_state_dict(state)
        g = rng.standard_normal(size).astype(np.float32)
        lanes = cy.encode(g, res_cy, n_workers)
        out = torch.zeros(lanes.shape, dtype=torch.float64, device=device)
        fresh.encode(torch.from_numpy(g).to(device), res_dev, n_workers, out)
        assert_same(out, lanes, "%s after load_state_dict" % name)


@pytest.mark.parametrize("device", DEVICES)
def test_the_rng_and_the_ordered_sums_are_the_kernels(device):
    """TorchOps.uniform is rng.uniform (and the kernels') bit for bit, seeds beyond 2**63
    included; chunk_sums adds as chunk_sum does, values over many magnitudes (where the
    order of the additions shows), one chunk and several."""
    from slimgc_mx.codecs import rng as codec_rng
    from slimgc_mx.codecs.base import kernels
    from slimgc_mx.codecs.lanes import ConstCache, chunk_sum
    from slimgc_mx.torch.device import TorchOps
    ops = TorchOps(ConstCache(), torch.device(device))
    for seed in (0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 0x9E3779B97F4A7C15):
        for count in (0, 1, 2, 7, 1000):
            got = host(ops.uniform(seed, count))
            assert_same(got, codec_rng.uniform(seed, 0, count), "seed %d count %d" % (seed, count))
            assert_same(got, kernels().uniforms(seed, 0, count), "kernel %d" % seed)
    gen = np.random.default_rng(2)
    for n, k in ((1, 5), (5000, 3), (3 * CHUNK_LANES * 7 + 11, 7)):
        v = gen.standard_normal(n) * np.exp(10 * gen.standard_normal(n))
        t = torch.from_numpy(v).to(device)
        got = host(ops.chunk_sums(torch.stack([t, t * t], 1), k))
        assert_same(got, np.array([chunk_sum(v, k), chunk_sum(v * v, k)]), "n=%d" % n)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_state_follows_decode(device):
    """1bit scale and 4bit group come from the trailer lane, as in Codec.decode()."""
    rng = np.random.default_rng(1)
    cy, dev = run_workers("1bit", (5000,), 3, 2, rng, device)
    assert dev.codec.scale > 0 and dev.codec.scale == cy.scale
    cy, dev = run_workers("4bit", (5000,), 2, 3, rng, device)
    assert dev.codec.group == cy.group == fourbit.group_for_mean(1.6)  # step 2: scale 2.0


class Host:
    """A HostArray over a NumPy array (backend.HostArray: what the engine hands a codec)."""

    def __init__(self, array):
        self.array = array

    def for_read(self):
        return self.array

    def for_write(self):
        return self.array


class Key:
    """The KeyBuffers fields encode_key / decode_key use."""

    def __init__(self, size):
        self.size = size
        self.residual = Host(np.zeros(size, np.float32))
        self.agg = Host(np.full(size, np.nan, np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED)
def test_key_api_keeps_the_residual_on_the_device(name, device):
    """encode_key / decode_key as the aggregator and pipeline call them: lanes to the host
    bit_buf, the decoded sum to agg, the residual on the gradient's device (b.residual
    itself on the CPU) until residual_to_host(), which a host flush then sees."""
    rng = np.random.default_rng(5)
    n_workers, shape = 2, (33, 31)
    size = int(np.prod(shape))
    cy = codecs.create(name, num_threads=1)
    dev = TorchDeviceCodec(codecs.create(name))
    b, res_cy = Key(size), np.zeros(size, np.float32)
    for step in range(3):
        g = gradient(rng, size, STEP_SCALES[step], cy)
        lanes = cy.encode(g, res_cy, n_workers)
        send = Host(np.full(lanes.shape, np.nan))
        dev.encode_key(b, torch.from_numpy(g).to(device).reshape(shape), n_workers, 0, send)
        body = lanes.shape[0] - cy.trailer_lanes
        assert_same(send.array[:body], lanes[:body], "lanes step %d" % step)
        if device == "cpu":
            assert dev.residual is None
            assert_same(b.residual.array, res_cy, "host residual step %d" % step)
        else:
            assert dev.residual.device.type == "cuda"
            assert (b.residual.array == 0).all()  # the host copy waits for residual_to_host
            assert_same(dev.residual, res_cy, "device residual step %d" % step)
        total = lanes * n_workers
        dev.decode_key(b, n_workers, Host(total))
        assert_same(b.agg.array, cy.decode(total, size, n_workers), "agg step %d" % step)
    dev.residual_to_host(b)
    assert dev.residual is None
    assert_same(b.residual.array, res_cy, "residual after residual_to_host")
    b.residual.array[:] = 0  # a full-precision push flushed it
    res_cy[:] = 0
    g = gradient(rng, size, 0.3, cy)
    lanes = cy.encode(g, res_cy, n_workers)
    send = Host(np.full(lanes.shape, np.nan))
    dev.encode_key(b, torch.from_numpy(g).to(device), n_workers, 0, send)
    body = lanes.shape[0] - cy.trailer_lanes
    assert_same(send.array[:body], lanes[:body], "lanes after the flush")
    dev.residual_to_host(b)
    assert_same(b.residual.array, res_cy, "residual after the flush")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("bad", ["nan", "inf", "sum"])
def test_nonfinite_raises_before_touching(name, bad, device):
    dev = TorchDeviceCodec(codecs.create(name))
    g = np.linspace(-1, 1, 1000).astype(np.float32)
    r = np.full(1000, 0.25, np.float32)
    if bad == "nan":
        g[17] = np.nan
    elif bad == "inf":
        g[999] = -np.inf
    else:  # finite alone, but grad + residual overflows float32
        g[3], r[3] = 3e38, 3e38
    residual = torch.from_numpy(r.copy()).to(device)
    n_lanes = dev.codec.lane_count(1000, 2)
    out = np.full(n_lanes, 7.0)
    match = "grad \\+ residual" if bad == "sum" else "grad\\[%d\\]" % (17 if bad == "nan" else 999)
    with pytest.raises(codecs.NonFiniteGradientError, match=match):
        dev.encode(torch.from_numpy(g).to(device), residual, 2, out)
    assert_same(residual, r, "residual")
    assert (out == 7.0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED + ["thc_hadamard"])
def test_the_flag_says_nonfinite_and_encodes_anyway(name, device):
    """encode(flag=...): no error, the flag 1 where grad + residual (or thc's rotation of
    finite values, which overflows) is not finite, else 0; the lanes written either way."""
    options = {"hadamard": True} if name == "thc_hadamard" else {}
    g = np.linspace(-1, 1, 1000).astype(np.float32)
    cases = [("finite", g, 0.0)]
    bad = g.copy()
    bad[17] = np.nan
    cases.append(("nan", bad, 1.0))
    if options:  # finite, but their rotation's sums pass float32's largest value
        big = g.copy()
        big[:8] = 3e38
        cases.append(("rotation", big, 1.0))
        dev = TorchDeviceCodec(codecs.create("thc", **options))
        with pytest.raises(codecs.NonFiniteGradientError, match="rotation"):
            dev.encode(torch.from_numpy(big).to(device), torch.zeros(1000, device=device), 2,
                       np.zeros(dev.codec.lane_count(1000, 2)))
    for what, grad, want in cases:
        dev = TorchDeviceCodec(codecs.create(name.split("_")[0], **options))
        flag = torch.full((), 7.0, dtype=torch.float64, device=device)
        out = torch.full((dev.codec.lane_count(1000, 2),), np.nan, dtype=torch.float64,
                         device=device)
        dev.encode(torch.from_numpy(grad).to(device), torch.zeros(1000, device=device), 2,
                   out, flag=flag, rank=1)
        assert float(flag) == want, (name, what)
        if what == "finite":
            assert not torch.isnan(out).any()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_gradient(device):
    for name in SERVED:
        cy, dev = codecs.create(name), TorchDeviceCodec(codecs.create(name))
        out = np.full(cy.lane_count(0, 2), 7.0)
        empty = torch.zeros(0, device=device)
        dev.encode(empty, empty.clone(), 2, out)
        np.testing.assert_array_equal(out, cy.encode(np.zeros(0, np.float32),
                                                     np.zeros(0, np.float32), 2))
        dev.decode(out, 0, 2, torch.zeros(0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_huge_finite_values_are_not_rejected(device):
    rng = np.random.default_rng(4)
    for name in SERVED:
        cy, dev = codecs.create(name), TorchDeviceCodec(codecs.create(name))
        g = rng.standard_normal(999).astype(np.float32)
        g[::7] = 3e38
        r = np.zeros(999, np.float32)
        lanes = cy.encode(g, r, 2)
        out = np.zeros(lanes.shape[0])
        residual = torch.zeros(999, device=device)
        dev.encode(torch.from_numpy(g).to(device), residual, 2, out)
        body = lanes.shape[0] - cy.trailer_lanes
        assert_same(out[:body], lanes[:body], name)
        assert_same(residual, r, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED)
def test_decode_extreme_lanes(name, device):
    """Digit sums at 0 and R-1 everywhere (lanes up to R**k - 1 <= 2**53) decode exactly."""
    rng = np.random.default_rng(3)
    for n_workers in (1, 2, 5, 64):
        cy, dev = codecs.create(name), TorchDeviceCodec(codecs.create(name))
        radix, k = cy.geometry(n_workers)
        size = 50 * k - 3
        state = cy.state_dict()  # a scale 0 would decode everything to 0
        if name == "qsgd":
            state["norms"] = [0.37 + j for j in range(cy.gathered_count(size))]
        elif "scale" in state:  # (thc's must be a float32 value; terngrad's need not)
            state["scale"] = float(np.float32(0.37)) if name == "thc" else 0.37
        cy.load_state_dict(state)
        dev.codec.load_state_dict(state)
        body = -(-size // k)
        digits = rng.integers(0, radix, (body, k))
        digits[0], digits[1] = radix - 1, 0
        digits[2, :] = 0
        digits[2, -1] = radix - 1
        digits[3, :-1] = radix - 1
        digits[-1, k - 3:] = 0  # the partial last lane packs no digits past the end
        powers = [radix ** j for j in range(k)]
        lanes = [float(sum(int(d) * p for d, p in zip(row, powers))) for row in digits]
        lanes += [0.7 * n_workers] * cy.trailer_lanes
        lanes += [0.5 + j for j in range(n_workers * cy.gathered_count(size))]
        lanes = np.array(lanes, dtype=np.float64)
        out = torch.zeros(size, device=device)
        dev.decode(torch.from_numpy(lanes).to(device), size, n_workers, out)
        assert_same(out, cy.decode(lanes, size, n_workers), "%s N=%d" % (name, n_workers))


@pytest.mark.parametrize("device", DEVICES)
def test_input_errors(device):
    for name in ("none", "topk", "powersgd", "dgc", "gcomp"):
        with pytest.raises(ValueError, match="lane codecs with torch levels"):
            TorchDeviceCodec(codecs.create(name))
        assert not TorchDeviceCodec.supports(codecs.create(name))
    for name in SERVED + ["randomk"]:
        assert TorchDeviceCodec.supports(codecs.create(name)), name
    assert TorchDeviceCodec.supports(codecs.create("thc", hadamard=True))
    dev = TorchDeviceCodec(codecs.create("2bit"))
    g, r = torch.zeros(10, device=device), torch.zeros(10, device=device)
    n_lanes = dev.codec.lane_count(10, 2)
    lanes = np.zeros(n_lanes)
    with pytest.raises(TypeError, match="float64"):
        dev.encode(g, r, 2, np.zeros(n_lanes, np.float32))
    with pytest.raises(TypeError, match="float32"):
        dev.encode(g.double(), r, 2, lanes)
    with pytest.raises(ValueError, match="elements"):
        dev.encode(g, torch.zeros(9, device=device), 2, lanes)
    with pytest.raises(ValueError, match="elements"):
        dev.encode(g, r, 2, np.zeros(n_lanes + 1))
    with pytest.raises(TypeError, match="torch tensor"):
        dev.encode(g.cpu().numpy(), r, 2, lanes)
    with pytest.raises(TypeError, match="torch tensor"):
        dev.encode(g, r.cpu().numpy(), 2, lanes)
    with pytest.raises(TypeError, match="contiguous"):
        dev.encode(g, torch.zeros(20, device=device)[::2], 2, lanes)
    with pytest.raises(TypeError, match="read-only"):
        frozen = np.zeros(n_lanes)
        frozen.setflags(write=False)
        dev.encode(g, r, 2, frozen)
    with pytest.raises(ValueError, match="num_workers"):
        dev.encode(g, r, 0, lanes)
    if device == "cuda":
        with pytest.raises(ValueError, match="grad's device"):
            dev.encode(g, r.cpu(), 2, lanes)
    bad = np.zeros(n_lanes)
    bad[0] = -1.0
    out = np.full(10, 7.0, np.float32)
    with pytest.raises(ValueError, match="outside \\[0, 2\\*\\*53\\)"):
        dev.decode(bad, 10, 2, out, device=device)
    assert (out == 7.0).all() and dev.codec.pushes == 0
    one = TorchDeviceCodec(codecs.create("1bit"))
    n_lanes = one.codec.lane_count(10, 2)
    lanes = torch.zeros(n_lanes, dtype=torch.float64, device=device)
    lanes[n_lanes - 1] = -1.0
    with pytest.raises(ValueError, match="trailer"):
        one.decode(lanes, 10, 2, torch.zeros(10, device=device))
    assert one.codec.scale == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED)
def test_benchmark_gives_seconds_per_encode_and_decode(name, device):
    result = benchmark(name, 5003, device, repeats=2, warmup=1)
    assert sorted(result) == ["decode", "encode"]
    assert all(isinstance(v, float) and v > 0 for v in result.values())


def _python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.slow
def test_codecs_import_no_torch_and_the_torch_codec_no_mxnet():
    r = _python("import sys, slimgc_mx.codecs; print('torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    r = _python("import sys, slimgc_mx.torch.device; print('mxnet' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
