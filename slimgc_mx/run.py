"""`python -m slimgc_mx.run SCRIPT [ARGS...]` or `python -m slimgc_mx.run -m MODULE [ARGS...]`:
run a training script or module that knows nothing of slimgc_mx (MXNet's
example/image-classification/train_*.py, say) with the kvstore names registered, so that
`--kv-store dist_sync_slimgc` or kvstore='slimgc' works without editing it.

The script runs as `python SCRIPT` would run it (sys.argv, sys.path[0], __name__ ==
'__main__'). Importing slimgc_mx imports no MXNet, so a server or scheduler process still
enters its loop at the script's own `import mxnet`. The launcher (python -m slimgc_mx.launch)
runs `python SCRIPT` and `python -m MODULE` commands through this module.
"""
import os
import runpy
import sys

import slimgc_mx  # noqa: F401  (registers the names once the script imports MXNet)

USAGE = "usage: python -m slimgc_mx.run SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print("python -m slimgc_mx.run: -m needs a MODULE\n" + USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.exists(script):
        print("python -m slimgc_mx.run: no script %r\n%s" % (script, USAGE), file=sys.stderr)
        return 2
    sys.argv = argv
    if os.path.isfile(script):  # (run_path puts a directory or zip on sys.path itself)
        # `python SCRIPT` puts the script's directory first on sys.path, not the current
        # one that `python -m` put there
        here = os.path.dirname(os.path.realpath(script))
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = here
        else:
            sys.path.insert(0, here)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
