# Conversion routines other Cython modules call while they copy (the pool's
# write kernels convert float32 -> float16/bf16 on the way into a block).
# All are noexcept nogil; the SIMD level is the one chosen in _convert.
from kvcore._native._typedefs cimport half_t

cdef extern from "kv_kinds.h":
    enum:
        KVH_F32
        KVH_F16
        KVH_BF16

cdef void f32_to_f16(const float* src, half_t* dst, Py_ssize_t n) noexcept nogil
cdef void f32_to_bf16(const float* src, half_t* dst, Py_ssize_t n) noexcept nogil
cdef void f16_to_f32(const half_t* src, float* dst, Py_ssize_t n) noexcept nogil
cdef void bf16_to_f32(const half_t* src, float* dst, Py_ssize_t n) noexcept nogil

# n contiguous elements of kind src_kind -> dst_kind (KVH_F32/F16/BF16, any
# pair).  Returns 0, or -1 for an unknown kind.
cdef int convert_n(int src_kind, const void* src, int dst_kind, void* dst,
                   Py_ssize_t n) noexcept nogil

# convert_n with non-temporal stores where the SIMD path has them (same
# bits); for large scattered writes.  Call stream_fence() once after the
# last of a batch.
cdef int convert_n_stream(int src_kind, const void* src, int dst_kind, void* dst,
                          Py_ssize_t n) noexcept nogil
cdef void stream_fence() noexcept nogil

cdef inline Py_ssize_t kind_itemsize(int kind) noexcept nogil:
    return 4 if kind == KVH_F32 else 2

# fp8 / int8 (kv_fp8.h): the pool's writers and readers call these; same bits
# as the scalar definitions in kv_fp8.h.  fmt: KV_FP8_E4M3 or KV_FP8_E5M2.
from libc.stdint cimport int8_t, uint8_t

cdef extern from "kv_fp8.h":
    enum:
        KV_FP8_E4M3
        KV_FP8_E5M2

cdef void f32_to_fp8(int fmt, const float* src, uint8_t* dst, Py_ssize_t n,
                     float scale, int saturate) noexcept nogil
cdef void fp8_to_f32(int fmt, const uint8_t* src, float* dst, Py_ssize_t n,
                     float scale) noexcept nogil
# int8 row of n elements: returns its scale (see kv_fp8.h)
cdef float f32_to_i8_row(const float* src, int8_t* dst, Py_ssize_t n) noexcept nogil
cdef void i8_to_f32(const int8_t* src, float* dst, Py_ssize_t n, float scale) noexcept nogil
# `rows` rows of n float32 (strides in bytes) in one call, as the paged
# writes need them; stream: non-temporal stores where possible, then one
# stream_fence() after the batch (see kv_fp8.h)
cdef void f32_to_fp8_rows(int fmt, const float* src, Py_ssize_t src_stride, uint8_t* dst,
                          Py_ssize_t dst_stride, Py_ssize_t rows, Py_ssize_t n, float scale,
                          int saturate, int stream) noexcept nogil
cdef void f32_to_i8_rows(const float* src, Py_ssize_t src_stride, int8_t* dst,
                         Py_ssize_t dst_stride, float* scales, Py_ssize_t scale_stride,
                         Py_ssize_t rows, Py_ssize_t n, int stream) noexcept nogil
