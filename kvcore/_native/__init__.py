"""Native (Cython/C) kernels and bookkeeping for kvcore. Internal."""
