"""PyTorch SGD's rule as a kernel: kernels.TorchSGD is its NumPy reference bitwise (1 and 4
threads, the decoded sum as decode + step), and the adapter's local and global updates agree
with torch's own SGD step within a rounding per operation, reading and keeping the state
where torch keeps it."""
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.codecs.base import kernels  # noqa: E402
from slimgc_mx.engine.sgd_rule import torch_sgd_reference  # noqa: E402
from slimgc_mx.torch.framework import (StepSettings, TorchUpdate, host_buffer,  # noqa: E402
                                       tensor_of)

RULES = [  # weight_decay, momentum, nesterov, dampening
    (0.0, 0.0, False, 0.0), (1e-3, 0.0, False, 0.0), (0.0, 0.9, False, 0.0),
    (1e-3, 0.9, False, 0.1), (1e-3, 0.9, True, 0.0)]
# torch's vector loops fuse multiply and add; the kernel rounds each operation
CLOSE = dict(rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("wd,momentum,nesterov,dampening", RULES)
@pytest.mark.parametrize("threads", [1, 4])
def test_the_kernel_is_its_numpy_reference_bitwise(wd, momentum, nesterov, dampening, threads):
    rng = np.random.default_rng(1)
    n = 200_003  # several chunks and a ragged end
    w, g, mom = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    for div in (1.0, 3.0):
        kernel = kernels().TorchSGD(0.05, wd, momentum, dampening, nesterov, div)
        for first in (True, False):
            ref_w, ref_m = torch_sgd_reference(w, g, None if first else mom, 0.05, wd,
                                               momentum, dampening, nesterov, div)
            out, m = np.empty_like(w), mom.copy()
            kernel.step(w, g, None if first else m, m, out, threads)
            assert np.array_equal(out, ref_w)
            if momentum:
                assert np.array_equal(m, ref_m)
            read_only = mom.copy()  # the local update: the momentum read, not written
            kernel.step(w, g, None if first else read_only, None, out, threads)
            assert np.array_equal(out, ref_w) and np.array_equal(read_only, mom)


@pytest.mark.parametrize("first", [True, False])
def test_the_decoding_step_is_decode_then_step_bitwise(first):
    rng = np.random.default_rng(2)
    n, workers = 50_001, 3
    codec = codecs.create("2bit", threshold=0.5)
    lanes = sum(codec.encode(rng.standard_normal(n, dtype=np.float32),
                             np.zeros(n, np.float32), workers) for _ in range(workers))
    w, mom = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    kernel = kernels().TorchSGD(0.1, 1e-4, 0.9, 0.0, True, float(workers))
    k, m, rows = codec.decode_table(lanes, n, workers)
    summed = codec.decode(lanes, n, workers)
    ref_w, ref_m = w.copy(), mom.copy()
    kernel.step(ref_w, summed, None if first else ref_m, ref_m, ref_w, 1)
    kernel.decode_step(lanes, rows, k, m, w, mom, first, 2)
    assert np.array_equal(w, ref_w) and np.array_equal(mom, ref_m)
    with pytest.raises(ValueError, match="outside"):
        kernel.decode_step(lanes - 1e17, rows, k, m, w, mom, first, 1)


def _setup(shape, wd, momentum, nesterov, dampening, workers=2):
    gen = torch.Generator().manual_seed(0)
    glo = host_buffer(shape)
    tensor_of(glo).copy_(torch.randn(shape, generator=gen))
    param = torch.nn.Parameter(torch.zeros(shape))
    opt = torch.optim.SGD([param], lr=0.1, momentum=momentum, nesterov=nesterov,
                          dampening=dampening, weight_decay=wd)
    return gen, glo, param, opt, TorchUpdate(opt, {0: 0}, workers)


def _global_step(update, opt, glo, agg):
    """TorchUpdate's global update of key 0 with the sum `agg` (a transfer without lanes)."""
    buffers = types.SimpleNamespace(index=0, agg=agg)
    transfer = types.SimpleNamespace(pushes=[types.SimpleNamespace(buffers=buffers)],
                                     settings=StepSettings.of(opt))
    update(transfer, None, [glo])


@pytest.mark.parametrize("wd,momentum,nesterov,dampening", RULES)
def test_the_local_and_global_steps_are_torchs_step(wd, momentum, nesterov, dampening):
    shape = (37, 11)
    gen, glo, param, opt, update = _setup(shape, wd, momentum, nesterov, dampening)
    assert update.decodes_in_update(types.SimpleNamespace(index=0, codec=codecs.create("2bit")))
    ref = torch.nn.Parameter(tensor_of(glo).clone())  # torch's own global SGD
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, nesterov=nesterov,
                              dampening=dampening, weight_decay=wd)
    for _ in range(3):
        grad = torch.randn(shape, generator=gen)
        # the local step: torch's own SGD from glo_buf with a copy of the global state
        local = torch.nn.Parameter(tensor_of(glo).clone())
        local_opt = torch.optim.SGD([local], lr=0.1, momentum=momentum, nesterov=nesterov,
                                    dampening=dampening, weight_decay=wd)
        shadow = update.shadow(0, glo)
        state = shadow.state[shadow.param_groups[0]["params"][0]]
        if "momentum_buffer" in state:
            local_opt.state[local] = {"momentum_buffer": state["momentum_buffer"].clone()}
        before = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
        local.grad = grad
        local_opt.step()
        update.local_step(0, glo, param, grad)
        torch.testing.assert_close(param.detach(), local.detach(), **CLOSE)
        for k, v in before.items():  # the global state is read, not written
            assert torch.equal(state[k], v)
        # the global step with the sum of two workers' gradients: their mean, as DDP's
        summed = host_buffer(shape)
        tensor_of(summed).copy_(torch.randn(shape, generator=gen))
        ref.grad = tensor_of(summed) / 2
        ref_opt.step()
        _global_step(update, opt, glo, summed)
        torch.testing.assert_close(tensor_of(glo), ref.detach(), **CLOSE)
        if momentum:  # kept where torch keeps it (state_dict, checkpoints)
            torch.testing.assert_close(update.state()["states"][0]["state"][0]
                                       ["momentum_buffer"],
                                       ref_opt.state[ref]["momentum_buffer"], **CLOSE)


def test_another_optimizer_runs_its_own_step():
    shape = (5, 3)
    gen = torch.Generator().manual_seed(0)
    glo = host_buffer(shape)
    tensor_of(glo).copy_(torch.randn(shape, generator=gen))
    param = torch.nn.Parameter(torch.zeros(shape))
    opt = torch.optim.Adam([param], lr=0.01)
    update = TorchUpdate(opt, {0: 0}, 1)
    ref = torch.nn.Parameter(tensor_of(glo).clone())
    ref_opt = torch.optim.Adam([ref], lr=0.01)
    key = types.SimpleNamespace(index=0, codec=codecs.create("2bit"))
    assert not update.decodes_in_update(key)  # the sum is decoded, then Adam steps
    for _ in range(2):
        summed = host_buffer(shape)
        tensor_of(summed).copy_(torch.randn(shape, generator=gen))
        ref.grad = tensor_of(summed).clone()
        ref_opt.step()
        _global_step(update, opt, glo, summed)
        assert torch.equal(tensor_of(glo), ref.detach())  # Adam's own step, bitwise


def test_the_local_step_fused_into_the_encoder_is_the_kernels_step_bitwise():
    rng = np.random.default_rng(3)
    n = 70_001
    g, w, mom, residual = (rng.standard_normal(n, dtype=np.float32) for _ in range(4))
    codec = codecs.create("2bit", threshold=0.5)
    kernel = kernels().TorchSGD(0.1, 1e-4, 0.9, 0.0, False)
    for m in (mom, None):  # None: the first step, before any global momentum
        fused_out, r_fused = np.empty_like(w), residual.copy()
        lanes = codec.encode(g, r_fused, 2, local=kernel.local(w, m, fused_out))
        out, r = np.empty_like(w), residual.copy()
        kernel.step(w, g, m, None, out, 1)
        assert np.array_equal(fused_out, out)
        assert np.array_equal(lanes, codec.encode(g, r, 2)) and np.array_equal(r_fused, r)


def test_a_fused_push_encodes_in_the_local_updates_pass():
    """TorchLocalUpdate on a CPU model with SGD hands the encoder the kernel's local step
    and the gradient in place; without an encoder it counts the gradient's NaN/Inf."""
    from slimgc_mx.engine.grad_buf import GradCheck
    from slimgc_mx.torch.framework import TorchLocalUpdate
    shape = (13, 7)
    gen, glo, param, opt, update = _setup(shape, 1e-3, 0.9, False, 0.0)
    local = TorchLocalUpdate(update, host=True)
    assert local.fused and not TorchLocalUpdate(update, host=False).fused
    grad = torch.randn(shape, generator=gen)
    calls = []
    local(0, grad, glo, param, check=GradCheck(),
          encoder=lambda g, step, piece=None: calls.append((g.held(), step)))
    (seen, step), = calls
    assert np.shares_memory(seen, grad.numpy()) and step is not None
    assert torch.equal(param.detach(), torch.zeros(shape))  # the encoder's pass writes it
    check = GradCheck()
    grad[0, 0] = float("nan")
    local(0, grad, glo, param, check=check)
    assert check.nonfinite == 1 and check.ready is glo
