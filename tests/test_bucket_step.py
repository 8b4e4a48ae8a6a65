"""The device path's step schedule (engine/bucket_step.py) without a framework: NumPy
buckets and a NumPy device that log what the engine asks of them, one rank.

It holds the order of model backup on the device (each step's global update deferred to
the next step's first pass, after the tail that guards it is read), the tail's guard (a
non-finite flag writes nothing and is raised again), the start of buckets from backward in
bucket order once the watched step agrees, and the warm-up's timing and decision."""
import numpy as np
import pytest

from slimgc_mx.engine import backend
from slimgc_mx.engine.bucket_cttab import BucketRoutes
from slimgc_mx.engine.bucket_step import BucketStep, tail_size
from slimgc_mx.engine.offload import NonFiniteAggregateError
from slimgc_mx.engine.push_plan import COMPRESSED, FULL, bucket_plan

LR = 0.5


class _Work:
    def __init__(self, log, what):
        self.log, self.what, self.elapsed = log, what, None

    def wait(self):
        self.log.append(("waited", self.what))


class _Device:
    """backend.DeviceStep on NumPy: a world of one, a clock the buckets' encodes advance."""

    sums = True

    def __init__(self, log, n_tail):
        self.log = log
        self.counts = None
        self.tail = np.zeros(n_tail)
        self.clock = 0.0
        self.spans_read = []

    def start_sum(self, tensor):
        self.log.append(("sum", tensor.owner))
        return _Work(self.log, tensor.owner)

    def mark(self):
        return self.clock

    def span_seconds(self, spans):
        self.spans_read.append(len(spans))
        return [(m[1] - m[0]) + (m[3] - m[2]) for m in spans]

    def tail_slot(self, i):
        return self.tail[i:i + 1]

    def tail_slots(self, lo, hi):
        return self.tail[lo:hi]

    def zero_tail(self, lo):
        self.tail[lo:] = 0

    def send_tail(self, n, overlap, scale, rider_at, rider):
        self.tail[n] = overlap
        self.tail[:n + 1] *= scale
        self.log.append(("tail sent",))
        self._sent = self.tail.copy()

    def read_tail(self):
        self.log.append(("tail read",))
        return self._sent

    def clip(self, means, max_norm, norm_type):
        total = np.linalg.norm([np.linalg.norm(m, norm_type) for m in means], norm_type)
        for m in means:
            m *= min(1.0, max_norm / (total + 1e-6))
        return total


class _Lanes(np.ndarray):
    """A bucket's lanes, knowing their bucket (the log names the sum by it)."""


class _Bucket:
    """backend.ScheduledBucket on NumPy: plain SGD, an identity 'codec' whose encode costs
    `cost[route]` on the device's clock."""

    def __init__(self, j, log, device, size, codec=False, cost=None):
        self.j, self.log, self.device = j, log, device
        self.names = ["w%d" % j]
        self.indices = (j,)
        self.numel = size
        self.codec = "identity" if codec else None
        self.base_codec = None
        self.watch = None
        self.pushes = 0
        self.route = COMPRESSED if codec else FULL
        self.timing = self.mean = self.step = None
        self.offloaded = False
        self.glo = np.ones(size)
        self.param = self.glo.copy()
        self.works = []
        self.sent = None
        self.lanes = self._lanes(np.zeros(size))
        self.cost = cost or {}
        self.settled = None

    def _lanes(self, values):
        lanes = np.asarray(values, dtype=float).copy().view(_Lanes)
        lanes.owner = self.j
        return lanes

    lane_bytes = property(lambda self: self.lanes.nbytes)

    def plan(self, timed=False):
        return bucket_plan(self.route, 1, timed)

    def settings(self):
        pass

    def stage(self, parts):
        return False

    def unstage(self):
        pass

    def prefetch(self, parts):
        pass

    def local_step(self, grads, scale=None):
        self.log.append(("local", self.j))
        self.param = self.glo - LR * grads[0] * (1 if scale is None else scale)

    def global_step(self):
        self.log.append(("global", self.j))
        self.glo = self.glo - LR * self.mean
        self.mean = None

    def write_back(self):
        self.log.append(("write back", self.j))
        self.param = self.glo.copy()

    def settle(self, route):
        self.settled = self.route = route

    def _encode(self, grads, flag):
        self.log.append(("encode", self.j, self.route))
        self.device.clock += self.cost.get(self.route, 0.0)
        self.lanes = self._lanes(grads[0])
        flag[...] = 0.0 if np.isfinite(self.lanes).all() else 1.0

    def fill_full_precision(self, grads, flag):
        self._encode(grads, flag)

    def flat_for_codec(self, grads, num_workers, watch=None):
        self.pushes += 1
        return grads

    def encode_on_device(self, flat, num_workers, flag, rank=0, on_piece=None):
        self._encode(flat, flag)

    def encode_on_host(self, flat, num_workers, flag, rank=0, counts=None):
        self._encode(flat, flag)

    def round_parts(self):
        return [self.lanes]

    def next_round(self, i, flag):
        raise AssertionError("one round")

    def wait_sums(self):
        for w in self.works:
            w.wait()
        self.works = []

    def average(self, num_workers):
        self.mean = np.asarray(self.lanes) / num_workers

    def decode_sum(self, num_workers, counts=None):
        self.log.append(("decode", self.j))
        self.average(num_workers)


class _Config:
    compressor, timeout = "identity", 10.0

    def __init__(self, backup):
        self.backup = backup


class _OneRank:
    num_workers, rank = 1, 0


def _step(backup, n=2, codec=False, mode="fixed", warmup=0, cost=None):
    log = []
    device = _Device(log, tail_size(n, 0))
    buckets = [_Bucket(j, log, device, 3, codec, cost) for j in range(n)]
    routes = BucketRoutes([b.codec is not None for b in buckets], [12] * n,
                          [b.names[0] for b in buckets], mode=mode, warmup_steps=warmup)
    return BucketStep(buckets, routes, device, _Config(backup), _OneRank(), 0), log


def _grads(*values):
    return [np.full(3, v, dtype=float) for v in values]


def _without_waits(log):
    return [e for e in log if e[0] != "waited"]


def test_the_numpy_stand_ins_implement_the_protocols():
    step, _ = _step(True)
    assert backend.missing(step.buckets[0], backend.ScheduledBucket) == []
    assert backend.missing(step.device, backend.DeviceStep) == []


def test_with_backup_each_global_update_waits_for_the_next_steps_first_pass():
    """Model backup: a step's passes are local update, encode, sum per bucket; the global
    updates of that step run at the next step's first pass, after its tail is read; the
    parameters hold loc_buf (glo_buf minus this rank's own step)."""
    step, log = _step(backup=True)
    step.step(_grads(1.0, 2.0))
    assert _without_waits(log) == [("local", 0), ("encode", 0, FULL), ("sum", 0),
                                   ("local", 1), ("encode", 1, FULL), ("sum", 1),
                                   ("tail sent",)]
    assert [b.glo.tolist() for b in step.buckets] == [[1.0] * 3] * 2  # nothing applied yet
    assert step.buckets[1].param.tolist() == [0.0] * 3  # 1 - 0.5 * 2: loc_buf
    del log[:]
    step.step(_grads(4.0, 4.0))
    assert _without_waits(log)[:4] == [("tail read",), ("global", 0), ("global", 1),
                                       ("local", 0)]
    assert [b.glo.tolist() for b in step.buckets] == [[0.5] * 3, [0.0] * 3]
    assert step.buckets[0].param.tolist() == [-1.5] * 3  # from the new glo_buf
    step.finish_pending()
    assert [b.glo.tolist() for b in step.buckets] == [[-1.5] * 3, [-2.0] * 3]
    assert step.stats()["steps"] == 2 and step.stats()["transfers"] == 6


def test_without_backup_the_global_update_follows_the_tail_in_the_same_step():
    step, log = _step(backup=False)
    step.step(_grads(1.0, 2.0))
    assert _without_waits(log) == [("encode", 0, FULL), ("sum", 0), ("encode", 1, FULL),
                                   ("sum", 1), ("tail sent",), ("tail read",),
                                   ("global", 0), ("write back", 0),
                                   ("global", 1), ("write back", 1)]
    assert [b.param.tolist() for b in step.buckets] == [[0.5] * 3, [0.0] * 3]


@pytest.mark.parametrize("backup", [True, False])
def test_a_non_finite_flag_writes_nothing_and_is_raised_again(backup):
    step, log = _step(backup=backup)
    step.step(_grads(1.0, 1.0))
    step.finish_pending()
    before = [b.glo.copy() for b in step.buckets]
    del log[:]
    with pytest.raises(NonFiniteAggregateError, match=r"step \d: the gradient of w1 .*rank 0"):
        step.step(_grads(1.0, np.nan))
        step.finish_pending()  # backup: the tail is read at the next pass
    assert not [e for e in log if e[0] == "global"]
    assert all(np.array_equal(a, b.glo) for a, b in zip(before, step.buckets))
    with pytest.raises(NonFiniteAggregateError):
        step.step(_grads(1.0, 1.0))


def test_buckets_start_from_backward_in_bucket_order_once_the_watched_step_agrees():
    step, log = _step(backup=True)
    step.watch_backward()
    step.ready(0, lambda i: _grads(9.0, 9.0)[i])  # watching: backward starts nothing
    assert log == []
    step.step(_grads(1.0, 1.0), changed="")
    assert step.overlap == "deciding"
    step.step(_grads(1.0, 1.0))  # its first pass reads the watched step's verdict
    assert step.overlap == "on"
    del log[:]
    grads = _grads(3.0, 3.0)
    step.ready(1, lambda i: grads[i])  # bucket 1 first: it waits for bucket 0
    assert not [e for e in log if e[0] == "encode"]
    step.ready(0, lambda i: grads[i])
    assert [e for e in log if e[0] == "encode"] == [("encode", 0, FULL), ("encode", 1, FULL)]
    n = len(log)
    step.step(grads)  # both started: step() sends the tail only
    assert _without_waits(log[n:]) == [("tail sent",)]


def test_a_gradient_changed_after_backward_keeps_buckets_starting_in_step(capfd):
    step, log = _step(backup=True)
    step.watch_backward()
    step.step(_grads(1.0, 1.0), changed="the gradient of w0 changed after backward")
    step.step(_grads(1.0, 1.0))
    assert step.overlap == "off"
    assert "starts its buckets in step()" in capfd.readouterr().err
    del log[:]
    step.ready(0, lambda i: _grads(1.0, 1.0)[i])
    assert log == []  # backward starts nothing any more


def test_the_warm_up_times_each_route_and_settles_on_the_fastest():
    """Every bucket that can be compressed cycles through its routes, each pass timed from
    the encode to the decode; the marks are read once, at the decision, and each bucket
    settles on the fastest route (compressed only where it wins by the margin)."""
    step, log = _step(backup=True, n=2, codec=True, mode="auto", warmup=2,
                      cost={COMPRESSED: 1.0, FULL: 5.0})
    for _ in range(3):
        step.step(_grads(1.0, 1.0))
    encodes = [e[2] for e in log if e[0] == "encode" and e[1] == 0]
    assert encodes == [COMPRESSED, FULL, COMPRESSED]
    assert step.device.spans_read == [4]  # two buckets x two warm-up steps, read together
    assert [b.settled for b in step.buckets] == [COMPRESSED, COMPRESSED]
    assert step.stats()["cttab_phase"] == "decided"
    slow = _step(backup=True, n=1, codec=True, mode="auto", warmup=2,
                 cost={COMPRESSED: 4.0, FULL: 5.0})[0]
    for _ in range(3):
        slow.step(_grads(1.0))
    assert slow.buckets[0].settled == FULL  # 4 * 1.5 is not under 5
