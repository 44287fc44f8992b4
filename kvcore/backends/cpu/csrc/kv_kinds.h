/*
 * Element kinds: the one numbering every kernel of kvcore uses.
 *
 * The source of truth.  kvcore/dtypes.py (F32, F16, BF16, F8E4M3, F8E5M2, I8) mirrors it for
 * Python; the CUDA kernels (kvcore/backends/cuda/kernels/kv_half.cuh, KV_*)
 * and the attention kernels (kv_attention.h, KVA_*) carry the same values,
 * which must stay self-contained for their compilers; tests/native/test_kinds.py
 * checks every twin against this header (read through _convert.KINDS).
 */
#ifndef KV_KINDS_H
#define KV_KINDS_H

enum { KVH_F32 = 0, KVH_F16 = 1, KVH_BF16 = 2 };

/* Low-precision storage kinds (pools only; never an input's or a widened
 * output's kind): fp8 bits as uint8 (a per-layer float32 scale), int8 codes
 * (one float32 scale per token and kv head, stored beside the blocks). */
enum { KVH_F8E4M3 = 3, KVH_F8E5M2 = 4, KVH_I8 = 5 };

#endif
