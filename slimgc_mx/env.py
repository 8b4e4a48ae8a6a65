"""The environment: every variable the library reads, and the only module of the library
that reads them (the experiments, slimgc_mx/bench/ and scripts/, read their jobs' own).

Standard library only, so the launcher and the kvstore share one list of names.
Variables are read when asked for (not at import), from `environ` when given; the
launcher and the benchmarks only write variables for the processes they start, or pass
their whole environment on to them.
"""
import collections
import numbers
import os

#: Options of the kvstore: SLIMGC_<OPTION> (see config.SlimGCConfig).
OPTION_PREFIX = "SLIMGC_"
#: CPU threads of the kernels (default: the CPUs this process may run on).
NUM_THREADS_VAR = "SLIMGC_NUM_THREADS"
#: Set by the launcher: the task's index within its role (worker 0, 1, ...).
LAUNCH_INDEX_VAR = "SLIMGC_LAUNCH_INDEX"
#: The ssh program of the launcher's ssh mode.
SSH_VAR = "SLIMGC_SSH"
#: Set by the launcher when its own output is a terminal (processes may draw progress bars).
TERMINAL_VAR = "SLIMGC_TERMINAL"
#: Where the benchmarks' mnist1d keeps its generated arrays (data_dir()).
DATA_DIR_VAR = "SLIMGC_DATA_DIR"
#: Read by the shell scripts only: the project venv (scripts/run.sh) and the Python that
#: creates it (run.sh) or builds the kernels (scripts/device_setup.sh).
VENV_VAR = "SLIMGC_VENV"
PYTHON_VAR = "SLIMGC_PYTHON"
#: Read by setup.py only: build the kernels without OpenMP.
NO_OPENMP_VAR = "SLIMGC_NO_OPENMP"
#: Variables of this project that are not kvstore options (config does not warn of them).
OWN_VARS = (NUM_THREADS_VAR, LAUNCH_INDEX_VAR, SSH_VAR, TERMINAL_VAR, DATA_DIR_VAR, VENV_VAR,
            PYTHON_VAR, NO_OPENMP_VAR)
#: What a launched worker prints once it knows its kvstore rank; the launcher then labels
#: the worker's lines with that rank (MXNet's ranks need not follow the launch order).
RANK_MARKER = "slimgc: worker %d is kvstore rank %d of %d"
RANK_MARKER_PATTERN = rb"^slimgc: worker \d+ is kvstore rank (\d+) of \d+$"

#: MXNet's engine runs CPU operators on this many threads (default 1). With one, a
#: worker's transfers (the kvstore's push and pull operators) and SlimGC's copies wait
#: behind every forward and backward operator queued before them (docs/launcher.md).
ENGINE_THREADS_VAR = "MXNET_CPU_WORKER_NTHREADS"
#: What the launcher gives every worker unless the caller chose.
WORKER_ENGINE_THREADS = 2
ENGINE_TYPE_VAR = "MXNET_ENGINE_TYPE"
BIGARRAY_BOUND_VAR = "MXNET_KVSTORE_BIGARRAY_BOUND"

#: MXNet 1.9.1's KVStoreDistServer never initializes its multi_precision_ flag; when the
#: heap hands it a nonzero byte the server sums float64 pushes in float32, which corrupts
#: packed lanes. With these glibc zero-fills every allocation (MALLOC_PERTURB_=255 covers
#: all of malloc's paths except its per-thread cache, which the tunable turns off), so the
#: flag reads false. The launcher sets them for servers; the kvstore checks the result.
SERVER_ENV = {"MALLOC_PERTURB_": "255", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
SERVER_ENV_TEXT = " ".join("%s=%s" % item for item in SERVER_ENV.items())


def _environ(environ):
    return os.environ if environ is None else environ


def is_set(name, environ=None):
    """True when variable `name` is set, blank included (the launcher then leaves it to the
    caller: OMP_NUM_THREADS, MXNet's engine threads)."""
    return name in _environ(environ)


def value(name, default=None, environ=None):
    """The value of variable `name` as set, or `default` (what the launcher's `--env NAME`
    forwards)."""
    return _environ(environ).get(name, default)


def env_count(name, unset_hint, environ=None):
    """The integer >= 1 in variable `name`, None when unset or blank.

    Anything else raises ValueError naming the variable, followed by `unset_hint`.
    """
    raw = _environ(environ).get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError("%s must be an integer >= 1, got %r; %s" % (name, raw, unset_hint))
    return int(raw)


# ---------------------------------------------------------------- CPU threads

def available_cpus():
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity
        return os.cpu_count() or 1


def default_num_threads(environ=None):
    """SLIMGC_NUM_THREADS when set, else available_cpus()."""
    value = env_count(NUM_THREADS_VAR, "unset it to use all %d CPUs" % available_cpus(),
                      environ)
    return available_cpus() if value is None else value


def check_num_threads(value):
    """Validate an explicit thread count (None means the default)."""
    if value is None:
        return default_num_threads()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError("num_threads must be an integer >= 1 (or None for the default), got %r"
                         % (value,))
    return int(value)


# ---------------------------------------------------------------- the project's own

def data_dir(environ=None):
    """SLIMGC_DATA_DIR: the directory where generated data sets are kept, or None."""
    return _environ(environ).get(DATA_DIR_VAR) or None


def ssh_program(environ=None):
    """SLIMGC_SSH: the launcher's ssh program and leading arguments (default: ssh)."""
    return _environ(environ).get(SSH_VAR) or "ssh"


def project_variables(environ=None):
    """{name: value} of every SLIMGC_* variable set, sorted by name (what a job inherits)."""
    env = _environ(environ)
    return {k: env[k] for k in sorted(env) if k.startswith(OPTION_PREFIX)}


# ---------------------------------------------------------------- kvstore options

def option_variables(names, environ=None):
    """{option: raw string} for every set, non-blank SLIMGC_<NAME> of the option `names`."""
    env = _environ(environ)
    out = {}
    for name in names:
        raw = env.get(OPTION_PREFIX + name.upper())
        if raw is not None and raw != "":
            out[name] = raw
    return out


def unknown_variables(names, environ=None):
    """[(variable, closest valid variable or None)] for SLIMGC_* variables that name no option."""
    import difflib
    valid = [OPTION_PREFIX + n.upper() for n in names] + list(OWN_VARS)
    out = []
    for var in sorted(_environ(environ)):
        if var.startswith(OPTION_PREFIX) and var not in valid:
            close = difflib.get_close_matches(var, valid, n=1, cutoff=0.6)
            out.append((var, close[0] if close else None))
    return out


# ---------------------------------------------------------------- the parameter-server job

def dmlc_role(environ=None):
    """DMLC_ROLE: 'worker', 'server', 'scheduler', or None outside a parameter-server job."""
    return _environ(environ).get("DMLC_ROLE") or None


def launched_as_worker(environ=None):
    """True in a worker process of a parameter-server job (DMLC_ROLE=worker, DMLC_NUM_WORKER set)."""
    env = _environ(environ)
    return env.get("DMLC_ROLE") == "worker" and bool(env.get("DMLC_NUM_WORKER"))


def launch_index(environ=None):
    """The launcher's index of this process within its role, or None when not launched by it."""
    raw = _environ(environ).get(LAUNCH_INDEX_VAR, "")
    return int(raw) if raw.isdigit() else None


def num_servers(environ=None):
    """DMLC_NUM_SERVER, at least 1."""
    return max(1, int(_environ(environ).get("DMLC_NUM_SERVER", "1") or 1))


def engine_threads(environ=None):
    """MXNet's CPU engine threads as the worker will see them (1 when unset or unreadable)."""
    try:
        return env_count(ENGINE_THREADS_VAR, "", environ) or 1
    except ValueError:  # not a count: MXNet would not get more threads from it either
        return 1


def async_engine(environ=None):
    """True when MXNet's engine runs operators asynchronously (not NaiveEngine)."""
    return "naive" not in _environ(environ).get(ENGINE_TYPE_VAR, "").lower()


def bigarray_bound(default, environ=None):
    """MXNET_KVSTORE_BIGARRAY_BOUND, setting `default` first when unset (MXNet reads it when
    its kvstore is created); a ValueError names the variable when it is not a positive count."""
    env = _environ(environ)
    raw = env.setdefault(BIGARRAY_BOUND_VAR, str(default))
    try:
        bound = int(raw)
    except ValueError:
        bound = 0
    if bound < 1:
        raise ValueError("%s=%r: expected a positive number of elements (unset it to use %d)"
                         % (BIGARRAY_BOUND_VAR, raw, default))
    return bound


# ---------------------------------------------------------------- torch.distributed's job

#: torch.distributed's variables, as torchrun sets them.
TORCH_DIST_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Set by torchrun: its agent hosts the store, and the count of restarts so far.
TORCH_AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
TORCH_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"

#: A torch.distributed job's rendezvous as torchrun describes it (torch_rendezvous()).
TorchRendezvous = collections.namedtuple(
    "TorchRendezvous", "rank world_size master_addr master_port agent_store attempt")


def torch_launched(environ=None):
    """True when a launcher set torch.distributed's WORLD_SIZE (else: a job of one)."""
    return "WORLD_SIZE" in _environ(environ)


def torch_rendezvous(environ=None):
    """The TorchRendezvous of torchrun's variables; a RuntimeError names those unset."""
    env = _environ(environ)
    missing = [v for v in TORCH_DIST_VARS if v not in env]
    if missing:
        raise RuntimeError("torch.distributed's variables %s are not set: start the job with "
                           "torchrun (or set them)" % ", ".join(missing))
    return TorchRendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"],
                           int(env["MASTER_PORT"]),
                           env.get(TORCH_AGENT_STORE_VAR, "").lower() == "true",
                           env.get(TORCH_RESTART_VAR, "0"))
