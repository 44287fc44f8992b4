/*
 * Element kinds: the one numbering every kernel of kvcore uses.
 *
 * The source of truth.  kvcore/dtypes.py (F32, F16, BF16) mirrors it for
 * Python; the CUDA kernels (kvcore/backends/cuda/kernels/kv_half.cuh, KV_*)
 * and the attention kernels (kv_attention.h, KVA_*) carry the same values,
 * which must stay self-contained for their compilers; tests/test_kinds.py
 * checks every twin against this header (read through _convert.KINDS).
 */
#ifndef KV_KINDS_H
#define KV_KINDS_H

enum { KVH_F32 = 0, KVH_F16 = 1, KVH_BF16 = 2 };

#endif
