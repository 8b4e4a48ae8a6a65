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


def env_count(name, unset_hint, environ=None):
    """The integer >= 1 in environment variable `name` (of `environ`, default os.environ),
    None when unset or blank.

    Anything else raises ValueError naming the variable, followed by `unset_hint`.
    """
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError("%s must be an integer >= 1, got %r; %s" % (name, raw, unset_hint))
    return int(raw)


def default_num_threads():
    """SLIMGC_NUM_THREADS when set, else available_cpus()."""
    value = env_count(ENV_VAR, "unset it to use all %d CPUs" % available_cpus())
    return available_cpus() if value is None else value


def check_num_threads(value):
    """Validate an explicit thread count (None means the default)."""
    if value is None:
        return default_num_threads()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError("num_threads must be an integer >= 1 (or None for the default), got %r"
                         % (value,))
    return int(value)
