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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "SLIMGC_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, TRAIN, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# -- the fused-buckets summary ------------------------------------------------------------

@pytest.mark.parametrize("fuse_compressed", ["off", 100_000])
def test_the_fused_summary_speaks_of_compressed_buckets_only_when_they_are_on(
        caplog, fuse_compressed):
    import training_helpers as th
    caplog.set_level(logging.INFO, logger="slimgc_mx.planner")
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

def test_a_codec_option_that_does_not_parse_is_shown_as_typed():
    r = _train("--compressor", "topk", "--codec-option", "ratio=abc", "--epochs", "1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "option ratio='abc': must be a number in (0, 1]" in r.stderr
    assert "ratio=None" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("below", ["", "run1"])
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
    from slimgc_mx.config import SlimGCConfig
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
