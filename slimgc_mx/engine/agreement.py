"""Check that every worker has the same settings, and later the same global weights.

A worker that disagrees (another compressor, threshold, key shape, worker count)
would otherwise hang the job or decode garbage. Each value is hashed to an
integer that float64 holds exactly, all workers' hashes are gathered, and any
difference raises on every worker, naming the setting and the ranks.
"""
import hashlib


class ConfigMismatchError(RuntimeError):
    """Workers disagree on a setting that must be identical everywhere."""


class WeightDivergenceError(RuntimeError):
    """The consistency audit found workers whose global weights differ."""


def digest(data):
    """A 52-bit hash of `data` (bytes), exact as a float64."""
    return float(int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 12)


def fingerprint(value):
    """A 52-bit hash of repr(value), exact as a float64."""
    return digest(repr(value).encode())


def _differences(transport, names, hashes):
    """[(name, my ranks, other ranks)] for every name whose hash differs across workers."""
    gathered = transport.allgather(hashes)
    out = []
    for col, name in enumerate(names):
        column = gathered[:, col]
        if (column != column[0]).any():
            mine = [r for r in range(len(column)) if column[r] == column[transport.rank]]
            others = [r for r in range(len(column)) if r not in mine]
            out.append((name, mine, others))
    return out


def check(transport, settings, what="configuration"):
    """Raise ConfigMismatchError unless all workers passed equal `settings` (a dict)."""
    names = sorted(settings)
    problems = ["%s=%r on ranks %s differs from ranks %s" % (name, settings[name], mine, others)
                for name, mine, others in
                _differences(transport, names, [fingerprint(settings[n]) for n in names])]
    if problems:
        raise ConfigMismatchError(
            "rank %d: workers disagree on the %s: %s. Start every worker with the same "
            "options (compression_params, SLIMGC_* variables, model)."
            % (transport.rank, what, "; ".join(problems)))


def audit(transport, weights, step):
    """Raise WeightDivergenceError unless every worker holds the same `weights` ({name: bytes})."""
    names = list(weights)
    diffs = _differences(transport, names, [digest(weights[n]) for n in names])
    if diffs:
        name, mine, others = diffs[0]
        raise WeightDivergenceError(
            "consistency audit at step %d: global weights of parameter %s differ between "
            "ranks %s and ranks %s (%d parameters differ in all)"
            % (step, name, mine, others, len(diffs)))
