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


def key_lo(pos, sliding_window, chunk_size=0):
    """The first key a query at position(s) ``pos`` sees (attention.cu's
    kva_key_lo, the CPU's rule): the later of its window's start and its
    chunk's start (0: off)."""
    pos = np.asarray(pos, np.int64)
    lo = np.maximum(pos + 1 - sliding_window, 0) if sliding_window > 0 else np.zeros_like(pos)
    if chunk_size > 0:
        lo = np.maximum(lo, pos - pos % chunk_size)
    return lo


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


# v3: the FlashAttention-2-class prefill (kv_attn_prefill.cuh, kva_prefill_tc):
# float16 / bfloat16 pages, every head_dim, any q kind; blocks of
# prefill_tc_rows(head_dim) (query, head) pairs over key tiles of 64 (32 for
# head_dim 256), 16-byte aligned pages (else the older kernel above).
PREFILL_TC_HEAD_DIMS = HEAD_DIMS
PREFILL_TC_WARPS = 4
PREFILL_TC_THREADS = 32 * PREFILL_TC_WARPS


def prefill_tc_name(kind, head_dim):
    """The FlashAttention-2-class prefill kernel (f16 / bf16 pages)."""
    return f"kva_prefill_tc<{kind}, {head_dim}>"


def prefill_tc_rows(head_dim):
    """(query, head) pairs per block of ``kva_prefill_tc`` (KvpCfg::ROWS)."""
    return PREFILL_TC_WARPS * 16 * (2 if head_dim <= 128 else 1)


def prefill_tc_smem(head_dim):
    """Dynamic shared memory of ``kva_prefill_tc<*, head_dim>`` (KvpCfg::SMEM)."""
    rows, keys, rs = prefill_tc_rows(head_dim), 64 if head_dim <= 64 else 32, 2 * head_dim + 16
    return rows * rs + 4 * keys * rs + rows * 8


def prefill_tc_plan(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window,
                    head_dim, min_queries=None, chunk_size=0):
    """``kva_prefill_tc``'s items for the sequences of at least
    ``min_queries`` (default ``PREFILL_MIN_QUERIES``) queries: int64
    ``[n, 4]`` = (sequence, kv head, first pair, pairs), the blocks that
    see the most keys first; and the bool ``[T]`` mask of the query rows
    they cover."""
    if min_queries is None:
        min_queries = PREFILL_MIN_QUERIES
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    nq = np.diff(qsl)
    G = num_heads // num_kv_heads
    rows = prefill_tc_rows(head_dim)
    mask = np.zeros(int(qsl[-1]) if qsl.size else 0, bool)
    out, work = [], []
    for s in np.flatnonzero(nq >= max(1, min_queries)):
        mask[qsl[s]:qsl[s + 1]] = True
        pairs = int(nq[s]) * G
        pos0 = int(lens[s] - nq[s])
        for p0 in range(0, pairs, rows):
            n = min(rows, pairs - p0)
            hi = pos0 + (p0 + n - 1) // G + 1
            lo = int(key_lo(pos0 + p0 // G, sliding_window, chunk_size))
            for g in range(num_kv_heads):
                out.append((int(s), g, p0, n))
                work.append(hi - lo)
    order = np.argsort(-np.asarray(work, np.int64), kind="stable")
    items = np.array(out, np.int64).reshape(-1, 4)[order]
    return np.ascontiguousarray(items), mask


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


# ------------------------------------------------------------------ v3
# The tensor-core decode kernel (kv_attn_decode.cuh, kva_decode_tc): float16,
# bfloat16, e4m3fn and e5m2 pages, head_dim <= 128, q of the mma's input
# type (tc_mma_kind).  Items of up to TC_ROWS (query, head) pairs of one kv
# head over a split of their keys; the splits of a unit are merged by the
# last of them to finish (an atomic ticket per unit in ``counters``).
TC_KINDS = (dtypes.F16, dtypes.BF16, dtypes.F8E4M3, dtypes.F8E5M2)
TC_HEAD_DIMS = (64, 80, 96, 128)
TC_ROWS = 16       # KVT_ROWS: pairs per item (the mma's m)
TC_WARPS = 4       # KVT_WARPS
TC_KEYS = 16       # KVT_KEYS: keys per warp tile
# KvtCfg::STAGES: buffers per warp, 3 for rows of 128 bytes or less, else 2
def tc_stages(kind, head_dim):
    return 3 if head_dim * dtypes.ITEMSIZE[kind] <= 128 else 2


TC_THREADS = 32 * TC_WARPS
# Splits sized from the device: about TC_BLOCKS_PER_SM blocks per
# multiprocessor (~70-110 KB of shared memory and ~170 registers a thread
# leave room for 2 on sm_90), whole rounds of the 4 warps' tiles.
TC_BLOCKS_PER_SM = 2
TC_SPLIT_ALIGN = TC_WARPS * TC_KEYS
# The item's keys are offsets from its first key's page in 32 bits.
TC_MAX_KEYS = 2 ** 31
# Splits of one unit at most (KVT_MAX_SPLITS: the last block merges their
# weights in shared memory); longer ranges get longer splits.
TC_MAX_SPLITS = 256


def tc_name(kind, head_dim, mma_kind):
    """The tensor-core decode kernel for pages of ``kind`` and q of ``mma_kind``."""
    return f"kva_decode_tc<{kind}, {head_dim}, {mma_kind}>"


def tc_mma_kinds(kind):
    """The q kinds the tensor-core decode takes over pages of ``kind``:
    float16 / bfloat16 pages their own; fp8 pages float16 and bfloat16
    (every fp8 value is both)."""
    if kind in (dtypes.F16, dtypes.BF16):
        return (kind,)
    if kind in (dtypes.F8E4M3, dtypes.F8E5M2):
        return (dtypes.F16, dtypes.BF16)
    return ()


def tc_smem(kind, head_dim):
    """Bytes of dynamic shared memory of ``kva_decode_tc<kind, head_dim, *>``
    (its KvtCfg::SMEM)."""
    row = head_dim * dtypes.ITEMSIZE[kind]
    pipe = TC_WARPS * tc_stages(kind, head_dim) * 2 * TC_KEYS * (row + 16)
    merge = TC_WARPS * TC_ROWS * (head_dim + 2) * 4 + (TC_WARPS + 4) * TC_ROWS * 4
    weights = (2 * TC_MAX_SPLITS + 2) * TC_ROWS * 4
    return max(pipe, merge, weights) + TC_ROWS * (2 * head_dim + 16) + TC_ROWS * 8 + 16


def _tc_chunks(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window, seqs,
               chunk_size=0):
    """The (sequence, first pair, pairs, first key, end key) of every chunk
    of up to TC_ROWS (query, head) pairs of the sequences in ``seqs``."""
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    nq = np.diff(qsl)
    G = num_heads // num_kv_heads
    use = nq > 0 if seqs is None else (nq > 0) & seqs
    sel = np.flatnonzero(use)
    pairs = nq[sel] * G
    nch = -(-pairs // TC_ROWS)
    seq = np.repeat(sel, nch)
    first = np.repeat(np.cumsum(nch) - nch, nch)
    p0 = (np.arange(seq.size, dtype=np.int64) - first) * TC_ROWS
    npairs = np.minimum(TC_ROWS, np.repeat(pairs, nch) - p0)
    pos0 = lens[seq] - nq[seq]
    hi = pos0 + (p0 + npairs - 1) // G + 1
    lo = key_lo(pos0 + p0 // G, sliding_window, chunk_size)
    return seq, p0, npairs, lo, hi


def tc_split_keys_for(longest, units, num_sms):
    """Keys per split of a call of ``units`` (chunk, kv head) units whose
    longest visible range is ``longest`` keys, on ``num_sms``
    multiprocessors: units x splits come to about TC_BLOCKS_PER_SM blocks
    per multiprocessor (a call of that many units is not split), in whole
    rounds of the block's warp tiles."""
    pieces = max(1, TC_BLOCKS_PER_SM * int(num_sms) // max(1, units))
    want = max(TC_SPLIT_ALIGN, -(-int(longest) // pieces))
    return -(-want // TC_SPLIT_ALIGN) * TC_SPLIT_ALIGN


def tc_plan(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window,
            split_keys=None, num_sms=None, seqs=None, chunk_size=0):
    """The tensor-core decode kernel's items: int64 ``[n, 8]`` = (sequence,
    kv head, first pair, pairs, first key, end key, split index, 0) and the
    int32 ``[n]`` splits of each item's unit; a unit's items are
    consecutive.  ``seqs``: a bool mask of the sequences planned (None:
    all).  ``split_keys`` defaults to ``tc_split_keys_for(..., num_sms)``
    given ``num_sms``, else ``SPLIT_KEYS``."""
    seq, p0, npairs, lo, hi = _tc_chunks(query_start_loc, seq_lens, num_heads, num_kv_heads,
                                         sliding_window, seqs, chunk_size)
    H = num_kv_heads
    if seq.size == 0:
        return np.zeros((0, 8), np.int64), np.zeros(0, np.int32)
    if split_keys is None:
        split_keys = SPLIT_KEYS if not num_sms else tc_split_keys_for(
            (hi - lo).max(), seq.size * H, num_sms)
    split_keys = max(int(split_keys), -(-int((hi - lo).max()) // TC_MAX_SPLITS))
    ns = np.maximum(1, -(-(hi - lo) // split_keys))                       # per chunk
    u_chunk = np.repeat(np.arange(seq.size, dtype=np.int64), H)
    u_g = np.tile(np.arange(H, dtype=np.int64), seq.size)
    u_ns = ns[u_chunk]
    unit = np.repeat(np.arange(u_chunk.size, dtype=np.int64), u_ns)
    start = np.repeat(np.cumsum(u_ns) - u_ns, u_ns)
    sp = np.arange(unit.size, dtype=np.int64) - start
    ch = u_chunk[unit]
    k0 = lo[ch] + sp * split_keys
    items = np.stack([seq[ch], u_g[unit], p0[ch], npairs[ch], k0,
                      np.minimum(hi[ch], k0 + split_keys), sp, np.zeros_like(sp)], axis=1)
    return np.ascontiguousarray(items), u_ns[unit].astype(np.int32)


def attention_names():
    """Name expressions of every kernel instantiation (as NVRTC spells them)."""
    return [n for _key, names in modules() for n in names]


MERGE_MODULE = "merge"
# Module families of one page kind: the float32 (CUDA-core) kernels, the
# tensor-core decode, the prefill kernels.  A call compiles only what it runs.
CORE, TC, PREFILL = "core", "tc", "prefill"


def module_key(name):
    """The module that holds kernel ``name``: ``(family, page kind)``, or
    ``MERGE_MODULE`` for a merge kernel."""
    if name.startswith("kva_attention_merge<"):
        return MERGE_MODULE
    kind = int(name.split("<", 1)[1].split(",")[0])
    family = TC if name.startswith("kva_decode_tc<") else \
        PREFILL if name.startswith(("kva_attention_prefill<", "kva_prefill_tc<")) else CORE
    return (family, kind)


def module_names(key):
    """Name expressions of module ``key`` (see :func:`module_key`)."""
    if key == MERGE_MODULE:
        return [merge_name(d) for d in HEAD_DIMS]
    family, kind = key
    if family == CORE:
        return [split_name(kind, d) for d in HEAD_DIMS] + \
            [scalar_name(kind, d) for d in HEAD_DIMS]
    if family == TC:
        return [tc_name(kind, d, mt) for mt in tc_mma_kinds(kind) for d in TC_HEAD_DIMS]
    return [prefill_name(kind, d) for d in PREFILL_HEAD_DIMS] + \
        [prefill_tc_name(kind, d) for d in PREFILL_TC_HEAD_DIMS]


def modules():
    """Every attention module: ``[(key, names)]``."""
    keys = [(CORE, k) for k in KINDS] + [(TC, k) for k in TC_KINDS]
    keys += [(PREFILL, k) for k in PREFILL_KINDS]
    return [(k, module_names(k)) for k in (*keys, MERGE_MODULE)]


def source():
    """The text NVRTC compiles: the file with the headers it includes
    (kv_fp8.cuh, kv_half.cuh) pasted in, as for every other kernel file."""
    return _sources.source(ATTENTION_FILE.name)


def _visible(query_start_loc, seq_lens, sliding_window, chunk_size=0):
    """Per query row: its sequence, first and end visible key."""
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    nq = np.diff(qsl)
    T = int(qsl[-1])
    seq = np.repeat(np.arange(len(nq), dtype=np.int64), nq)              # [T]
    row = np.arange(T, dtype=np.int64)
    pos = lens[seq] - nq[seq] + (row - qsl[seq])
    hi = pos + 1
    lo = key_lo(pos, sliding_window, chunk_size)
    return seq, lo, hi


def split_keys_for(query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window,
                   num_sms, rows=None, chunk_size=0):
    """Keys per split for a call on a device of ``num_sms``
    multiprocessors: the call's units (row, kv head, chunk) are split so
    their items (one thread block each) come to at most ``BLOCKS_PER_SM *
    num_sms``, as many as fit at once: the longest row in
    ``target // units`` pieces (a call of that many units or more is not
    split: a split only adds a merge).  A multiple of ``SPLIT_ALIGN``, at
    least ``MIN_SPLIT_KEYS``.  ``rows``: a bool mask of the rows planned."""
    _, lo, hi = _visible(query_start_loc, seq_lens, sliding_window, chunk_size)
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
         split_keys=None, num_sms=None, rows=None, chunk_size=0):
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
    seq, lo, hi = _visible(query_start_loc, seq_lens, sliding_window, chunk_size)
    row = np.arange(hi.size, dtype=np.int64)
    if rows is not None:
        seq, lo, hi, row = seq[rows], lo[rows], hi[rows], row[rows]
    if split_keys is None:
        split_keys = SPLIT_KEYS if not num_sms else split_keys_for(
            query_start_loc, seq_lens, num_heads, num_kv_heads, sliding_window, num_sms, rows,
            chunk_size)
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
