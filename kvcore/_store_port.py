"""The pool's store port: everything that passes between a ``BlockPool`` and
the prefix stores below it (docs/stores.md, "The pool's store port").

The pool publishes, the stores consume.  Every cached block the pool evicts
leaves it as one self-contained ``BlockRecord`` (block id, chained hash,
parent hash, salt root, identity digest, token ids and the block's bytes),
copied out under the pool's lock right after the eviction, before anything
can overwrite the block, and appended to the port's record queue; the
consumer the stores registered (:meth:`StorePort.listen`) is woken and
reads the queue.  Nothing below ever calls back into the pool: what a store
lookup finds is handed back to the pool's side (``_pool_stores``), which
copies it into blocks with :meth:`StorePort.import_blocks`.
"""
import collections

import numpy as np

from . import _arrays
from ._threads import get_num_threads
from .stores.base import BlockRecord

__all__ = ["StorePort"]


class StorePort:
    """A pool's side of the boundary with its prefix stores.

    Attributes
    ----------
    layout : dict
        ``dtype``, ``block_size``, ``num_layers``, ``num_kv_heads``,
        ``head_dim`` and ``kv_scales`` (fp8 pools; else None): what makes two
        pools' blocks interchangeable (the stores' layout fingerprint).
    block_size, bytes_per_block : int
        Token positions per block; bytes of one block's payload.
    headroom : int
        Bytes left free before each payload :meth:`export_blocks` gives (0
        by default): the consumer may write a block's entry header there
        and use header and payload as one buffer, the payload never copied
        again (the spill sets it to its entry header's size).
    """

    def __init__(self, core, lock, backend, storage, scales, layout, bytes_per_block):
        self._core = core
        self._lock = lock
        self._backend = backend
        self._storage = storage
        self._scales = scales
        self.layout = dict(layout)
        self.block_size = layout["block_size"]
        self.bytes_per_block = bytes_per_block
        self.headroom = 0
        self._records = collections.deque()   # batches of BlockRecords, oldest first
        self._wake = None

    # ------------------------------------------------------------ the record queue
    def listen(self, wake):
        """Become the consumer of this port's records: returns the record
        queue (a ``collections.deque`` of lists of ``BlockRecord``, oldest
        first; take them with ``popleft``), and ``wake()`` is called after
        each publish, on the publishing thread, with the pool's lock maybe
        held (so it must not wait on I/O)."""
        self._wake = wake
        return self._records

    def publish(self, records):
        """Hand ``records`` to the stores (nothing when empty or None)."""
        if records:
            self._records.append(records)
            if self._wake is not None:
                self._wake()

    def copy_out_evicted(self):
        """The records of the cached blocks the pool evicted since the last
        call (the pool's lock held: the blocks are not written yet)."""
        return self._records_of(*self._core.take_evicted())

    def publish_evicted(self):
        """Copy out and publish what the pool just evicted (lock held)."""
        self.publish(self.copy_out_evicted())

    def cached_records(self):
        """The records of every block in the prefix cache now, evicting
        nothing (for ``flush_to_stores``; the lock is held only while their
        bytes are copied)."""
        with self._lock:
            core = self._core
            return self._records_of(*core.entries(core.cached_blocks()))

    def _records_of(self, blocks, hashes, parents, roots, idents, tokens):
        if not blocks.size:
            return []
        payloads = self.export_blocks(blocks)
        hb = hashes.astype("<u8").tobytes()
        pb = parents.astype("<u8").tobytes()
        rb = roots.astype("<u8").tobytes()
        return [BlockRecord(int(b), hb[16 * j:16 * j + 16], pb[16 * j:16 * j + 16],
                            rb[16 * j:16 * j + 16], idents[j].tobytes(), tokens[j], payload)
                for j, (b, payload) in enumerate(zip(blocks.tolist(), payloads))]

    # ------------------------------------------------------------ block bytes
    def _block_ids(self, block_ids):
        """``block_ids`` as a list of ints, each a block of the pool
        (IndexError naming the first that is not; nothing read or written)."""
        a = _arrays.index_array(self._backend, block_ids, "block_ids")
        if a.ndim != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"block_ids must hold integers, got dtype {a.dtype}")
        n = self._storage.shape[1]
        bad = np.flatnonzero((a < 0) | (a >= n))
        if bad.size:
            i = int(bad[0])
            raise IndexError(f"block_ids[{i}] must be a block id in 0..{n - 1}, got {a[i]}")
        return a.astype(np.int64).tolist()

    def export_blocks(self, block_ids):
        """The contents of blocks ``block_ids`` as host bytes: one
        C-contiguous ``numpy.uint8`` array of :attr:`bytes_per_block` bytes
        per block: the block's planes in storage order
        (``[2 * layer + (0: K, 1: V)][kv_head][token][dim]`` in the storage
        dtype), then, for int8 pools, its float32 scales in the same order
        (``[2 * layer + (0: K, 1: V)][kv_head][token]``).  The one place block
        contents leave the pool; :meth:`import_blocks` is its inverse.  The
        caller makes sure nobody writes the blocks meanwhile (the pool's
        lock held, or the blocks its own)."""
        ids = self._block_ids(block_ids)
        host = self._backend.to_host
        size, room = self.bytes_per_block, self.headroom
        # one allocation for all (large: NumPy asks the kernel for huge
        # pages; a fresh array per block paid a page fault every 4 KiB,
        # most of an eviction's time), each block copied into its slice,
        # after ``headroom`` free bytes (a consumer's entry header)
        step = room + size
        arena = np.empty(len(ids) * step, np.uint8)
        out = []
        for j, b in enumerate(ids):
            dst = arena[j * step + room:(j + 1) * step]
            a = host(self._storage[:, b])
            np.copyto(dst[:a.nbytes].view(a.dtype).reshape(a.shape), a)
            if self._scales is not None:
                sc = host(self._scales[:, b])
                np.copyto(dst[a.nbytes:].view(np.float32).reshape(sc.shape), sc)
            out.append(dst)
        return out

    def import_blocks(self, block_ids, payloads, seeds=None):
        """Write ``payloads`` (bytes-like, as :meth:`export_blocks` gives
        them) into blocks ``block_ids``.  Checks every payload's size before
        writing anything (ValueError).  With ``seeds`` (one int per block),
        returns the XXH3-64 of each payload with its seed (the entries'
        checksum, kvcore/stores/_format.py), computed while copying (on
        ``kvcore.get_num_threads()`` threads for large runs); else None."""
        ids = self._block_ids(block_ids)
        if len(ids) != len(payloads):
            raise ValueError(f"payloads must hold one entry per block ({len(ids)}), "
                             f"got {len(payloads)}")
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"seeds must hold one entry per block ({len(ids)}), "
                             f"got {len(seeds)}")
        pays = []
        per_block = self.bytes_per_block
        for i, p in enumerate(payloads):
            a = np.frombuffer(p, dtype=np.uint8)
            if a.nbytes != per_block:
                raise ValueError(f"payloads[{i}] must hold {per_block} bytes (one "
                                 f"block), got {a.nbytes}")
            pays.append(a)
        # (int8: the codes, then the scales that follow them in a payload)
        planes = [a for a in (self._storage, self._scales) if a is not None]
        return self._backend.write_block_bytes(planes, ids, pays, seeds, get_num_threads())
