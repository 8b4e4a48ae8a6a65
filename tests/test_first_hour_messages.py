"""What a new user meets in the first hour (issue 34): messages that say what they count,
user errors without tracebacks, docs in step with the code, long work that tells its pace."""
import logging
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def _train(*args, timeout=300):
    pytest.importorskip("mxnet")  # train.py imports it first
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "SLIMGC_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, TRAIN, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# -- the fused-buckets summary ------------------------------------------------------------

@pytest.mark.parametrize("fuse_compressed", ["off", 100_000])
def test_the_fused_summary_speaks_of_compressed_buckets_only_when_they_are_on(
        caplog, fuse_compressed):
    import training_helpers as th
    caplog.set_level(logging.INFO, logger="slimgc_mx.engine.planner")
    th.slimgc_workers(2, lambda: th.dense_net((32, 4)), th.batches(6), compressor="2bit",
                      comm_threshold=256, warmup_steps=2, timeout=30,
                      fuse_compressed=fuse_compressed)
    lines = [r.getMessage() for r in caplog.records if "keys fused into" in r.getMessage()]
    assert lines, caplog.text
    if fuse_compressed == "off":  # it read "0 compressed keys below 0 bytes into 0"
        assert not any("compressed keys below" in line for line in lines), lines
    else:
        assert all("compressed keys below 100000 bytes into" in line for line in lines), lines


# -- scripts/train.py: user errors ----------------------------------------------------------

@pytest.mark.slow
def test_a_codec_option_that_does_not_parse_is_shown_as_typed():
    r = _train("--compressor", "topk", "--codec-option", "ratio=abc", "--epochs", "1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "option ratio='abc': must be a number in (0, 1]" in r.stderr
    assert "ratio=None" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("below", ["", "run1"])
@pytest.mark.slow
def test_a_checkpoint_dir_that_is_a_file_is_a_usage_error(tmp_path, below):
    existing = tmp_path / "ckpt"
    existing.write_text("not a directory")
    given = os.path.join(str(existing), below) if below else str(existing)
    r = _train("--kvstore", "local", "--checkpoint-dir", given, "--epochs", "1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert ("--checkpoint-dir %s: %s is a file, not a directory; give a directory"
            % (given, existing)) in r.stderr


# -- docs in step with the code -------------------------------------------------------------

def _doc(name):
    with open(os.path.join(ROOT, "docs", name)) as f:
        return f.read()


def _train_parser():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_script", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_reliability_md_quotes_the_unknown_compressor_message_as_raised():
    from slimgc_mx.engine.config import SlimGCConfig
    (row,) = [line for line in _doc("reliability.md").splitlines()
              if line.startswith("| Unknown compressor |")]
    quoted = row.split("`")[1]
    with pytest.raises(ValueError) as exc:
        SlimGCConfig(compressor="8bit").validate()
    assert quoted == "ValueError: %s" % exc.value


def test_training_md_lists_every_option_and_choice_of_train_py():
    doc = _doc("training.md")
    rows = {line.split("`")[1].split()[0]: line for line in doc.splitlines()
            if line.startswith("| `--")}
    for action in _train_parser()._actions:
        names = [n for n in action.option_strings if n.startswith("--") and n != "--help"]
        if not names:
            continue
        assert any(n in doc for n in names), "%s is not in docs/training.md" % names
        if action.dest in ("kvstore", "compressor"):
            cell = rows[names[0]].split("`")[1]  # `--kvstore slimgc\|dist_sync\|...`
            shown = cell.split(None, 1)[1].replace("\\|", "|").split("|")
            assert sorted(shown) == sorted(action.choices), (names[0], shown)


# -- long work tells its pace -----------------------------------------------------------------

def test_the_codecs_bench_says_how_long_it_takes_and_reports_each_codec(capsys):
    """It printed nothing for minutes: now an estimate first, then a line per codec."""
    import re

    from slimgc_mx import bench, codecs
    assert bench.main(["codecs", "--size", "3000", "--repeat", "1", "--reference-repeat",
                       "1"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    names = codecs.available()
    assert re.fullmatch(r"codecs: %d codecs on 3000 elements, best of 1 \(NumPy reference: "
                        r"best of 1\); (under 1 s|about [\d]+ s) in all \(scaled from a trial on "
                        r"3000 elements, [\d.]+ s\)" % len(names), lines[0])
    for k, name in enumerate(names, 1):
        assert re.fullmatch(r"\[%d/%d\] %s, (under|about) [^:]+: all threads [\d.]+ s, "
                            r"1 thread [\d.]+ s, NumPy reference [\d.]+ s; done in [\d.]+ s"
                            % (k, len(names), name), lines[k]), lines[k]
    assert "memcpy" in captured.out and "codecs:" not in captured.out


def test_the_readme_bench_example_is_the_quick_run():
    from slimgc_mx.bench import codecs as bench_codecs
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert "bash scripts/run.sh python -m slimgc_mx.bench codecs --quick`" in readme
    quick = bench_codecs.parse_args(["--quick"], "codecs")
    assert (quick.size, quick.repeat, quick.reference_repeat) == (1 << 20, 3, 1)
    assert bench_codecs.parse_args(["--quick", "--size", "4096"], "codecs").size == 4096
    full = bench_codecs.parse_args([], "codecs")
    assert (full.size, full.repeat, full.reference_repeat) == (1 << 24, 5, 2)


def test_the_quick_run_of_two_codecs_completes(capsys):
    from slimgc_mx import bench
    assert bench.main(["codecs", "--quick", "--codecs", "2bit,topk"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("codecs: 2 codecs on 1048576 elements, best of 3")
    assert "--quick runs in seconds" not in err and "[2/2] topk" in err


# -- python -m slimgc_mx.launch.netns ---------------------------------------------------------

@pytest.mark.slow
def test_the_netns_module_runs_without_runpys_warning():
    """run.sh's `python -m slimgc_mx.launch.netns --check` printed runpy's RuntimeWarning:
    the package imported the module before runpy executed it."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m",
                        "slimgc_mx.launch.netns"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert "RuntimeWarning" not in r.stderr, r.stderr
    assert r.returncode == 2 and "usage: python -m slimgc_mx.launch.netns --check" in r.stderr


# -- settings: a misspelt name, options that compressor 'none' does not take ------------------

def test_a_misspelt_setting_suggests_the_closest_name_on_the_mxnet_side_too():
    from slimgc_mx.engine.config import SlimGCConfig
    with pytest.raises(ValueError, match="unknown SlimGC option 'warmup_step'.*"
                                         "did you mean warmup_steps\\?"):
        SlimGCConfig.from_sources({"type": "2bit", "warmup_step": 5}, {})
    with pytest.raises(ValueError, match="has no option warmup_step.*did you mean warmup_steps"):
        SlimGCConfig.from_sources({"codec_options": {"warmup_step": 5}}, {})


def test_compression_params_of_none_with_a_threshold_are_refused():
    from slimgc_mx.engine.config import SlimGCConfig
    with pytest.raises(ValueError, match="compressor 'none' takes no codec options: "
                                         "threshold=0.1 given in compression_params"):
        SlimGCConfig.from_sources({"type": "none", "threshold": 0.1}, {}, "compression_params")
    assert SlimGCConfig.from_sources({"type": "none"}, {"SLIMGC_THRESHOLD": "0.1"}).threshold \
        == 0.1  # the environment may be shared by jobs of several codecs: not refused


def test_the_benchmarks_full_precision_configuration_gives_no_threshold():
    from slimgc_mx.bench import cluster
    assert "--threshold" not in cluster.config_args("slimgc-none-full")
    assert "--threshold" in cluster.config_args("slimgc-2bit-full")
