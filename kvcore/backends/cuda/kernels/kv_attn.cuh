/*
 * kv_attn.cuh: the primitives of kvcore's attention kernels (attention.cu
 * and the headers it includes: kv_attn_decode.cuh, kv_attn_prefill.cuh).
 *
 *   - float32 operations that keep subnormals whatever flags CuPy adds
 *     (kva_add ... kva_exp2: PTX without .ftz), tanh, bit tests;
 *   - element widening of every page kind (kva_widen) and fp8 pairs
 *     widened to the mma's input type (kva_fp8x2);
 *   - 16-byte global -> shared copies (cp.async on sm_80+, with commit and
 *     wait groups), a 32-bit division by an invariant (KvaDiv);
 *   - tensor-core tiles: mma.sync.m16n8k16 (f16 / bf16 in, f32 out),
 *     ldmatrix (x4, plain and transposed), packing floats into halves;
 *   - q / out of any float kind read and written where they lie
 *     (kva_load_f / kva_store_f: the kind is a run-time argument);
 *   - warp exchanges, dynamic shared memory, the last-block atomics;
 *   - what every kernel does the same way, written once: the keys a query
 *     row sees (kva_row_keys), a key's row in the pages (kva_key_row), the
 *     soft cap, the online softmax step (per score: kva_online; per row of
 *     an m16 tile: kva_tile_online), the merges of partials (kva_merge,
 *     kva_part_weight) and the normalised output (kva_store_result,
 *     kva_tile_store), all __forceinline__.
 *
 * Host emulation (tests/_cuda_attention_emulation.py): with
 * KVCORE_HOST_EMULATION defined the file is compiled by the host C++
 * compiler after a shim that runs each block's threads as fibers; the
 * device instructions here then call the shim's kvemu_* functions, which
 * do what the PTX ISA says the instruction does (ldmatrix and mma from
 * their fragment layouts, cp.async as copies completed at the wait that
 * covers them, the destination poisoned until then).
 */
#ifndef KVCORE_KV_ATTN_CUH
#define KVCORE_KV_ATTN_CUH

#include "kv_fp8.cuh"

#define KVA_LOG2E 1.4426950408889634f
/* -inf without math.h (NVRTC compiles without headers) */
#define KVA_NEG_INF (-__int_as_float(0x7f800000))

typedef long long kva_i64;
typedef unsigned short kva_u16;

/* The float32 operations of this file, with subnormals kept.  CuPy compiles
 * every kernel with -ftz=true, which would flush subnormal operands and
 * results of every float instruction to zero: subnormal bf16 / f32 K/V, an
 * fp8 code times a subnormal layer scale, an int8 code times the 2^-149 row
 * scale would read as 0 on the GPU where the CPU keeps them.  On the device
 * these are the PTX instructions without .ftz (tests/cuda/test_cuda_kernels_compile.py
 * checks that no .ftz instruction is left in this file's kernels); on the
 * host (the tests' emulation) the plain C++ operations, which keep
 * subnormals.  add / mul / fma / div are IEEE round-to-nearest (and never
 * contracted); ex2.approx.f32 is the same 2-ulp instruction exp2f uses,
 * subnormal results included. */
#if defined(__CUDA_ARCH__)
#define KVA_BINARY(NAME, PTX)                                                  \
    __device__ __forceinline__ float NAME(float a, float b)                    \
    {                                                                          \
        float r;                                                               \
        asm(PTX " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                    \
        return r;                                                              \
    }
KVA_BINARY(kva_add, "add.rn.f32")
KVA_BINARY(kva_sub, "sub.rn.f32")
KVA_BINARY(kva_mul, "mul.rn.f32")
KVA_BINARY(kva_div, "div.rn.f32")
KVA_BINARY(kva_max, "max.f32") /* a NaN operand gives the other one (fmaxf) */
#undef KVA_BINARY
__device__ __forceinline__ float kva_fma(float a, float b, float c)
{
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
__device__ __forceinline__ float kva_exp2(float a)
{
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
#else
__device__ __forceinline__ float kva_add(float a, float b) { return a + b; }
__device__ __forceinline__ float kva_sub(float a, float b) { return a - b; }
__device__ __forceinline__ float kva_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float kva_div(float a, float b) { return a / b; }
__device__ __forceinline__ float kva_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float kva_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ float kva_exp2(float a) { return exp2f(a); }
#endif

/* x == +-0, read from the bits (a float compare would flush a subnormal). */
__device__ __forceinline__ bool kva_is_zero(float x)
{
    union { unsigned u; float f; } c;
    c.f = x;
    return (c.u << 1) == 0;
}

/* tanh(x) from the operations above (CUDA's tanhf flushes under -ftz):
 * |x| < 0.3 its odd Taylor series to x^11 (the next term is below 2^-28
 * of the result), else 1 - 2 / (2^(2|x| log2 e) + 1) (within a few ulp),
 * the sign restored; NaN stays NaN, +-inf gives +-1.  The host emulation
 * uses the C library's tanhf. */
__device__ __forceinline__ float kva_tanh(float x)
{
#if defined(__CUDA_ARCH__)
    union { unsigned u; float f; } c;
    c.f = x;
    const unsigned sign = c.u & 0x80000000u;
    c.u ^= sign; /* |x| */
    const float a = c.f;
    float t;
    if (c.u < 0x3e99999au) { /* |x| < 0.3f, compared as bits (NaN goes on) */
        const float a2 = kva_mul(a, a);
        float p = -1382.0f / 155925.0f;
        p = kva_fma(p, a2, 62.0f / 2835.0f);
        p = kva_fma(p, a2, -17.0f / 315.0f);
        p = kva_fma(p, a2, 2.0f / 15.0f);
        p = kva_fma(p, a2, -1.0f / 3.0f);
        t = kva_fma(kva_mul(p, a2), a, a);
    } else {
        const float e = kva_exp2(kva_mul(a, 2.0f * 1.4426950408889634f));
        t = kva_sub(1.0f, kva_div(2.0f, kva_add(e, 1.0f)));
    }
    c.f = t;
    c.u |= sign;
    return c.f;
#else
    return tanhf(x);
#endif
}

template <int KIND> struct KvaStorage { typedef kva_u16 type; };
template <> struct KvaStorage<KV_F32> { typedef float type; };
template <> struct KvaStorage<KV_F8E4M3> { typedef kv_u8 type; };
template <> struct KvaStorage<KV_F8E5M2> { typedef kv_u8 type; };
template <> struct KvaStorage<KV_I8> { typedef signed char type; };

/* Kinds whose elements carry scales (fp8 per layer, int8 per row). */
#define KVA_SCALED(KIND) ((KIND) >= KV_F8E4M3)

template <int KIND>
__device__ __forceinline__ float kva_widen(const typename KvaStorage<KIND>::type *p)
{
    if constexpr (KIND == 0) {
        return *p;
    } else if constexpr (KIND == 1) {
#ifdef KVCORE_HOST_EMULATION
        return kvemu_half_to_float(*p); /* the tests' host emulation */
#else
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
        return f;
#endif
    } else if constexpr (KIND == KV_BF16) {
        return __uint_as_float((unsigned)(*p) << 16);
    } else if constexpr (KIND == KV_I8) {
        return (float)*p; /* the code (the caller multiplies by its row scale) */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVCORE_HOST_EMULATION)
    } else if constexpr (KIND == KV_F8E4M3) {
        /* the hardware conversion (sm_89+): every e4m3 value is an f16
         * value, so e4m3 -> f16 -> f32 is exact, as kv_fp8_to_f32_one (the
         * NaN codes give a NaN, of another payload: the result is NaN either
         * way).  The code goes in both bytes, so either half is its value. */
        const unsigned short two = (unsigned short)(*p | (*p << 8));
        unsigned h2;
        float f;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
        asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }"
            : "=f"(f) : "r"(h2));
        return f;
#endif
    } else {
        return __uint_as_float(kv_fp8_to_f32_one<KIND - KV_F8E4M3>(*p));
    }
}

__device__ __forceinline__ float kva_warp_sum(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        x = kva_add(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* n / d for 32-bit n by a 32-bit multiply-high (Granlund & Montgomery,
 * "Division by invariant integers using multiplication", 1994: with
 * l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1, n / d =
 * (mulhi(m, n) + n) >> l for every n < 2^32); d >= 1. */
struct KvaDiv {
    unsigned d, m, l;
};

__device__ __forceinline__ KvaDiv kva_div_init(unsigned d)
{
    KvaDiv r;
    unsigned l = 0;
    while (l < 32 && (1ull << l) < d)
        ++l;
    r.d = d;
    r.l = l;
    r.m = (unsigned)(((1ull << 32) * ((1ull << l) - d)) / d + 1); /* once per block */
    return r;
}

__device__ __forceinline__ unsigned kva_udiv(unsigned n, KvaDiv v)
{
    return (unsigned)(((unsigned long long)__umulhi(v.m, n) + n) >> v.l);
}


__device__ __forceinline__ bool kva_is_neg_inf(float x) /* from the bits: no .ftz compare */
{
    return __float_as_uint(x) == 0xff800000u;
}

/* ------------------------------------------------------------------ */
/* What a query sees and how a score is formed (kv_attention.h's rules, */
/* the CPU's kva_key_lo / kva_score_units / kva_finish_sink)            */
/* ------------------------------------------------------------------ */

/* The first key a query at position pos sees: the later of its window's
 * start (window > 0) and its chunk's start (chunk > 0). */
__device__ __forceinline__ kva_i64 kva_key_lo(kva_i64 pos, kva_i64 window, kva_i64 chunk)
{
    kva_i64 lo = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
    if (chunk > 0 && pos - pos % chunk > lo)
        lo = pos - pos % chunk;
    return lo;
}

/* |x| > 1, from the bits (a float compare would carry .ftz); NaN: false. */
__device__ __forceinline__ bool kva_abs_above_one(float x)
{
    const unsigned a = __float_as_uint(x) & 0x7fffffffu;
    return a > 0x3f800000u && a <= 0x7f800000u;
}

/* How a call's scale (times an fp8 key scale, where the kernel applies it
 * to the dots) enters the scores, for every accepted scale:
 *   score x = dot * mult (the float32 kernels fold mult into q); with a
 *   soft cap c: x = c log2(e) tanh(dot * mult * post / c), where a |scale|
 *   <= 1 rides on mult and a larger one is post (after the dot: an
 *   overflow to +-inf caps to +-c);
 *   without a cap: mult = scale log2(e) when that is at most 1 in
 *   magnitude (base-2 logits), else its sign ("wide": the scores are the
 *   dots; exact ties stay ties) and u = |scale log2(e)| multiplies each
 *   score's difference to the row maximum before exp2 (an overflow is
 *   -inf: weight 0, never NaN).  u = 1 otherwise. */
struct KvaUnits {
    float mult, post, u;
};

__device__ __forceinline__ KvaUnits kva_units(float scale, bool capped)
{
    KvaUnits r;
    r.post = 1.0f;
    r.u = 1.0f;
    if (capped) {
        const bool big = kva_abs_above_one(scale);
        r.mult = big ? 1.0f : scale;
        r.post = big ? scale : 1.0f;
        return r;
    }
    const float c = kva_mul(scale, KVA_LOG2E);
    if (!kva_abs_above_one(c) || (__float_as_uint(c) & 0x7fffffffu) == 0x7f800000u) {
        r.mult = c;
        return r;
    }
    r.mult = (__float_as_uint(c) >> 31) ? -1.0f : 1.0f;
    r.u = __uint_as_float(__float_as_uint(c) & 0x7fffffffu);
    return r;
}

/* A natural-log logit (an ALiBi slope, a sink) in the scores' units. */
__device__ __forceinline__ float kva_logit_units(float x, KvaUnits u)
{
    return kva_div(kva_mul(x, KVA_LOG2E), u.u);
}

/* A row's output is (acc / den) * w: without a sink den = l, w = 1; with
 * one (s, in the scores' units) and d = (s - m) u its exponent over the
 * keys' largest: d <= 0: den = l + 2^d; d > 0: w = 2^-d / (l 2^-d + 1)
 * (nothing overflows; the keys' terms vanish in the limit). */
struct KvaNorm {
    float den, w;
};

__device__ __forceinline__ KvaNorm kva_norm(float l, float m, bool sink, float s, KvaUnits u)
{
    KvaNorm r;
    r.den = l;
    r.w = 1.0f;
    if (sink) {
        const float d = kva_mul(kva_sub(s, m), u.u);
        if ((int)__float_as_uint(d) <= 0) { /* d <= 0 (from the bits) */
            r.den = kva_add(l, kva_exp2(d));
        } else {
            const float f = kva_exp2(__uint_as_float(__float_as_uint(d) ^ 0x80000000u)); /* 2^-d */
            r.den = 1.0f;
            r.w = kva_div(f, kva_fma(l, f, 1.0f));
        }
    }
    return r;
}

__device__ __forceinline__ float kva_apply(float acc, KvaNorm n)
{
    return kva_mul(kva_div(acc, n.den), n.w);
}

/* ------------------------------------------------------------------ */
/* Copies global -> shared                                             */
/* ------------------------------------------------------------------ */

struct alignas(16) KvaVec16 {
    unsigned a, b, c, d;
};

/* The 32-bit shared-window address of a generic pointer to shared memory. */
__device__ __forceinline__ unsigned kva_smem_addr(const void *p)
{
    (void)p;
#if defined(__CUDA_ARCH__) && !defined(KVCORE_HOST_EMULATION)
    unsigned s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(s) : "l"(p));
    return s;
#else
    return 0;
#endif
}

/* One 16-byte copy global -> shared: cp.async on sm_80+ (complete after
 * the kva_copy_wait that covers its group), else a plain 16-byte load and
 * store.  Both addresses 16-byte aligned. */
__device__ __forceinline__ void kva_copy16(void *dst_shared, const void *src)
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_cp_async16(dst_shared, src, 16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 ::"r"(kva_smem_addr(dst_shared)), "l"(src) : "memory");
#else
    *(KvaVec16 *)dst_shared = *(const KvaVec16 *)src;
#endif
}

/* 16 zero bytes into shared memory, in the same group order as kva_copy16
 * (cp.async with source size 0: nothing is read from `src`). */
__device__ __forceinline__ void kva_zero16(void *dst_shared, const void *src)
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_cp_async16(dst_shared, src, 0);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 0;"
                 ::"r"(kva_smem_addr(dst_shared)), "l"(src) : "memory");
#else
    (void)src;
    *(KvaVec16 *)dst_shared = KvaVec16{0, 0, 0, 0};
#endif
}

__device__ __forceinline__ void kva_copy_commit()
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_cp_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

/* Wait until at most N committed groups of this thread are in flight. */
template <int N> __device__ __forceinline__ void kva_copy_wait()
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_cp_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

/* ------------------------------------------------------------------ */
/* Tensor cores                                                        */
/* ------------------------------------------------------------------ */

/* d += A B for the warp: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}
 * (KIND = KV_BF16: bf16 inputs, else f16), f32 accumulators.  Fragment
 * layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4,
 * c = lane % 4: A (16 x 16, row major) a0 = (g, 2c..2c+1), a1 = (g+8,
 * 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..); B (16 x 8, column major) b0 =
 * (k 2c..2c+1, n g), b1 = (k 2c+8.., n g); C / D (16 x 8) d0, d1 = (g,
 * 2c..2c+1), d2, d3 = (g+8, 2c..); the lower element of a pair in the lower
 * 16 bits.  The host emulation computes the same tile from these layouts. */
template <int KIND>
__device__ __forceinline__ void kva_mma16816(float *d, const unsigned *a, const unsigned *b)
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_mma16816(KIND == KV_BF16, d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (KIND == KV_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
    /* below sm_80 nothing: the host never runs this kernel there */
}

/* Two floats as the mma's input type, the first in the lower half. */
template <int KIND> __device__ __forceinline__ unsigned kva_pack2(float lo, float hi)
{
    if constexpr (KIND == KV_BF16)
        return (unsigned)kv_f32_to_bf16(__float_as_uint(lo)) |
               ((unsigned)kv_f32_to_bf16(__float_as_uint(hi)) << 16);
    else
        return (unsigned)kv_f32_to_f16(__float_as_uint(lo)) |
               ((unsigned)kv_f32_to_f16(__float_as_uint(hi)) << 16);
}

__device__ __forceinline__ float kva_quad_max(float x)
{
    x = kva_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return kva_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float kva_quad_sum(float x)
{
    x = kva_add(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return kva_add(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float kva_row_sum(float x) /* over a row's 16 lanes */
{
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
        x = kva_add(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* Two floats as the mma's input type (MT: KV_F16 or KV_BF16), the first in
 * the lower half, rounded to nearest even (the hardware conversion on
 * sm_80+, without .ftz; the same bits as kva_pack2 for every finite input
 * and infinity; a NaN stays a NaN). */
template <int MT> __device__ __forceinline__ unsigned kva_pack2_rn(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(KVCORE_HOST_EMULATION)
    unsigned r;
    if constexpr (MT == KV_BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return kva_pack2<MT>(lo, hi);
#endif
}

/* The value of the lower (H = 0) or upper (H = 1) half of a pair of MT. */
template <int MT, int H> __device__ __forceinline__ float kva_half_of(unsigned x)
{
    const kva_u16 h = (kva_u16)(x >> (16 * H));
    if constexpr (MT == KV_BF16)
        return __uint_as_float((unsigned)h << 16);
    else
        return kva_widen<KV_F16>(&h);
}

/* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i .. 8i+7 give
 * the 16-byte row addresses of matrix i; r[i] receives, for lane (g =
 * lane / 4, c = lane % 4), elements (g, 2c), (g, 2c+1) of matrix i (TRANS:
 * (2c, g), (2c+1, g)), the first in the lower half. */
template <bool TRANS> __device__ __forceinline__ void kva_ldmatrix_x4(unsigned *r, const void *row)
{
#if defined(KVCORE_HOST_EMULATION)
    kvemu_ldmatrix(r, 4, TRANS, row);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(kva_smem_addr(row)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(kva_smem_addr(row)));
#else
    (void)row;
    r[0] = r[1] = r[2] = r[3] = 0; /* below sm_80 nothing: the host never runs it there */
#endif
}

/* Two fp8 codes (the lower byte of `two` first) widened to a pair of MT,
 * exactly: every e4m3fn / e5m2 value is a float16 and a bfloat16 value.  A
 * NaN code gives a NaN. */
template <int KIND, int MT> __device__ __forceinline__ unsigned kva_fp8x2(unsigned two)
{
    if constexpr (KIND == KV_F8E5M2 && MT == KV_F16) {
        /* e5m2 is float16 with 8 fewer mantissa bits */
        return ((two & 0xffu) << 8) | ((two & 0xff00u) << 16);
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVCORE_HOST_EMULATION)
        unsigned h2;
        if constexpr (KIND == KV_F8E4M3)
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)two));
        else
            h2 = ((two & 0xffu) << 8) | ((two & 0xff00u) << 16);
        if constexpr (MT == KV_F16) {
            return h2;
        } else { /* f16 -> f32 exact, then the upper half (these values fit bf16) */
            float lo, hi;
            asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
                : "=f"(lo), "=f"(hi) : "r"(h2));
            return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
        }
#else
        const unsigned a = kv_fp8_to_f32_one<KIND - KV_F8E4M3>((kv_u8)(two & 0xffu));
        const unsigned b = kv_fp8_to_f32_one<KIND - KV_F8E4M3>((kv_u8)((two >> 8) & 0xffu));
        if constexpr (MT == KV_F16)
            return (unsigned)kv_f32_to_f16(a) | ((unsigned)kv_f32_to_f16(b) << 16);
        else
            return (a >> 16) | (b & 0xffff0000u);
#endif
    }
}

/* __byte_perm (prmt.b32): byte i of the result is byte (s >> 4i) & 7 of
 * the 8 bytes (x, y). */
__device__ __forceinline__ unsigned kva_prmt(unsigned x, unsigned y, unsigned s)
{
#if defined(__CUDA_ARCH__) && !defined(KVCORE_HOST_EMULATION)
    return __byte_perm(x, y, s);
#else
    const unsigned long long b = (unsigned long long)x | ((unsigned long long)y << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; i++)
        r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
#endif
}

/* ------------------------------------------------------------------ */
/* q and out of any float kind (a run-time argument: one branch per     */
/* element read or written, never per score)                            */
/* ------------------------------------------------------------------ */

__device__ __forceinline__ float kva_load_f(const void *p, int kind, kva_i64 i)
{
    if (kind == KV_F32)
        return ((const float *)p)[i];
    const kva_u16 h = ((const kva_u16 *)p)[i];
    if (kind == KV_F16)
        return kva_widen<KV_F16>(&h);
    return __uint_as_float((unsigned)h << 16);
}

/* float16 / bfloat16 out: kv_half.cuh's rounding, the bits the CPU path's
 * conversion of a float32 result gives. */
__device__ __forceinline__ void kva_store_f(void *p, int kind, kva_i64 i, float x)
{
    if (kind == KV_F32)
        ((float *)p)[i] = x;
    else if (kind == KV_F16)
        ((kva_u16 *)p)[i] = kv_f32_to_f16(__float_as_uint(x));
    else
        ((kva_u16 *)p)[i] = kv_f32_to_bf16(__float_as_uint(x));
}

/* ------------------------------------------------------------------ */
/* Warp exchanges, shared memory, the last block of a unit              */
/* ------------------------------------------------------------------ */

__device__ __forceinline__ kva_i64 kva_shfl64(kva_i64 x, int src)
{
    const int lo = __shfl_sync(0xffffffffu, (int)(x & 0xffffffff), src);
    const int hi = __shfl_sync(0xffffffffu, (int)(x >> 32), src);
    return (kva_i64)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo);
}

/* The block's dynamic shared memory (16-byte aligned). */
#if defined(KVCORE_HOST_EMULATION)
#define KVA_DYN_SMEM() ((unsigned char *)kvemu_dyn_smem())
#else
extern __shared__ __align__(16) unsigned char kva_dyn_smem[];
#define KVA_DYN_SMEM() (kva_dyn_smem)
#endif

/* A float another block wrote (before its __threadfence and atomic):
 * read from L2, never from this SM's L1. */
__device__ __forceinline__ float kva_load_cg(const float *p)
{
#if defined(__CUDA_ARCH__) && !defined(KVCORE_HOST_EMULATION)
    return __ldcg(p);
#else
    return *p;
#endif
}

/* ------------------------------------------------------------------ */
/* What every kernel does the same way: the keys a row sees, a key's   */
/* row in the pages, the online softmax, the merges and the output     */
/* ------------------------------------------------------------------ */

/* The keys of query row `row` of sequence s within an item's [first,
 * end): its position pos and keys lo .. hi-1 (none when hi <= lo). */
struct KvaKeys {
    kva_i64 pos, lo, hi;
};

__device__ __forceinline__ KvaKeys kva_row_keys(const kva_i64 *seq_lens,
                                                const kva_i64 *query_start_loc, kva_i64 s,
                                                kva_i64 row, kva_i64 window, kva_i64 chunk,
                                                kva_i64 first, kva_i64 end)
{
    const kva_i64 nq = query_start_loc[s + 1] - query_start_loc[s];
    KvaKeys k;
    k.pos = seq_lens[s] - nq + (row - query_start_loc[s]);
    k.lo = kva_key_lo(k.pos, window, chunk);
    k.hi = k.pos + 1;
    if (first > k.lo)
        k.lo = first;
    if (end < k.hi)
        k.hi = end;
    return k;
}

/* The element offset of the row of key `rel` counted from the start of
 * page pb of a sequence's `pages` (block_size = bdiv.d keys a page), less
 * the head's: pages[pb + rel / bs] * c_block + (rel % bs) * c_tok. */
__device__ __forceinline__ kva_i64 kva_key_row(const int *pages, kva_i64 pb, unsigned rel,
                                               KvaDiv bdiv, kva_i64 c_block, kva_i64 c_tok)
{
    const unsigned j = kva_udiv(rel, bdiv);
    return (kva_i64)pages[pb + j] * c_block + (kva_i64)(rel - j * bdiv.d) * c_tok;
}

/* A score x soft-capped: c log2(e) tanh(x post / c), capl2 = c log2(e). */
__device__ __forceinline__ float kva_cap(float x, float capl2, float cap, KvaUnits u)
{
    return kva_mul(capl2, kva_tanh(kva_div(kva_mul(x, u.post), cap)));
}

/* One score's step of a row's online softmax in base 2 (the scores' units
 * u): m (the running max) and l (the sum) updated; returns the key's
 * weight p, and in alpha the rescaling of the row's accumulators (0 while
 * m was -inf; a row with no visible key yet subtracts 0). */
__device__ __forceinline__ float kva_online(float score, float &m, float &l, float &alpha,
                                            KvaUnits un)
{
    const float mnew = kva_max(m, score);
    const float mu = kva_is_neg_inf(mnew) ? 0.0f : mnew;
    alpha = kva_exp2(kva_mul(kva_sub(m, mu), un.u));
    const float p = kva_exp2(kva_mul(kva_sub(score, mu), un.u));
    l = kva_fma(l, alpha, p);
    m = mnew;
    return p;
}

/* Row r's step of the online softmax of an m16 tile (the tensor-core
 * kernels): this lane's elements 2r, 2r + 1 of NK n8 tiles of scores sc
 * (masked ones -inf), the row's max over the quad; their weights into p
 * (may be sc itself), this lane's sum added to l (quad-summed at the end);
 * returns alpha, the rescaling of the row's accumulators. */
template <int NK>
__device__ __forceinline__ float kva_tile_online(float (*sc)[4], float (*p)[4], int r,
                                                 float &m, float &l, KvaUnits un)
{
    float mx = KVA_NEG_INF;
#pragma unroll
    for (int n = 0; n < NK; n++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            mx = kva_max(mx, sc[n][2 * r + e]);
    mx = kva_quad_max(mx);
    const float mnew = kva_max(m, mx);
    const float mu = kva_is_neg_inf(mnew) ? 0.0f : mnew; /* no key yet: every p is 0 */
    const float alpha = kva_exp2(kva_mul(kva_sub(m, mu), un.u));
    float rs = 0.0f;
#pragma unroll
    for (int n = 0; n < NK; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float pe = kva_exp2(kva_mul(kva_sub(sc[n][2 * r + e], mu), un.u));
            p[n][2 * r + e] = pe;
            rs = kva_add(rs, pe);
        }
    }
    l = kva_fma(l, alpha, rs);
    m = mnew;
    return alpha;
}

/* The merge of partials (m, l, acc[...]) first .. first + n - 1 at part +
 * STRIDE w in their order, for dim d: one without keys (l == 0) is
 * skipped, a NaN sum is kept.  The merged max, sum and acc.  (I: the
 * index type of the caller's loop, 32 or 64 bits: the same code as the
 * loop written in place.) */
struct KvaMerged {
    float m, l, acc;
};

template <int STRIDE, typename I>
__device__ __forceinline__ KvaMerged kva_merge(const float *part, I first, int n, int d,
                                               KvaUnits un)
{
    KvaMerged r;
    r.m = KVA_NEG_INF;
    for (I w = first; w < first + n; w++)
        r.m = kva_max(r.m, part[w * STRIDE]);
    r.l = 0.0f;
    r.acc = 0.0f;
    for (I w = first; w < first + n; w++) {
        const float *pw = part + w * STRIDE;
        if (kva_is_zero(pw[1]))
            continue;
        const float wgt = kva_exp2(kva_mul(kva_sub(pw[0], r.m), un.u));
        r.l = kva_fma(wgt, pw[1], r.l);
        r.acc = kva_fma(wgt, pw[2 + d], r.acc);
    }
    return r;
}

/* The weight of a partial (m, l) in a merge of maximum mx: 0 for one
 * without keys (l == 0), a NaN sum kept. */
__device__ __forceinline__ float kva_part_weight(float m, float l, float mx, KvaUnits un)
{
    return kva_is_zero(l) ? 0.0f : kva_exp2(kva_mul(kva_sub(m, mx), un.u));
}

/* Query head `head`'s sink (sinks: null for none) in the scores' units. */
__device__ __forceinline__ float kva_sink(const float *sinks, kva_i64 head, KvaUnits un)
{
    return sinks != nullptr ? kva_logit_units(sinks[head], un) : 0.0f;
}

/* out[at] = a merged row's element: acc normalised by its (m, l) and
 * query head `head`'s sink. */
__device__ __forceinline__ void kva_store_result(void *out, kva_i64 out_kind, kva_i64 at,
                                                 KvaMerged r, const float *sinks, kva_i64 head,
                                                 KvaUnits un)
{
    kva_store_f(out, (int)out_kind, at,
                kva_apply(r.acc, kva_norm(r.l, r.m, sinks != nullptr, kva_sink(sinks, head, un),
                                          un)));
}

/* Row r of an m16 tile's output written by this lane: its elements 2r,
 * 2r + 1 of NT n8 tiles of acc (dims 8 n + 2c, + 1, c = lane % 4) at
 * out[o + dim], normalised by n. */
template <int NT>
__device__ __forceinline__ void kva_tile_store(void *out, kva_i64 out_kind, kva_i64 o,
                                               const float (*acc)[4], int r, int c, KvaNorm n)
{
#pragma unroll
    for (int nn = 0; nn < NT; nn++) {
        kva_store_f(out, (int)out_kind, o + 8 * nn + 2 * c, kva_apply(acc[nn][2 * r], n));
        kva_store_f(out, (int)out_kind, o + 8 * nn + 2 * c + 1, kva_apply(acc[nn][2 * r + 1], n));
    }
}

#endif /* KVCORE_KV_ATTN_CUH */
