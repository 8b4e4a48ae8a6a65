"""The fused full-precision route: tensors below BestCT share one transfer and one update.

Sent one by one, every small tensor pays a transfer, three pipeline hand-offs and
an optimizer call in Python, 0.3-0.5 ms of CPU per key and step
(scripts/per_key_cost.py), where MXNet's own kvstore pays one call into C++. On a
model with many small tensors that is several percent of the step. After the
CTTab's decision, a FusedRoute packs the full-precision keys into one flat
fp_buf per server: each member's grad_buf and agg become views into it, so the
gradient copy the training thread makes anyway fills the fused buffer, one
transfer moves it, and the finisher updates every member with one Updater call
(MXNet's multi-tensor optimizer ops).
"""
import numpy as np

from .transport import FUSED_KEY_BASE


class Bucket:
    """Consecutive member keys in one flat grad_buf / agg, sent as one wire key.

    It stands in for a KeyBuffers of the full-precision route in the pipeline.
    `pending` holds the (key, KeyBuffers, step, local) of the members pushed since
    the last transfer; the bucket is sent once every member is in it.
    """

    codec = None
    device = None
    bit_send = None

    def __init__(self, members, wire_key, make_buffer):
        self.members = members  # {user key: KeyBuffers}, in key order
        self.size = sum(b.size for b in members.values())
        self.nbytes = 4 * self.size
        self.fp_key = wire_key
        self.grad_buf = make_buffer((self.size,), np.float32)
        self.agg = make_buffer((self.size,), np.float32)
        offset = 0
        for b in members.values():
            b.grad_buf = self.grad_buf.view(offset, b.shape)
            b.agg = self.agg.view(offset, b.shape)
            offset += b.size
        self.pending = []
        self.settings = None  # the optimizer settings of the first push since the last transfer

    @property
    def label(self):
        """How messages name the bucket, e.g. 'keys 0..64 (fused)'."""
        keys = list(self.members)
        if len(keys) == 1:
            return "key %r (fused)" % (keys[0],)
        return "keys %r..%r (fused)" % (keys[0], keys[-1])

    def holds(self, key):
        """True when `key` was pushed since the last transfer."""
        return any(entry[0] == key for entry in self.pending)

    def add(self, key, buffers, step, local, settings):
        """Record that `key`'s gradient of `step` is in grad_buf; True once every member is.

        local: the member's local update (backup) has run, as in ModelBackup.publish.
        """
        if not self.pending:
            self.settings = settings
        self.pending.append((key, buffers, step, local))
        return len(self.pending) == len(self.members)

    def take(self):
        """The pushes to send now (the bucket starts collecting the next round)."""
        pending, self.pending = self.pending, []
        return pending


class FusedRoute:
    """The buckets of the full-precision keys: one per server, split by bytes in key order.

    One bucket per server keeps every server busy, as the per-key route does
    (consecutive wire keys go to consecutive servers). Building it declares the
    buckets' wire keys, so every worker must build it at the same point.
    """

    def __init__(self, members, transport, make_buffer, first_wire_key=FUSED_KEY_BASE):
        self.keys = list(members)
        self.buckets = []
        self._of = {}
        for group in _split(list(members.items()), transport.num_servers):
            bucket = Bucket(dict(group), first_wire_key + len(self.buckets), make_buffer)
            transport.declare(bucket.fp_key, bucket.grad_buf)
            self.buckets.append(bucket)
            for key, _ in group:
                self._of[key] = bucket

    def __contains__(self, key):
        return key in self._of

    def bucket(self, key):
        return self._of[key]

    def partial(self):
        """Buckets holding some but not all of their members' pushes."""
        return [b for b in self.buckets if b.pending]


def _split(items, parts):
    """`items` ((key, KeyBuffers) in key order) cut into at most `parts` runs of similar bytes."""
    parts = max(1, min(parts, len(items)))
    total = sum(b.nbytes for _, b in items)
    groups, current, done = [], [], 0
    for i, (key, b) in enumerate(items):
        current.append((key, b))
        done += b.nbytes
        left = len(items) - i - 1
        wanted = parts - len(groups) - 1  # groups still to start after this one
        if wanted and (done >= total * (len(groups) + 1) / parts or left == wanted):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
