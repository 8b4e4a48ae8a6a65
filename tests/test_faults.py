"""The restart guarantee: kill -9 a worker, a server or the scheduler of a training run at
a random moment; with --max-restarts 2 the job exits 0 with the weights of an
uninterrupted run (python -m slimgc_mx.bench faults, 2 workers + 2 servers, fixed
comm_threshold). The random seed is printed; pass it as --rng-seed to replay a failure.
"""
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_any_killed_node_is_survived_with_the_same_weights(tmp_path):
    pytest.importorskip("mxnet")
    seed = random.SystemRandom().randrange(2**31)
    out = tmp_path / "faults"
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.bench", "faults", "--rng-seed",
                        str(seed), "--epochs", "3", "--checkpoint-every", "8",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    context = "--rng-seed %d\n%s\n%s" % (seed, r.stdout[-4000:], r.stderr[-4000:])
    report = json.loads((out / "faults.json").read_text())
    drills = report["drills"]
    assert [d["victim"].split()[0] for d in drills] == ["worker", "server", "scheduler"], context
    for d in drills:
        assert d["killed"], context
        assert d["exit_code"] == 0, context
        assert d["restarts"] >= 1, context
        assert d["weights_sha256"] == report["reference"]["weights_sha256"], context
        assert d["resumed_from_step"] is not None and d["resumed_from_step"] % 8 == 0, context
    assert r.returncode == 0, context
    print(r.stdout)
