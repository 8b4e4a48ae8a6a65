"""A rank of a job of many tiny parameters, DDP (`ddp`) or SlimGC (`slimgc` with JSON
options), once per mode of a comma list: records each step's seconds and SlimGC's transfers
after each step. Options `steps`, `params` (tiny ones, 4 elements) and `large` (of 16384
elements) are the script's. The model and its timed steps are `bench small-keys`'."""
import json
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import record
from slimgc_mx.bench.small_keys_rank import run as timed_run

out, modes = sys.argv[1], sys.argv[2].split(",")
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
steps = options.pop("steps", 14)
count = options.pop("params", 500)
large = options.pop("large", 0)
dist.init_process_group("gloo")
rank = dist.get_rank()


def run(mode):
    net, opt, seconds, transfers = timed_run(mode, count, options, steps, rank, large)
    stats = {}
    if mode != "ddp":
        slimgc.flush(opt)
        stats = opt.stats()
        opt.close()
    record(out, mode, rank, seconds=seconds, transfers=transfers,
           fused_keys=stats.get("fused_keys"), fused_buckets=stats.get("fused_buckets"),
           weights=torch.cat([p.detach() for p in net.parameters()]).tolist())


for mode in modes:
    run(mode)
dist.destroy_process_group()
