"""Round-to-nearest-even float32 <-> float16/bfloat16 kernels.

The Python-facing validation lives in ``kvcore/convert.py``; this module only
loops.  The C bodies are in ``kv_half.c`` (scalar + run-time dispatched SIMD).
"""
cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, uint32_t

cnp.import_array()

cdef extern from "kv_half.h" nogil:
    int kvh_best_level()
    int kvh_default_level()
    int kvh_level_supported(int level)
    int kvh_current_level()
    int kvh_set_level(int level)
    int kvh_level_at_most(int level)
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


cdef extern from "kv_simd.h" nogil:
    int kvs_cap()
    const char* kvs_cap_text()
    const char* kvs_level_name(int level)
    int kvs_level_supported(int level)
    int KVS_NUM_LEVELS


cdef extern from "kv_fp8.h" nogil:
    void kvh_f32_to_fp8(int fmt, const float* src, uint8_t* dst, Py_ssize_t n,
                        float scale, int saturate)
    void kvh_fp8_to_f32(int fmt, const uint8_t* src, float* dst, Py_ssize_t n, float scale)
    const char* kvh_fp8_path(int level)
    float kvh_f32_to_i8_row(const float* src, int8_t* dst, Py_ssize_t n)
    void kvh_i8_to_f32(const int8_t* src, float* dst, Py_ssize_t n, float scale)
    void kvh_f32_to_fp8_rows(int fmt, const float* src, Py_ssize_t src_stride, uint8_t* dst,
                             Py_ssize_t dst_stride, Py_ssize_t rows, Py_ssize_t n, float scale,
                             int saturate, int stream)
    void kvh_f32_to_i8_rows(const float* src, Py_ssize_t src_stride, int8_t* dst,
                            Py_ssize_t dst_stride, float* scales, Py_ssize_t scale_stride,
                            Py_ssize_t rows, Py_ssize_t n, int stream)


cdef void f32_to_fp8_rows(int fmt, const float* src, Py_ssize_t src_stride, uint8_t* dst,
                          Py_ssize_t dst_stride, Py_ssize_t rows, Py_ssize_t n, float scale,
                          int saturate, int stream) noexcept nogil:
    kvh_f32_to_fp8_rows(fmt, src, src_stride, dst, dst_stride, rows, n, scale, saturate, stream)


cdef void f32_to_i8_rows(const float* src, Py_ssize_t src_stride, int8_t* dst,
                         Py_ssize_t dst_stride, float* scales, Py_ssize_t scale_stride,
                         Py_ssize_t rows, Py_ssize_t n, int stream) noexcept nogil:
    kvh_f32_to_i8_rows(src, src_stride, dst, dst_stride, scales, scale_stride, rows, n, stream)


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


# One elementwise job over two arrays: what _run_n does to a contiguous run.
cdef enum:
    _HALF = 0       # kvh_convert(src_kind -> dst_kind)
    _TO_FP8 = 1     # float32 -> fp8 (fmt, saturate)
    _FROM_FP8 = 2   # fp8 -> float32 (fmt)

cdef struct _Job:
    int op
    int src_kind, dst_kind      # _HALF
    int fmt, saturate           # _TO_FP8 / _FROM_FP8
    Py_ssize_t s_item, d_item   # bytes per element on each side


cdef int _run_n(const _Job* job, const char* sp, char* dp, Py_ssize_t n) noexcept nogil:
    """The job over ``n`` contiguous elements."""
    if job.op == _HALF:
        return kvh_convert(job.src_kind, sp, job.dst_kind, dp, n)
    if job.op == _TO_FP8:
        kvh_f32_to_fp8(job.fmt, <const float*>sp, <uint8_t*>dp, n, 1.0, job.saturate)
    else:
        kvh_fp8_to_f32(job.fmt, <const uint8_t*>sp, <float*>dp, n, 1.0)
    return 0


cdef int _run_strided(const _Job* job, const char* sp, const cnp.npy_intp* sst,
                      char* dp, const cnp.npy_intp* dst_st,
                      const cnp.npy_intp* shape, int nd) noexcept nogil:
    """Odometer over the outer axes; the last axis is one kernel call when it
    is contiguous on both sides, else element by element."""
    cdef Py_ssize_t idx[64]
    cdef Py_ssize_t inner = shape[nd - 1]
    cdef Py_ssize_t s_in = sst[nd - 1], d_in = dst_st[nd - 1]
    cdef bint contiguous_inner = s_in == job.s_item and d_in == job.d_item
    cdef Py_ssize_t j
    cdef int ax
    for ax in range(nd):
        idx[ax] = 0
    while True:
        if contiguous_inner:
            if _run_n(job, sp, dp, inner) != 0:
                return -1
        else:
            for j in range(inner):
                if _run_n(job, sp + j * s_in, dp + j * d_in, 1) != 0:
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


cdef int _run_array(const _Job* job, cnp.ndarray src, cnp.ndarray dst) except -2:
    """The job from ``src`` into ``dst`` (same shape, any strides, aligned,
    not overlapping: the caller has checked).  Returns the kernel's status
    (0, or -1 for unknown element kinds); the GIL is released while it runs."""
    cdef int nd = cnp.PyArray_NDIM(src)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(src)
    cdef const char* sp = <const char*>cnp.PyArray_DATA(src)
    cdef char* dp = <char*>cnp.PyArray_DATA(dst)
    cdef int rc
    if n == 0:
        return 0
    # the kernels load and store typed elements (the caller copies
    # misaligned arrays; here it is an error, never undefined behaviour)
    if not cnp.PyArray_ISALIGNED(src) or not cnp.PyArray_ISALIGNED(dst):
        raise ValueError("internal: conversion needs arrays aligned for their dtype")
    if nd == 0 or (cnp.PyArray_IS_C_CONTIGUOUS(src) and cnp.PyArray_IS_C_CONTIGUOUS(dst)):
        with nogil:
            rc = _run_n(job, sp, dp, n)
    else:
        if nd > 64:
            raise ValueError(f"arrays of more than 64 dimensions are not supported, got {nd}")
        with nogil:
            rc = _run_strided(job, sp, cnp.PyArray_STRIDES(src), dp, cnp.PyArray_STRIDES(dst),
                              cnp.PyArray_DIMS(src), nd)
    return rc


def convert_array(cnp.ndarray src, int src_kind, cnp.ndarray dst, int dst_kind):
    """Convert ``src`` into ``dst`` element by element.

    Both arrays have the same shape (any strides, 0-d and empty included),
    are aligned and must not overlap; the caller has checked dtypes, shape,
    alignment and overlap.
    The GIL is released while converting.
    """
    cdef _Job job
    job.op = _HALF
    job.src_kind = src_kind
    job.dst_kind = dst_kind
    job.s_item = kind_itemsize(src_kind)
    job.d_item = kind_itemsize(dst_kind)
    if _run_array(&job, src, dst) != 0:
        raise ValueError(f"unknown element kinds {src_kind} -> {dst_kind}")


FP8_E4M3 = KV_FP8_E4M3
FP8_E5M2 = KV_FP8_E5M2


def fp8_array(cnp.ndarray src, cnp.ndarray dst, int fmt, bint narrow, bint saturate=False):
    """float32 ``src`` -> fp8 bits ``dst`` (``narrow``), or fp8 bits ``src``
    -> float32 ``dst``; ``fmt`` is FP8_E4M3 or FP8_E5M2.  Same shape, any
    strides, aligned, not overlapping (the caller has checked, dtypes
    included).  The GIL is released while converting."""
    cdef _Job job
    if fmt != KV_FP8_E4M3 and fmt != KV_FP8_E5M2:
        raise ValueError(f"internal: unknown fp8 format {fmt}")
    job.op = _TO_FP8 if narrow else _FROM_FP8
    job.fmt = fmt
    job.saturate = saturate
    job.s_item = 4 if narrow else 1
    job.d_item = 1 if narrow else 4
    _run_array(&job, src, dst)


# ------------------------------------------------------ C-level test hooks
# Thin wrappers over the bulk C functions the pools call, for tests (the
# public conversions above never pass a scale or quantize to int8).

def f32_to_fp8_scaled(const float[::1] src, uint8_t[::1] dst, int fmt, float scale,
                      bint saturate):
    """kvh_f32_to_fp8 as it is: ``dst = fp8(src / scale)``."""
    if dst.shape[0] != src.shape[0] or fmt not in (KV_FP8_E4M3, KV_FP8_E5M2):
        raise ValueError("f32_to_fp8_scaled: dst must match src and fmt be FP8_E4M3/FP8_E5M2")
    with nogil:
        kvh_f32_to_fp8(fmt, &src[0] if src.shape[0] else NULL,
                       &dst[0] if dst.shape[0] else NULL, src.shape[0], scale, saturate)


def fp8_to_f32_scaled(const uint8_t[::1] src, float[::1] dst, int fmt, float scale):
    """kvh_fp8_to_f32 as it is: ``dst = float(src) * scale``."""
    if dst.shape[0] != src.shape[0] or fmt not in (KV_FP8_E4M3, KV_FP8_E5M2):
        raise ValueError("fp8_to_f32_scaled: dst must match src and fmt be FP8_E4M3/FP8_E5M2")
    with nogil:
        kvh_fp8_to_f32(fmt, &src[0] if src.shape[0] else NULL,
                       &dst[0] if dst.shape[0] else NULL, src.shape[0], scale)


def f32_to_i8_row_hook(const float[::1] src, int8_t[::1] dst):
    """kvh_f32_to_i8_row as it is: quantizes ``src`` into ``dst`` and
    returns the row's scale."""
    cdef float scale
    if dst.shape[0] != src.shape[0]:
        raise ValueError("f32_to_i8_row_hook: dst must match src")
    with nogil:
        scale = kvh_f32_to_i8_row(&src[0] if src.shape[0] else NULL,
                                  &dst[0] if dst.shape[0] else NULL, src.shape[0])
    return scale


def i8_to_f32_hook(const int8_t[::1] src, float[::1] dst, float scale):
    """kvh_i8_to_f32 as it is: ``dst = src * scale``."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("i8_to_f32_hook: dst must match src")
    with nogil:
        kvh_i8_to_f32(&src[0] if src.shape[0] else NULL,
                      &dst[0] if dst.shape[0] else NULL, src.shape[0], scale)


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


def registry_levels():
    """``(names, supported)``: every level of the SIMD registry (kv_simd.h),
    lowest first, and those this CPU (and build) supports."""
    names = tuple(kvs_level_name(i).decode() for i in range(KVS_NUM_LEVELS))
    return names, tuple(n for i, n in enumerate(names) if kvs_level_supported(i))


def use_registry_level(int level):
    """Run the conversions at their best level at or under registry level
    ``level`` (an index into ``registry_levels()[0]``)."""
    kvh_set_level(kvh_level_at_most(level))


def fp8_paths():
    """``{level: fp8 path}`` for the levels this CPU supports: the fp8/int8
    code each runs (levels without fp8 instructions share the scalar one)."""
    return {lvl: kvh_fp8_path(LEVELS.index(lvl)).decode() for lvl in available_simd_levels()}


def fp8_level():
    """Name of the fp8/int8 code path in use now."""
    return kvh_fp8_path(kvh_current_level()).decode()


def simd_cap_error():
    """The error message for a KVCORE_SIMD value that names no level (the
    registry read it once, kv_simd.h), or None when it is fine."""
    if kvs_cap() >= 0:
        return None
    # the registry's names: a level of another family (amx) is a valid cap
    names = tuple(kvs_level_name(i).decode() for i in range(KVS_NUM_LEVELS))
    return f"KVCORE_SIMD must be one of {names}, got {kvs_cap_text().decode()!r}"


# KVCORE_SIMD caps the level (e.g. KVCORE_SIMD=scalar to rule SIMD out while
# debugging); it never asks for more than the CPU has.  The registry reads it.
if simd_cap_error() is not None:
    raise ImportError(simd_cap_error())
kvh_set_level(kvh_default_level())
