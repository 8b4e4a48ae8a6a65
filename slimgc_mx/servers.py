"""What MXNet 1.9.1 parameter servers need in their environment to sum float64 exactly.

MXNet 1.9.1's KVStoreDistServer never initializes its multi_precision_ flag; when the heap
hands it a nonzero byte, the server sums float64 pushes in float32 and corrupts SlimGC's
packed lanes. glibc then zero-fills every allocation (MALLOC_PERTURB_=255 covers all of
malloc's paths except its per-thread cache, which the tunable turns off), so the flag reads
false. The launcher sets these; the kvstore checks the result at start (docs/launcher.md).
"""

SERVER_ENV = {"MALLOC_PERTURB_": "255", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
SERVER_ENV_TEXT = " ".join("%s=%s" % item for item in SERVER_ENV.items())
