"""CUDA paged-attention kernels (``kernels/attention.cu``): names and the
host-side plan of a call.  Internal; pure Python and NumPy (no CuPy), so
the backend, the nvcc compile test and the host emulation read the same
tables.

A call is cut into work items, one thread block each (see attention.cu):
(query row, kv head, chunk of up to ``CHUNK_HEADS`` query heads of its
group, split of the row's visible keys).  Splits are sized from the
device's multiprocessor count and the call's work (``split_keys_for``), or
are ``SPLIT_KEYS`` keys where the count is unknown.  Rows whose keys take
more than one split get a merge row: ``kva_attention_merge`` combines
their partials in split order.

Two split kernels take the same items and arguments: the tiled one
(``kva_attention_split``: 16-byte copies, double-buffered K/V tiles in
shared memory, the chunk's heads in parallel) where the pages allow it
(``tiled_ok``), else the scalar one (``kva_attention_split_scalar``).
"""
from pathlib import Path

import numpy as np

from ... import dtypes
from . import _sources

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ATTENTION_FILE = KERNEL_DIR / "attention.cu"

# Instantiations (element kind, head_dim) the host side will ask for:
# float pages and fp8 / int8 pages (read with their scales).
KINDS = (dtypes.F32, dtypes.F16, dtypes.BF16) + dtypes.LOWPREC_KINDS
HEAD_DIMS = (64, 80, 96, 128, 256)

# attention.cu's KVA_HEADS and KVA_WARPS (checked against the file by the tests).
CHUNK_HEADS = 8
WARPS = 4
THREADS = 32 * WARPS
# Keys per split where the device's multiprocessor count is unknown.
SPLIT_KEYS = 256
# Splits sized from the device (split_keys_for): the items of a call aim at
# BLOCKS_PER_SM resident blocks per multiprocessor (the tiled kernel's
# 128 threads and ~33 KB of shared memory leave room for 6 on sm_90), a
# split never smaller than MIN_SPLIT_KEYS keys (its merge would cost more
# than it spreads) and a multiple of SPLIT_ALIGN (whole tiles).
BLOCKS_PER_SM = 4
MIN_SPLIT_KEYS = 64
SPLIT_ALIGN = 64
# attention.cu's KVA_TILE_BYTES: bytes of K (and of V) per tile.
TILE_BYTES = 8192
# The tiled kernel divides key offsets by block_size in 32 bits.
TILED_MAX_BLOCK_SIZE = 2 ** 30
# Threads per block of the merge kernel.
MERGE_THREADS = 128


def split_name(kind, head_dim):
    """The tiled split kernel (16-byte aligned pages)."""
    return f"kva_attention_split<{kind}, {head_dim}>"


def scalar_name(kind, head_dim):
    """The scalar split kernel (any element-aligned pages)."""
    return f"kva_attention_split_scalar<{kind}, {head_dim}>"


# The tensor-core prefill kernel (kva_attention_prefill): float16 / bfloat16
# pages, head_dim <= 128, groups of at most PREFILL_PAIRS query heads; run
# for the rows of sequences with at least PREFILL_MIN_QUERIES queries in a
# call (prefill, chunked prefill) on devices with mma.sync (sm_80+).
PREFILL_KINDS = (dtypes.F16, dtypes.BF16)
PREFILL_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d <= 128)
PREFILL_PAIRS = 64    # attention.cu's KVA_PREFILL_PAIRS
PREFILL_MIN_QUERIES = 64


def prefill_name(kind, head_dim):
    """The tensor-core prefill kernel (f16 / bf16 pages)."""
    return f"kva_attention_prefill<{kind}, {head_dim}>"


def prefill_ok(kind, head_dim, num_heads, num_kv_heads):
    """Whether calls of this shape may use the tensor-core prefill kernel."""
    return (kind in PREFILL_KINDS and head_dim in PREFILL_HEAD_DIMS
            and num_heads // num_kv_heads <= PREFILL_PAIRS)


def prefill_plan(query_start_loc, num_heads, num_kv_heads, min_queries=None):
    """The tensor-core kernel's items for the sequences of at least
    ``min_queries`` (default ``PREFILL_MIN_QUERIES``) queries: int64
    ``[n, 4]`` = (sequence, first query row, rows, kv head), each item
    ``PREFILL_PAIRS // group`` rows (or the sequence's last ones); and the
    bool ``[T]`` mask of the query rows they cover."""
    if min_queries is None:
        min_queries = PREFILL_MIN_QUERIES
    qsl = np.asarray(query_start_loc, np.int64)
    nq = np.diff(qsl)
    per = PREFILL_PAIRS // (num_heads // num_kv_heads)
    mask = np.zeros(int(qsl[-1]) if qsl.size else 0, bool)
    out = []
    for s in np.flatnonzero(nq >= max(1, min_queries)):
        mask[qsl[s]:qsl[s + 1]] = True
        for r in range(int(qsl[s]), int(qsl[s + 1]), per):
            rows = min(per, int(qsl[s + 1]) - r)
            out += [(int(s), r, rows, g) for g in range(num_kv_heads)]
    items = np.array(out, np.int64).reshape(-1, 4)
    return items, mask


def tile_keys(kind, head_dim):
    """Keys per tile of the tiled kernel (attention.cu's KvaTile::KEYS)."""
    return min(64, TILE_BYTES // (head_dim * dtypes.ITEMSIZE[kind]))


def tiled_ok(addresses, byte_strides, block_size):
    """Whether the tiled kernel may read pages at ``addresses`` (the K and
    V base addresses) with ``byte_strides`` (block, head, token strides in
    bytes, the same for K and V): every 16-byte copy is then aligned."""
    return (all(int(a) % 16 == 0 for a in addresses)
            and all(int(st) % 16 == 0 for st in byte_strides)
            and 0 < int(block_size) <= TILED_MAX_BLOCK_SIZE)


def merge_name(head_dim):
    return f"kva_attention_merge<{head_dim}>"


def attention_names():
    """Name expressions of every kernel instantiation (as NVRTC spells them)."""
    names = [split_name(kind, d) for kind in KINDS for d in HEAD_DIMS]
    names += [scalar_name(kind, d) for kind in KINDS for d in HEAD_DIMS]
    names += [prefill_name(kind, d) for kind in PREFILL_KINDS for d in PREFILL_HEAD_DIMS]
    names += [merge_name(d) for d in HEAD_DIMS]
    return names


MERGE_MODULE = "merge"


def module_key(name):
    """The module that holds kernel ``name``: its page kind for a split
    kernel (one module per kind, so a call compiles only its kind's
    kernels), ``MERGE_MODULE`` for a merge kernel."""
    if name.startswith("kva_attention_merge<"):
        return MERGE_MODULE
    return int(name.split("<", 1)[1].split(",")[0])


def module_names(key):
    """Name expressions of module ``key`` (see :func:`module_key`)."""
    if key == MERGE_MODULE:
        return [merge_name(d) for d in HEAD_DIMS]
    names = [split_name(key, d) for d in HEAD_DIMS] + [scalar_name(key, d) for d in HEAD_DIMS]
    if key in PREFILL_KINDS:
        names += [prefill_name(key, d) for d in PREFILL_HEAD_DIMS]
    return names


def modules():
    """Every attention module: ``[(key, names)]``."""
    return [(k, module_names(k)) for k in (*KINDS, MERGE_MODULE)]


def source():
    """The text NVRTC compiles: the file with the headers it includes
    (kv_fp8.cuh, kv_half.cuh) pasted in, as for every other kernel file."""
    return _sources.source(ATTENTION_FILE.name)


def _visible(query_start_loc, seq_lens, sliding_window):
    """Per query row: its sequence, first and end visible key."""
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    nq = np.diff(qsl)
    T = int(qsl[-1])
    seq = np.repeat(np.arange(len(nq), dtype=np.int64), nq)              # [T]
    row = np.arange(T, dtype=np.int64)
    pos = lens[seq] - nq[seq] + (row - qsl[seq])
    hi = pos + 1
    lo = np.maximum(hi - sliding_window, 0) if sliding_window > 0 else np.zeros_like(hi)
    return seq, lo, hi


def split_keys_for(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window,
                   num_sms, rows=None):
    """Keys per split for a call on a device of ``num_sms``
    multiprocessors: the call's units (row, kv head, chunk) are split so
    their items (one thread block each) come to at most ``BLOCKS_PER_SM *
    num_sms``, as many as fit at once: the longest row in
    ``target // units`` pieces (a call of that many units or more is not
    split: a split only adds a merge).  A multiple of ``SPLIT_ALIGN``, at
    least ``MIN_SPLIT_KEYS``.  ``rows``: a bool mask of the rows planned."""
    _, lo, hi = _visible(query_start_loc, seq_lens, sliding_window)
    if rows is not None:
        lo, hi = lo[rows], hi[rows]
    if hi.size == 0:
        return MIN_SPLIT_KEYS
    units = hi.size * num_kv_heads * -(-(num_heads // num_kv_heads) // CHUNK_HEADS)
    pieces = max(1, BLOCKS_PER_SM * int(num_sms) // units)
    longest = int((hi - lo).max())
    want = max(MIN_SPLIT_KEYS, -(-longest // pieces))
    return -(-want // SPLIT_ALIGN) * SPLIT_ALIGN


def plan(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window,
         split_keys=None, num_sms=None, rows=None):
    """The work items of a call (host NumPy, checked arguments).

    Returns ``(items, nsplit, merge_rows)``: ``items`` int64 ``[n, 7]`` =
    (sequence, query row, kv head, first query head of the chunk, heads in
    the chunk, first key, end key); ``nsplit`` int32 ``[n]``, the splits of
    each item's (row, chunk); ``merge_rows`` int64 ``[m, 4]`` = (query row,
    first head, heads, first item) of every (row, chunk) of more than one
    split, whose items are consecutive.  ``split_keys`` defaults to
    ``split_keys_for(..., num_sms)`` given ``num_sms``, else ``SPLIT_KEYS``.
    ``rows`` (a bool mask of the query rows) plans only those rows (the
    others go to the prefill kernel).
    """
    seq, lo, hi = _visible(query_start_loc, seq_lens, sliding_window)
    row = np.arange(hi.size, dtype=np.int64)
    if rows is not None:
        seq, lo, hi, row = seq[rows], lo[rows], hi[rows], row[rows]
    if split_keys is None:
        split_keys = SPLIT_KEYS if not num_sms else split_keys_for(
            query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window, num_sms, rows)
    T = hi.size
    G = num_heads // num_kv_heads
    chunks = -(-G // CHUNK_HEADS)
    ns = np.maximum(1, -(-(hi - lo) // split_keys))                        # [T]
    # units: (row, kv head, chunk), row-major
    U = T * num_kv_heads * chunks
    u_loc = np.repeat(np.arange(T, dtype=np.int64), num_kv_heads * chunks)
    u_row = row[u_loc]
    u_g = np.tile(np.repeat(np.arange(num_kv_heads, dtype=np.int64), chunks), T)
    u_c = np.tile(np.arange(chunks, dtype=np.int64), T * num_kv_heads)
    u_h0 = u_g * G + u_c * CHUNK_HEADS
    u_nh = np.minimum(CHUNK_HEADS, G - u_c * CHUNK_HEADS)
    u_ns = ns[u_loc]
    first = np.zeros(U + 1, np.int64)
    np.cumsum(u_ns, out=first[1:])
    n = int(first[-1])
    unit = np.repeat(np.arange(U, dtype=np.int64), u_ns)
    sp = np.arange(n, dtype=np.int64) - first[unit]
    rl = u_loc[unit]
    k0 = lo[rl] + sp * split_keys
    items = np.stack([seq[rl], row[rl], u_g[unit], u_h0[unit], u_nh[unit], k0,
                      np.minimum(hi[rl], k0 + split_keys)], axis=1)
    nsplit = u_ns[unit].astype(np.int32)
    multi = np.flatnonzero(u_ns > 1)
    merge_rows = np.stack([u_row[multi], u_h0[multi], u_nh[multi], first[multi]], axis=1) \
        if multi.size else np.zeros((0, 4), np.int64)
    return np.ascontiguousarray(items), nsplit, np.ascontiguousarray(merge_rows, np.int64)
