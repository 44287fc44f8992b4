"""kvcore: a KV-cache engine for transformer inference.

Block pool with refcounted ownership, prefix caching, paged and contiguous
caches, and round-to-nearest-even float16/bfloat16/fp8 conversion, at C speed
(Cython/C kernels, GIL released) with an optional CuPy GPU path.
"""
from .backends import CudaUnavailableError, cuda_available, set_simd_level, simd_levels
from ._errors import CacheFullError, KVCacheError, OutOfBlocksError
from .attention import AttentionPlan, get_num_threads, paged_attention, set_num_threads
from .contiguous import KVCache
from .convert import (from_bfloat16, from_float8_e4m3fn, from_float8_e5m2, from_float16,
                      to_bfloat16, to_float8_e4m3fn, to_float8_e5m2, to_float16)
from .hashing import block_hashes
from .paged import PagedKVCache
from .pool import BlockPool
from .stores import DiskStore, HostStore, PrefixStore, RedisStore, StoreWarning
from .tables import csr_block_tables, padded_block_tables

__version__ = "0.1.0"

__all__ = [
    "KVCacheError", "OutOfBlocksError", "CacheFullError",
    "to_float16", "to_bfloat16", "from_float16", "from_bfloat16",
    "to_float8_e4m3fn", "to_float8_e5m2", "from_float8_e4m3fn", "from_float8_e5m2",
    "KVCache", "BlockPool", "PagedKVCache", "block_hashes",
    "padded_block_tables", "csr_block_tables", "CudaUnavailableError", "cuda_available",
    "AttentionPlan", "paged_attention", "set_num_threads", "get_num_threads", "simd_levels",
    "set_simd_level",
    "HostStore", "DiskStore", "RedisStore", "PrefixStore", "StoreWarning",
]
