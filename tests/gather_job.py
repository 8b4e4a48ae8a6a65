"""The gather route under the launcher: random payloads of random lengths, checked bitwise.

Every role runs this file (servers stop at `import mxnet`). Each worker declares a few
gather keys of various slot shapes on DistTransport, then per round writes into its slot
a header (the payload's true length) and a payload drawn from (seed, key, round, rank),
so every worker knows what every other worker sent; it checks that the gathered array is
exactly every worker's slot side by side, and writes a summary to OUT/rank<r>.json.
    python -m slimgc_mx.launch -n 2 -s 2 python tests/gather_job.py --out DIR
"""
import argparse
import json
import os

import mxnet  # noqa: F401  (a server or scheduler process stops here)
import numpy as np

from slimgc_mx.mxnet.buffers import Buffer
from slimgc_mx.mxnet.dist import DistTransport

#: Slot shapes (rows, columns) of the keys: one lane, a thin column, a row of a few lanes,
#: and slots of many rows, which a small MXNET_KVSTORE_BIGARRAY_BOUND splits over servers
#: (at boundaries that fall inside a worker's slot).
SHAPES = ((1, 1), (5, 1), (1, 9), (7, 13), (11, 40))


def payload(seed, key, rnd, rank, lanes):
    """(length, float32 values) worker `rank` sends on `key` in round `rnd`: a random length
    below `lanes` (the header takes one lane), integers below 2**24 or plain floats."""
    rng = np.random.default_rng([seed, key, rnd, rank])
    length = int(rng.integers(0, lanes))
    if rng.integers(2):
        values = rng.integers(0, 1 << 24, size=length).astype(np.float32)
    else:
        magnitude = 10.0 ** rng.uniform(-44, 38, size=length)  # subnormals too
        values = (rng.choice([-1.0, 1.0], size=length) * magnitude).astype(np.float32)
    return length, values


def slot(seed, key, rnd, rank, lanes):
    """The whole slot: header, payload, then padding (a marker that must come back too)."""
    length, values = payload(seed, key, rnd, rank, lanes)
    out = np.full(lanes, 1000.0 + rnd, dtype=np.float32)
    out[0] = length
    out[1:1 + length] = values
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    t = DistTransport(timeout=60)
    n, rank = t.num_workers, t.rank
    keys = []
    for i, (rows, cols) in enumerate(SHAPES):
        send, recv = Buffer((rows, cols), np.float32), Buffer((n * rows, cols), np.float32)
        wire = t.keys.per_key(i).bit
        t.declare_gather(wire, send, recv)
        keys.append((i, wire, send, recv, rows * cols))
    checked = 0
    for rnd in range(args.rounds):
        handles = []
        for i, wire, send, recv, lanes in keys:
            send.for_write()[:] = slot(args.seed, i, rnd, rank, lanes)
            handles.append(t.gather(wire, send, recv))
        for (i, wire, send, recv, lanes), handle in zip(keys, handles):
            handle.wait()
            got = recv.for_read().reshape(n, lanes)
            for j in range(n):
                want = slot(args.seed, i, rnd, j, lanes)
                bad = np.flatnonzero(got[j].view(np.uint32) != want.view(np.uint32))
                if bad.size:
                    raise SystemExit(
                        "rank %d, key %d %s, round %d: worker %d's slot differs at %d lanes, "
                        "first lane %d: got %r, sent %r (header: got %r, sent %r)"
                        % (rank, i, SHAPES[i], rnd, j, bad.size, bad[0], got[j][bad[0]],
                           want[bad[0]], got[j][0], want[0]))
                checked += 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump({"rank": rank, "num_workers": n, "num_servers": t.num_servers,
                   "slots_checked": checked, "bigarray_bound": t.bigarray_bound}, f)
    t.close(timeout=30)


if __name__ == "__main__":
    main()
