/*
 * kv_half.cuh: what every kvcore CUDA kernel shares.
 *
 *   - element kinds (KV_F32 / KV_F16 / KV_BF16, the numbers kv_half.h uses)
 *     and the integer type that stores each one;
 *   - the float32 <-> float16 / bfloat16 conversions, bit-exact with the
 *     scalar reference in kvcore/backends/cpu/csrc/kv_half.c (round to nearest even;
 *     overflow to +-inf; subnormals and +-0 kept; a NaN narrows to a quiet
 *     NaN of the same sign keeping the top payload bits; f16 signalling NaNs
 *     widen quiet; bf16 widens by a plain shift);
 *   - the row/chunk launch shape of every kernel (KV_ROW_LOOP).
 *
 * Every value is moved and converted as raw integer bits: no float
 * instruction touches the data, so no FTZ/DAZ mode, NaN canonicalisation or
 * fast-math flag can change a result.
 *
 * The Python loader (kvcore/backends/cuda/_sources.py) pastes this header into each
 * .cu file before NVRTC sees it, so the compiled text never depends on an
 * include path.  Compiled as plain C++ (KVCORE_HOST_EMULATION, no CUDA
 * compiler) the same functions run on the host; the tests use that to check
 * the kernels' index arithmetic against the CPU backend on machines without
 * a GPU.
 */
#ifndef KVCORE_KV_HALF_CUH
#define KVCORE_KV_HALF_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KV_HD __host__ __device__ __forceinline__
#define KV_UNROLL _Pragma("unroll")
#else
#define KV_HD inline
#define KV_UNROLL
#endif

/* No standard headers: NVRTC ships none. */
typedef unsigned short kv_u16;
typedef unsigned int kv_u32;
typedef int kv_i32;
typedef long long kv_i64;

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
/* Low-precision pool kinds (kv_kinds.h): lowprec.cu. */
enum { KV_F8E4M3 = 3, KV_F8E5M2 = 4, KV_I8 = 5 };

/* The integer that holds one element of each kind (float32 as its bits). */
template <int K> struct KvStorage;
template <> struct KvStorage<KV_F32> { typedef kv_u32 type; };
template <> struct KvStorage<KV_F16> { typedef kv_u16 type; };
template <> struct KvStorage<KV_BF16> { typedef kv_u16 type; };

/* 16 bytes, moved as one 128-bit access: CUDA's uint4 on the device, the
 * same layout on the host. */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
typedef uint4 kv_vec16;
#else
struct alignas(16) kv_vec16 {
    kv_u32 x, y, z, w;
};
#endif

#if defined(KVCORE_HOST_EMULATION)
/* Host emulation only: the test harness defines this to record any vector
 * access that is not 16-byte aligned (on a GPU that would be a fault). */
void kv_host_check_aligned16(const void *p);
#endif

/* One 16-byte load / store.  On the device these are spelled in PTX: left
 * to itself the optimiser sees through the pack/unpack below and splits the
 * access into 8- and 4-byte pieces, losing the 128-bit transactions the
 * vector path exists for.  Generic pointers to global memory are global
 * addresses on every CUDA GPU, so ld/st.global take them as they are. */
KV_HD kv_vec16 kv_load16(const void *p)
{
#if defined(__CUDA_ARCH__)
    kv_vec16 q;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                 : "l"(p));
    return q;
#else
#if defined(KVCORE_HOST_EMULATION)
    kv_host_check_aligned16(p);
#endif
    kv_vec16 q;
    __builtin_memcpy(&q, p, 16);
    return q;
#endif
}

KV_HD void kv_store16(void *p, const kv_vec16 &q)
{
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(p), "r"(q.x), "r"(q.y), "r"(q.z), "r"(q.w)
                 : "memory");
#else
#if defined(KVCORE_HOST_EMULATION)
    kv_host_check_aligned16(p);
#endif
    __builtin_memcpy(p, &q, 16);
#endif
}

/* A 16-byte word as 4 floats' bits or 8 halves, and back (little-endian,
 * like every CUDA device and the hosts kvcore runs on). */
KV_HD void kv_unpack(const kv_vec16 &q, kv_u32 *e)
{
    e[0] = q.x;
    e[1] = q.y;
    e[2] = q.z;
    e[3] = q.w;
}

KV_HD void kv_unpack(const kv_vec16 &q, kv_u16 *e)
{
    e[0] = (kv_u16)(q.x & 0xffffu);
    e[1] = (kv_u16)(q.x >> 16);
    e[2] = (kv_u16)(q.y & 0xffffu);
    e[3] = (kv_u16)(q.y >> 16);
    e[4] = (kv_u16)(q.z & 0xffffu);
    e[5] = (kv_u16)(q.z >> 16);
    e[6] = (kv_u16)(q.w & 0xffffu);
    e[7] = (kv_u16)(q.w >> 16);
}

KV_HD kv_vec16 kv_pack(const kv_u32 *e)
{
    kv_vec16 q;
    q.x = e[0];
    q.y = e[1];
    q.z = e[2];
    q.w = e[3];
    return q;
}

KV_HD kv_vec16 kv_pack(const kv_u16 *e)
{
    kv_vec16 q;
    q.x = (kv_u32)e[0] | ((kv_u32)e[1] << 16);
    q.y = (kv_u32)e[2] | ((kv_u32)e[3] << 16);
    q.z = (kv_u32)e[4] | ((kv_u32)e[5] << 16);
    q.w = (kv_u32)e[6] | ((kv_u32)e[7] << 16);
    return q;
}

/* ------------------------------------------------------------------ */
/* Scalar conversions: line for line the kv_half.c reference.          */
/* ------------------------------------------------------------------ */

KV_HD kv_u16 kv_f32_to_f16(kv_u32 x)
{
    kv_u32 sign = (x >> 16) & 0x8000u;
    kv_u32 ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        if (ax == 0x7f800000u)
            return (kv_u16)(sign | 0x7c00u);
        /* quiet NaN, top 10 payload bits kept */
        return (kv_u16)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) /* >= 65520 rounds up to 2^16: infinity */
        return (kv_u16)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { /* a normal half (>= 2^-14) */
        /* re-bias the exponent (127 -> 15), round the 13 dropped bits to
         * nearest even; a carry into the exponent is the right answer */
        kv_u32 m = ax - 0x38000000u;
        m += 0x0fffu + ((m >> 13) & 1u);
        return (kv_u16)(sign | (m >> 13));
    }
    /* a half subnormal (unit 2^-24) or zero */
    kv_u32 e = ax >> 23;
    if (e < 102u) /* below 2^-25: rounds to zero */
        return (kv_u16)sign;
    kv_u32 mant = (ax & 0x7fffffu) | 0x800000u;
    kv_u32 shift = 126u - e; /* 14..24 */
    kv_u32 r = mant >> shift;
    kv_u32 rem = mant & ((1u << shift) - 1u);
    kv_u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r += 1u;
    return (kv_u16)(sign | r);
}

KV_HD kv_u16 kv_f32_to_bf16(kv_u32 x)
{
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (kv_u16)((x >> 16) | 0x0040u); /* quiet NaN, same sign */
    /* RNE on the low 16 bits; the carry into the exponent gives +-inf */
    return (kv_u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

KV_HD kv_u32 kv_f16_to_f32(kv_u16 h)
{
    kv_u32 sign = ((kv_u32)h & 0x8000u) << 16;
    kv_u32 e = ((kv_u32)h >> 10) & 0x1fu;
    kv_u32 m = (kv_u32)h & 0x3ffu;
    if (e == 0x1fu) {
        if (m == 0)
            return sign | 0x7f800000u;
        return sign | 0x7fc00000u | (m << 13); /* quieted, as VCVTPH2PS does */
    }
    if (e == 0) {
        if (m == 0)
            return sign;
        /* subnormal: normalise with integer shifts (at most 10) */
        e = 113u;
        while ((m & 0x400u) == 0) {
            m <<= 1;
            e -= 1u;
        }
        m &= 0x3ffu;
        return sign | (e << 23) | (m << 13);
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}

KV_HD kv_u32 kv_bf16_to_f32(kv_u16 b) { return (kv_u32)b << 16; }

/* One element of kind SK to kind DK.  f16 <-> bf16 goes through float32:
 * widening is exact, so the one narrowing is the single correct rounding
 * (what kvh_convert does on the CPU). */
template <int SK, int DK>
KV_HD typename KvStorage<DK>::type kv_convert(typename KvStorage<SK>::type x)
{
    if constexpr (SK == DK) {
        return x;
    } else if constexpr (SK == KV_F32) {
        if constexpr (DK == KV_F16)
            return kv_f32_to_f16(x);
        else
            return kv_f32_to_bf16(x);
    } else {
        kv_u32 w = SK == KV_F16 ? kv_f16_to_f32(x) : kv_bf16_to_f32(x);
        if constexpr (DK == KV_F32)
            return w;
        else if constexpr (DK == KV_F16)
            return kv_f32_to_f16(w);
        else
            return kv_f32_to_bf16(w);
    }
}

/* ------------------------------------------------------------------ */
/* Runs of V elements                                                  */
/* ------------------------------------------------------------------ */

/* dst[0..V) = convert(src[0..V)).  V == 1 is the scalar path; otherwise
 * V elements fill whole 16-byte words on both sides and the caller has
 * checked that src and dst are 16-byte aligned, so each side is moved with
 * 128-bit accesses (a warp then reads/writes whole 512-byte segments). */
template <int SK, int DK, int V>
KV_HD void kv_convert_run(const typename KvStorage<SK>::type *src,
                          typename KvStorage<DK>::type *dst)
{
    typedef typename KvStorage<SK>::type S;
    typedef typename KvStorage<DK>::type T;
    if constexpr (V == 1) {
        dst[0] = kv_convert<SK, DK>(src[0]);
    } else {
        static_assert(V * sizeof(S) % 16 == 0 && V * sizeof(T) % 16 == 0,
                      "a vector run must fill whole 16-byte words");
        constexpr int NS = V * (int)sizeof(S) / 16; /* words read */
        constexpr int ND = V * (int)sizeof(T) / 16; /* words written */
        constexpr int ES = 16 / (int)sizeof(S);     /* elements per word read */
        constexpr int ED = 16 / (int)sizeof(T);     /* elements per word written */
        S in[V];
        T out[V];
KV_UNROLL
        for (int k = 0; k < NS; ++k)
            kv_unpack(kv_load16(src + k * ES), in + k * ES);
KV_UNROLL
        for (int k = 0; k < V; ++k)
            out[k] = kv_convert<SK, DK>(in[k]);
KV_UNROLL
        for (int k = 0; k < ND; ++k)
            kv_store16(dst + k * ED, kv_pack(out + k * ED));
    }
}

/* dst[0..V) = +0 (padding of batched gathers). */
template <int DK, int V>
KV_HD void kv_zero_run(typename KvStorage<DK>::type *dst)
{
    typedef typename KvStorage<DK>::type T;
    if constexpr (V == 1) {
        dst[0] = (T)0;
    } else {
        constexpr int ND = V * (int)sizeof(T) / 16;
        constexpr int ED = 16 / (int)sizeof(T);
        kv_vec16 z;
        z.x = z.y = z.z = z.w = 0u;
KV_UNROLL
        for (int k = 0; k < ND; ++k)
            kv_store16(dst + k * ED, z);
    }
}

/* ------------------------------------------------------------------ */
/* Atomics (the slot claims of slots.cu)                               */
/* ------------------------------------------------------------------ */

/* *p = max(*p, v) and *p = min(*p, v) as one atomic operation on the
 * device.  The host emulation runs the items one after another, so a plain
 * read-modify-write is the same there. */
KV_HD void kv_atomic_max_i32(kv_i32 *p, kv_i32 v)
{
#if defined(__CUDA_ARCH__)
    atomicMax(p, v);
#else
    if (v > *p)
        *p = v;
#endif
}

/* For values >= 0 only (compared as unsigned: the 64-bit atomicMin every
 * CUDA GPU since sm_35 has). */
KV_HD void kv_atomic_min_nonneg_i64(kv_i64 *p, kv_i64 v)
{
#if defined(__CUDA_ARCH__)
    atomicMin((unsigned long long *)p, (unsigned long long)v);
#else
    if (v < *p)
        *p = v;
#endif
}

/* ------------------------------------------------------------------ */
/* Launch shape                                                        */
/* ------------------------------------------------------------------ */

/*
 * Every kernel is a loop over (row, chunk): a row is one (token, head) line
 * of head_dim elements (or one block of one plane, or one run of a flat
 * array), a chunk is V consecutive elements of it.  Each kernel's
 * kv_<name>_item(row, chunk, args...) does one chunk; the __global__
 * kv_<name>(rows, chunks, args...) maps threadIdx.x to chunks and
 * (blockIdx.x, threadIdx.y) to rows, grid-striding over rows, so consecutive
 * threads touch consecutive chunks of a row (coalesced).  The host launches
 * blocks of (min(chunks, 256), 256 / that) threads.
 */
#define KV_ROW_LOOP(ROWS, CHUNKS, ...)                                                \
    for (kv_i64 row = (kv_i64)blockIdx.x * blockDim.y + threadIdx.y; row < (ROWS);   \
         row += (kv_i64)gridDim.x * blockDim.y)                                       \
        for (kv_i64 chunk = threadIdx.x; chunk < (CHUNKS); chunk += blockDim.x)       \
            __VA_ARGS__

/* Where row `row` (= h * n + t) of a gather of n positions from `start`
 * reads: head h, output position t, block b = table[p / bs] and offset
 * off = p % bs of position p = start + t (32-bit division: the host
 * checked the ranges).  Shared by paged.cu and lowprec.cu. */
struct KvGatherAt {
    kv_u32 h, t, off;
    kv_i64 b;
};

KV_HD KvGatherAt kv_gather_at(kv_i64 row, kv_i64 n, kv_i64 start, kv_i64 block_size,
                              const kv_i32 *table)
{
    KvGatherAt a;
    kv_u32 r = (kv_u32)row, nn = (kv_u32)n;
    a.h = r / nn;
    a.t = r - a.h * nn;
    kv_u32 p = (kv_u32)start + a.t, bs = (kv_u32)block_size;
    kv_u32 q = p / bs;
    a.off = p - q * bs;
    a.b = table[q];
    return a;
}

/* Row `row` = (s * heads + h) * max_len + t of a padded batch gather:
 * sequence s, head h, position t (32-bit division). */
KV_HD void kv_batch_row(kv_i64 row, kv_i64 heads, kv_i64 max_len, kv_u32 *s, kv_u32 *h,
                        kv_u32 *t)
{
    kv_u32 r = (kv_u32)row, L = (kv_u32)max_len, nh = (kv_u32)heads;
    kv_u32 sh = r / L;
    *t = r - sh * L;
    *s = sh / nh;
    *h = sh - *s * nh;
}

/* The slot a paged write's row (= t * heads + h) writes, with its token t
 * and head h; -1 where it writes none: a slot outside 0..num_slots-1 (-1 by
 * definition, or refused by the host or the claim pass), or, with an owner
 * table (slots.cu; null when the slots are known to be distinct), a slot
 * another token owns.  Shared by paged.cu and lowprec.cu. */
KV_HD kv_i64 kv_slot_of_row(kv_i64 row, kv_i64 heads, const kv_i64 *slots, const kv_i32 *owner,
                            kv_i64 num_slots, kv_u32 *t, kv_u32 *h)
{
    kv_u32 r = (kv_u32)row, nh = (kv_u32)heads;
    *t = r / nh;
    *h = r - *t * nh;
    kv_i64 slot = slots[*t];
    if (slot < 0 || slot >= num_slots || (owner != 0 && owner[slot] != (kv_i32)*t))
        return -1;
    return slot;
}

#endif /* KVCORE_KV_HALF_CUH */
