"""Default CPU thread count of the kernels: the CPUs this process may run on.

SLIMGC_NUM_THREADS overrides it; this is the one place that variable is read.
"""
import numbers
import os

ENV_VAR = "SLIMGC_NUM_THREADS"


def available_cpus():
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity
        return os.cpu_count() or 1


def default_num_threads():
    """SLIMGC_NUM_THREADS when set, else available_cpus()."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return available_cpus()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError("%s must be an integer >= 1, got %r; unset it to use all %d CPUs"
                         % (ENV_VAR, raw, available_cpus()))
    return value


def check_num_threads(value):
    """Validate an explicit thread count (None means the default)."""
    if value is None:
        return default_num_threads()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError("num_threads must be an integer >= 1 (or None for the default), got %r"
                         % (value,))
    return int(value)
