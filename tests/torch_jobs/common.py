"""What the torch job scripts share: a model with tiny and large tensors and BatchNorm,
per-(step, rank) data, and how a rank records its result. A rank that imports it prints
every thread's stack on SIGUSR1, which torch_launch sends a job past its timeout."""
import faulthandler
import hashlib
import json
import os
import signal

import torch

faulthandler.register(signal.SIGUSR1, all_threads=True)


def model(seed=0, hidden=300):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


#: The task: 3 classes, the argmax of a fixed linear teacher of 8 inputs.
TEACHER = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))


def batch(step, rank, size=16):
    """The batch of (step, rank): inputs and the teacher's labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 8, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def weights(net):
    """The parameters, flat (buffers: each rank's own last forward updated them)."""
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def buffers(net):
    return torch.cat([b.detach().reshape(-1).float() for b in net.buffers()])


def digest(tensor):
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def record(out, name, rank, **values):
    with open(os.path.join(out, "%s_%d.json" % (name, rank)), "w") as f:
        json.dump(values, f)
