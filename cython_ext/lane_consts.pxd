# Constants shared by the codec kernels (kernels.pyx) and documented for the NumPy reference.

# Lanes per parallel work item. Fixed, so per-chunk partial sums (the 1bit/4bit
# trailer statistic) do not depend on the thread count; the NumPy reference reads it.
cdef enum:
    CHUNK_LANES = 1024
    # Elements per work item of the finiteness pre-check.
    CHECK_CHUNK = 65536
    # Lanes the decoder unpacks side by side: independent division chains keep the core busy.
    GROUP = 8
    # Width (float32 values) of a decoder table row: one fixed-size copy per super-digit.
    ROW = 8
    # Most digits a lane can hold (radix >= 2, 2**53): size of the encoders' level buffer.
    MAX_DIGITS = 53
    # Lanes an encoder quantizes in one level loop (its level buffer: BLOCK * MAX_DIGITS).
    BLOCK = 64
