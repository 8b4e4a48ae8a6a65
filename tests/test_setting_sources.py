"""Where a setting comes from: the script's explicit parameters beat SLIMGC_* variables,
which beat the defaults; a variable that loses is said out loud, and the CTTab's decision
reaches a script that configured no logging (docs/configuration.md, docs/usage.md)."""
import json
import logging
import os
import subprocess
import sys

import pytest

from slimgc_mx import notice
from slimgc_mx.engine.config import SlimGCConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_notices():
    notice._TOLD.clear()
    yield
    notice._TOLD.clear()


def test_an_overridden_variable_is_said_with_both_values(capsys):
    cfg = SlimGCConfig.from_sources({"type": "2bit", "threshold": 0.5},
                                    environ={"SLIMGC_THRESHOLD": "0.3"},
                                    source="compression_params")
    assert cfg.threshold == 0.5
    err = capsys.readouterr().err
    assert "SLIMGC_THRESHOLD=0.3 is overridden by compression_params threshold=0.5" in err


def test_a_variable_that_agrees_or_is_not_overridden_is_silent(capsys):
    cfg = SlimGCConfig.from_sources({"threshold": 0.3}, environ={
        "SLIMGC_THRESHOLD": "0.3", "SLIMGC_BACKUP": "off"})
    assert cfg.threshold == 0.3 and cfg.backup is False
    assert "overridden" not in capsys.readouterr().err


def test_codec_options_of_a_compressor_that_lost_go_with_it(capsys):
    """SLIMGC_COMPRESSOR=topk with SLIMGC_CODEC_OPTIONS=ratio=...: a script that says 2bit
    gets 2bit, told so twice over, not "codec '2bit' has no option ratio"."""
    cfg = SlimGCConfig.from_sources({"type": "2bit"}, source="compression_params", environ={
        "SLIMGC_COMPRESSOR": "topk", "SLIMGC_CODEC_OPTIONS": "ratio=0.1"})
    assert cfg.compressor == "2bit"
    err = capsys.readouterr().err
    assert "SLIMGC_COMPRESSOR=topk is overridden by compression_params type='2bit'" in err
    assert ("SLIMGC_CODEC_OPTIONS=ratio=0.1 goes with SLIMGC_COMPRESSOR=topk, which "
            "compression_params type='2bit' overrides") in err


def test_codec_options_merge_by_name_and_the_script_wins(capsys):
    cfg = SlimGCConfig.from_sources({"ratio": 0.2}, environ={
        "SLIMGC_COMPRESSOR": "topk", "SLIMGC_CODEC_OPTIONS": "ratio=0.1"})
    assert (cfg.compressor, cfg.codec_options["ratio"]) == ("topk", 0.2)
    assert "SLIMGC_CODEC_OPTIONS ratio=0.1 is overridden by keyword arguments ratio=0.2" in \
        capsys.readouterr().err
    env_only = SlimGCConfig.from_sources({}, environ={
        "SLIMGC_COMPRESSOR": "topk", "SLIMGC_CODEC_OPTIONS": "ratio=0.1"})
    assert env_only.codec_options["ratio"] == 0.1


@pytest.mark.parametrize("options, where", [
    ({"type": "2bit"}, "compression_params type='2bit'"),
    ({}, "the default"),
])
def test_a_variables_codec_option_the_codec_lacks_names_the_variable(options, where):
    with pytest.raises(ValueError) as err:
        SlimGCConfig.from_sources(options, environ={"SLIMGC_CODEC_OPTIONS": "ratio=0.1"},
                                  source="compression_params")
    text = str(err.value)
    assert text.startswith("SLIMGC_CODEC_OPTIONS=ratio=0.1 sets ratio, which codec '2bit'")
    assert where in text and "unset the variable" in text


def test_notice_goes_to_stderr_without_logging_and_to_the_logger_with_it(capsys, caplog):
    assert notice.tell("first", once=True) and not notice.tell("first", once=True)
    assert capsys.readouterr().err == "slimgc: first\n"
    with caplog.at_level(logging.INFO, logger="slimgc_mx"):
        notice.tell("second")
    assert "second" in caplog.text and "second" not in capsys.readouterr().err


def test_the_kvstore_applies_the_rule_to_compression_params(monkeypatch, capsys):
    """Trainer's compression_params arrive after the store read the environment."""
    pytest.importorskip("mxnet")
    from slimgc_mx.mxnet.kvstore import SlimGC
    monkeypatch.setenv("SLIMGC_THRESHOLD", "0.3")
    monkeypatch.setenv("SLIMGC_BACKUP", "off")
    kv = SlimGC()
    assert kv.config.threshold == 0.3
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert kv.config.threshold == 0.5 and kv.config.backup is False
    assert ("SLIMGC_THRESHOLD=0.3 is overridden by compression_params threshold=0.5"
            in capsys.readouterr().err)


def _python(script, *args, **env):
    """Run `script` in a fresh interpreter outside any job and without SLIMGC_* variables
    (but `env`); it must succeed. Every script run here imports MXNet."""
    pytest.importorskip("mxnet")
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("DMLC_", "SLIMGC_"))}
    environ.update(OMP_NUM_THREADS="1", **env)
    r = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _train(tmp_path, *args, **env):
    out = tmp_path / "r.json"
    r = _python(os.path.join(ROOT, "scripts", "train.py"), "--kvstore", "slimgc", "--model",
                "mlp", "--dataset", "digits", "--epochs", "1", "--steps", "3", "--no-progress",
                "--json", str(out), *args, **env)
    return r, json.loads(out.read_text())


@pytest.mark.slow
def test_train_script_passes_only_what_its_user_gave(tmp_path):
    """SLIMGC_* reach a train.py job whose command line does not set them, and a
    command-line value that beats one is said."""
    r, res = _train(tmp_path, SLIMGC_COMPRESSOR="topk", SLIMGC_CODEC_OPTIONS="ratio=0.25",
                    SLIMGC_COMM_THRESHOLD="off")
    assert res["kvstore_stats"]["compressor"] == "topk"
    assert res["kvstore_stats"]["compressed_transfers"] > 0  # comm_threshold off from the env
    assert "overridden" not in r.stderr
    r, res = _train(tmp_path, "--threshold", "0.5", SLIMGC_THRESHOLD="0.3")
    assert "SLIMGC_THRESHOLD=0.3 is overridden by compression_params threshold=0.5" in r.stderr


@pytest.mark.parametrize("routing", ["'warmup_steps': 4", "'comm_threshold': 1 << 20"])
@pytest.mark.slow
def test_a_gluon_script_without_logging_hears_the_cttab_decision(tmp_path, routing):
    """The README's Gluon shape, no logging configured: rank 0 prints what the CTTab chose
    (after the warm-up, or at the first step when comm_threshold fixes it) and, when it
    compresses nothing, how to force compression."""
    script = tmp_path / "job.py"
    script.write_text(
        "import mxnet as mx\nimport slimgc_mx\nfrom mxnet import autograd, gluon\n"
        "net = gluon.nn.Dense(4, in_units=8)\nnet.initialize()\n"
        "trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},\n"
        "                        kvstore='slimgc', compression_params={'type': '2bit',\n"
        "                        %s})\n" % routing +
        "for _ in range(6):\n"
        "    with autograd.record():\n"
        "        loss = net(mx.nd.ones((2, 8))).sum()\n"
        "    loss.backward()\n    trainer.step(2)\n")
    r = _python(script)
    lines = [line for line in r.stderr.splitlines() if line.startswith("slimgc: CTTab: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert " of 2 tensors compressed" in lines[0]
    if "comm_threshold" in routing:  # no tensor reaches 1 MiB
        assert lines[0].startswith("slimgc: CTTab: BestCT = 1.0 MiB (fixed by comm_threshold")
        assert "0 of 2 tensors compressed" in lines[0]
        assert "comm_threshold='off' compresses every tensor" in lines[0]


@pytest.mark.slow
def test_usage_md_reads_rank_and_worker_count_from_the_store(tmp_path):
    """docs/usage.md's recipe: create the store, read rank and num_workers, hand it to the
    Trainer; the Trainer then uses that very store."""
    page = open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8").read()
    recipe = page.split("**Rank and worker count.**", 1)[1].split("```python\n", 1)[1]
    recipe = recipe.split("```", 1)[0]
    script = tmp_path / "rank.py"
    script.write_text(
        "import mxnet as mx\nimport slimgc_mx\n"
        "net = mx.gluon.nn.Dense(2, in_units=3)\nnet.initialize()\n" + recipe +
        "with mx.autograd.record():\n    loss = net(mx.nd.ones((1, 3))).sum()\n"
        "loss.backward()\ntrainer.step(1)\nassert trainer._kvstore is kv, trainer._kvstore\n")
    r = _python(script)
    assert "worker 0 of 1" in r.stdout
