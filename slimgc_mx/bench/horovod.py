"""Horovod baselines of the cluster benchmark (horovod-fp32, horovod-fp16): its rendezvous
server and the environment each worker needs, on loopback or one namespace per worker.

Horovod is optional (bash scripts/run.sh horovod); this module imports it only in the
rendezvous subprocess, `python -m slimgc_mx.bench.horovod HOST1 HOST2 ...`, which prints
its port and serves until its stdin closes.
"""
import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional


def installed(python=sys.executable) -> bool:
    """Whether `python` can import horovod.mxnet (checked in a subprocess: importing
    Horovod imports MXNet)."""
    r = subprocess.run([python, "-c", "import horovod.mxnet"], capture_output=True)
    return r.returncode == 0


class Rendezvous:
    """Horovod's HTTP rendezvous for one job, and each worker's HOROVOD_* environment.

    hosts: the host name of every worker, in rank order (one name per namespace, or the
    same name for every worker on loopback). netns: the namespace the server runs in and
    its address there (reachable from every worker's namespace), or None for loopback.
    """

    def __init__(self, hosts: List[str], iface: str, netns: Optional[tuple] = None):
        self.hosts, self.iface, self.netns = hosts, iface, netns
        self.proc, self.port = None, None

    def __enter__(self):
        argv = [sys.executable, "-m", "slimgc_mx.bench.horovod"] + self.hosts
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns[0]] + argv
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=root,
                                     env=dict(os.environ, PYTHONPATH=root))
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.__exit__()
            raise RuntimeError("Horovod's rendezvous server did not start (%r)" % line)
        self.port = int(line)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def worker_env(self, rank: int) -> Dict[str, str]:
        """What worker `rank` needs to find the others (horovodrun sets the same)."""
        host = self.hosts[rank]
        local = [r for r, h in enumerate(self.hosts) if h == host]
        distinct = list(dict.fromkeys(self.hosts))
        return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": self.netns[1] if self.netns else "127.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": self.iface, "HOROVOD_HOSTNAME": host,
                "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(len(self.hosts)),
                "HOROVOD_LOCAL_RANK": str(local.index(rank)),
                "HOROVOD_LOCAL_SIZE": str(len(local)),
                "HOROVOD_CROSS_RANK": str(distinct.index(host)),
                "HOROVOD_CROSS_SIZE": str(len(distinct))}


def namespace_hosts_files(namespaces: Dict[str, str]):
    """/etc/netns/NS/hosts mapping this machine's host name to the namespace's own address
    (`ip netns exec` bind-mounts it over /etc/hosts): Horovod 0.28.1's Gloo device resolves
    the host name and ignores HOROVOD_GLOO_IFACE. Returns the files made, to remove later."""
    made = []
    name = socket.gethostname()
    for ns, ip in namespaces.items():
        folder = os.path.join("/etc/netns", ns)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "hosts")
        with open(path, "w") as f:
            f.write("127.0.0.1 localhost\n%s %s\n" % (ip, name))
        made.append(path)
    return made


def remove_hosts_files(paths):
    for path in paths:
        try:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass


def _serve(hosts: List[str]) -> int:
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    from horovod.runner.http.http_server import RendezvousServer
    slots = {}
    for h in hosts:
        slots[h] = slots.get(h, 0) + 1
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments([HostInfo(h, n) for h, n in slots.items()], len(hosts)))
    print(port, flush=True)
    sys.stdin.read()  # until the harness closes our stdin
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
