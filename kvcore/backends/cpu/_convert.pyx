"""Round-to-nearest-even float32 <-> float16/bfloat16 kernels.

The Python-facing validation lives in ``kvcore/convert.py``; this module only
loops.  The C bodies are in ``kv_half.c`` (scalar + run-time dispatched SIMD).
"""
import os

cimport numpy as cnp
from libc.stdint cimport uint32_t

cnp.import_array()

cdef extern from "kv_half.h" nogil:
    int kvh_best_level()
    int kvh_level_supported(int level)
    int kvh_current_level()
    int kvh_set_level(int level)
    const char* kvh_level_name(int level)
    int KVH_NUM_LEVELS
    void kvh_f32_to_f16(const float* src, half_t* dst, Py_ssize_t n)
    void kvh_f32_to_bf16(const float* src, half_t* dst, Py_ssize_t n)
    void kvh_f16_to_f32(const half_t* src, float* dst, Py_ssize_t n)
    void kvh_bf16_to_f32(const half_t* src, float* dst, Py_ssize_t n)
    int kvh_convert(int sk, const void* src, int dk, void* dst, Py_ssize_t n)
    int kvh_convert_stream(int sk, const void* src, int dk, void* dst, Py_ssize_t n)
    void kvh_stream_fence()

F32 = KVH_F32
F16 = KVH_F16
BF16 = KVH_BF16


cdef void f32_to_f16(const float* src, half_t* dst, Py_ssize_t n) noexcept nogil:
    kvh_f32_to_f16(src, dst, n)


cdef void f32_to_bf16(const float* src, half_t* dst, Py_ssize_t n) noexcept nogil:
    kvh_f32_to_bf16(src, dst, n)


cdef void f16_to_f32(const half_t* src, float* dst, Py_ssize_t n) noexcept nogil:
    kvh_f16_to_f32(src, dst, n)


cdef void bf16_to_f32(const half_t* src, float* dst, Py_ssize_t n) noexcept nogil:
    kvh_bf16_to_f32(src, dst, n)


cdef int convert_n(int src_kind, const void* src, int dst_kind, void* dst,
                   Py_ssize_t n) noexcept nogil:
    return kvh_convert(src_kind, src, dst_kind, dst, n)


cdef int convert_n_stream(int src_kind, const void* src, int dst_kind, void* dst,
                          Py_ssize_t n) noexcept nogil:
    return kvh_convert_stream(src_kind, src, dst_kind, dst, n)


cdef void stream_fence() noexcept nogil:
    kvh_stream_fence()


cdef extern from "kv_fp8.h" nogil:
    void kvh_f32_to_fp8(int fmt, const float* src, uint8_t* dst, Py_ssize_t n,
                        float scale, int saturate)
    void kvh_fp8_to_f32(int fmt, const uint8_t* src, float* dst, Py_ssize_t n, float scale)
    float kvh_f32_to_i8_row(const float* src, int8_t* dst, Py_ssize_t n)
    void kvh_i8_to_f32(const int8_t* src, float* dst, Py_ssize_t n, float scale)


cdef void f32_to_fp8(int fmt, const float* src, uint8_t* dst, Py_ssize_t n,
                     float scale, int saturate) noexcept nogil:
    kvh_f32_to_fp8(fmt, src, dst, n, scale, saturate)


cdef void fp8_to_f32(int fmt, const uint8_t* src, float* dst, Py_ssize_t n,
                     float scale) noexcept nogil:
    kvh_fp8_to_f32(fmt, src, dst, n, scale)


cdef float f32_to_i8_row(const float* src, int8_t* dst, Py_ssize_t n) noexcept nogil:
    return kvh_f32_to_i8_row(src, dst, n)


cdef void i8_to_f32(const int8_t* src, float* dst, Py_ssize_t n, float scale) noexcept nogil:
    kvh_i8_to_f32(src, dst, n, scale)


cdef int _convert_strided(int sk, char* sp, const cnp.npy_intp* sst,
                          int dk, char* dp, const cnp.npy_intp* dst_st,
                          const cnp.npy_intp* shape, int nd) noexcept nogil:
    """Odometer over the outer axes; the last axis is one kernel call when it
    is contiguous on both sides, else element by element."""
    cdef Py_ssize_t idx[64]
    cdef Py_ssize_t inner = shape[nd - 1]
    cdef Py_ssize_t s_in = sst[nd - 1], d_in = dst_st[nd - 1]
    cdef Py_ssize_t s_item = kind_itemsize(sk), d_item = kind_itemsize(dk)
    cdef bint contiguous_inner = s_in == s_item and d_in == d_item
    cdef Py_ssize_t j
    cdef int ax
    for ax in range(nd):
        idx[ax] = 0
    while True:
        if contiguous_inner:
            if kvh_convert(sk, sp, dk, dp, inner) != 0:
                return -1
        else:
            for j in range(inner):
                if kvh_convert(sk, sp + j * s_in, dk, dp + j * d_in, 1) != 0:
                    return -1
        # advance the odometer over axes nd-2 .. 0
        ax = nd - 2
        while ax >= 0:
            idx[ax] += 1
            sp += sst[ax]
            dp += dst_st[ax]
            if idx[ax] < shape[ax]:
                break
            sp -= sst[ax] * shape[ax]
            dp -= dst_st[ax] * shape[ax]
            idx[ax] = 0
            ax -= 1
        if ax < 0:
            return 0


def convert_array(cnp.ndarray src, int src_kind, cnp.ndarray dst, int dst_kind):
    """Convert ``src`` into ``dst`` element by element.

    Both arrays have the same shape (any strides, 0-d and empty included),
    are aligned and must not overlap; the caller has checked dtypes, shape,
    alignment and overlap.
    The GIL is released while converting.
    """
    cdef int nd = cnp.PyArray_NDIM(src)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(src)
    cdef char* sp = <char*>cnp.PyArray_DATA(src)
    cdef char* dp = <char*>cnp.PyArray_DATA(dst)
    cdef int rc
    if n == 0:
        return
    # the kernels load and store typed elements (the caller copies
    # misaligned arrays; here it is an error, never undefined behaviour)
    if not cnp.PyArray_ISALIGNED(src) or not cnp.PyArray_ISALIGNED(dst):
        raise ValueError("internal: convert_array needs arrays aligned for their dtype")
    if nd == 0 or (cnp.PyArray_IS_C_CONTIGUOUS(src) and cnp.PyArray_IS_C_CONTIGUOUS(dst)):
        with nogil:
            rc = kvh_convert(src_kind, sp, dst_kind, dp, n)
    else:
        if nd > 64:
            raise ValueError(f"arrays of more than 64 dimensions are not supported, got {nd}")
        with nogil:
            rc = _convert_strided(src_kind, sp, cnp.PyArray_STRIDES(src),
                                  dst_kind, dp, cnp.PyArray_STRIDES(dst),
                                  cnp.PyArray_DIMS(src), nd)
    if rc != 0:
        raise ValueError(f"unknown element kinds {src_kind} -> {dst_kind}")


# ---------------------------------------------------------------- SIMD level

LEVELS = tuple(kvh_level_name(i).decode() for i in range(KVH_NUM_LEVELS))


def available_simd_levels():
    """Names of the conversion paths this CPU can run, lowest first."""
    return tuple(LEVELS[i] for i in range(KVH_NUM_LEVELS) if kvh_level_supported(i))


def best_simd_level():
    """Name of the path used by default: the fastest this CPU supports."""
    return LEVELS[kvh_best_level()]


def get_simd_level():
    """Name of the conversion path in use now."""
    return LEVELS[kvh_current_level()]


def set_simd_level(level):
    """Use the conversion path ``level`` from now on (process-wide).

    Returns the previous level's name.  Every path gives identical bits; this
    exists for tests and benchmarks.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    previous = get_simd_level()
    if kvh_set_level(LEVELS.index(level)) != 0:
        raise ValueError(
            f"level {level!r} is not supported by this CPU; available: {available_simd_levels()}")
    return previous


def _initial_level():
    # KVCORE_SIMD caps the level (e.g. KVCORE_SIMD=scalar to rule SIMD out
    # while debugging); it never asks for more than the CPU has.
    best = kvh_best_level()
    want = os.environ.get("KVCORE_SIMD", "").strip().lower()
    if not want:
        return best
    if want not in LEVELS:
        raise ImportError(f"KVCORE_SIMD must be one of {LEVELS}, got {want!r}")
    cap = LEVELS.index(want)
    while cap > 0 and not kvh_level_supported(cap):
        cap -= 1
    return min(cap, best)


kvh_set_level(_initial_level())
