"""A PyTorch user's first job: an MLP 64-1024-3 with BatchNorm learns a fixed linear teacher,
every tensor compressed (comm_threshold=0), SGD lr 0.05; prints each rank's loss on a held-out
batch before and after, and whether the residual watch warned (docs/codecs.md, "Compression
that wrecks training"). One process (no torchrun: LocalTransport) or under torchrun:

    python tests/torch_jobs/first_hour.py --codec 2bit --momentum 0.9 [--option threshold=0.05]
"""
import argparse
import json
import sys

import torch

INPUTS, HIDDEN, CLASSES = 64, 1024, 3


def batch(seed, size):
    """`size` inputs of the seed and the teacher's labels."""
    x = torch.randn(size, INPUTS, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(INPUTS, CLASSES, generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(dim=1)


def job(codec="2bit", momentum=0.9, steps=80, lr=0.05, size=64, **options):
    """(loss before, loss after, the optimizer's stats()["residual_growth"])."""
    import slimgc_mx.torch as slimgc
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.BatchNorm1d(HIDDEN),
                              torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr,
                                                      momentum=momentum),
                                      net, compression=codec, comm_threshold=0, **options)
    rank = opt.rank
    x, y = batch(10 ** 6, 512)
    before = torch.nn.functional.cross_entropy(net(x), y).item()
    for step in range(steps):
        opt.zero_grad()
        xb, yb = batch(1000 * step + rank, size)
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
    slimgc.flush(opt)
    net.eval()
    with torch.no_grad():
        after = torch.nn.functional.cross_entropy(net(x), y).item()
    growth = opt.stats()["residual_growth"]
    opt.close()
    return before, after, growth


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", default="2bit")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a codec option, its value as JSON (repeatable)")
    args = p.parse_args(argv)
    options = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.option)}
    before, after, growth = job(args.codec, args.momentum, args.steps, args.lr, **options)
    print("%s %s momentum %g: loss %.3f -> %.3f; residual watch: %s"
          % (args.codec, options or "defaults", args.momentum, before, after,
             "WARNED" if growth else "silent"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
