"""Tests for slimgc_mx.launch: env passing, prefixes, exit status, teardown, ssh mode, errors.

Jobs run tiny Python probes (tests write them to tmp_path); one test runs a real MXNet
dist_sync job. Probes write their pids to files so the tests can check /proc afterwards.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from slimgc_mx import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r'''
import json, os, subprocess, sys, time
outdir, mode = sys.argv[1], sys.argv[2]
role, idx = os.environ["DMLC_ROLE"], int(os.environ["SLIMGC_LAUNCH_INDEX"])
name = "%s-%d" % (role, idx)

def write_pid(fname, pid):
    tmp = os.path.join(outdir, fname + ".tmp")  # not "*.pid": readers skip it until renamed
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.rename(tmp, os.path.join(outdir, fname))

def joined():  # what a SlimGC worker says once it is in the job (the launcher counts it)
    print("slimgc: worker %d is kvstore rank %d of %s" % (idx, idx, os.environ["DMLC_NUM_WORKER"]))

write_pid(name + ".pid", os.getpid())
if mode == "env":
    keys = [k for k in os.environ if k.startswith(("DMLC_", "T_"))] + ["SLIMGC_LAUNCH_INDEX"]
    print(json.dumps({k: os.environ[k] for k in keys}))
    print("to stderr", file=sys.stderr)
elif mode == "exit7":
    if role == "worker":
        time.sleep(0.3)
        sys.exit(7 if idx == 1 else 0)
    time.sleep(60)
elif mode == "flaky":  # worker 1 fails its first int(argv[3]) attempts with status 5
    if role == "worker" and idx == 1:
        with open(os.path.join(outdir, "attempts"), "a") as f:
            f.write("x")
        with open(os.path.join(outdir, "attempts")) as f:
            if len(f.read()) <= int(sys.argv[3]):
                sys.exit(5)
    if role != "worker":
        time.sleep(60)
    joined()
elif mode == "linger":
    if role != "worker":
        time.sleep(60)
    joined()
elif mode == "hang":
    child = subprocess.Popen(["sleep", "60"])
    write_pid(name + ".child.pid", child.pid)
    expected = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if role == "worker" and idx == 1 and expected:
        while len([f for f in os.listdir(outdir) if f.endswith(".pid")]) < expected:
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(60)
'''

FAKE_SSH = r'''#!{python}
"""Stand-in for ssh: logs the call, runs the command in a new session with a bare env."""
import json, os, sys
args, opts, port = sys.argv[1:], [], None
while args and args[0].startswith("-"):
    o = args.pop(0)
    if o in ("-o", "-p"):
        v = args.pop(0)
        if o == "-p":
            port = v
        else:
            opts.append(v)
host, command = args[0], " ".join(args[1:])
with open(os.environ["FAKE_SSH_LOG"], "a") as f:
    f.write(json.dumps({{"host": host, "port": port, "opts": opts, "command": command}}) + "\n")
pid = os.fork()
if pid == 0:  # the "remote" side: its own session, so only the launcher's teardown can end it
    os.setsid()
    os.execve("/bin/sh", ["sh", "-c", command], {{"PATH": os.environ["PATH"]}})
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
sys.exit(code if code >= 0 else 255)
'''


@pytest.fixture
def job(tmp_path):
    """A probe script, an output dir for pid files, and a function running the launcher."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()

    def cmd(mode, *extra):
        return [sys.executable, str(probe), str(out), mode, *map(str, extra)]

    def start(opts, command, env=None, **kw):
        full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
        return subprocess.Popen([sys.executable, "-m", "slimgc_mx.launch", *opts, *command],
                                cwd=str(tmp_path), env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def run(opts, command, env=None, timeout=30):
        p = start(opts, command, env)
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            pytest.fail(f"launcher hung\n{stdout}\n{stderr}")
        return p.returncode, stdout, stderr

    class J:
        pass
    j = J()
    j.tmp, j.out, j.cmd, j.run, j.start = tmp_path, out, cmd, run, start
    return j


def read_pids(out):
    return {f.name: int(f.read_text()) for f in out.iterdir() if f.name.endswith(".pid")}


def alive(pid):
    """True when /proc shows the pid as a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(out, within=5.0):
    pids = read_pids(out)
    assert pids, "probes wrote no pid files"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.05)
    left = {n: p for n, p in pids.items() if alive(p)}
    assert not left, f"processes of the job still running: {left}"


def wait_for_pids(out, count, proc, timeout=20):
    deadline = time.monotonic() + timeout
    while len(read_pids(out)) < count:
        assert proc.poll() is None, f"launcher exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"only {sorted(read_pids(out))} started"
        time.sleep(0.05)
    return read_pids(out)


def parse_env_lines(stdout):
    """{'[worker 0]': env dict, ...} from the probes' prefixed JSON lines."""
    envs = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            envs[prefix + "]"] = json.loads(rest)
    return envs


# ---------------------------------------------------------------- local mode

@pytest.mark.slow
def test_local_env_roles_counts_and_prefixes(job):
    code, stdout, stderr = job.run(
        ["-n", "2", "-s", "1", "--env", "T_ALL:a", "--env", "T_FROM_SHELL",
         "--env-server", "T_S:s", "--env-worker", "T_W:w", "--env-worker", "T_ALL:worker-wins"],
        job.cmd("env"), env={"T_FROM_SHELL": "shell value"})
    assert code == 0, stderr
    envs = parse_env_lines(stdout)
    assert sorted(envs) == ["[scheduler]", "[server 0]", "[worker 0]", "[worker 1]"]
    ports = {e["DMLC_PS_ROOT_PORT"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for label, e in envs.items():
        role = label.strip("[]").split()[0]
        assert e["DMLC_ROLE"] == role
        assert (e["DMLC_NUM_WORKER"], e["DMLC_NUM_SERVER"]) == ("2", "1")
        assert e["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert e["T_FROM_SHELL"] == "shell value"
        assert e["T_ALL"] == ("worker-wins" if role == "worker" else "a")
        assert ("T_S" in e) == (role == "server") and ("T_W" in e) == (role == "worker")
    assert envs["[worker 1]"]["SLIMGC_LAUNCH_INDEX"] == "1"
    for label in envs:
        assert f"{label} to stderr" in stderr.splitlines()


def test_servers_get_a_zero_filled_heap_unless_told_otherwise():
    plan = launch.build_plan(launch.parse_args(["-n", "1", "-s", "1", "true"]))
    envs = {t.role: t.env for t in plan}
    assert envs["server"]["MALLOC_PERTURB_"] == "255"
    assert envs["server"]["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
    assert "MALLOC_PERTURB_" not in envs["worker"] and "MALLOC_PERTURB_" not in envs["scheduler"]
    plan = launch.build_plan(launch.parse_args(
        ["-n", "1", "--env-server", "MALLOC_PERTURB_:0", "--env", "GLIBC_TUNABLES:x", "true"]))
    server = next(t.env for t in plan if t.role == "server")
    assert server["MALLOC_PERTURB_"] == "0"  # --env-server wins
    assert server["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"  # over --env it does not


def test_local_processes_share_the_cores_unless_told_otherwise(monkeypatch, tmp_path):
    assert launch.omp_threads(2, cpus=2) == 1 and launch.omp_threads(4, cpus=2) == 1
    assert launch.omp_threads(2, cpus=16) == 8 and launch.omp_threads(1, cpus=3) == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = launch.build_plan(launch.parse_args(["-n", "2", "true"]))
    assert {t.env["OMP_NUM_THREADS"] for t in plan} == {str(launch.omp_threads(2))}
    plan = launch.build_plan(launch.parse_args(["-n", "2", "--env", "OMP_NUM_THREADS:5",
                                                "--env-worker", "OMP_NUM_THREADS:3", "true"]))
    assert {t.role: t.env["OMP_NUM_THREADS"] for t in plan} == {
        "scheduler": "5", "server": "5", "worker": "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the shell's value reaches the processes
    plan = launch.build_plan(launch.parse_args(["-n", "2", "true"]))
    assert not any("OMP_NUM_THREADS" in t.env for t in plan)
    monkeypatch.delenv("OMP_NUM_THREADS")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0\n")  # remote hosts: their cores are not known here
    plan = launch.build_plan(launch.parse_args(["-n", "2", "-H", str(hostfile), "true"]))
    assert not any("OMP_NUM_THREADS" in t.env for t in plan)


def test_workers_get_two_engine_threads_unless_told_otherwise(monkeypatch, tmp_path):
    name = "MXNET_CPU_WORKER_NTHREADS"
    monkeypatch.delenv(name, raising=False)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0\n")
    for mode in ([], ["-H", str(hostfile)]):  # the thread count does not depend on the host
        plan = launch.build_plan(launch.parse_args(["-n", "2"] + mode + ["true"]))
        assert {t.role: t.env.get(name) for t in plan} == {
            "scheduler": None, "server": None, "worker": str(launch.WORKER_ENGINE_THREADS)}
    for option in (["--env", name + ":1"], ["--env-worker", name + ":3"]):
        plan = launch.build_plan(launch.parse_args(["-n", "2"] + option + ["true"]))
        assert {t.env[name] for t in plan if t.role == "worker"} == {option[1][-1]}
    monkeypatch.setenv(name, "4")  # the shell's value reaches local processes
    plan = launch.build_plan(launch.parse_args(["-n", "2", "true"]))
    assert not any(name in t.env for t in plan)


def test_servers_default_to_workers_and_round_robin_plan(tmp_path):
    args = launch.parse_args(["-n", "3", "true"])
    assert (args.num_servers, args.launcher) == (3, "local")
    assert [t.label for t in launch.build_plan(args)] == [
        "scheduler", "server 0", "server 1", "server 2", "worker 0", "worker 1", "worker 2"]

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0\n# comment\n\nh1:2200  # trailing comment\n")
    args = launch.parse_args(
        ["-n", "3", "-s", "2", "-H", str(hostfile), "--root-uri", "10.0.0.9", "true"])
    assert args.launcher == "ssh"
    plan = launch.build_plan(args)
    assert [(t.label, t.node) for t in plan] == [
        ("scheduler", None), ("server 0", "h0"), ("server 1", "h1"),
        ("worker 0", "h0"), ("worker 1", "h1"), ("worker 2", "h0")]
    assert plan[1].runner.ports == {"h0": None, "h1": 2200}
    assert all(t.env["DMLC_PS_ROOT_URI"] == "10.0.0.9" for t in plan)
    assert plan[4].env["DMLC_NODE_HOST"] == "h1"


@pytest.mark.slow
def test_worker_exit_status_propagates_and_others_stop(job):
    start = time.monotonic()
    code, _, stderr = job.run(["-n", "3", "-s", "1", "--kill-grace", "1"], job.cmd("exit7"))
    assert code == 7, stderr
    assert time.monotonic() - start < 15
    assert "worker 1 exited with code 7" in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_lingering_servers_are_terminated_after_success(job):
    """Workers that joined (said their rank) and succeeded; servers that never exit."""
    code, _, stderr = job.run(["-n", "1", "-s", "2", "--linger", "0.5", "--kill-grace", "1"],
                              job.cmd("linger"))
    assert code == 0, stderr
    assert "still ran" in stderr and "server 1" in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_sigkilled_worker_stops_whole_job(job):
    p = job.start(["-n", "2", "-s", "2", "--kill-grace", "1"], job.cmd("hang"))
    try:
        pids = wait_for_pids(job.out, 10, p)  # 5 probes, each with a grandchild
        killed_at = time.monotonic()
        os.kill(pids["worker-1.pid"], signal.SIGKILL)
        _, stderr = p.communicate(timeout=30)
        assert time.monotonic() - killed_at < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL
    assert "worker 1 was killed by signal SIGKILL" in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_max_restarts_starts_the_whole_job_again_until_it_succeeds(job):
    code, _, stderr = job.run(["-n", "2", "-s", "1", "--kill-grace", "1", "--linger", "0.2",
                               "--max-restarts", "2"], job.cmd("flaky", 2), timeout=60)
    assert code == 0, stderr
    assert (job.out / "attempts").read_text() == "xxx"
    for i in (1, 2):
        assert "restart %d of 2 after worker 1 exited with code 5" % i in stderr
    ports = [line.rsplit(":", 1)[1].split()[0] for line in stderr.splitlines()
             if "scheduler at" in line]
    assert len(ports) == 3 and len(set(ports)) == 3, ports  # a fresh port every attempt
    assert "(attempt 3 of 3)" in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_max_restarts_exhausted_exits_with_the_last_attempts_status(job):
    code, _, stderr = job.run(["-n", "2", "-s", "1", "--kill-grace", "1",
                               "--max-restarts", "1"], job.cmd("flaky", 5), timeout=60)
    assert code == 5, stderr
    assert (job.out / "attempts").read_text() == "xx"
    assert "restart 1 of 1 after worker 1" in stderr and "restart 2" not in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_max_restarts_must_not_be_negative(job):
    code, _, stderr = job.run(["--max-restarts", "-1", "-n", "1"], job.cmd("env"))
    assert code == 2 and "--max-restarts must be >= 0" in stderr


@pytest.mark.parametrize("restarts", ["0", "2"])  # a launcher told to stop does not restart
@pytest.mark.slow
def test_sigint_to_launcher_tears_down(job, restarts):
    p = job.start(["-n", "1", "-s", "1", "--kill-grace", "1", "--max-restarts", restarts],
                  job.cmd("hang"))
    try:
        wait_for_pids(job.out, 6, p)
        p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGINT, stderr
    assert "restart" not in stderr
    assert_all_gone(job.out)


@pytest.mark.slow
def test_sigkill_to_launcher_still_cleans_up(job):
    p = job.start(["-n", "1", "-s", "1", "--kill-grace", "1"], job.cmd("hang"))
    try:
        wait_for_pids(job.out, 6, p)
        p.kill()
        p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
    assert_all_gone(job.out)


# ---------------------------------------------------------------- ssh mode

def write_fake_ssh(path):
    path.write_text(FAKE_SSH.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.mark.slow
def test_ssh_mode_through_fake_ssh_on_path(job):
    bindir = job.tmp / "bin"
    bindir.mkdir()
    write_fake_ssh(bindir / "ssh")
    hostfile = job.tmp / "hosts"
    hostfile.write_text("localhost\n127.0.0.1:2222\n")
    ssh_log = job.tmp / "ssh.log"
    code, stdout, stderr = job.run(
        ["-n", "3", "-s", "2", "-H", str(hostfile), "--root-uri", "127.0.0.1",
         "--remote-dir", str(job.out), "--env", "T_ALL:x y", "--env-worker", "T_W:w"],
        job.cmd("env"),
        env={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "FAKE_SSH_LOG": str(ssh_log),
             "SLIMGC_SSH": "ssh"})
    assert code == 0, stderr
    envs = parse_env_lines(stdout)
    assert sorted(envs) == ["[scheduler]", "[server 0]", "[server 1]",
                            "[worker 0]", "[worker 1]", "[worker 2]"]
    expected_host = {"[server 0]": "localhost", "[server 1]": "127.0.0.1",
                     "[worker 0]": "localhost", "[worker 1]": "127.0.0.1",
                     "[worker 2]": "localhost"}
    for label, host in expected_host.items():
        e = envs[label]
        assert e["DMLC_NODE_HOST"] == host
        assert e["T_ALL"] == "x y"
        assert ("T_W" in e) == label.startswith("[worker")
        assert (e["DMLC_NUM_WORKER"], e["DMLC_NUM_SERVER"]) == ("3", "2")
    assert len({e["DMLC_PS_ROOT_PORT"] for e in envs.values()}) == 1
    calls = [json.loads(line) for line in ssh_log.read_text().splitlines()]
    assert sorted((c["host"], c["port"]) for c in calls) == [
        ("127.0.0.1", "2222"), ("127.0.0.1", "2222"),
        ("localhost", None), ("localhost", None), ("localhost", None)]
    for c in calls:
        assert c["opts"] == ["StrictHostKeyChecking=no"]
        assert c["command"].startswith(f"cd {job.out} && export ")


@pytest.mark.slow
def test_ssh_failure_stops_remote_sessions(job):
    fake = write_fake_ssh(job.tmp / "fakessh")
    hostfile = job.tmp / "hosts"
    hostfile.write_text("localhost\n127.0.0.1\n")
    code, _, stderr = job.run(
        ["-n", "2", "-s", "1", "-H", str(hostfile), "--root-uri", "127.0.0.1",
         "--kill-grace", "1"],
        job.cmd("hang", 8),
        env={"SLIMGC_SSH": str(fake), "FAKE_SSH_LOG": str(job.tmp / "ssh.log")})
    assert code == 3, stderr
    assert "worker 1 exited with code 3" in stderr
    assert_all_gone(job.out)


@pytest.mark.parametrize("content,message", [
    (None, "cannot read hostfile"),
    ("", "lists no hosts"),
    ("# only a comment\n\n", "lists no hosts"),
    ("good\nbad host\n", "line 2"),
    ("h:notaport\n", "line 1"),
    ("h:70000\n", "line 1"),
])
@pytest.mark.slow
def test_bad_hostfile_is_a_clear_usage_error(job, content, message):
    hostfile = job.tmp / "hosts"
    if content is not None:
        hostfile.write_text(content)
    code, stdout, stderr = job.run(["-n", "1", "-H", str(hostfile)], job.cmd("env"))
    assert code == 2
    assert message in stderr and str(hostfile) in stderr
    assert stdout == "" and not read_pids(job.out)


# ---------------------------------------------------------------- usage errors

@pytest.mark.slow
def test_missing_command_is_a_usage_error(job):
    code, _, stderr = job.run(["-n", "2"], [])
    assert code == 2
    assert "usage:" in stderr and "missing COMMAND" in stderr


@pytest.mark.slow
def test_occupied_port_is_named_with_the_fix(job):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, stderr = job.run(["-n", "1", "--port", str(port)], job.cmd("env"))
    assert code == 2
    assert f"port {port} is already in use" in stderr and "--port" in stderr
    assert not read_pids(job.out)


@pytest.mark.slow
def test_command_that_cannot_start(job):
    code, _, stderr = job.run(["-n", "1", "-s", "1"], ["no-such-program-slimgc", "x"])
    assert code == 127
    assert "cannot start scheduler" in stderr and "no-such-program-slimgc" in stderr


@pytest.mark.slow
def test_unsupported_options_say_so(job):
    code, _, stderr = job.run(["-n", "1", "--sync-dst-dir", "/x"], job.cmd("env"))
    assert code == 2 and "--sync-dst-dir is not supported" in stderr
    code, _, stderr = job.run(["-n", "1", "-s", "0"], job.cmd("env"))
    assert code == 2 and "need -s >= 1 servers" in stderr
    code, _, stderr = job.run(["-n", "1", "--bandwidth", "1gbit"], job.cmd("env"))
    assert code == 2 and "--bandwidth and --delay shape the links of --launcher netns only" \
        in stderr
    code, _, stderr = job.run(["-n", "1", "--launcher", "mpi"], job.cmd("env"))
    assert code == 2 and "--launcher mpi is not supported" in stderr


def test_help_lists_every_option_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ["--num-workers", "--num-servers", "--launcher", "--hostfile", "--sync-dst-dir",
                "--env", "--env-server", "--env-worker", "--p3", "--port", "--root-uri",
                "--scheduler-host", "--remote-dir", "--ssh", "--linger", "--kill-grace",
                "--max-restarts", "--as-is", "--log-level"]:
        assert opt in text
    assert "(default: 10.0)" in text and "(default: 3.0)" in text
    assert "(default: same as -n)" in text
    flat = " ".join(text.split())
    assert "a bare python or python3 in COMMAND is the launcher's own interpreter" in flat
    assert "1 when the workers succeeded without ever joining the servers" in flat


def test_forwarding_passes_progress_to_a_terminal_and_drops_it_elsewhere():
    """Carriage-return segments (a progress bar's refreshes) reach a terminal only; a
    worker's rank line relabels its later lines."""
    import io
    from slimgc_mx.launch.job import LaunchedJob
    from slimgc_mx.launch.plan import Task
    text = (b"starting\nbar 1/3\rbar 2/3\rbar 3/3\r\nslimgc: worker 1 is kvstore rank 0 of 2\n"
            b"epoch done\npartial")
    seen = {}
    for terminal in (True, False):
        task = Task("worker", 1, None, launch.LocalRunner(), {})
        sink = io.BytesIO()
        job = LaunchedJob([task], ["true"], ".", 1.0, 1.0)
        job._forward(task, io.BufferedReader(io.BytesIO(text)), sink, terminal)
        seen[terminal] = sink.getvalue()
        assert task.rank == 0 and task.prefix == "[rank 0] "
    assert b"[worker 1] bar 2/3\r" in seen[True] and b"bar" not in seen[False]
    assert seen[False] == (b"[worker 1] starting\n[worker 1] \n"
                           b"[rank 0] slimgc: worker 1 is kvstore rank 0 of 2\n"
                           b"[rank 0] epoch done\n[rank 0] partial\n")


# ---------------------------------------------------------------- real MXNet job

MX_JOB = textwrap.dedent('''
    import mxnet as mx
    kv = mx.kv.create("dist_sync")
    assert kv.num_workers == 2, kv.num_workers
    assert type(kv).__name__ == "KVStore" and kv.type == "dist_sync", (type(kv), kv.type)
    kv.init(3, mx.nd.ones((2, 3)))
    kv.push(3, mx.nd.ones((2, 3)) * (kv.rank + 1))
    out = mx.nd.zeros((2, 3))
    kv.pull(3, out=out)
    assert (out.asnumpy() == 3).all(), out.asnumpy()
    print("dist_sync sum ok on rank", kv.rank)
''')


@pytest.mark.multiprocess
def test_real_mxnet_dist_sync_job(job):
    pytest.importorskip("mxnet")
    script = job.tmp / "mx_job.py"
    script.write_text(MX_JOB)
    start = time.monotonic()
    code, stdout, stderr = job.run(["-n", "2", "-s", "2", "--linger", "5"],
                                   [sys.executable, str(script)], timeout=40)
    assert code == 0, stdout + stderr
    assert stdout.count("dist_sync sum ok on rank") == 2
    assert {line.split("]")[0] for line in stdout.splitlines() if "sum ok" in line} == {
        "[worker 0", "[worker 1"}
    # run through slimgc_mx.run, a stock dist_sync job is unchanged: its servers and
    # scheduler leave with the workers, nothing is flagged
    assert "-m slimgc_mx.run" in stderr and "still ran" not in stderr
    assert time.monotonic() - start < 40


@pytest.mark.multiprocess
def test_netns_launcher_runs_a_job_on_rate_limited_links(job):
    """--launcher netns: every process in its own namespace; the namespaces are gone after."""
    pytest.importorskip("mxnet")
    from slimgc_mx.launch import netns
    ok, why = netns.netns_available()
    if not ok:
        pytest.skip("network namespaces unavailable here: " + why)
    script = job.tmp / "mx_job.py"
    script.write_text(MX_JOB)
    p = job.start(["-n", "2", "-s", "1", "--launcher", "netns", "--bandwidth", "100mbit"],
                  [sys.executable, str(script)])
    try:
        stdout, stderr = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("launcher hung\n%s\n%s" % p.communicate())
    assert p.returncode == 0, stdout + stderr
    assert stdout.count("dist_sync sum ok on rank") == 2
    assert "each in its own namespace on a 100mbit link" in stderr
    # its namespaces (named for the launcher's pid: other jobs may run beside it) are gone
    mine = "%s%d-" % (netns.NS_PREFIX, p.pid)
    assert [ns for ns in netns.list_namespaces() if ns.startswith(mine)] == []
