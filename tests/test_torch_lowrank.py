"""powersgd's torch-ops version (slimgc_mx/torch/lowrank.py) against the Cython codec and
its NumPy reference: given the same matrix products, every round, residual, decode and Q
bit for bit, step after step; the flags; its state through a checkpoint."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.torch import lowrank  # noqa: E402
from slimgc_mx.torch.lowrank import TorchPowerSGD  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]
N, SEED = 3, 12345


def numpy_products(a, b, out):
    """The host codec's np.matmul of the same operands (a CUDA one's brought to the host)."""
    made = np.matmul(a.detach().cpu().numpy(), b.detach().cpu().numpy())
    out.copy_(torch.from_numpy(made).to(out.device))


def pair(shape, reference, device, rank=4, products=numpy_products):
    host = codecs.create("powersgd", rank=rank, reference=reference)
    host.seed = SEED
    size = int(np.prod(shape))
    host.wire_rounds(size, shape, N)
    dev = TorchPowerSGD(codecs.create("powersgd", rank=rank), shape, N, matmul=products)
    dev.codec.seed = SEED
    return host, dev, size


def step(host, dev, size, rh, rd, g, others_p, others_q, device, zero_column=None):
    """One push on both; the sums are this worker's plus the others' values."""
    n, m = host.matrix
    r = min(host.rank, n, m)
    flag = torch.zeros((), dtype=torch.float64, device=device)
    ph = host.encode(g, rh, N)
    pd = torch.zeros(n * r, device=device)
    dev.encode(torch.from_numpy(g).to(device), rd, pd, flag)
    assert np.array_equal(ph, pd.cpu().numpy()), "P"
    psum = ph + sum(others_p)
    qh = np.zeros(m * r, np.float32)
    host.next_round(0, psum, qh, N)
    qd = torch.zeros(m * r, device=device)
    dev.next_round(torch.from_numpy(psum).to(device), qd, flag)
    assert np.array_equal(qh, qd.cpu().numpy()), "Q"
    assert np.array_equal(rh, rd.cpu().numpy()), "residual"
    qsum = qh + sum(others_q)
    if zero_column is not None:
        qsum.reshape(m, r)[:, zero_column] = 0.0
    oh = host.decode(qsum, size, N)
    od = torch.zeros(size, device=device)
    dev.decode(torch.from_numpy(qsum).to(device), od)
    assert np.array_equal(oh, od.cpu().numpy()), "decode"
    assert np.array_equal(host.q, dev.q.cpu().numpy()), "the next Q"
    assert float(flag) == 0.0
    return psum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("shape", [(16, 3, 3), (5, 100), (64, 64), (12, 20)])
def test_every_round_is_bitwise_the_host_codecs_given_its_products(shape, reference, device):
    """Five pushes with other workers' P and Q added to the sums; at push 2 a column of the
    summed Q is zeros, so the next Q draws it again from the push's seed."""
    rng = np.random.default_rng(1)
    host, dev, size = pair(shape, reference, device)
    n, m = host.matrix
    r = min(4, n, m)
    rh = np.zeros(size, np.float32)
    rd = torch.zeros(size, device=device)
    for k in range(5):
        g = rng.standard_normal(size).astype(np.float32)
        others_p = [rng.standard_normal(n * r).astype(np.float32) for _ in range(N - 1)]
        others_q = [rng.standard_normal(m * r).astype(np.float32) for _ in range(N - 1)]
        step(host, dev, size, rh, rd, g, others_p, others_q, device,
             zero_column=1 if k == 2 else None)
    assert dev.codec.pushes == host.pushes == 5


@pytest.mark.parametrize("device", DEVICES)
def test_orthonormalize_adds_in_element_order_as_the_host_codec(device):
    """Gram-Schmidt's float64 sums in element order (a plain sum adds in another order and
    differs in the last bits on vectors this long, which the float32 result mostly hides);
    a column with nothing left becomes zeros."""
    from slimgc_mx.codecs.powersgd import _ordered_dot, orthonormalize
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal(5000), rng.standard_normal(5000)  # float64: sums that round
    got = lowrank._ordered_dot(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
    assert float(got) == _ordered_dot(x, y)
    p = rng.standard_normal((5000, 4)).astype(np.float32) * 1e3
    p[:, 2] = 0.0  # nothing to normalize
    got = lowrank.orthonormalize(torch.from_numpy(p).to(device)).cpu().numpy()
    assert np.array_equal(got, orthonormalize(p))
    assert not got[:, 2].any() and np.allclose(got.T @ got, np.diag([1.0, 1, 0, 1]),
                                                atol=1e-5)


def test_row_pieces_change_no_bit(monkeypatch):
    """outer() runs a large matrix in row pieces (their float64 temporaries bounded): pieces
    of one and of three rows give the whole pass's bits."""
    rng = np.random.default_rng(2)
    p = torch.from_numpy(rng.standard_normal((12, 3)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((20, 3)).astype(np.float32))
    x0 = torch.from_numpy(rng.standard_normal(240).astype(np.float32))
    whole = [x0.clone(), x0.clone()]
    lowrank.outer(whole[0], p, q, subtract=True)
    lowrank.outer(whole[1], p, q, subtract=False)
    for rows in (1, 3):
        monkeypatch.setattr(lowrank.device, "PIECE_ELEMENTS", rows * 20)
        pieces = [x0.clone(), x0.clone()]
        lowrank.outer(pieces[0], p, q, subtract=True)
        lowrank.outer(pieces[1], p, q, subtract=False)
        assert all(torch.equal(a, b) for a, b in zip(whole, pieces)), rows


def test_torch_products_stay_within_float32_rounding_of_the_host_codec():
    """torch.matmul (another BLAS than NumPy's): the same rule, its products a rounding apart."""
    rng = np.random.default_rng(3)
    shape = (64, 64)
    host, dev, size = pair(shape, False, "cpu", products=None)
    rh, rd = np.zeros(size, np.float32), torch.zeros(size)
    for _ in range(3):
        g = rng.standard_normal(size).astype(np.float32)
        flag = torch.zeros((), dtype=torch.float64)
        ph, pd = host.encode(g, rh, N), torch.zeros(256)
        dev.encode(torch.from_numpy(g), rd, pd, flag)
        np.testing.assert_allclose(pd.numpy(), ph, rtol=1e-5, atol=1e-5)
        qh, qd = np.zeros(256, np.float32), torch.zeros(256)
        host.next_round(0, ph, qh, N)
        dev.next_round(pd, qd, flag)
        np.testing.assert_allclose(qd.numpy(), qh, rtol=1e-4, atol=1e-4)
        oh, od = host.decode(qh, size, N), torch.zeros(size)
        dev.decode(qd, od)
        np.testing.assert_allclose(od.numpy(), oh, rtol=1e-4, atol=1e-4)
        rd.copy_(torch.from_numpy(rh))  # each push from the host's residual: no drift
        dev.q.copy_(torch.from_numpy(host.q))


def test_a_non_finite_matrix_or_sum_raises_the_flag_without_a_host_read():
    shape, size = (16, 16), 256
    dev = TorchPowerSGD(codecs.create("powersgd", rank=2), shape, N)
    g = torch.ones(size)
    g[7] = float("nan")
    flag = torch.zeros((), dtype=torch.float64)
    p = torch.zeros(32)
    dev.encode(g, torch.zeros(size), p, flag)
    assert float(flag) == 1.0  # encoded anyway: every rank drops the step when it reads it
    dev = TorchPowerSGD(codecs.create("powersgd", rank=2), shape, N)
    flag.zero_()
    dev.encode(torch.ones(size), torch.zeros(size), p, flag)
    assert float(flag) == 0.0
    p_sum = p.clone()
    p_sum[3] = float("inf")  # another rank's P overflowed
    dev.next_round(p_sum, torch.zeros(32), flag)
    assert float(flag) == 1.0
    with pytest.raises(ValueError, match="next_round follows encode"):
        dev.next_round(p_sum, torch.zeros(32), flag)


def test_its_state_resumes_bit_for_bit():
    """Q (drawn, then summed) read back into the codec's state_dict and loaded into a new
    instance: the next pushes are those of the instance that went on."""
    rng = np.random.default_rng(4)
    shape, size = (12, 20), 240
    a = TorchPowerSGD(codecs.create("powersgd", rank=3), shape, N)
    a.codec.seed = SEED
    ra = torch.zeros(size)

    def push(dev, residual, g):
        flag = torch.zeros((), dtype=torch.float64)
        p, q, out = torch.zeros(36), torch.zeros(60), torch.zeros(size)
        dev.encode(g, residual, p, flag)
        dev.next_round(p * N, q, flag)
        dev.decode(q * N, out)
        return out
    grads = [torch.from_numpy(rng.standard_normal(size).astype(np.float32)) for _ in range(5)]
    for g in grads[:2]:
        push(a, ra, g)
    state = a.state_dict()
    assert state["pushes"] == 2 and np.array_equal(state["q"], a.q.numpy())
    b = TorchPowerSGD(codecs.create("powersgd", rank=3), shape, N)
    b.load_state_dict(state)
    rb = ra.clone()
    for g in grads[2:]:
        assert torch.equal(push(a, ra, g), push(b, rb, g))
    assert torch.equal(a.q, b.q) and torch.equal(ra, rb)
