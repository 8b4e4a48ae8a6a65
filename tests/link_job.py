"""The CTTab's warm-up on a model of 512 KiB .. 1 KiB weights: rank 0 writes the fitted link.

Run under the launcher (every role runs it; MXNet's servers stop at `import mxnet`):
    python -m slimgc_mx.launch -n 2 --framework torch --launcher netns \
        python tests/link_job.py torch OUT
    python -m slimgc_mx.launch -n 1 -s 1 --launcher netns python tests/link_job.py mxnet OUT
"""
import json
import sys

import numpy as np

WIDTHS = [512, 256, 256, 128, 64, 4]  # float32 weights of 512, 256, 128, 32 and 1 KiB
WARMUP = 16  # steps; each key is timed 8 times on each route


def torch_link():
    import torch
    import slimgc_mx.torch as slimgc
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), net,
                                      compression="2bit", warmup_steps=WARMUP)
    rank = torch.distributed.get_rank()
    for step in range(WARMUP + 1):
        x = torch.randn(32, WIDTHS[0], generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        net(x).square().sum().backward()
        opt.step()
    slimgc.flush(opt)
    link = opt.cttab.link_report(), opt.cttab.format_table()
    opt.close()
    torch.distributed.destroy_process_group()
    return rank, link


def mxnet_link():
    import mxnet as mx
    from mxnet import autograd, gluon
    import slimgc_mx
    kv = mx.kv.create("slimgc")
    net = gluon.nn.HybridSequential()
    for width in WIDTHS[1:-1]:
        net.add(gluon.nn.Dense(width, activation="relu"))
    net.add(gluon.nn.Dense(WIDTHS[-1]))
    net.initialize(mx.init.Xavier())
    rng = np.random.RandomState(0)
    net(mx.nd.array(rng.randn(32, WIDTHS[0])))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv,
                            compression_params={"type": "2bit", "warmup_steps": WARMUP})
    for step in range(WARMUP + 1):
        with autograd.record():
            loss = (net(mx.nd.array(rng.randn(32, WIDTHS[0]))) ** 2).sum()
        loss.backward()
        trainer.step(32)
    slimgc_mx.flush(trainer)
    return kv.rank, (kv.cttab.link_report(), kv.cttab.format_table())


if __name__ == "__main__":
    framework, out = sys.argv[1], sys.argv[2]
    rank, (link, table) = torch_link() if framework == "torch" else mxnet_link()
    if rank == 0:
        print(table, flush=True)
        with open(out, "w") as f:
            json.dump(link, f)
