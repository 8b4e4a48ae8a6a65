"""Process exit with SlimGC stores alive: join the threads, finalize MXNet's kvstore, never hang.

After a failed aggregation in a distributed job MXNet's own shutdown (kvstore
finalize, engine wait) would block forever on the lost peer; a finalize can also
stall on its own. The guard is installed when the first store is created.
"""
import atexit
import os
import sys
import threading
import weakref

SHUTDOWN_TIMEOUT = 30.0  # seconds MXNet's dist kvstore finalize may take at exit

# Stores not closed yet, held until they are: one collected unclosed would free MXNet's
# dist kvstore in the middle of the program without its shutdown, which aborts the process.
_LIVE = set()
_ALL = weakref.WeakSet()
_uncaught = []
_installed = []
_lock = threading.Lock()


def track(store):
    """Watch `store` (closed at exit unless closed before); installs the guard once."""
    with _lock:
        if not _installed:
            _installed.append(True)
            previous = sys.excepthook

            def record_uncaught(exc_type, exc, tb):
                _uncaught.append(exc_type)
                previous(exc_type, exc, tb)

            sys.excepthook = record_uncaught
            atexit.register(_close_all)
    _LIVE.add(store)
    _ALL.add(store)


def untrack(store):
    """False if `store` was closed already."""
    if store not in _LIVE:
        return False
    _LIVE.discard(store)
    return True


def _close_all():
    """At exit: close every live store; if one cannot be closed, leave with os._exit.

    The status is 1 after a failed aggregation or an uncaught exception, else 0, and
    the exit comes before MXNet's own exit handler, which would wait forever.
    """
    closed = [store.close() for store in list(_LIVE)]
    if all(closed):
        return
    failed = any(store.broken for store in _ALL) or bool(_uncaught)
    sys.stderr.write("slimgc: %s; exiting without MXNet's kvstore shutdown, which would wait "
                     "forever\n" % ("an aggregation failed" if failed else
                                    "the kvstore finalize did not finish in %.0f s"
                                    % SHUTDOWN_TIMEOUT))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)
