"""The launcher's ssh mode on real hosts: network namespaces with their own addresses,
each running OpenSSH's sshd; the launcher runs in a namespace of its own and reaches
the hosts with a key pair made here. A 2-worker training job across the hosts, a host
whose processes are all killed (every host cleaned up), and the same with
--max-restarts (the job finishes with the weights of an uninterrupted run).

Needs root, network namespaces and openssh-server (scripts/run.sh installs it when it
runs as root on Debian); skipped with the reason otherwise.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from slimgc_mx.launch.netns import NetnsCluster, netns_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
HOSTS = ("worker 0", "worker 1")  # the cluster's node labels used as hosts
LAUNCHER_NODE = "scheduler"       # the namespace the launcher (and scheduler) runs in
TRAIN = ["--model", "mlp", "--dataset", "digits", "--epochs", "3", "--compressor", "2bit",
         "--comm-threshold", "4000", "--checkpoint-every", "8", "--log-every", "1",
         "--no-progress"]


def _why_not():
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    ok, why = netns_available()
    if not ok:
        return why
    for tool in (SSHD, shutil.which("ssh"), shutil.which("ssh-keygen")):
        if not tool or not os.path.exists(tool):
            return ("OpenSSH not installed (bash scripts/run.sh setup installs openssh-server "
                    "when run as root)")
    return None


pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def _ns_pids(ns):
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return {int(p) for p in r.stdout.split()}


class Hosts:
    """The namespaces, one sshd per host, the key pair, the hostfile."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.cluster = NetnsCluster(0, len(HOSTS), None, None, subnet="10.78.0", tag="ssh")
        self.sshd = {}

    def __enter__(self):
        self.cluster.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self):
        key = os.path.join(self.tmp, "id")
        hostkey = os.path.join(self.tmp, "hostkey")
        for path in (key, hostkey):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path],
                           check=True)
        shutil.copy(key + ".pub", os.path.join(self.tmp, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        with open(os.path.join(self.tmp, "hostfile"), "w") as f:
            for label in HOSTS:
                ip = self.cluster.ip(label)
                config = os.path.join(self.tmp, "sshd-%s.conf" % ip)
                with open(config, "w") as c:
                    c.write("ListenAddress %s\nPort 22\nHostKey %s\nAuthorizedKeysFile %s\n"
                            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                            "PidFile %s\n" % (ip, hostkey, os.path.join(self.tmp, "authorized_keys"),
                                              os.path.join(self.tmp, "sshd-%s.pid" % ip)))
                log = open(os.path.join(self.tmp, "sshd-%s.log" % ip), "w")
                self.sshd[label] = subprocess.Popen(
                    ["ip", "netns", "exec", self.cluster.ns(label), SSHD, "-D", "-e", "-f",
                     config], stdout=log, stderr=log)
                f.write("%s\n" % ip)
        self.hostfile = os.path.join(self.tmp, "hostfile")
        self.ssh = ("ssh -i %s -o UserKnownHostsFile=/dev/null -o BatchMode=yes "
                    "-o LogLevel=ERROR -o ConnectTimeout=5" % key)
        for label in HOSTS:  # wait until each sshd answers
            deadline = time.monotonic() + 15
            while True:
                r = subprocess.run(["ip", "netns", "exec", self.cluster.ns(LAUNCHER_NODE)]
                                   + self.ssh.split() + ["-o", "StrictHostKeyChecking=no",
                                                         self.cluster.ip(label), "true"],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    break
                assert time.monotonic() < deadline, "sshd on %s does not answer: %s" % (
                    label, r.stderr)
                time.sleep(0.2)

    def __exit__(self, *exc):
        for p in self.sshd.values():
            p.terminate()
        for p in self.sshd.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        for label in list(HOSTS) + [LAUNCHER_NODE]:  # nothing may outlive the namespaces
            for pid in _ns_pids(self.cluster.ns(label)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.cluster.__exit__(None, None, None)

    def job_pids(self, label):
        """Processes in a host's namespace other than its listening sshd."""
        return _ns_pids(self.cluster.ns(label)) - {self.sshd[label].pid}

    def launch(self, out, restarts=0):
        """Start the launcher in its namespace: 2 workers + 2 servers over ssh."""
        os.makedirs(out, exist_ok=True)
        argv = (["ip", "netns", "exec", self.cluster.ns(LAUNCHER_NODE), sys.executable, "-m",
                 "slimgc_mx.launch", "--launcher", "ssh", "-H", self.hostfile, "--ssh", self.ssh,
                 "--remote-dir", ROOT, "-n", "2", "-s", "2", "--kill-grace", "2",
                 "--env", "OMP_NUM_THREADS:1", "--max-restarts", str(restarts), "--",
                 sys.executable, "scripts/train.py"] + TRAIN
                + ["--checkpoint-dir", os.path.join(out, "ckpt"),
                   "--json", os.path.join(out, "result.json")])
        self.log = open(os.path.join(out, "launcher.log"), "w+")
        return subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    pytest.importorskip("mxnet")  # every job here trains with it
    with Hosts(str(tmp_path_factory.mktemp("ssh"))) as h:
        yield h


def _finish(hosts, proc, timeout=240):
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("launcher still running after %d s:\n%s" % (timeout, hosts.output()[-4000:]))
    return proc.returncode


def _sha(out):
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)["weights_sha256"]


def _kill_host_after_step(hosts, proc, label, step, timeout=120):
    """Once rank 0 logs `step`, SIGKILL every process on host `label` but its sshd."""
    deadline = time.monotonic() + timeout
    while "[rank 0] step %d " % step not in hosts.output():
        assert proc.poll() is None, "job ended before step %d:\n%s" % (step, hosts.output())
        assert time.monotonic() < deadline, hosts.output()[-4000:]
        time.sleep(0.05)
    victims = hosts.job_pids(label)
    assert victims, "no job process on %s" % label
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def _assert_hosts_clean(hosts, within=15):
    deadline = time.monotonic() + within
    left = None
    while time.monotonic() < deadline:
        left = {label: hosts.job_pids(label) for label in HOSTS}
        left[LAUNCHER_NODE] = _ns_pids(hosts.cluster.ns(LAUNCHER_NODE))
        if not any(left.values()):
            return
        time.sleep(0.2)
    pytest.fail("processes left on the hosts after the job: %s" % left)


@pytest.fixture(scope="module")
def reference(hosts, tmp_path_factory):
    """An uninterrupted job across the two hosts: its weights."""
    out = str(tmp_path_factory.mktemp("reference"))
    proc = hosts.launch(out)
    assert _finish(hosts, proc) == 0, hosts.output()[-4000:]
    _assert_hosts_clean(hosts)
    return out


def test_a_training_job_runs_across_the_hosts(hosts, reference):
    text = open(os.path.join(reference, "launcher.log")).read()
    assert "ssh launcher" in text and "epoch   3" in text, text[-3000:]
    assert len(_sha(reference)) == 64


def test_a_lost_host_stops_the_job_and_every_host_is_cleaned_up(hosts, tmp_path):
    proc = hosts.launch(str(tmp_path))
    _kill_host_after_step(hosts, proc, HOSTS[1], 10)
    code = _finish(hosts, proc, timeout=60)
    assert code != 0, hosts.output()[-3000:]
    _assert_hosts_clean(hosts)


def test_with_max_restarts_a_lost_host_is_survived_with_the_same_weights(hosts, reference,
                                                                        tmp_path):
    proc = hosts.launch(str(tmp_path), restarts=1)
    _kill_host_after_step(hosts, proc, HOSTS[1], 20)
    assert _finish(hosts, proc) == 0, hosts.output()[-4000:]
    text = hosts.output()
    assert "restart 1 of 1 after" in text and "resumed from" in text, text[-4000:]
    assert _sha(str(tmp_path)) == _sha(reference)
    _assert_hosts_clean(hosts)
