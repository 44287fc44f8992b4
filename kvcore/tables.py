"""Block tables of a batch of sequences, in the forms paged-attention kernels
read: vLLM's padded ``[batch, max_blocks]`` table and FlashInfer's CSR form
(``indptr``, ``indices``, ``last_page_len``).  Arrays live on the pool's
device (CuPy int32 arrays for a CUDA pool), so a kernel reads the pool's
``key_cache(layer)``/``value_cache(layer)`` directly.
"""
import numpy as np

from ._validate import index_int, nonneg_int

__all__ = ["padded_block_tables", "csr_block_tables"]


def _batch(seqs, lengths):
    from .paged import PagedKVCache

    seqs = list(seqs)
    if not seqs:
        raise ValueError("seqs must hold at least one PagedKVCache, got none")
    for i, s in enumerate(seqs):
        if not isinstance(s, PagedKVCache):
            raise TypeError(f"seqs[{i}] must be a kvcore.PagedKVCache, got {type(s).__name__}")
        if s.pool is not seqs[0].pool:
            raise ValueError(f"seqs must share one BlockPool; seqs[{i}] uses another")
    if lengths is None:
        lens = [s._max_written() for s in seqs]
    else:
        lens = [nonneg_int(v, f"lengths[{i}]") for i, v in enumerate(lengths)]
        if len(lens) != len(seqs):
            raise ValueError(f"lengths must have one entry per sequence ({len(seqs)}), "
                             f"got {len(lens)}")
    bs = seqs[0].pool.block_size
    for i, (s, n) in enumerate(zip(seqs, lens)):
        if n > s.num_blocks * bs:
            raise ValueError(f"lengths[{i}] = {n} exceeds the {s.num_blocks * bs} positions "
                             f"that sequence's blocks hold")
    return seqs, lens, bs


def padded_block_tables(seqs, lengths=None, pad_value=0, max_blocks=None):
    """vLLM's form: a padded ``[batch, max_blocks]`` int32 table.

    Parameters
    ----------
    seqs : sequence of PagedKVCache
        All on one pool.
    lengths : sequence of int, optional
        Positions each sequence attends over; default: committed plus
        appended in the current step.  Only the blocks these need are listed.
    pad_value : int, default 0
        Fills unused entries (kernels stop at the sequence length).
    max_blocks : int, optional
        Table width; default the longest sequence's block count.

    Returns
    -------
    (block_tables, seq_lens)
        int32 arrays ``[batch, max_blocks]`` and ``[batch]`` on the pool's device.
    """
    seqs, lens, bs = _batch(seqs, lengths)
    pad_value = index_int(pad_value, "pad_value")
    if not -2**31 <= pad_value < 2**31:
        raise ValueError(f"pad_value must fit the int32 table (-2**31..2**31-1), got {pad_value}")
    need = [-(-n // bs) for n in lens]
    width = max(need) if max_blocks is None else nonneg_int(max_blocks, "max_blocks")
    if width < max(need):
        raise ValueError(f"max_blocks must be at least {max(need)} (the longest sequence's "
                         f"blocks), got {width}")
    try:
        out = np.full((len(seqs), width), pad_value, np.int32)
    except (ValueError, MemoryError) as e:     # (NumPy's own errors name no argument)
        kind = MemoryError if isinstance(e, MemoryError) else ValueError
        raise kind(f"max_blocks must leave a table kvcore can allocate ({len(seqs)} rows of "
                   f"max_blocks int32), got {width}: {e}") from None
    for i, (s, k) in enumerate(zip(seqs, need)):
        out[i, :k] = s._table_head(k)
    pool = seqs[0].pool
    return pool._device_array(out), pool._device_array(np.asarray(lens, np.int32))


def csr_block_tables(seqs, lengths=None):
    """FlashInfer's paged-KV form: ``(indptr, indices, last_page_len)``.

    ``indices[indptr[i]:indptr[i+1]]`` are sequence i's pages (blocks) in
    order and ``last_page_len[i]`` the valid positions in its last page
    (1..block_size; 0 for an empty sequence).  int32 arrays on the pool's
    device.  ``lengths`` as in :func:`padded_block_tables`.
    """
    seqs, lens, bs = _batch(seqs, lengths)
    need = [-(-n // bs) for n in lens]
    indptr = np.zeros(len(seqs) + 1, np.int32)
    np.cumsum(need, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), np.int32)
    for i, (s, k) in enumerate(zip(seqs, need)):
        indices[indptr[i]:indptr[i + 1]] = s._table_head(k)
    last = np.array([n - (k - 1) * bs if k else 0 for n, k in zip(lens, need)], np.int32)
    pool = seqs[0].pool
    return pool._device_array(indptr), pool._device_array(indices), pool._device_array(last)
