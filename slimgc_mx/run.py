"""`python -m slimgc_mx.run SCRIPT [ARGS...]`: run a training script that knows nothing of
slimgc_mx (MXNet's example/image-classification/train_*.py, say) with the kvstore names
registered, so that `--kv-store dist_sync_slimgc` works without editing it.

Importing slimgc_mx imports no MXNet, so a server or scheduler process still enters its
loop at the script's own `import mxnet`.
"""
import os
import runpy
import sys

import slimgc_mx  # noqa: F401  (registers the names once the script imports MXNet)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print("python -m slimgc_mx.run: no script %r" % script, file=sys.stderr)
        return 2
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
