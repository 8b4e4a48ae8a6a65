"""Every codec trains at its defaults with every tensor compressed (scripts/defaults_check.py,
workers as threads), and option combinations known to diverge are refused, or run with a
warning only when overridden."""
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest

from slimgc_mx import codecs
from slimgc_mx.engine import residual_watch
from slimgc_mx.codecs import lanes
from slimgc_mx.mxnet.kvstore import SlimGC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "defaults_check.py")
_spec = importlib.util.spec_from_file_location("defaults_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

#: qsgd against full precision where gradient noise costs most (large batches, high rate).
NOISY_JOB = dict(dataset="mnist1d", hidden=(256, 256), batch=128, lr=0.1, steps=150)
#: The same MLP at batch 32, where randomk at its former ratio 0.01 diverged.
M1D_JOB = dict(dataset="mnist1d", hidden=(256, 256), batch=32, lr=0.05, steps=200)
#: The paper's communication threshold (15 KB) under which 2bit reached full precision's
#: accuracy: smaller tensors go in float32.
PAPER_THRESHOLD = 15360

DIVERGENT = [("qsgd", {"error_feedback": True}, "error_feedback=true"),
             ("terngrad", {"error_feedback": "true"}, "error_feedback=true"),
             ("thc", {"granularity": 2}, "granularity=2"),
             ("thc", {"granularity": 3}, "granularity=3")]


@pytest.mark.slow
@pytest.mark.parametrize("codec", [c for c in codecs.available() if c != "none"])
def test_every_codec_trains_at_its_defaults_on_every_rank(codec):
    """2 workers, every tensor compressed, the job's fixed settings: loss at least halved, and
    the residual watch silent."""
    for rank, (before, after, growth) in enumerate(check.in_threads(2, codec)):
        assert after < check.FRACTION * before, (codec, rank, before, after)
        assert growth is None, (codec, rank, growth)


@pytest.mark.slow
def test_qsgd_at_its_defaults_trains_about_as_well_as_full_precision():
    """Its rounding noise must not dominate: at 4 levels per bucket of 512 (variance bound
    sqrt(512) / 4 = 5.7 times the signal) the final loss was 1.5x full precision's."""
    full = check.in_threads(2, "none", **NOISY_JOB)
    qsgd = check.in_threads(2, "qsgd", **NOISY_JOB)
    for (before, exact, _), (_, after, _) in zip(full, qsgd):
        assert exact < 0.2 * before
        assert after < 1.25 * exact, (after, exact)


@pytest.mark.slow
def test_randomk_at_its_default_trains_where_one_percent_diverged():
    """At ratio 0.01 an element went out once per 100 pushes with all it had accumulated,
    and with momentum the loss rose (2.41 -> 4.93); at the default it falls on every rank."""
    for before, after, growth in check.in_threads(2, "randomk", **M1D_JOB):
        assert after < 0.75 * before, (before, after)
        assert growth is None, growth


@pytest.mark.slow
def test_2bit_at_its_default_trains_the_noisy_job_with_small_tensors_in_full_precision():
    """Every tensor compressed at threshold 0.5 diverged there (2.41 -> 2.72); with the
    tensors below the paper's 15 KB communication threshold in float32 it trains, and the
    residual watch is silent although the first layer's residual grows (saturated)."""
    for before, after, growth in check.in_threads(2, "2bit", comm_threshold=PAPER_THRESHOLD,
                                                  **NOISY_JOB):
        assert after < 0.4 * before, (before, after)
        assert growth is None, growth


@pytest.mark.slow
def test_2bit_with_every_tensor_compressed_diverges_on_the_noisy_job_and_is_told(monkeypatch):
    """The residual watch finds the diverging run (docs/codecs.md, "Compression that wrecks
    training") on every rank, naming a parameter and the fixes."""
    monkeypatch.setattr(residual_watch, "_told", True)  # the stats, not the warning
    for before, after, growth in check.in_threads(2, "2bit", **NOISY_JOB):
        assert after > before, (before, after)
        assert growth is not None and "codec '2bit' is likely wrecking training: the " \
            "error-feedback residual of check_batchnorm" in growth, growth
        assert "comm_threshold='auto', or a size such as 15360 bytes" in growth


@pytest.mark.parametrize("name, options, setting", DIVERGENT)
def test_a_combination_known_to_diverge_is_refused_naming_why_and_the_fix(name, options,
                                                                          setting):
    for reference in (False, True):
        with pytest.raises(ValueError) as err:
            codecs.create(name, reference=reference, **options)
        text = str(err.value)
        assert "codec %r: %s" % (name, setting) in text
        assert "until training diverges" in text
        assert "allow_unbiased_feedback=true" in text
    fix = "granularity >= 4" if name == "thc" else "leave error_feedback false"
    assert fix in text


def test_the_store_refuses_it_before_any_training():
    with pytest.raises(ValueError, match="codec 'qsgd': error_feedback=true .*diverges"):
        SlimGC(compressor="qsgd", error_feedback=True)


@pytest.mark.parametrize("name, options, setting", DIVERGENT)
def test_the_override_runs_it_and_warns_exactly_once(monkeypatch, name, options, setting):
    monkeypatch.setattr(lanes, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = codecs.create(name, allow_unbiased_feedback=True, **options)
        clones = [first.clone() for _ in range(3)]  # one instance per key
        codecs.create(name, reference=True, allow_unbiased_feedback="true", **options)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1, said
    assert setting in said[0] and "allow_unbiased_feedback=true" in said[0]
    if name != "thc":
        assert all(c.option_values["error_feedback"] for c in clones + [first])


def test_the_override_alone_changes_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = codecs.create("qsgd", allow_unbiased_feedback=True)
    assert not c.option_values["error_feedback"]


@pytest.mark.slow
def test_the_script_refuses_a_divergent_option_without_a_traceback():
    r = subprocess.run([sys.executable, SCRIPT, "--codec", "qsgd", "--threads", "2",
                        "--option", "error_feedback=true"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "allow_unbiased_feedback=true" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_script_refuses_a_bad_threshold_naming_the_flag():
    r = subprocess.run([sys.executable, SCRIPT, "--codec", "2bit", "--threads", "2",
                        "--comm-threshold", "-1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "--comm-threshold" in r.stderr and "byte count must be >= 0, got -1" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.multiprocess
def test_the_documented_launcher_job_runs():
    """docs/codecs.md's command, shortened: 2 workers, 2 servers, MXNet's transport."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.launch", "-n", "2", "-s", "2",
                        sys.executable, "scripts/defaults_check.py", "--codec", "qsgd",
                        "--steps", "40", "--fraction", "0.75"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank in (0, 1):
        assert "rank %d: qsgd defaults: loss" % rank in r.stdout + r.stderr
