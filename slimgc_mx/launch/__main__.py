"""`python -m slimgc_mx.launch`: the launcher (standard library only)."""
import sys

from .cli import main

sys.exit(main())
