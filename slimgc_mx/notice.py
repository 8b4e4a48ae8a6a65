"""What the user must hear whatever their logging setup: the CTTab's decision, a setting
that lost to another source. Standard library only.

A message goes to the `slimgc_mx` logger when that logger would show it (a handler is
configured at INFO or below), else straight to stderr with a `slimgc:` prefix, as
MXNet's and Python's own warnings reach a script that configured no logging.
"""
import logging
import sys

log = logging.getLogger("slimgc_mx")
_TOLD = set()  # messages already told (once=True)


def tell(message, once=False):
    """Show `message` to the user once per process when `once`; returns whether it was shown."""
    if once:
        if message in _TOLD:
            return False
        _TOLD.add(message)
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", message)
    else:
        sys.stderr.write("slimgc: %s\n" % message)
        sys.stderr.flush()
    return True

