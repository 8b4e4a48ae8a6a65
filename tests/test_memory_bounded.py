"""Memory stays bounded: the host bytes a worker allocates per codec at N = 4 on fc's
tensors, against compressor 'none', and gcomp's slot in pieces (bit for bit the sums of
its whole slot, buffers of one piece)."""
import numpy as np
import pytest

from codec_contract import assert_same, gradient
from slimgc_mx import codecs
from slimgc_mx.bench import shapes
from slimgc_mx.codecs.gcomp import MAX_PIECES, layout
from slimgc_mx.engine.grad_buf import KeyBuffers
from slimgc_mx.transport.host import HostBuffer

N = 4


def worker_bytes(name, model="fc", num_workers=N):
    """(bytes of the buffers KeyBuffers allocates and the codec's work arrays, bytes MXNet
    holds for the gathers) of one worker over the model's tensors.

    A gather's pulled rows are held twice inside MXNet besides the receive buffer (its
    kvstore's receive array of the key, and the row_sparse array the pull fills), once
    per wire key; a sum is pulled into the pushed array itself."""
    allocated = []

    def make_buffer(shape, dtype):
        buf = HostBuffer(shape, dtype)
        buf.nd = buf.held()  # what lanes32 reads the dtype of
        allocated.append(buf.nbytes)
        return buf

    proto = None if name == "none" else codecs.create(name)
    host = mxnet = 0
    for _, shape in shapes.get(model).tensors:
        codec = proto.clone() if proto is not None else None
        if codec is not None and not codec.compresses(tuple(shape)):
            codec = None
        b = KeyBuffers(0, shape, codec, num_workers, make_buffer, lanes32=True)
        if codec is not None and hasattr(codec, "work_bytes"):
            host += codec.work_bytes(b.size, num_workers)
        rounds = {id(r): r for rs in b.round_sets for r in rs}.values()
        mxnet += sum(2 * r.recv.nbytes for r in rounds if r.route == "gather")
    return host + sum(allocated), mxnet


def test_every_codec_within_three_times_none_at_four_workers():
    """The whole worker stays within 2x the same job with compressor 'none' when what a
    codec adds is at most the model's float32 bytes x 4: the job without compression also
    holds MXNet's parameters, gradients and optimizer state (>= 2x, with momentum 3x) and
    MXNet's runtime, beside none's grad_buf and agg (2x). So: codec <= 3 x none's 2x."""
    model_bytes = 4 * shapes.get("fc").elements
    none, none_mxnet = worker_bytes("none")
    assert none == 2 * model_bytes and none_mxnet == 0
    over = {}
    for name in codecs.available():
        host, mxnet = worker_bytes(name)
        if host + mxnet > 3 * none:
            over[name] = round((host + mxnet) / model_bytes, 2)
    assert not over, "x the model's float32 bytes, bound 6: %r" % over


def test_gcomp_pulls_pieces_not_whole_slots():
    """fc's large keys travel in MAX_PIECES pieces: a worker receives N pieces, not N
    slots of 34 bits per element (before: 5.7 bytes per parameter at N = 4)."""
    size = 4096 * 4096
    blocks, header, cols, rows, piece = layout(size, 2 ** 0.25)
    assert piece and len(rows) == MAX_PIECES and rows[0] == MAX_PIECES * piece
    assert rows[0] * cols * 24 >= size * 34
    b = KeyBuffers(0, (4096, 4096), codecs.create("gcomp"), N, HostBuffer)
    assert len({id(r) for rs in b.round_sets for r in rs}) == 1
    assert b.rounds[0].recv.nbytes == N * piece * cols * 4 < 0.2 * 4 * size
    assert b.codec.push_rounds(size, N) == (0,) * MAX_PIECES


def stream(cs, grads, residuals, size):
    """One push of every worker through its pieces, as the pipeline runs it: encode into a
    piece, next_round between the gathers, decode of the last; (decoded sums, rounds)."""
    n = len(cs)
    lanes = cs[0].piece_lanes(size)
    rounds = len(cs[0].push_rounds(size, n))
    sends = [np.zeros(lanes, np.float32) for _ in cs]
    for j, c in enumerate(cs):
        c.encode(grads[j], residuals[j], n, out=sends[j], rank=j)
    for done in range(rounds - 1):
        result = np.concatenate(sends)
        sends = [c.next_round(done, result, sends[j], n) for j, c in enumerate(cs)]
    result = np.concatenate(sends)
    return [c.decode(result, size, n) for c in cs], rounds


@pytest.mark.slow
@pytest.mark.parametrize("reference, size, n", [(False, 600_007, 3), (True, 200_003, 2)])
def test_gcomp_pieces_decode_as_the_whole_slot(reference, size, n):
    """Four pushes (the first at the top class, then the code table, sparse gradients, a
    class that cuts blocks): sums, residuals and state bit for bit those of whole slots;
    kernels and the NumPy reference."""
    runs = []
    for streamed in (True, False):
        cs = [codecs.create("gcomp", reference=reference) for _ in range(n)]
        residuals = [np.zeros(size, np.float32) for _ in range(n)]
        history = []
        for step in range(4):
            g_rng = np.random.default_rng(step)
            grads = [gradient(g_rng, size) for _ in range(n)]
            if step == 2:
                grads = [np.where(g_rng.random(size) < 0.8, 0, g).astype(np.float32)
                         for g in grads]
            if step == 3:
                for c in cs:
                    c.wire_class = 1  # a slot smaller than the payload: blocks deferred
            if streamed and len(cs[0].push_rounds(size, n)) > 1:
                decoded, _ = stream(cs, grads, residuals, size)
            else:
                slots = np.concatenate([c.encode(g, r, n, rank=j) for j, (c, g, r)
                                        in enumerate(zip(cs, grads, residuals))])
                decoded = [c.decode(slots, size, n) for c in cs]
            history.append((decoded, [r.copy() for r in residuals], cs[0].state_dict()))
        runs.append(history)
    for step, ((da, ra, sa), (db, rb, sb)) in enumerate(zip(*runs)):
        for d in da:
            assert_same(d, db[0], "decoded sum step %d" % step)
        for x, y in zip(ra, rb):
            assert_same(x, y, "residual step %d" % step)
        assert sa == sb


def test_gcomp_piece_rounds_refuse_misuse():
    size = 600_007
    c = codecs.create("gcomp")
    lanes = c.piece_lanes(size)
    with pytest.raises(RuntimeError, match="without a streamed encode"):
        c.next_round(0, np.zeros(2 * lanes, np.float32), np.zeros(lanes, np.float32), 2)
    c.encode(gradient(np.random.default_rng(0), size), np.zeros(size, np.float32), 2,
             out=np.zeros(lanes, np.float32))
    with pytest.raises(RuntimeError, match="out of order"):
        c.next_round(1, np.zeros(2 * lanes, np.float32), np.zeros(lanes, np.float32), 2)


def test_gcomp_pieces_through_the_kvstore_train_as_whole_slots(monkeypatch):
    """2 thread workers through the kvstore: a 16384 x 12 weight travels in pieces; the
    weights end bit for bit those of the same job with every slot whole."""
    import training_helpers as th
    from slimgc_mx.codecs import gcomp

    def run():
        return th.slimgc_workers(2, lambda: th.dense_net((16384, 4)), th.batches(6),
                                 compressor="gcomp", comm_threshold="off", backup=False)
    calls = []
    real = gcomp.GComp.next_round
    monkeypatch.setattr(gcomp.GComp, "next_round",
                        lambda self, *a: calls.append(a[0]) or real(self, *a))
    assert layout(16384 * 12, 2 ** 0.25)[4]
    streamed = run()
    assert calls and set(calls) == {0}  # two pieces per push: one next_round
    monkeypatch.setattr(gcomp, "PIECE_LANES", 1 << 40)
    assert not layout(16384 * 12, 2 ** 0.25)[4]
    whole = run()
    (w0, s0), (w1, _) = streamed
    for a, b, c in zip(w0, w1, whole[0][0]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert s0["bytes_pulled"] == 2 * s0["bytes_pushed"]
    assert s0["compressed_transfers"] == 4 * 6


def test_benchmarks_page_shows_these_bytes_and_a_command_the_harness_takes():
    """docs/benchmarks.md, "Resident memory": its host-buffer row is what worker_bytes
    counts now, and its command parses into configurations the harness runs."""
    import os
    import re
    import shlex
    from slimgc_mx.bench import cluster
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md")
    with open(path, encoding="utf-8") as f:
        page = f.read().split("## Resident memory", 1)[1]
    lines = page.splitlines()
    head = next(line for line in lines if line.startswith("| codec |"))
    names = [c.strip() for c in head.strip("|").split("|")][1:]
    assert sorted(names) == sorted(set(codecs.available()))
    row = next(line for line in lines if line.startswith("| host buffers |"))
    model_bytes = 4 * shapes.get("fc").elements
    for name, cell in zip(names, [c.strip() for c in row.strip("|").split("|")][1:]):
        assert float(cell.split()[0]) == round(worker_bytes(name)[0] / model_bytes, 2), name
    command = re.search(r"```bash\n(.*?)```", page, re.S).group(1).replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "slimgc_mx.bench", "cluster"]
    opts = cluster.parse_args(argv[4:], "cluster")
    assert (opts.model, opts.workers, opts.servers, opts.bandwidth) == ("fc", 4, 4, "1gbit")
    for name in opts.config_list:
        cluster.config_args(name)
    assert {"fp32", "none-alone", "gcomp-alone"} <= set(opts.config_list)
