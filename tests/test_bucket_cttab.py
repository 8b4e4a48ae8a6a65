"""The CTTab per bucket (slimgc_mx/engine/bucket_cttab.py), the device path's placement of
each bucket: its warm-up, its choice, rank 0's routes adopted, its checkpoint. No framework:
the adapter hands it times."""
import numpy as np
import pytest

from slimgc_mx.engine import bucket_cttab

C, H, F = bucket_cttab.COMPRESSED, bucket_cttab.HOST, bucket_cttab.FULL


def test_a_bucket_is_compressed_only_where_it_wins_by_the_margin():
    s = lambda q, fp, host=None: {"q": q, "fp": fp, "host": host}  # noqa: E731
    assert bucket_cttab.choose([s(1.0, 1.6), s(1.0, 1.4), None, s(1.0, 0.5)], 0.5) == [C, F, F, F]
    assert bucket_cttab.choose([s(2.0, 3.0)], 0.5) == [F]  # a tie goes full precision
    assert bucket_cttab.choose([s(2.0, 3.0 + 1e-9)], 0.5) == [C]
    assert bucket_cttab.choose([s(1.0, 1.0), s(1.0, 1.01)], 0.0) == [F, C]
    assert bucket_cttab.choose([s(None, 1.0), s(1.0, None), {}], 0.0) == [F, F, F]
    # the host codec: the faster compressed route, the device on a tie, still by the margin
    assert bucket_cttab.choose([s(1.0, 1.6, 0.5), s(1.0, 1.6, 1.0), s(None, 1.6, 1.0),
                          s(3.0, 1.6, 1.1), s(None, None, 0.1)], 0.5) == [H, C, H, F, F]


def test_the_warm_up_alternates_keeps_the_fastest_and_decides():
    r = bucket_cttab.BucketRoutes([True, False, True], [4000, 16, 400], ["a", "b", "c"],
                            warmup_steps=4, margin=0.5)
    assert r.warming and r.route_names() == ["warm-up", "full precision", "warm-up"]
    assert [r.route(0, step) for step in range(4)] == [C, F, C, F]
    assert [r.route(1, step) for step in range(4)] == [F] * 4
    assert [r.due(step) for step in (3, 4)] == [False, True]
    for step, (q, fp) in enumerate([(5.0, 9.0), (1.0, 9.0)]):  # bucket 0: q 1 (its fastest)
        r.record(0, C, q, 2 * step)
        r.record(0, F, fp, 2 * step + 1)
        r.record(2, C, 2.0, 2 * step)  # bucket 2: 2 * 1.5 = 3.0, a tie
        r.record(2, F, 3.0, 2 * step + 1)
    r.record(1, C, 0.0, 0)  # not a candidate: no samples
    assert r.samples == [{"q": 1.0, "fp": 9.0}, None, {"q": 2.0, "fp": 3.0}]
    saved = r.state_dict()
    assert r.own_routes() == [C, F, F]
    r.adopt(r.own_routes())
    assert r.phase == "decided" and not r.due(10)
    assert r.route_names() == ["compressed", "full precision", "full precision"]
    assert [r.route(j, 11) for j in range(3)] == [C, F, F]
    r.record(0, C, 0.001, 5)  # after the decision: ignored
    assert r.samples[0]["q"] == 1.0
    line = r.summary()
    assert line.startswith("device path CTTab: 1 of 3 buckets compressed (3.9 KiB of 4.3 KiB)")
    assert "compressed: a" in line and "full precision: c" in line and "1.50" in line
    # a checkpoint mid-warm-up restores its samples, one after the decision its routes
    again = bucket_cttab.BucketRoutes([True, False, True], [4000, 16, 400], ["a", "b", "c"],
                                warmup_steps=4, margin=0.5)
    again.load_state_dict(saved)
    assert again.warming and again.samples == saved["samples"]
    again.load_state_dict(r.state_dict())
    assert again.routes == [C, F, F] and again.phase == "decided"
    old = dict(r.state_dict(), routes=[True, False, False])  # saved with two routes
    again.load_state_dict(old)
    assert again.routes == [C, F, F]
    fixed = bucket_cttab.BucketRoutes([True, False, True], [4000, 16, 400], ["a", "b", "c"],
                                mode="fixed")
    assert fixed.phase == "fixed" and not fixed.due(100)
    assert fixed.route_names() == ["compressed", "full precision", "compressed"]
    with pytest.raises(ValueError, match="same comm_threshold"):
        fixed.load_state_dict(saved)
    # nothing pays: every bucket full precision, and the line says the step is DDP's
    slow = bucket_cttab.BucketRoutes([True, True], [40, 40], ["a", "b"], warmup_steps=2)
    slow.record(0, C, 2.0, 0)
    slow.record(0, F, 1.0, 1)  # bucket 1: never timed on both routes
    slow.record(1, C, 0.1, 0)
    slow.adopt(slow.own_routes())
    assert slow.routes == [F, F] and "DDP's" in slow.summary()
    assert "not timed on both routes" in slow.summary()


def test_a_bucket_with_a_host_codec_cycles_three_routes():
    """hosts[j]: the warm-up cycles the device codec, the host codec and full precision;
    the host wins where it is the fastest by the margin, and the line says how many."""
    r = bucket_cttab.BucketRoutes([True, True, False], [4000, 400, 16], ["a", "b", "c"],
                            warmup_steps=6, margin=0.5, hosts=[True, False, True])
    assert r.hosts == [True, False, False]  # no codec, no host codec
    assert [r.route(0, step) for step in range(6)] == [C, H, F] * 2
    assert [r.route(1, step) for step in range(6)] == [C, F] * 3
    assert "compressed on the host" in r.opening()
    for step in range(6):
        r.record(0, r.route(0, step), {C: 2.0, H: 1.0, F: 9.0}[r.route(0, step)], step)
        r.record(1, r.route(1, step), {C: 1.0, F: 9.0}[r.route(1, step)], step)
    assert r.samples[0] == {"q": 2.0, "host": 1.0, "fp": 9.0}
    r.adopt(r.own_routes())
    assert r.routes == [H, C, F]
    assert r.route_names() == ["compressed on the host", "compressed", "full precision"]
    assert [r.route(j, 7) for j in range(3)] == [H, C, F]
    line = r.summary()
    assert "2 of 3 buckets compressed (1 on the host)" in line
    assert "on the host (device 2000.000 ms)" in line
    # a route a bucket cannot take is full precision: a checkpoint of another codec
    other = bucket_cttab.BucketRoutes([True, True, False], [4000, 400, 16], ["a", "b", "c"],
                                warmup_steps=6, margin=0.5)
    other.load_state_dict(r.state_dict())
    assert other.routes == [F, C, F]


def test_every_rank_adopts_rank_0s_routes():
    class Gathered:
        num_workers, rank = 2, 1

        def allgather(self, values):
            self.sent = list(values)
            return np.array([[1.0, 0.0, 2.0], values])
    transport = Gathered()
    assert bucket_cttab.agree(transport, [F, C, H]) == [C, F, H]
    assert transport.sent == [0.0, 1.0, 2.0]
    assert bucket_cttab.agree(None, [F, C]) == [F, C]  # one process
    r = bucket_cttab.BucketRoutes([True, True, True], [4, 4, 4], ["a", "b", "c"], warmup_steps=0,
                            hosts=[False, False, True])
    r.adopt(bucket_cttab.agree(transport, r.own_routes()))  # no samples: all full precision
    assert r.routes == [C, F, H] and "rank 0's choice" in r.reason
