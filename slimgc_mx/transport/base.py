"""What every transport offers: fixed-shape float arrays ("wire keys") summed over workers."""
import threading

from .keys import WireKeys


class TransportTimeout(TimeoutError):
    """A transfer did not complete within the configured timeout."""


class TransferHandle:
    """A transfer in flight; `wait()` returns once the summed result is in `recv`.

    It blocks without a limit: the training thread, not the pipeline thread,
    enforces the timeout (see backup.ModelBackup.wait_version).
    """

    def __init__(self, recv, elapsed=None):
        self._recv = recv
        self.elapsed = elapsed  # set by emulated links: the modeled transfer time

    def wait(self):
        self._recv.for_read()


class PiecesHandle(TransferHandle):
    """A transfer sent as pieces: done once every piece of `recv` has its sum."""

    def __init__(self, recv, pieces):
        super().__init__(recv)
        self._pieces = pieces

    def wait(self):
        for nd in self._pieces:
            nd.wait_to_read()


def piece_bounds(size, itemsize, piece_bytes):
    """[(lo, hi), ...] element ranges of at most piece_bytes each, or None for one piece."""
    per = max(1, piece_bytes // itemsize) if piece_bytes else size
    if size <= per:
        return None
    return [(lo, min(lo + per, size)) for lo in range(0, size, per)]


def wait_readable(arrays, timeout):
    """Block until every NDArray in `arrays` (or the one NDArray) is readable, or raise
    TransportTimeout after `timeout` seconds in all.

    For the rare collective calls made on the training thread (broadcast, allgather).
    """
    arrays = arrays if isinstance(arrays, list) else [arrays]
    if timeout is None:
        for nd in arrays:
            nd.wait_to_read()
        return
    done = threading.Event()
    err = []

    def waiter():
        try:
            for nd in arrays:
                nd.wait_to_read()
        except Exception as exc:  # surfaced in the caller below
            err.append(exc)
        done.set()

    threading.Thread(target=waiter, name="slimgc-wait", daemon=True).start()
    if not done.wait(timeout):
        raise TransportTimeout(
            "a transfer did not complete in %.0f s: a worker or server may have died "
            "(raise SLIMGC_TIMEOUT if your steps are legitimately slower)" % timeout)
    if err:
        raise err[0]


class Transport:
    """Sums fixed-shape arrays over workers; `declare` must run in the same order everywhere."""

    rank = 0
    num_workers = 1
    num_servers = 1
    kind = "abstract"
    timeout = None
    bigarray_bound = None  # elements from which MXNet splits an array over all servers

    @property
    def keys(self):
        """The owner of this transport's wire keys (made on first use)."""
        if "_wire_keys" not in self.__dict__:
            self._wire_keys = WireKeys()
        return self._wire_keys

    @property
    def pieces_declared(self):
        """Wire keys made by splitting declared buffers into pieces."""
        return self.keys.pieces_taken

    def declare(self, wire_key, buf):
        """Create `wire_key` with the shape and dtype of `buf` (collective)."""
        raise NotImplementedError

    def pieces(self, wire_key):
        """[(lo, hi), ...]: the element ranges of wire_key's buffer that travel as wire keys
        of their own, each pushed as soon as it is written (push_pull's in_pieces), or None
        when the buffer goes whole."""
        return None

    def announce(self, wire_keys):
        """The training thread's order of the exchanges to come (push_pull or gather of each
        wire key, in this order on every worker). Keyed transports ignore it; a transport
        whose collectives pair up by order alone (torch.distributed) issues them in it."""

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        """Start summing `send` over workers into `recv`; returns a TransferHandle.

        priority: MXNet's priority of the push and pull operators (higher goes first).
        in_pieces: engine operators queued before this call are writing send's pieces
        (send.pieces(self.pieces(wire_key))); each piece goes once its writer is done,
        and nothing waits for the whole of `send`."""
        raise NotImplementedError

    def declare_gather(self, wire_key, send, recv):
        """Create `wire_key` for gather(): `send` holds one worker's slot, `recv` all N."""
        raise NotImplementedError

    def gather(self, wire_key, send, recv, priority=0):
        """Start collecting every worker's `send` into `recv`, worker j's in the j-th slot
        (an allgather); returns a TransferHandle. Values must survive x + 0 exactly."""
        raise NotImplementedError

    def broadcast(self, wire_key, buf):
        """Overwrite `buf` with rank 0's value (collective; wire_key must be declared)."""
        raise NotImplementedError

    def allgather(self, values):
        """Every worker's float64 vector, stacked as (num_workers, len) (collective)."""
        raise NotImplementedError

    def check_exact_sums(self):
        """Raise ServerPrecisionError unless float64 sums are exact (collective)."""
        if self.lossy_servers():
            raise RuntimeError("float64 sums of this transport are not exact")

    def lossy_servers(self):
        """How many servers sum float64 arrays inexactly (a collective probe; run it once)."""
        return 0

    def close(self, timeout=None):
        """Release the transport; returns False if that did not finish within `timeout`."""
        return True
