"""Check that every worker has the same settings before they exchange a single gradient.

A worker that disagrees (another compressor, threshold, key shape, worker count)
would otherwise hang the job or decode garbage. Each setting is hashed to an
integer that float64 holds exactly, all workers' hashes are gathered, and any
difference raises on every worker, naming the setting and the ranks.
"""
import hashlib


class ConfigMismatchError(RuntimeError):
    """Workers disagree on a setting that must be identical everywhere."""


def fingerprint(value):
    """A 52-bit hash of repr(value), exact as a float64."""
    digest = hashlib.sha256(repr(value).encode()).digest()
    return float(int.from_bytes(digest[:8], "little") >> 12)


def check(transport, settings, what="configuration"):
    """Raise ConfigMismatchError unless all workers passed equal `settings` (a dict)."""
    names = sorted(settings)
    gathered = transport.allgather([fingerprint(settings[n]) for n in names])
    problems = []
    for col, name in enumerate(names):
        column = gathered[:, col]
        if (column != column[0]).any():
            groups = {}
            for rank, h in enumerate(column):
                groups.setdefault(h, []).append(rank)
            mine = [ranks for ranks in groups.values() if transport.rank in ranks][0]
            others = sorted(r for r in range(len(column)) if r not in mine)
            problems.append("%s=%r on ranks %s differs from ranks %s"
                            % (name, settings[name], mine, others))
    if problems:
        raise ConfigMismatchError(
            "rank %d: workers disagree on the %s: %s. Start every worker with the same "
            "options (compression_params, SLIMGC_* variables, model)."
            % (transport.rank, what, "; ".join(problems)))
