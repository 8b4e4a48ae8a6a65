"""slimgc.clip_grad_norm_: DDP's gradient clipping under SlimGC (docs/pytorch.md).

torch's clip_grad_norm_ on the parameters would clip each rank's own gradient before it is
sent; DDP clips the mean. This one asks the engine to clip the step's mean gradient by its
norm over all parameters (step_clip.py), where the aggregation computes it.
"""
import torch

from ..engine.step_clip import EPS, check_max_norm, check_norm_type


def clip_grad_norm_(optimizer, max_norm, norm_type=2.0):
    """Clip the coming step()'s mean gradient over ranks by its norm over all parameters, as
    DDP with torch.nn.utils.clip_grad_norm_; call it where DDP's users call torch's.

    Returns this rank's own gradient's total norm (the mean's is known only once the step
    is aggregated: optimizer.global_grad_norm). The .grad tensors are left as they are.
    With backup the local update reads this rank's gradient clipped by its own norm.
    """
    from .optimizer import DistributedOptimizer
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError("slimgc.clip_grad_norm_ takes a slimgc DistributedOptimizer, got %s "
                        "(for a plain model use torch.nn.utils.clip_grad_norm_)"
                        % type(optimizer).__name__)
    norm_type = check_norm_type(norm_type)
    max_norm = check_max_norm(max_norm)
    grads = [p.grad.detach() for _, p in optimizer._named if p.grad is not None]
    if not grads:
        total = torch.tensor(0.0)
    else:
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    scale = None
    if optimizer._config.backup:
        coef = max_norm / (float(total) + EPS)
        scale = coef if coef < 1.0 else None  # (NaN: unclipped, the step fails on it anyway)
    optimizer._request_clip(max_norm, norm_type, scale)
    return total
