"""The PyTorch adapter (slimgc_mx.torch) in real multi-process jobs over Gloo (torchrun)."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # two-rank jobs under torchrun

from torch_launch import Batch, results  # noqa: E402


def run_ok(*args, **kw):
    code, text = SHARED.run(*args, **kw)
    assert code == 0, text[-4000:]
    return text


def test_full_precision_without_backup_gives_ddp_weights(tmp_path):
    run_ok("train.py", tmp_path, "ddp,slimgc", json.dumps(
        {"compression": "none", "backup": False}))
    ddp, mine = results(tmp_path, "ddp"), results(tmp_path, "slimgc")
    for r in range(2):
        assert np.abs(np.subtract(ddp[r]["weights"], mine[r]["weights"])).max() <= 1e-6
        assert np.abs(np.subtract(ddp[r]["buffers"], mine[r]["buffers"])).max() <= 1e-6
    assert mine[0]["transfers"] > 0


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_and_adamw_without_backup_give_ddp_weights(tmp_path, optimizer):
    """Another optimizer than SGD runs its own step on glo_buf with the mean gradient: the
    weights are DDP's with the same optimizer (AdamW: decoupled weight decay)."""
    run_ok("train.py", tmp_path, "ddp,slimgc", json.dumps(
        {"compression": "none", "backup": False, "optimizer": optimizer}))
    ddp, mine = results(tmp_path, "ddp"), results(tmp_path, "slimgc")
    for r in range(2):
        assert np.abs(np.subtract(ddp[r]["weights"], mine[r]["weights"])).max() <= 1e-6
    assert mine[0]["weights"] == mine[1]["weights"]


def test_accumulation_gives_ddp_weights(tmp_path):
    opts = {"accumulate": 2, "steps": 8}
    run_ok("train.py", tmp_path, "ddp,slimgc", json.dumps(
        dict(opts, compression="none", backup=False)))
    ddp, mine = results(tmp_path, "ddp"), results(tmp_path, "slimgc")
    assert np.abs(np.subtract(ddp[0]["weights"], mine[0]["weights"])).max() <= 1e-6


@pytest.mark.parametrize("backup", [True, False])
def test_compressed_ranks_agree_bitwise(tmp_path, backup):
    run_ok("train.py", tmp_path, "slimgc", json.dumps(
        {"compression": "2bit", "backup": backup, "comm_threshold": 0, "warmup_steps": 3}))
    ranks = results(tmp_path, "slimgc")
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["compressed"] > 0


@pytest.mark.parametrize("mode", ["backup", "nobackup"])
def test_every_codec_trains_and_ranks_agree(tmp_path, mode):
    run_ok("codecs.py", tmp_path, mode, timeout=600)
    ranks = results(tmp_path, "codecs")
    assert len(ranks[0]) == 11  # every codec but none
    for name, r0 in ranks[0].items():
        assert r0["digest"] == ranks[1][name]["digest"], name
        assert r0["compressed"] > 0, name
        assert r0["last"] < 0.75 * r0["first"], (name, r0)


@pytest.mark.parametrize("codec,backup", [("2bit", "backup"), ("powersgd", "nobackup"),
                                          ("adam", "backup")])
def test_state_dict_round_trip_resumes_bitwise(tmp_path, codec, backup):
    run_ok("resume.py", tmp_path, codec, backup)
    a, b = results(tmp_path, "straight"), results(tmp_path, "resumed")
    assert a[0]["weights"] == b[0]["weights"] and a[1]["weights"] == b[1]["weights"]


def test_restart_drill_ends_with_the_uninterrupted_weights(tmp_path):
    straight, killed = tmp_path / "a", tmp_path / "b"
    straight.mkdir(), killed.mkdir()
    run_ok("restart.py", straight, "straight")
    # a restart may itself fail to connect on a loaded machine (Gloo's connect retries are
    # few): a second restart resumes from the same checkpoints
    run_ok("restart.py", killed, "kill", extra=("--max-restarts", "3"))
    a, b = results(straight, "restart"), results(killed, "restart")
    assert b[0]["attempt"] >= 1  # the job did restart
    assert a[0]["weights"] == b[0]["weights"] == b[1]["weights"]


@pytest.mark.parametrize("path", ["host", "device"])
def test_amp_step_with_inf_on_one_rank_is_skipped_on_every_rank(tmp_path, path):
    run_ok("amp.py", tmp_path, path)
    ranks = results(tmp_path, "amp")
    h0, h1 = ranks[0]["history"], ranks[1]["history"]
    assert h0 == h1  # every step taken or skipped alike
    assert h0[3] == h0[2] and h0[4] != h0[3]  # step 3 skipped, the next one taken
    assert ranks[1]["scales"][3] < ranks[1]["scales"][2]  # the scaler that saw inf backs off


ERRORS = {"options": ["threshold"], "optimizer": ["optimizer settings", "param group 0 lr="],
          "model": ["shape"], "nan": ["3.weight", "rank 1", "NaN"],
          "again": ["failed on this process group", "afresh"]}
#: The jobs of this file's tests but the killed one, in one torchrun (a job asked for that is
#: not listed runs alone); those that go wrong on purpose last.
SHARED = Batch(
    ("train.py", "ddp,slimgc", json.dumps({"compression": "none", "backup": False})),
    *(("train.py", "ddp,slimgc", json.dumps(
        {"compression": "none", "backup": False, "optimizer": optimizer}))
      for optimizer in ("adam", "adamw")),
    ("train.py", "ddp,slimgc", json.dumps(
        {"accumulate": 2, "steps": 8, "compression": "none", "backup": False})),
    *(("train.py", "slimgc", json.dumps({"compression": "2bit", "backup": backup,
                                         "comm_threshold": 0, "warmup_steps": 3}))
      for backup in (True, False)),
    ("codecs.py", "backup"), ("codecs.py", "nobackup"),
    ("resume.py", "2bit", "backup"), ("resume.py", "powersgd", "nobackup"),
    ("resume.py", "adam", "backup"),
    ("restart.py", "straight"), ("amp.py", "host"), ("amp.py", "device"),
    ("save_midway.py", "2bit", "backup"), ("save_midway.py", "2bit", "nobackup"),
    ("errors.py", ",".join(ERRORS)))
#: The per-step settings check's jobs, in a torchrun of their own, so that one case can be
#: run alone and often (pytest -k) without the whole batch.
SETTINGS = Batch(("settings.py", "backup", 12), ("settings.py", "nobackup", 12),
                 ("settings.py", "backup", 19))


def test_bad_jobs_fail_on_every_rank_with_the_reason(tmp_path):
    text = run_ok("errors.py", tmp_path, ",".join(ERRORS))  # (a hang: each rank's stacks)
    for case, words in ERRORS.items():
        for r in results(tmp_path, "errors-" + case):
            assert r["error"] is not None, (case, text[-2000:])
            for word in words:
                assert word in r["error"], (case, r["error"])


@pytest.mark.parametrize("codec,backup", [("2bit", "backup"), ("2bit", "nobackup")])
def test_a_checkpoint_midway_changes_nothing(tmp_path, codec, backup):
    """state_dict() at step 15 flushed, so the next forward read the global weights instead
    of loc_buf: the run ended 1.8e-3 away from one without it. Now the parameters before
    and after the final flush are those of the run without a checkpoint, bit for bit, and
    so are a resumed run's."""
    run_ok("save_midway.py", tmp_path, codec, backup)
    plain, saved, resumed = (results(tmp_path, mode) for mode in ("plain", "saved", "resumed"))
    for r in range(2):
        for what in ("params", "flushed"):
            assert saved[r][what] == plain[r][what], (r, what, np.abs(np.subtract(
                saved[r][what], plain[r][what])).max())
            assert resumed[r][what] == plain[r][what], (r, what)
    assert plain[0]["flushed"] == plain[1]["flushed"]
    if backup == "backup":
        assert plain[0]["params"] != plain[0]["flushed"]  # the parameters held loc_buf


@pytest.mark.parametrize("backup,at,lr", [
    ("backup", 12, 0.025), ("nobackup", 12, 0.025), ("backup", 19, 0.0125)])
def test_a_hyperparameter_changed_on_one_rank_fails_every_rank_naming_it(tmp_path, backup, at,
                                                                         lr):
    """Rank 1 alone sets its lr at step 12: it went unnoticed and the ranks' global weights
    parted. Now both ranks fail at the next step (at the last step: at the flush) naming
    the setting, the step and each rank's value, and no global weight of it is written."""
    code, text = SETTINGS.run("settings.py", tmp_path, backup, at, timeout=180)
    ranks = results(tmp_path, "settings")  # (recorded before the exit)
    for r in ranks:
        assert r["error"] == (
            "ConfigMismatchError: ranks disagree on param group 0 lr at step %d: rank 0 has "
            "%r, rank 1 has 0.01; change hyperparameters on every rank alike (e.g. step a "
            "ReduceLROnPlateau on a metric averaged over ranks)" % (at, lr)), r["error"]
        assert r["raised_at"] == at + 1, r
        assert r["after"] == r["before"], r  # the step's global update was not applied
    assert ranks[0]["after"] == ranks[1]["after"]
