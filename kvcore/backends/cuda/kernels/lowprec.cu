/*
 * lowprec.cu: fp8 (e4m3fn, e5m2) and int8 pools and caches.
 *
 * FK is the float kind on the other side (KV_F32 / KV_F16 / KV_BF16: the
 * source of a write, the destination of a read), QK the storage kind
 * (KV_F8E4M3, KV_F8E5M2, KV_I8).  The bits are those of the NumPy
 * reference (kvcore/backends/base.py: fp8_encode, int8_encode, ...) and of
 * the CPU backend (kv_fp8.h / kv_fp8.c), values defined on float32:
 *
 *   fp8 write   code = fp8(x / scale), saturated (kv_fp8.cuh's rule), the
 *               division skipped when scale == 1 and for a NaN (whose sign
 *               the code keeps, as on the CPU);
 *   int8 write  per (token, head) row: scale = max|x| / 127 (1 for an
 *               all-zero row, 2^-149 where the quotient underflows to 0),
 *               code = clamp(rint(x / scale), -127, 127)
 *               (round half to even); a row holding a NaN or an infinity
 *               stores scale NaN (0x7FC00000) and zeros;
 *   read        fp8 * scale (no multiply when scale == 1), code * scale for
 *               int8; a NaN operand gives that NaN, quieted (as x86 does;
 *               a GPU would give its canonical NaN), then narrowed to FK.
 *
 * Float arithmetic: one IEEE float32 division or multiplication per element
 * (NVRTC's defaults: -prec-div=true, no FTZ; never compile with fast-math).
 * Floats move as their bits (kv_u32), scales included.
 *
 * Launch shapes: fp8 writes and every read are (row, element) grids: rows =
 * (token, head) lines, chunks = head_dim, one element per thread.  An int8
 * write needs the row's largest magnitude first: one thread per row
 * (chunks = 1) walks it twice (max, then quantize).  The max is exact
 * whatever the order, so a warp-wide reduction would give the same bits;
 * that is a possible speed-up, not a change of results.
 */
#include "kv_fp8.cuh"

/* The integer that holds one stored element, and the fp8 format number. */
template <int QK> struct KvQ;
template <> struct KvQ<KV_F8E4M3> { typedef kv_u8 type; enum { FMT = 0 }; };
template <> struct KvQ<KV_F8E5M2> { typedef kv_u8 type; enum { FMT = 1 }; };
template <> struct KvQ<KV_I8> { typedef signed char type; enum { FMT = -1 }; };

/* A raw read of the codes (BlockPool.gather without a dtype) is a read
 * with FK == QK: the stored bytes, copied. */
template <> struct KvStorage<KV_F8E4M3> { typedef kv_u8 type; };
template <> struct KvStorage<KV_F8E5M2> { typedef kv_u8 type; };
template <> struct KvStorage<KV_I8> { typedef signed char type; };

enum { KV_F32_ONE = 0x3F800000, KV_F32_QNAN = 0x7FC00000 };

KV_HD float kv_lp_float(kv_u32 b)
{
    union { kv_u32 u; float f; } c;
    c.u = b;
    return c.f;
}

KV_HD kv_u32 kv_lp_bits(float f)
{
    union { kv_u32 u; float f; } c;
    c.f = f;
    return c.u;
}

KV_HD bool kv_lp_isnan(kv_u32 b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }

/* The float32 operations of this file, IEEE with subnormals kept.  CuPy
 * compiles every kernel with -ftz=true, which would turn `a / b` into
 * div.rn.ftz.f32 (a subnormal operand or result flushed to zero) and part
 * ways with the CPU's bits for tiny rows and scales: on the device these
 * are the PTX instructions without .ftz (tests/cuda/test_cuda_kernels_compile.py
 * checks that no .ftz instruction is left in this file's kernels). */
#if defined(__CUDA_ARCH__)
#define KV_LP_BINARY(NAME, PTX, OP)                                                      \
    KV_HD float NAME(float a, float b)                                                   \
    {                                                                                    \
        float r;                                                                         \
        asm(PTX " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                              \
        return r;                                                                        \
    }
#else
#define KV_LP_BINARY(NAME, PTX, OP)                                                      \
    KV_HD float NAME(float a, float b) { return a OP b; }
#endif
KV_LP_BINARY(kv_lp_div, "div.rn.f32", /)
KV_LP_BINARY(kv_lp_fmul, "mul.rn.f32", *)

/* int8 code of q = x / scale: rounded half to even, clamped to +-127
 * (q is never NaN here: the row's scale is finite and non-zero, 2^-149 at
 * the least). */
KV_HD signed char kv_lp_i8(float q)
{
#if defined(__CUDA_ARCH__)
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(q));
#else
    int r = (int)__builtin_rintf(q > 128.0f ? 128.0f : q < -128.0f ? -128.0f : q);
#endif
    return (signed char)(r > 127 ? 127 : r < -127 ? -127 : r);
}

/* float32 bits of one element of float kind FK (exact). */
template <int FK>
KV_HD kv_u32 kv_lp_widen(typename KvStorage<FK>::type x)
{
    return kv_convert<FK, KV_F32>(x);
}

/* fp8 code of float32 bits x / scale, saturated. */
template <int QK>
KV_HD kv_u8 kv_lp_fp8(kv_u32 x, kv_u32 scale)
{
    if (scale != (kv_u32)KV_F32_ONE && !kv_lp_isnan(x))
        x = kv_lp_bits(kv_lp_div(kv_lp_float(x), kv_lp_float(scale)));
    return kv_f32_to_fp8_one<KvQ<QK>::FMT, 1>(x);
}

/* float32 bits of v * s; a NaN operand (v first) gives that NaN, quieted. */
KV_HD kv_u32 kv_lp_mul(kv_u32 v, kv_u32 s)
{
    if (kv_lp_isnan(v))
        return v | 0x00400000u;
    if (kv_lp_isnan(s))
        return s | 0x00400000u;
    return kv_lp_bits(kv_lp_fmul(kv_lp_float(v), kv_lp_float(s)));
}

/* The value of stored element c (float32 bits): fp8 * scale (layer scale,
 * scale == 1 not multiplied) or int8 code * row scale. */
template <int QK>
KV_HD kv_u32 kv_lp_value(typename KvQ<QK>::type c, kv_u32 scale)
{
    if constexpr (QK == KV_I8) {
        return kv_lp_mul(kv_lp_bits((float)c), scale);
    } else {
        kv_u32 v = kv_fp8_to_f32_one<KvQ<QK>::FMT>(c);
        return scale == (kv_u32)KV_F32_ONE ? v : kv_lp_mul(v, scale);
    }
}

/* Element `chunk` of a row (fp8, chunks = dim), or the whole row of `dim`
 * elements (int8, chunk 0 of 1) with its scale into *scale_out. */
template <int FK, int QK>
KV_HD void kv_lp_encode(const typename KvStorage<FK>::type *src, typename KvQ<QK>::type *dst,
                        kv_u32 *scale_out, kv_i64 chunk, kv_i64 dim, kv_u32 scale)
{
    if constexpr (QK == KV_I8) {
        kv_u32 m = 0;
        for (kv_i64 i = 0; i < dim; ++i) {
            kv_u32 a = kv_lp_widen<FK>(src[i]) & 0x7FFFFFFFu;
            m = a > m ? a : m;   /* NaN and inf are the largest patterns */
        }
        if (m == 0 || m >= 0x7F800000u) {
            for (kv_i64 i = 0; i < dim; ++i)
                dst[i] = 0;
            *scale_out = m == 0 ? (kv_u32)KV_F32_ONE : (kv_u32)KV_F32_QNAN;
            return;
        }
        float s = kv_lp_div(kv_lp_float(m), 127.0f);
        if (kv_lp_bits(s) == 0)   /* underflow: the smallest subnormal (exact codes) */
            s = kv_lp_float(1u);
        for (kv_i64 i = 0; i < dim; ++i) {
            dst[i] = kv_lp_i8(kv_lp_div(kv_lp_float(kv_lp_widen<FK>(src[i])), s));
        }
        *scale_out = kv_lp_bits(s);
    } else {
        (void)scale_out;
        (void)dim;
        dst[chunk] = kv_lp_fp8<QK>(kv_lp_widen<FK>(src[chunk]), scale);
    }
}

/* The parameters each kernel passes on to its item, written once (as in paged.cu). */
#define KV_WRITE_SLOTS_Q_PARAMS                                                          \
    typename KvQ<QK>::type *cache, kv_u32 *scales,                                       \
        const typename KvStorage<FK>::type *src, const kv_i64 *slots,                    \
        const kv_i32 *owner, kv_i64 num_slots, kv_i64 heads, kv_i64 block_size,          \
        kv_i64 dim, kv_i64 src_tok, kv_i64 src_head, kv_i64 c_block, kv_i64 c_head,      \
        kv_i64 c_tok, kv_i64 s_block, kv_i64 s_head, kv_i64 s_tok, kv_i64 scale
#define KV_WRITE_SLOTS_Q_ARGS                                                            \
    cache, scales, src, slots, owner, num_slots, heads, block_size, dim, src_tok,        \
        src_head, c_block, c_head, c_tok, s_block, s_head, s_tok, scale
#define KV_GATHER_Q_PARAMS                                                               \
    typename KvStorage<FK>::type *out, const typename KvQ<QK>::type *cache,              \
        const kv_u32 *scales, const kv_i32 *table, kv_i64 start, kv_i64 n,               \
        kv_i64 block_size, kv_i64 c_block, kv_i64 c_head, kv_i64 c_tok,                  \
        kv_i64 s_block, kv_i64 s_head, kv_i64 s_tok, kv_i64 o_head, kv_i64 o_tok,        \
        kv_i64 scale
#define KV_GATHER_Q_ARGS                                                                 \
    out, cache, scales, table, start, n, block_size, c_block, c_head, c_tok,             \
        s_block, s_head, s_tok, o_head, o_tok, scale
#define KV_GATHER_BATCH_Q_PARAMS                                                         \
    typename KvStorage<FK>::type *out, const typename KvQ<QK>::type *cache,              \
        const kv_u32 *scales, const kv_i32 *tables, const kv_i32 *lens,                  \
        kv_i64 heads, kv_i64 max_len, kv_i64 table_stride, kv_i64 block_size,            \
        kv_i64 c_block, kv_i64 c_head, kv_i64 c_tok, kv_i64 s_block, kv_i64 s_head,      \
        kv_i64 s_tok, kv_i64 o_seq, kv_i64 o_head, kv_i64 o_tok, kv_i64 scale
#define KV_GATHER_BATCH_Q_ARGS                                                           \
    out, cache, scales, tables, lens, heads, max_len, table_stride, block_size,          \
        c_block, c_head, c_tok, s_block, s_head, s_tok, o_seq, o_head, o_tok, scale
#define KV_WRITE_CONTIGUOUS_Q_PARAMS                                                     \
    typename KvQ<QK>::type *dst, kv_u32 *scales,                                         \
        const typename KvStorage<FK>::type *src, kv_i64 heads, kv_i64 n,                 \
        kv_i64 start, kv_i64 dim, kv_i64 s_b, kv_i64 s_h, kv_i64 s_t, kv_i64 d_b,        \
        kv_i64 d_h, kv_i64 d_t, kv_i64 sc_b, kv_i64 sc_h, kv_i64 sc_t, kv_i64 scale
#define KV_WRITE_CONTIGUOUS_Q_ARGS                                                       \
    dst, scales, src, heads, n, start, dim, s_b, s_h, s_t, d_b, d_h, d_t, sc_b,          \
        sc_h, sc_t, scale
#define KV_DEQUANTIZE_PARAMS                                                             \
    typename KvStorage<FK>::type *dst, const typename KvQ<QK>::type *src,                \
        const kv_u32 *scales, kv_i64 dim, kv_i64 scale
#define KV_DEQUANTIZE_ARGS                                                               \
    dst, src, scales, dim, scale

/* cache[b, h, off, :] = encode(src[t, h, :]) (and, int8, scales[b, h, off])
 * for slots[t] = b * block_size + off, as paged.cu's kv_write_slots: a slot
 * outside 0..num_slots-1 is skipped, and with an owner table (slots.cu) a
 * token writes only a slot it owns.  rows = n * heads (row = t * heads + h). */
template <int FK, int QK>
KV_HD void kv_write_slots_q_item(kv_i64 row, kv_i64 chunk, KV_WRITE_SLOTS_Q_PARAMS)
{
    kv_u32 t, h;
    kv_i64 slot = kv_slot_of_row(row, heads, slots, owner, num_slots, &t, &h);
    if (slot < 0)
        return;
    kv_i64 b = slot / block_size, off = slot - b * block_size;
    kv_lp_encode<FK, QK>(src + t * src_tok + h * src_head,
                         cache + b * c_block + h * c_head + off * c_tok,
                         scales == 0 ? (kv_u32 *)0 : scales + b * s_block + h * s_head + off * s_tok,
                         chunk, dim, (kv_u32)scale);
}

/* out[h, t, chunk] = value(cache[table[p / bs], h, p % bs, chunk]), p =
 * start + t.  rows = heads * n (row = h * n + t), chunks = dim.  scales:
 * int8 row scales (null for fp8, which use `scale`).  FK == QK: the codes. */
template <int FK, int QK>
KV_HD void kv_gather_q_item(kv_i64 row, kv_i64 chunk, KV_GATHER_Q_PARAMS)
{
    const KvGatherAt a = kv_gather_at(row, n, start, block_size, table);
    typename KvQ<QK>::type c = cache[a.b * c_block + a.h * c_head + a.off * c_tok + chunk];
    if constexpr (FK == QK) {
        out[a.h * o_head + a.t * o_tok + chunk] = c;
    } else {
        kv_u32 s = scales == 0 ? (kv_u32)scale
                               : scales[a.b * s_block + a.h * s_head + a.off * s_tok];
        out[a.h * o_head + a.t * o_tok + chunk] = kv_convert<KV_F32, FK>(kv_lp_value<QK>(c, s));
    }
}

/* A padded batch: out[s, h, t, chunk] as kv_gather_q for t < lens[s], +0
 * for lens[s] <= t < max_len.  rows = batch * heads * max_len. */
template <int FK, int QK>
KV_HD void kv_gather_batch_q_item(kv_i64 row, kv_i64 chunk, KV_GATHER_BATCH_Q_PARAMS)
{
    kv_u32 sq, h, t;
    kv_batch_row(row, heads, max_len, &sq, &h, &t);
    typename KvStorage<FK>::type *dst = out + sq * o_seq + h * o_head + t * o_tok + chunk;
    if ((kv_i64)t >= (kv_i64)lens[sq]) {
        *dst = 0;
        return;
    }
    kv_u32 bs = (kv_u32)block_size, q = t / bs, off = t - q * bs;
    kv_i64 b = tables[sq * table_stride + q];
    typename KvQ<QK>::type c = cache[b * c_block + h * c_head + off * c_tok + chunk];
    if constexpr (FK == QK) {
        *dst = c;
    } else {
        kv_u32 s = scales == 0 ? (kv_u32)scale : scales[b * s_block + h * s_head + off * s_tok];
        *dst = kv_convert<KV_F32, FK>(kv_lp_value<QK>(c, s));
    }
}

/* dst[b, h, start + t, :] = encode(src[b, h, t, :]) (and, int8,
 * scales[b, h, start + t]).  rows = batch * heads * n (row = (b * heads +
 * h) * n + t); chunks = dim (fp8) or 1 (int8). */
template <int FK, int QK>
KV_HD void kv_write_contiguous_q_item(kv_i64 row, kv_i64 chunk, KV_WRITE_CONTIGUOUS_Q_PARAMS)
{
    kv_u32 r = (kv_u32)row, nn = (kv_u32)n, nh = (kv_u32)heads;
    kv_u32 bh = r / nn, t = r - bh * nn;
    kv_u32 b = bh / nh, h = bh - b * nh;
    kv_i64 p = start + t;
    kv_lp_encode<FK, QK>(src + b * s_b + h * s_h + t * s_t, dst + b * d_b + h * d_h + p * d_t,
                         scales == 0 ? (kv_u32 *)0 : scales + b * sc_b + h * sc_h + p * sc_t,
                         chunk, dim, (kv_u32)scale);
}

/* dst[row, chunk] = value(src[row, chunk]) of contiguous (rows, dim) arrays
 * (the host makes contiguous copies); int8 scales: one per row. */
template <int FK, int QK>
KV_HD void kv_dequantize_item(kv_i64 row, kv_i64 chunk, KV_DEQUANTIZE_PARAMS)
{
    kv_i64 i = row * dim + chunk;
    kv_u32 s = scales == 0 ? (kv_u32)scale : scales[row];
    dst[i] = kv_convert<KV_F32, FK>(kv_lp_value<QK>(src[i], s));
}

#ifndef KVCORE_HOST_EMULATION
template <int FK, int QK>
__global__ void kv_write_slots_q(kv_i64 rows, kv_i64 chunks, KV_WRITE_SLOTS_Q_PARAMS)
{
    KV_ROW_LOOP(rows, chunks,
                kv_write_slots_q_item<FK, QK>(row, chunk, KV_WRITE_SLOTS_Q_ARGS));
}

template <int FK, int QK>
__global__ void kv_gather_q(kv_i64 rows, kv_i64 chunks, KV_GATHER_Q_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_gather_q_item<FK, QK>(row, chunk, KV_GATHER_Q_ARGS));
}

template <int FK, int QK>
__global__ void kv_gather_batch_q(kv_i64 rows, kv_i64 chunks, KV_GATHER_BATCH_Q_PARAMS)
{
    KV_ROW_LOOP(rows, chunks,
                kv_gather_batch_q_item<FK, QK>(row, chunk, KV_GATHER_BATCH_Q_ARGS));
}

template <int FK, int QK>
__global__ void kv_write_contiguous_q(kv_i64 rows, kv_i64 chunks,
                                      KV_WRITE_CONTIGUOUS_Q_PARAMS)
{
    KV_ROW_LOOP(rows, chunks,
                kv_write_contiguous_q_item<FK, QK>(row, chunk, KV_WRITE_CONTIGUOUS_Q_ARGS));
}

template <int FK, int QK>
__global__ void kv_dequantize(kv_i64 rows, kv_i64 chunks, KV_DEQUANTIZE_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_dequantize_item<FK, QK>(row, chunk, KV_DEQUANTIZE_ARGS));
}
#endif /* KVCORE_HOST_EMULATION */
