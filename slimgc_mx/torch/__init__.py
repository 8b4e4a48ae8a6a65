"""SlimGC for PyTorch: the engine's three strategies behind a torch optimizer (docs/pytorch.md).

    import slimgc_mx.torch as slimgc
    optimizer = slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                            model, compression="2bit")

The adapter over the backend protocol (docs/backend.md): collective.py (torch.distributed),
framework.py (host buffers, gradients in, the optimizer's own rule), optimizer.py (the API).
It imports no MXNet.
"""
from .clip import clip_grad_norm_
from .optimizer import DistributedOptimizer, flush, init_process_group

__all__ = ["DistributedOptimizer", "clip_grad_norm_", "flush", "init_process_group"]
