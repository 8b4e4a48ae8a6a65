"""N workers as threads on a ThreadGroup, with no framework imported: the runner that the
MXNet helpers (training_helpers) and the framework-free engines (host_engine,
numpy_engine) share."""
import threading

from slimgc_mx.transport import ThreadGroup


def in_threads(num_workers, fn, piece_bytes=0, timeout=120):
    """Run fn(rank, transport) on num_workers threads; [result per rank]. The first failure
    is re-raised; a worker still running after `timeout` seconds is a TimeoutError.
    piece_bytes: buffers larger than this travel as pieces (ThreadGroup)."""
    group = ThreadGroup(num_workers, piece_bytes=piece_bytes)
    results, errors = [None] * num_workers, []

    def run(rank):
        try:
            results[rank] = fn(rank, group.transport(rank))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a worker thread did not finish in %d s" % timeout)
    return results


def frameworks_loaded_by(code, timeout=300):
    """Run `code` in a fresh interpreter (in tests/, the project importable); the
    frameworks it left loaded, e.g. [] or ['mxnet']. A failure of `code` fails the test."""
    import ast
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    probe = code + "\nimport sys\nprint(sorted(m for m in ('mxnet', 'torch') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=here, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, PYTHONPATH=os.path.dirname(here)))
    assert r.returncode == 0, r.stderr[-3000:]
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])
