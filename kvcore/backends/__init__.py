"""Compute backends of kvcore.  Internal.

``reference`` holds plain NumPy float64 implementations, the oracle every
kernel is tested against; ``cpu`` holds the C kernels (runtime SIMD
dispatch, GIL released).  A backend sees only arrays and block ids, never
a pool or a sequence.
"""
