"""The launcher against a new user's first mistakes: a script without `import slimgc_mx`,
a port out of range, a missing script, the wrong `python`, a module the interpreter lacks.

Most tests run tiny probes or only plan the command; the `multiprocess` ones run real
2-worker MXNet jobs on loopback.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from slimgc_mx.launch import command
from slimgc_mx.launch.plan import LaunchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def launch(tmp_path, opts, cmd, env=None, timeout=60):
    """Run the launcher in tmp_path; (status, stdout, stderr)."""
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    p = subprocess.run([PY, "-m", "slimgc_mx.launch", *opts, *cmd], cwd=str(tmp_path),
                       env=full_env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def fake_python(tmp_path):
    """A directory whose `python` and `python3` are not Python: they say so and exit 3."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("python", "python3"):
        f = bindir / name
        f.write_text("#!/bin/sh\necho \"not the launcher's python\" >&2\nexit 3\n")
        f.chmod(0o755)
    return {"PATH": "%s:%s" % (bindir, os.environ["PATH"])}


# ---------------------------------------------------------------- what COMMAND becomes

def test_a_python_script_runs_through_slimgc_mx_run_on_the_launchers_python(tmp_path):
    (tmp_path / "train.py").write_text("")
    cwd = str(tmp_path)
    run = ["-m", "slimgc_mx.run"]
    for given, expected in [
            (["python", "train.py", "--lr", "1"], [PY] + run + ["train.py", "--lr", "1"]),
            (["python3", "-u", "-W", "ignore", "train.py"],
             [PY, "-u", "-W", "ignore"] + run + ["train.py"]),
            ([PY, "-m", "pkg.train", "--x"], [PY] + run + ["-m", "pkg.train", "--x"]),
            (["python -u train.py --name 'a b'"], [PY, "-u"] + run + ["train.py", "--name", "a b"]),
            ([PY, "-m", "slimgc_mx.run", "train.py"], [PY, "-m", "slimgc_mx.run", "train.py"])]:
        for launcher in ("local", "netns"):
            prepared = command.prepare(given, launcher, cwd)
            assert prepared.command == expected, given
            assert prepared.as_given is None and prepared.interpreter == PY


def test_commands_it_cannot_wrap_run_as_given_and_say_why(tmp_path):
    (tmp_path / "train.py").write_text("")
    cwd = str(tmp_path)
    for given, why in [(["cd sub && python train.py"], "shell string"),
                       (["bash", "job.sh"], "does not start with python"),
                       (["python", "-c", "print(1)"], "not `python SCRIPT`"),
                       (["python", "-I", "train.py"], "not `python SCRIPT`")]:
        prepared = command.prepare(given, "local", cwd)
        assert why in prepared.as_given, given
        assert "slimgc_mx.run" not in " ".join(prepared.command)
    (tmp_path / "other").mkdir()
    other = tmp_path / "other" / "python3"  # another interpreter may not have slimgc_mx
    other.symlink_to(os.path.realpath(PY))
    prepared = command.prepare([str(other), "train.py"], "local", cwd)
    assert prepared.command == [str(other), "train.py"]
    assert "is not the launcher's Python" in prepared.as_given
    prepared = command.prepare(["python", "train.py"], "local", cwd, as_is=True)
    assert prepared.command == ["python", "train.py"] and prepared.as_given == "--as-is"
    # ssh: the hosts' paths and Python; the script is not looked for here
    prepared = command.prepare(["python", "nowhere.py"], "ssh", "/srv/job")
    assert prepared.command == ["python", "nowhere.py"] and "ssh" in prepared.as_given


@pytest.mark.slow
def test_a_missing_script_is_named_before_anything_starts(tmp_path):
    for given in (["python", "trian.py"], ["python3", "-u", "trian.py"], [PY, "trian.py"],
                  ["python", "-m", "slimgc_mx.run", "trian.py"]):
        for launcher in ("local", "netns"):
            with pytest.raises(LaunchError, match="no script 'trian.py'"):
                command.prepare(given, launcher, str(tmp_path))
    code, stdout, stderr = launch(tmp_path, ["-n", "2"], ["python", "trian.py"])
    assert code == 2 and stdout == ""
    assert "error: no script 'trian.py' (looked in %s)" % tmp_path in stderr
    assert "Traceback" not in stderr and "can't open file" not in stderr


@pytest.mark.slow
def test_a_port_out_of_range_is_a_usage_error_naming_the_range(tmp_path):
    (tmp_path / "train.py").write_text("")
    for port in ("70000", "-1", "http"):
        code, stdout, stderr = launch(tmp_path, ["-n", "1", "--port", port],
                                      ["python", "train.py"])
        assert code == 2 and stdout == ""
        assert "argument --port: %r is not a port: give 1-65535" % port in stderr
        assert "Traceback" not in stderr and "OverflowError" not in stderr


# ---------------------------------------------------------------- which python runs it

PROBE = textwrap.dedent('''
    import json, os, sys
    print(json.dumps({"role": os.environ["DMLC_ROLE"], "exe": sys.executable,
                      "run": "slimgc_mx" in sys.modules, "path0": sys.path[0],
                      "argv": sys.argv}))
''')


@pytest.mark.slow
def test_a_bare_python_is_the_launchers_own_not_the_first_on_path(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = fake_python(tmp_path)
    code, stdout, stderr = launch(tmp_path, ["-n", "2", "-s", "1"],
                                  ["python", "probe.py", "x"], env=env)
    assert code == 0, stderr
    seen = [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines()]
    assert sorted(s["role"] for s in seen) == ["scheduler", "server", "worker", "worker"]
    for s in seen:  # the launcher's Python, through slimgc_mx.run, as `python probe.py x`
        assert s["exe"] == PY and s["run"] and s["argv"] == ["probe.py", "x"]
        assert s["path0"] == os.path.realpath(str(tmp_path))
    assert "every process runs %s -m slimgc_mx.run probe.py x" % PY in stderr
    # --as-is: the first python on PATH, as a shell would
    code, _, stderr = launch(tmp_path, ["-n", "1", "-s", "1", "--as-is"],
                             ["python", "probe.py"], env=env)
    assert code == 3 and "not the launcher's python" in stderr


@pytest.mark.slow
def test_slimgc_mx_run_runs_a_module_or_script_as_python_would(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": REPO, "DMLC_ROLE": "worker"}
    for args, argv, path0 in [(["-m", "probe", "x"], [str(tmp_path / "probe.py"), "x"],
                               str(tmp_path)),
                              (["probe.py", "x"], ["probe.py", "x"],
                               os.path.realpath(str(tmp_path)))]:
        p = subprocess.run([PY, "-m", "slimgc_mx.run"] + args, cwd=str(tmp_path), env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        seen = json.loads(p.stdout)
        assert seen["argv"] == argv and seen["run"] and seen["path0"] == path0


@pytest.mark.slow
def test_a_worker_that_cannot_import_a_module_names_its_interpreter(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent('''
        import os, time
        if os.environ["DMLC_ROLE"] == "worker":
            import no_such_module_slimgc
        time.sleep(30)
    '''))
    code, _, stderr = launch(tmp_path, ["-n", "2", "-s", "1", "--kill-grace", "1"],
                             ["python", "job.py"])
    assert code == 1
    last = [line for line in stderr.splitlines() if line.startswith("[launcher]")][-1]
    assert last.startswith("[launcher] ERROR worker ")
    assert ("could not import a module (ModuleNotFoundError: No module named "
            "'no_such_module_slimgc'). It ran %s: run the launcher with the Python that has "
            "the job's packages" % PY) in last
    assert "give that interpreter's path in COMMAND" in last


# ---------------------------------------------------------------- workers that never joined

NEVER_JOINED = textwrap.dedent('''
    import os, sys, time
    if os.environ["DMLC_ROLE"] != "worker":
        time.sleep(60)          # as MXNet's servers wait for workers that never come
    elif sys.argv[1] == "joined":
        i, n = os.environ["SLIMGC_LAUNCH_INDEX"], os.environ["DMLC_NUM_WORKER"]
        print("slimgc: worker %s is kvstore rank %s of %s" % (i, i, n))
''')


@pytest.mark.slow
def test_workers_that_never_joined_the_servers_fail_the_job(tmp_path):
    (tmp_path / "job.py").write_text(NEVER_JOINED)
    opts = ["-n", "2", "-s", "1", "--linger", "0.5", "--kill-grace", "1"]
    code, _, stderr = launch(tmp_path, opts, ["python", "job.py", "alone"])
    assert code == 1, stderr
    assert ("every worker exited 0, but scheduler, server 0 still ran 0.5 s later, waiting "
            "for workers that never joined") in stderr
    assert "does not `import slimgc_mx`" in stderr and "python -m slimgc_mx.run" in stderr
    # workers that said their kvstore rank joined: lingering servers are only a warning
    code, _, stderr = launch(tmp_path, opts, ["python", "job.py", "joined"])
    assert code == 0, stderr
    assert "all workers succeeded but scheduler, server 0 still ran" in stderr
    assert "never joined" not in stderr


# ---------------------------------------------------------------- real MXNet jobs

GLUON_WITHOUT_IMPORT = textwrap.dedent('''
    import json, os, sys
    import mxnet as mx
    from mxnet import autograd, gluon
    name = sys.argv[1]
    net = gluon.nn.Dense(1, in_units=4)
    net.initialize(mx.init.Constant(0.0))
    kv = mx.kv.create(name) if name.startswith("dist") else name
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    index = int(os.environ["SLIMGC_LAUNCH_INDEX"])
    for step in range(3):
        x = mx.nd.ones((2, 4)) * (index + 1 + step)
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
    store = trainer._kvstore
    if hasattr(store, "flush"):
        store.flush()  # what slimgc_mx.flush(trainer) does
    print("RESULT " + json.dumps({"store": type(store).__name__ if store else None,
                                  "type": getattr(store, "type", None),
                                  "weight": net.weight.data().asnumpy().tolist()}))
''')


def results(stdout):
    return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines()
            if "RESULT " in line]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["slimgc", "dist_sync_slimgc"])
def test_a_script_without_import_slimgc_mx_trains_synchronised_with_slimgc(tmp_path, name):
    pytest.importorskip("mxnet")
    (tmp_path / "train.py").write_text(GLUON_WITHOUT_IMPORT)
    code, stdout, stderr = launch(tmp_path, ["-n", "2", "-s", "1"],
                                  ["python", "train.py", name], timeout=120)
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    got = results(stdout)
    assert len(got) == 2, stdout
    assert [g["store"] for g in got] == ["SlimGC"] * 2
    assert [g["type"] for g in got] == ["dist_sync_slimgc"] * 2
    assert got[0]["weight"] == got[1]["weight"]  # the global weights, the same on both


@pytest.mark.multiprocess
def test_run_as_is_the_same_script_trains_alone_and_the_launcher_says_so(tmp_path):
    pytest.importorskip("mxnet")
    (tmp_path / "train.py").write_text(GLUON_WITHOUT_IMPORT)
    code, stdout, stderr = launch(tmp_path, ["-n", "2", "-s", "1", "--linger", "3", "--as-is",
                                             "--kill-grace", "1"],
                                  [PY, "train.py", "slimgc"], timeout=120)
    got = results(stdout)
    assert [g["store"] for g in got] == [None, None]  # MXNet made no store: each alone
    assert got[0]["weight"] != got[1]["weight"]
    assert code == 1, stderr
    assert "waiting for workers that never joined" in stderr
    assert "does not `import slimgc_mx`" in stderr
