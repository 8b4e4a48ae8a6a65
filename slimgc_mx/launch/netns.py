"""Network-namespace nodes: an emulated cluster on one machine (`--launcher netns`).

One Linux network namespace per process (scheduler, servers, workers) plus one holding
a bridge; each node's eth0 is a veth whose other end is a bridge port, and a tbf qdisc
on both ends limits upload and download to the given rate: a full-duplex link per node
to a switch. Standard library only (it runs `ip` and `tc`); needs root.
"""
import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional

from .errors import LaunchError
from .runners import Runner, local_argv

NS_PREFIX = "slimgc-"           # every namespace the launcher creates starts with this
NODE_IFACE = "eth0"             # a node's interface inside its namespace
RATE_PATTERN = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.I)
DELAY_PATTERN = re.compile(r"^\d+(\.\d+)?(us|ms|s)$", re.I)


def _run(argv: List[str], check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), proc.returncode,
                                                   proc.stderr.strip() or proc.stdout.strip()))
    return proc


def netns_available() -> (bool, str):
    """Whether this process can build the emulated cluster; otherwise the reason why not."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, "%r not found (install iproute2)" % tool
    probe = "%sprobe-%d" % (NS_PREFIX, os.getpid())
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as e:
        return False, "cannot create a network namespace: %s" % e
    try:
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["ip", "-n", probe, "link", "set", "v0", "gso_max_size", str(gso_bytes(10 ** 9))])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root"] + tbf_args(10 ** 9))
    except RuntimeError as e:
        return False, "veth, gso_max_size or tc tbf unavailable: %s" % e
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "ok"


def rate_bits(text: str) -> float:
    """A tc rate ('1gbit', '10gbit', '100mbit', '125mbps') in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", text.strip().lower())
    if not m:
        raise ValueError("not a tc rate: %r" % text)
    value = float(m.group(1)) * 1000 ** " kmgt".index(m.group(2) or " ")
    return value * (8 if m.group(3) == "bps" else 1)


def tbf_burst(bits_per_s: float) -> int:
    """Bytes a link sends at once: 0.25 ms of traffic, at least 8 KiB. A message finding the
    bucket full skips the rate for that many bytes (256 KiB let whole tensors skip it)."""
    return max(8192, int(bits_per_s / 8 / 4000))


def gso_bytes(bits_per_s: float) -> int:
    """The largest packet a node hands its link (gso_max_size): half the burst, at most
    64 KiB, as tbf splits a packet larger than its burst into frames, at half the rate."""
    return min(65536, tbf_burst(bits_per_s) // 2)


def tbf_args(bits_per_s: float) -> List[str]:
    """Token bucket for a rate, with tbf_burst's burst."""
    return ["tbf", "rate", "%dbit" % int(bits_per_s), "burst", str(tbf_burst(bits_per_s)),
            "latency", "100ms"]


def netem_available() -> bool:
    """Whether the kernel has sch_netem (needed for --delay only)."""
    probe = "%snetem-%d" % (NS_PREFIX, os.getpid())
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "netem", "delay", "1ms"])
        return True
    except RuntimeError:
        return False
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def list_namespaces() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale(force=False) -> List[str]:
    """Delete this harness's namespaces whose creating process is gone (all with force)."""
    removed = []
    for ns in list_namespaces():
        m = re.match(re.escape(NS_PREFIX) + r"(?:probe-|netem-)?(\d+)", ns)
        if not m:
            continue
        pid = int(m.group(1))
        if not force and pid != os.getpid() and os.path.exists("/proc/%d" % pid):
            continue
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed


class NetnsCluster:
    """Namespaces for the scheduler, servers and workers on one bridge, tc on every link.

    Each node has eth0 with its own address; the other end of its veth sits in a
    bridge namespace. A tbf qdisc on both ends limits upload and download to
    --bandwidth; --delay (netem) is added once per direction, on the node's egress.
    Nothing is created in the caller's namespace. As a context manager teardown always runs.
    """

    def __init__(self, num_servers: int, num_workers: int, bandwidth: Optional[str],
                 delay: Optional[str], subnet: str = "10.77.0", tag: str = ""):
        self.prefix = "%s%d%s" % (NS_PREFIX, os.getpid(), ("-" + tag) if tag else "")
        self.bridge_ns = self.prefix + "-br"
        self.bandwidth, self.delay = bandwidth, delay
        self.nodes = {"scheduler": (self.prefix + "-sched", "%s.1" % subnet)}
        for i in range(num_servers):
            self.nodes["server %d" % i] = (self.prefix + "-s%d" % i, "%s.%d" % (subnet, 10 + i))
        for i in range(num_workers):
            self.nodes["worker %d" % i] = (self.prefix + "-w%d" % i, "%s.%d" % (subnet, 100 + i))
        self.created: List[str] = []

    def ns(self, label):
        return self.nodes[label][0]

    def ip(self, label):
        return self.nodes[label][1]

    def _shape(self, ns, dev, with_delay):
        """tbf for the rate, its packets no larger than gso_bytes; netem (rate and delay)
        when a delay is asked for."""
        qdisc = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"]
        if self.bandwidth:
            _run(["ip", "-n", ns, "link", "set", dev, "gso_max_size",
                  str(gso_bytes(rate_bits(self.bandwidth)))])
        if self.delay and with_delay:
            rate = ["rate", self.bandwidth] if self.bandwidth else []
            _run(qdisc + ["netem", "delay", self.delay] + rate + ["limit", "100000"])
        elif self.bandwidth:
            _run(qdisc + tbf_args(rate_bits(self.bandwidth)))

    def up(self):
        _run(["ip", "netns", "add", self.bridge_ns])
        self.created.append(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for k, (label, (ns, addr)) in enumerate(self.nodes.items()):
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            port = "v%d" % k
            _run(["ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer",
                  "name", NODE_IFACE, "netns", ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", addr + "/24", "dev", NODE_IFACE])
            _run(["ip", "-n", ns, "link", "set", NODE_IFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._shape(ns, NODE_IFACE, True)               # upload of this node
            self._shape(self.bridge_ns, port, False)        # download of this node
        return self

    def down(self):
        for ns in reversed(self.created):
            _run(["ip", "netns", "del", ns], check=False)
        self.created = []

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc):
        self.down()


def cluster_for(args):
    """The NetnsCluster of a `--launcher netns` job, after checking that this machine can
    make one; a LaunchError says why not."""
    if args.bandwidth and not RATE_PATTERN.match(args.bandwidth):
        raise LaunchError("--bandwidth %r: expected a tc rate such as 1gbit, 10gbit, 100mbit, "
                          "or none" % args.bandwidth)
    if args.delay and not DELAY_PATTERN.match(args.delay):
        raise LaunchError("--delay %r: expected a time such as 0.1ms or 100us" % args.delay)
    ok, why = netns_available()
    if not ok:
        raise LaunchError("--launcher netns: %s; use --launcher local" % why)
    if args.delay and not netem_available():
        raise LaunchError("--delay needs the kernel's netem qdisc, which this kernel lacks; "
                          "leave --delay out")
    return NetnsCluster(args.num_servers, args.num_workers, args.bandwidth or None, args.delay)


def describe_links(args):
    """', each process on its own 1gbit link' and the like, for the launcher's log."""
    rate = args.bandwidth or "unlimited"
    return ", each in its own namespace on a %s link%s" % (
        rate, " with %s delay" % args.delay if args.delay else "")


class NetnsRunner(Runner):
    """Start a node's command inside its network namespace (`ip netns exec NS ...`)."""

    def start(self, node, command, env, cwd):
        return self.spawn(["ip", "netns", "exec", node] + local_argv(command),
                          {**os.environ, **env}, cwd)


def main(argv=None):
    """`python -m slimgc_mx.launch.netns --check`: exit 0 if namespaces work here, else print why."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--check"]:
        print("usage: python -m slimgc_mx.launch.netns --check", file=sys.stderr)
        return 2
    ok, why = netns_available()
    if not ok:
        print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
