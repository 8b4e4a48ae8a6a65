"""One plan per push (push_plan.Plan): Planner.plan decides once where a push is encoded,
decoded and checked for NaN/Inf; the transfer carries that plan, immutable, and the
pipeline and the global update follow it. Runs on the NumPy backend, no framework."""
import dataclasses
import threading

import numpy as np
import pytest

import numpy_engine
from slimgc_mx import codecs
from slimgc_mx.engine.config import SlimGCConfig
from slimgc_mx.engine.grad_buf import FusedEncode, Push
from slimgc_mx.engine.offload import Pipeline, Transfer
from slimgc_mx.engine.planner import Planner
from slimgc_mx.engine import backend, stages
from slimgc_mx.engine.stages import Stages
from slimgc_mx.engine.push_plan import (BUCKET, COMPRESSED, DEVICE, ENCODER, FINISHER,
                                        FINITE, FINITE_IN_RANGE, FULL, HOST, HOST_CODEC,
                                        LOCAL_UPDATE, PIECES, TAIL, UPDATE, Plan, bucket_plan)
from slimgc_mx.engine.cttab import CTTab
from slimgc_mx.transport import HostBuffer, ThreadGroup
from thread_workers import in_threads

OPT = (0.05, 0.9, 1e-4, 0.5)  # learning_rate, momentum, wd, rescale_grad
#: numpy_engine.SHAPES in bytes: 12, 768, 8000, 28, 8448; from 256 bytes compressed
COMPRESSED_KEYS, FULL_KEYS = {"key 1", "key 2", "key 4"}, {"key 0", "key 3"}


def _plans(monkeypatch, config, steps=3, piece_bytes=0, optimizer=True):
    """{(label, step): plan} of every transfer rank 0 submits in a 2-worker NumPy run."""
    seen, lock = {}, threading.Lock()
    submit = Pipeline.submit

    def recording(self, transfer):
        if self.transport.rank == 0:
            with lock:
                seen[transfer.label, transfer.step] = transfer.plan
        return submit(self, transfer)

    monkeypatch.setattr(Pipeline, "submit", recording)
    w0, grads = numpy_engine.problem(2, steps, seed=5)
    if optimizer:
        in_threads(2, lambda rank, transport: numpy_engine._worker(
            "numpy", transport, w0, grads, rank, OPT, dict(config, threshold=0.05)),
            piece_bytes=piece_bytes)
    else:
        in_threads(2, lambda rank, transport: _sums(transport, w0, grads, rank, config))
    return seen


def _sums(transport, w0, grads, rank, config):
    """No optimizer: every push is a plain sum over the workers."""
    from slimgc_mx.engine.aggregator import Aggregator
    from slimgc_mx.engine.numpy_backend import NumpyFramework
    agg = Aggregator(SlimGCConfig(**config, threshold=0.05), transport,
                     framework=NumpyFramework())
    for k, w in enumerate(w0):
        agg.add_key(k, w.copy())
    for step_grads in grads:
        for k, g in enumerate(step_grads[rank]):
            agg.push(k, [g])
        agg.flush()
    agg.close(join=True)


def _keys(seen, labels):
    return {plan for (label, _), plan in seen.items() if label in labels}


def test_a_compressed_push_with_backup_is_encoded_and_checked_in_its_local_update(monkeypatch):
    seen = _plans(monkeypatch, dict(compressor="2bit", comm_threshold=256, backup=True))
    assert _keys(seen, COMPRESSED_KEYS) == {
        Plan(COMPRESSED, LOCAL_UPDATE, UPDATE, LOCAL_UPDATE, FINITE_IN_RANGE)}
    full = {plan for (label, step), plan in seen.items() if label not in COMPRESSED_KEYS}
    # step 0 per key, then the full-precision keys travel in a fused bucket
    assert full == {Plan(FULL, None, None, ENCODER, FINITE),
                    Plan(BUCKET, None, None, ENCODER, FINITE)}
    assert any("(fused)" in label for label, _ in seen)


def test_without_backup_the_encoder_encodes_and_checks(monkeypatch):
    seen = _plans(monkeypatch, dict(compressor="2bit", comm_threshold=256, backup=False))
    assert _keys(seen, COMPRESSED_KEYS) == {
        Plan(COMPRESSED, ENCODER, UPDATE, ENCODER, FINITE_IN_RANGE)}


class PiecedBuffer(HostBuffer):
    """A host buffer that lends an array per piece, as MXNet's Buffer does (Buffer.pieces)."""

    def pieces(self, bounds):
        return [self.view(lo, (hi - lo,)) for lo, hi in bounds]


def _planner(config, piece_bytes=0, device_codec=None):
    """(a planner of one worker, its key 'w' of 10,000 elements)."""
    transport = ThreadGroup(1, piece_bytes=piece_bytes).transport(0)
    cfg = SlimGCConfig(**config)
    planner = Planner(cfg, transport, codecs.create(cfg.compressor), CTTab("off"),
                      PiecedBuffer, device_codec, lambda key, step: None, lambda key: None)
    return planner, planner.add("w", (10000,))


@pytest.mark.parametrize("stream", [True, False])
def test_a_key_in_pieces_is_encoded_by_one_operator_per_piece(stream):
    planner, b = _planner(dict(compressor="2bit", comm_threshold="off", stream=stream),
                          piece_bytes=512)
    plan = planner.plan(b, 0, decodes_in_update=lambda b: True, local_kernel=True)
    if not stream:  # option stream off: the local update encodes the key whole
        assert plan == Plan(COMPRESSED, LOCAL_UPDATE, UPDATE, LOCAL_UPDATE, FINITE_IN_RANGE)
        return
    assert (plan.encode, plan.decode, plan.grad_check) == (PIECES, UPDATE, LOCAL_UPDATE)
    assert len(plan.pieces) > 1 and plan.pieces[-1].hi == b.size
    transfer = planner.transfer(Push("w", b, 0, local=True), object(), lambda b: True,
                                local_kernel=True)
    assert transfer.plan.encode == PIECES and transfer.check is not None
    # no local update to serve the encoder: the pipeline's encoder encodes and checks
    assert planner.plan(b, 1, decodes_in_update=lambda b: True) == Plan(
        COMPRESSED, ENCODER, UPDATE, ENCODER, FINITE_IN_RANGE)


@pytest.mark.parametrize("name, encode, decode, rounds", [
    ("qsgd", LOCAL_UPDATE, FINISHER, (0,)),  # fuses the local update, no decode table
    ("topk", ENCODER, FINISHER, (0,)),  # no fused kernel: the local update counts NaN/Inf
    ("gcomp", ENCODER, FINISHER, (0,)),  # reads the optimizer while encoding
    ("powersgd", ENCODER, FINISHER, (0, 1)),  # two rounds
])
def test_the_codec_decides_where_it_encodes_and_decodes(monkeypatch, name, encode, decode,
                                                         rounds):
    seen = _plans(monkeypatch, dict(compressor=name, comm_threshold=256, backup=True), steps=2)
    plans = _keys(seen, COMPRESSED_KEYS)
    assert {(p.encode, p.decode, p.grad_check, p.sum_check) for p in plans} == {
        (encode, decode, LOCAL_UPDATE, FINITE)}
    assert {p.rounds for p in plans} >= {rounds}
    # the one codec whose encoder reads the optimizer's view gets it through the plan
    assert {p.optimizer_view for p in plans} == {name == "gcomp"}


def test_the_warm_up_is_serial_and_checked_and_decoded_in_the_pipeline(monkeypatch):
    seen = _plans(monkeypatch, dict(compressor="2bit", warmup_steps=4, backup=True,
                                    cttab_rule="measured"), steps=5)  # (small keys: see cttab)
    warm = [plan for (_, step), plan in seen.items() if step < 4]
    assert warm and all(p.serial for p in warm)
    assert {(p.encode, p.decode, p.grad_check) for p in warm if p.compressed} == {
        (ENCODER, FINISHER, ENCODER)}
    assert not any(p.serial for (_, step), p in seen.items() if step >= 4)


def test_plain_sums_are_decoded_in_the_finisher(monkeypatch):
    seen = _plans(monkeypatch, dict(compressor="2bit", comm_threshold=256), optimizer=False)
    assert _keys(seen, COMPRESSED_KEYS) == {Plan(COMPRESSED, ENCODER, FINISHER, ENCODER, FINITE)}


def test_small_compressed_keys_share_a_compressed_bucket(monkeypatch):
    seen = _plans(monkeypatch, dict(compressor="2bit", comm_threshold=256, backup=True,
                                    fuse_compressed=9000))
    assert Plan(BUCKET, ENCODER, FINISHER, ENCODER, FINITE) in seen.values()


def test_a_key_placed_on_the_device_is_encoded_checked_and_decoded_there():
    device = object()
    planner, b = _planner(dict(compressor="2bit", comm_threshold="off", offload=False),
                          device_codec=lambda codec: device)
    assert b.device is device
    plan = planner.plan(b, 0, decodes_in_update=lambda b: True, local_kernel=True)
    assert plan == Plan(COMPRESSED, DEVICE, DEVICE, DEVICE, FINITE)
    transfer = planner.transfer(Push("w", b, 0, local=True), object(), lambda b: True,
                                local_kernel=True)
    assert transfer.plan == plan and transfer.check is None
    assert Stages.ready_array(transfer) is transfer.exchange.send  # encoded on the training thread


def test_the_plan_is_immutable_and_the_transfer_holds_no_route_flags():
    plan = Plan(FULL, None, None, ENCODER, FINITE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.encode = ENCODER
    fields = {f.name for f in dataclasses.fields(Transfer)}
    assert "plan" in fields
    assert not fields & {"compressed", "serial", "decode_in_update", "streamed", "wire_class"}


@pytest.mark.parametrize("change", ["decode in the finisher", "encode in the encoder"])
def test_the_pipeline_and_the_update_follow_the_plan(monkeypatch, change):
    """A plan moved to another site is carried out there, with the same weights bit for
    bit: the readers dispatch on the plan, they do not derive the conditions again."""
    config = dict(compressor="2bit", comm_threshold=256, backup=True, threshold=0.05)
    w0, grads = numpy_engine.problem(2, 3, seed=6)
    want = numpy_engine.run("numpy", w0, grads, OPT, config)
    plan = Planner.plan

    def moved(self, *args, **kwargs):
        p = plan(self, *args, **kwargs)
        if p.route != COMPRESSED:
            return p
        if change == "decode in the finisher":
            return dataclasses.replace(p, decode=FINISHER, sum_check=FINITE)
        return dataclasses.replace(p, encode=ENCODER)

    calls = {"decode": 0, "decode_table": 0, "fused": 0}
    codec = type(codecs.create("2bit"))
    for name in ("decode", "decode_table"):
        def counted(self, *args, _name=name, _fn=getattr(codec, name), **kwargs):
            calls[_name] += 1
            return _fn(self, *args, **kwargs)
        monkeypatch.setattr(codec, name, counted)
    fused_call = FusedEncode.__call__

    def fused(self, *args, **kwargs):
        calls["fused"] += 1
        return fused_call(self, *args, **kwargs)

    monkeypatch.setattr(FusedEncode, "__call__", fused)
    monkeypatch.setattr(Planner, "plan", moved)
    got = numpy_engine.run("numpy", w0, grads, OPT, config)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(got[rank][0], want[rank][0])):
            for x, y in zip(a, b):
                assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), step
    if change == "decode in the finisher":
        assert calls["decode"] > 0 and calls["decode_table"] == 0
    else:
        assert calls["fused"] == 0 and calls["decode_table"] > 0


class _RecordingBucket:
    """A device-path bucket (backend.DeviceBucket) that records which of its stages ran."""

    def __init__(self, rounds=1):
        self.calls, self.works, self.lanes, self.sent = [], [], "lanes", None
        self._rounds = rounds

    def fill_full_precision(self, grads, flag):
        self.calls.append("full")

    def flat_for_codec(self, grads, num_workers, watch=None):
        self.calls.append("flat")
        return "flat"

    def encode_on_device(self, flat, num_workers, flag, rank=0, on_piece=None):
        self.calls.append(("device", flat, rank))

    def encode_on_host(self, flat, num_workers, flag, rank=0, counts=None):
        self.calls.append(("host", flat, rank))

    def round_parts(self):
        return ["P", "Q"][:self._rounds]

    def next_round(self, i, flag):
        self.calls.append(("next", i))

    def wait_sums(self):
        self.calls.append("wait")

    def average(self, num_workers):
        self.calls.append(("average", num_workers))

    def decode_sum(self, num_workers, counts=None):
        self.calls.append(("decode", num_workers))


@pytest.mark.parametrize("route,rounds,encode,exchanged,decode", [
    (FULL, 1, ["full"], ["lanes"], ("average", 3)),
    (FULL, 2, ["full"], ["lanes"], ("average", 3)),  # a codec's rounds are not full precision's
    (COMPRESSED, 1, ["flat", ("device", "flat", 2)], ["lanes"], ("decode", 3)),
    (COMPRESSED, 2, ["flat", ("device", "flat", 2)], ["P", "Q"], ("decode", 3)),
    (HOST, 1, ["flat", ("host", "flat", 2)], ["lanes"], ("decode", 3))])
def test_a_device_bucket_runs_each_stage_where_its_plan_places_it(route, rounds, encode,
                                                                  exchanged, decode):
    """The device path's buckets get their plan from bucket_plan (the CTTab per bucket's
    route) and the engine's stages run each stage at its site through the adapter's bucket:
    the encode (full precision, the device codec, the host codec), each round's sum (a
    round after the first made from the previous sum, waited for), the decode."""
    for timed in (False, True):
        plan = bucket_plan(route, rounds, timed)
        assert plan is bucket_plan(route, rounds, timed)  # made once, shared, immutable
        assert plan.sum_check == TAIL
        assert plan.serial == timed and plan.route == route
        b = _RecordingBucket(rounds)
        stages.encode_bucket(plan, b, ["g"], 3, "flag", rank=2)
        assert b.calls == encode and b.sent is plan
        b.calls = []
        sums = []
        assert stages.exchange_bucket(plan, b, lambda part: sums.append(part) or part,
                                      "flag") == len(exchanged)
        assert sums == exchanged and b.works == [exchanged[-1]]
        assert b.calls == ([] if len(exchanged) == 1 else ["wait", ("next", 0)])
        b.calls = []
        stages.decode_bucket(plan, b, 3)
        assert b.calls == [decode]
    assert backend.missing(_RecordingBucket(), backend.DeviceBucket) == []


def test_a_device_bucket_plan_names_its_sites_and_refuses_others():
    assert bucket_plan(FULL).encode is None and bucket_plan(FULL).decode is None
    assert (bucket_plan(COMPRESSED).encode, bucket_plan(COMPRESSED).decode) == (DEVICE, DEVICE)
    assert bucket_plan(HOST).encode == HOST_CODEC and bucket_plan(HOST).grad_check == HOST_CODEC
    assert bucket_plan(COMPRESSED, 2).rounds == (0, 1) and bucket_plan(HOST, 2).rounds == (0,)
    with pytest.raises(ValueError, match="route is one of"):
        bucket_plan(BUCKET)
    b = _RecordingBucket()
    with pytest.raises(ValueError, match="device-path bucket is not encoded at 'encoder'"):
        stages.encode_bucket(dataclasses.replace(bucket_plan(COMPRESSED), encode=ENCODER),
                             b, ["g"], 3, "flag")
    with pytest.raises(ValueError, match="device-path bucket is not decoded at 'finisher'"):
        stages.decode_bucket(dataclasses.replace(bucket_plan(COMPRESSED), decode=FINISHER),
                             b, 3)
