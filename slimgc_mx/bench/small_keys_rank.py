"""One rank of `bench small-keys`: a model of many tiny parameters, trained by DDP and then
by SlimGC in the same ranks, each step timed. Run by path, so that `slimgc_mx` comes from
PYTHONPATH (the checkout under test): `python small_keys_rank.py SPEC OUT`."""
import json
import sys
import time

import torch
import torch.distributed as dist


class Tiny(torch.nn.Module):
    """`count` parameters of 4 elements and `large` of 16384 (64 KiB: enough for the
    CTTab's fit to read a link from, so that a warm-up runs), weighed by the input."""

    def __init__(self, count, large=0):
        super().__init__()
        torch.manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n))
                                          for n in [4] * count + [1 << 14] * large])

    def forward(self, x):
        return sum((x * p).sum() for p in self.ps)


def run(mode, count, options, steps, rank, large=0):
    """(net, opt, seconds, transfers): a Tiny trained `steps` steps by DDP (`mode` 'ddp') or
    SlimGC with `options`, each step's seconds (zero_grad, forward, backward, step) and,
    with SlimGC, its transfers after each step; SlimGC's optimizer is left open for the
    caller to read and close."""
    import slimgc_mx.torch as slimgc
    net = Tiny(count, large)
    base = torch.optim.SGD(net.parameters(), lr=0.01)
    if mode == "ddp":
        wrapped, opt = torch.nn.parallel.DistributedDataParallel(net), base
    else:
        wrapped, opt = net, slimgc.DistributedOptimizer(base, net, **options)
    seconds, transfers = [], []
    for step in range(steps):
        x = torch.tensor(float(step + rank))
        start = time.perf_counter()
        opt.zero_grad()
        wrapped(x).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        if mode != "ddp":
            transfers.append(opt.stats()["transfers"])
    return net, opt, seconds, transfers


def _measured(mode, spec, rank):
    """run()'s seconds, and with SlimGC its transfers and its CTTab's decision."""
    import slimgc_mx.torch as slimgc
    _, opt, seconds, transfers = run(mode, spec["params"], spec["options"], spec["steps"], rank)
    out = {"seconds": seconds}
    if mode != "ddp":
        slimgc.flush(opt)
        table = opt.cttab
        out.update(transfers=transfers, best_ct=None if table is None else table.best_ct,
                   phase=None if table is None else table.phase)
        opt.close()
    return out


def main():
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {mode: _measured(mode, spec, rank) for mode in ("ddp", "slimgc")}
    dist.barrier()
    dist.destroy_process_group()
    best = result["slimgc"].get("best_ct")
    if best is not None and best == float("inf"):
        result["slimgc"]["best_ct"] = "never"
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
