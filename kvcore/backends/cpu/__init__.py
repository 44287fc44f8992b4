"""CPU kernels (C, runtime SIMD dispatch) behind thin Cython wrappers.  Internal."""
