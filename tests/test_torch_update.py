"""The PyTorch adapter's updates: the local step of torch.optim.SGD, written in place without
allocations, equals torch's own SGD step bitwise, and reads the global state only."""
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx.torch.framework import TorchUpdate, host_buffer, tensor_of  # noqa: E402


@pytest.mark.parametrize("wd,momentum,nesterov,dampening,steps", [
    (0.0, 0.0, False, 0.0, 2), (1e-3, 0.0, False, 0.0, 2), (0.0, 0.9, False, 0.0, 3),
    (1e-3, 0.9, False, 0.1, 3), (1e-3, 0.9, True, 0.0, 3), (0.0, 0.9, True, 0.0, 1)])
def test_the_local_sgd_step_is_torchs_step_bitwise(wd, momentum, nesterov, dampening, steps):
    gen = torch.Generator().manual_seed(0)
    shape = (37, 11)
    glo = host_buffer(shape)
    tensor_of(glo).copy_(torch.randn(shape, generator=gen))
    param = torch.nn.Parameter(torch.zeros(shape))
    opt = torch.optim.SGD([param], lr=0.1, momentum=momentum, nesterov=nesterov,
                          dampening=dampening, weight_decay=wd)
    update = TorchUpdate(opt, {0: 0}, 2)
    for _ in range(steps):
        grad = torch.randn(shape, generator=gen)
        # the reference: torch's own SGD from glo_buf with a copy of the global state
        shadow = update.shadow(0, glo)
        ref = torch.nn.Parameter(tensor_of(glo).clone())
        ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, nesterov=nesterov,
                                  dampening=dampening, weight_decay=wd)
        state = shadow.state[shadow.param_groups[0]["params"][0]]
        if "momentum_buffer" in state:
            ref_opt.state[ref] = {"momentum_buffer": state["momentum_buffer"].clone()}
        before = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
        ref.grad = grad
        ref_opt.step()
        update.local_step(0, glo, param, grad)
        assert torch.equal(param.detach(), ref.detach())
        for k, v in before.items():  # the global state is read, not written
            assert torch.equal(state[k], v)
        # then a global step, as the aggregation would make it
        shadow.param_groups[0]["params"][0].grad = torch.randn(shape, generator=gen)
        with torch.no_grad():
            shadow.step()
