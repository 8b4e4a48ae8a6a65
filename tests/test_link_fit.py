"""The CTTab's fitted link on the launcher's emulated cluster reads the link's rate, on both
adapters (tests/link_job.py). Needs root, iproute2 and network namespaces; skipped with the
reason otherwise."""
import json
import os
import subprocess
import sys

import pytest

from slimgc_mx.launch import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE = "100mbit"  # slow enough that a transfer's bytes outweigh a busy host's delays


def test_a_full_bucket_lets_no_tensor_skip_the_rate():
    """At 1 Gbit/s the main job's 320 KiB tensor pays 90 % of its bytes at the rate, and a
    packet fits the bucket twice (tbf would split it)."""
    assert netns.tbf_burst(1e9) <= 32 * 1024 and 2 * netns.gso_bytes(1e9) <= netns.tbf_burst(1e9)
    for rate in (1e8, 1e10):
        assert 2 * netns.gso_bytes(rate) <= netns.tbf_burst(rate) <= max(8192, rate / 8 / 4000)
    args = netns.tbf_args(1e9)
    assert args[args.index("burst") + 1] == str(netns.tbf_burst(1e9))


@pytest.mark.multiprocess
@pytest.mark.parametrize("framework, job, crossings", [
    ("torch", ["-n", "2", "--framework", "torch"], 1),  # an allreduce of 2: each byte once
    ("mxnet", ["-n", "1", "-s", "1"], 2),  # a push, then its pull: each byte up, then down
])
def test_the_fitted_bandwidth_reads_the_emulated_links_rate(framework, job, crossings, tmp_path):
    pytest.importorskip(framework)
    ok, why = netns.netns_available()
    if not ok:
        pytest.skip("network namespaces unavailable here: " + why)
    out = tmp_path / "link.json"
    argv = [sys.executable, "-m", "slimgc_mx.launch"] + job + [
        "--launcher", "netns", "--bandwidth", RATE, sys.executable, "tests/link_job.py",
        framework, str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bandwidth = json.loads(out.read_text())["bandwidth_Bps"]  # None: bytes cost no time
    fitted = (bandwidth or float("inf")) * crossings
    rate = netns.rate_bits(RATE) / 8
    assert abs(fitted / rate - 1) <= 0.2, (fitted / rate, proc.stdout[-2000:])
