"""Entry point of `python -m slimgc_mx.bench`."""
import sys

from . import main

sys.exit(main())
