"""offload='auto': the CTTab's warm-up times the compressed route encoded on the device and
on CPU threads, and each size is compressed where its t^q is least; rank 0's choice is
every worker's, saved, replayed and told. Here the 'device' is torch ops on CPU tensors
(the torch device codec), so the whole path runs without a GPU."""
import math

import numpy as np
import pytest

from slimgc_mx.engine.config import SlimGCConfig
from slimgc_mx.engine.cttab import CTTab

torch = pytest.importorskip("torch")

from thread_workers import in_threads  # noqa: E402


def test_the_table_takes_the_faster_place_per_size():
    tab = CTTab("auto", 3, places=True)
    for step in range(3):
        for key, size, host, device in [("small", 4000, 0.001, 0.004),
                                        ("large", 4000000, 0.040, 0.010)]:
            tab.record(key, size, False, 0.05 if size > 4000 else 0.002)
            tab.record(key, size, True, 0.01, host, size // 16, where="host")
            tab.record(key, size, True, 0.01, device, size // 16, where="device")
    rows = {r["size"]: r for r in tab.build()}
    assert rows[4000]["where"] == "host" and rows[4000]["t_p_q"] == 0.001
    assert rows[4000000]["where"] == "device" and rows[4000000]["t_p_q"] == 0.010
    assert tab.placement_votes([4000, 4000000]) == [0.0, 1.0]
    tab.adopt(4000000, {4000000: "device"})
    assert tab.where(4000000, 10) == "device" and tab.where(4000, 10) == "host"
    state = tab.state_dict()
    again = CTTab("auto", 3, places=True)
    again.load_state_dict(state)
    assert again.where(4000000, 10) == "device"


def test_warmup_cycles_full_precision_host_and_device():
    tab = CTTab("auto", 6, places=True)
    routes = [(tab.compressed(100, s), tab.where(100, s)) for s in range(6)]
    assert routes == [(True, "host"), (False, "host"), (True, "device")] * 2
    assert CTTab("auto", 6).where(100, 2) == "host"  # without placement: today's routes


def test_offload_option_accepts_auto_only_as_a_word():
    assert SlimGCConfig.from_sources({"offload": "auto"}, {}).offload == "auto"
    assert SlimGCConfig.from_sources({}, {"SLIMGC_OFFLOAD": "auto"}).offload == "auto"
    with pytest.raises(ValueError, match="offload"):
        SlimGCConfig(offload="sometimes").validate()


def _worker(rank, transport, places, steps=9):
    from slimgc_mx.engine.aggregator import Aggregator
    from slimgc_mx.torch.framework import TorchFramework
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3000, 70000)]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    framework = TorchFramework(params, {0: 0, 1: 0}, transport.num_workers)
    framework.has_device = places
    config = SlimGCConfig(compressor="2bit", offload="auto", warmup_steps=6, comm_threshold="auto")
    agg = Aggregator(config, transport, framework=framework)
    agg.set_optimizer(opt)
    for i, p in enumerate(params):
        agg.add_key(i, p.detach().numpy().copy())
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        for i, p in enumerate(params):
            agg.push(i, [torch.randn(p.shape, generator=gen)], [p])
    agg.flush()
    out = ([p.detach().numpy().copy() for p in params], agg.cttab.places,
           dict(agg.cttab.placement), [r.get("where") for r in agg.cttab.rows],
           agg.planner.route_summary(),
           [(r.get("t_p_q_host"), r.get("t_p_q_device")) for r in agg.cttab.rows])
    agg.close(join=True)
    return out


def test_every_worker_adopts_rank_0s_placement_and_weights_agree():
    r0, r1 = in_threads(2, lambda rank, t: _worker(rank, t, places=True))
    assert r0[1] and r1[1]
    assert r0[2] == r1[2]  # rank 0's placement everywhere
    assert all(w in ("host", "device") for w in r0[3]) and len(r0[3]) == 2
    for a, b in zip(r0[0], r1[0]):
        np.testing.assert_array_equal(a, b)
    assert "encoded on the device" in r0[4]
    for host, device in r0[5]:  # both places were timed in the warm-up
        assert 0 < host < math.inf and 0 < device < math.inf


def test_without_a_device_offload_auto_is_todays_host_route():
    r0, _ = in_threads(2, lambda rank, t: _worker(rank, t, places=False))
    assert not r0[1] and r0[2] == {} and all(w is None for w in r0[3])
    assert not math.isnan(r0[0][0][0])
