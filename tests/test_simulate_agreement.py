"""scripts/simulate_agreement.py: runs with tiny settings and reports both agreements."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "simulate_agreement.py")
pytestmark = pytest.mark.slow  # runs the script


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_tiny_run_reports_fp32_and_both_agreements_per_codec():
    r = _run("--dataset", "digits", "--epochs", "1", "--seeds", "1", "--workers", "2",
             "--hidden", "16", "--layers", "1", "--codecs", "terngrad,qsgd:levels=8,thc")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| codec | scale agreed |")
    assert any(row.startswith("| fp32 | - |") for row in rows)
    for label in ("terngrad", "qsgd:levels=8", "thc"):
        for variant in ("last push", "same step"):
            assert any(row.startswith("| %s | %s | 0." % (label, variant)) for row in rows), \
                (label, variant, r.stdout)


def test_bad_codec_options_are_refused_before_training():
    r = _run("--codecs", "qsgd:bucket_size=3")
    assert r.returncode != 0 and "bucket_size" in r.stderr
