"""A rank whose peers never start: the rendezvous waits `timeout` seconds (the keyword or
SLIMGC_TIMEOUT), not 30 minutes, and says what is missing and how to start it."""
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # every test starts ranks in fresh interpreters

from torch_launch import ROOT, free_port  # noqa: E402

BUILD = """
import torch, slimgc_mx.torch as slimgc
net = torch.nn.Linear(2, 1)
slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net, %s)
"""

USER_GROUP = """
import datetime, sys, torch, torch.distributed as dist, slimgc_mx.torch as slimgc
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mine = dist.group.WORLD
net = torch.nn.Linear(2, 1)
opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net, timeout=5)
assert dist.group.WORLD is mine and opt.num_workers == 1
opt.close()
"""


def run_rank(code, rank, world, *args, **env):
    """(returncode, output, seconds) of `code` as rank `rank` of `world`, alone."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLIMGC_")}
    environ.update(PYTHONPATH=ROOT, RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=45, env=environ, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("rank %d of %d alone still waited after 45 s" % (rank, world))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, port


@pytest.mark.parametrize("keyword,env", [("timeout=2", {}), ("", {"SLIMGC_TIMEOUT": "2"})])
def test_rank_0_alone_fails_after_the_timeout_naming_the_missing_ranks(keyword, env):
    code, text, seconds, port = run_rank(BUILD % keyword, 0, 2, **env)
    assert code != 0 and seconds < 30, (seconds, text[-2000:])
    assert ("rank 0 of 2: the rendezvous at 127.0.0.1:%d got 1 of 2 processes within 2 s; "
            "start every rank (torchrun --nproc-per-node 2), or raise timeout" % port) in text


def test_a_rank_without_rank_0_fails_after_the_timeout_naming_the_host():
    code, text, seconds, port = run_rank(BUILD % "timeout=2", 1, 2)
    assert code != 0 and seconds < 30, (seconds, text[-2000:])
    assert "rank 1 of 2: no rendezvous at 127.0.0.1:%d after " % port in text, text[-2000:]
    assert "(rank 0 hosts it; timeout 2 s): start every rank" in text


def test_the_users_own_group_is_left_alone(tmp_path):
    code, text, _, _ = run_rank(USER_GROUP, 0, 1, str(tmp_path / "store"))
    assert code == 0, text[-2000:]
