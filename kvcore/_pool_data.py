"""A pool's memory and the data ops over it: ``BlockPool`` holds one
``PoolData`` (``pool._data``) and calls it once it has checked the layer; the
bytes go through the backend of the pool's device.

The storage is one allocation ``(num_layers * 2, num_blocks, num_kv_heads,
block_size, head_dim)`` (plane ``2*l``: layer l's keys, ``2*l + 1``: its
values, each block head-major) and, for int8 pools, one float32 scale per
(plane, block, kv head, token) addressed by the same block ids.
"""
import functools

import numpy as np

from . import _arrays, dtypes
from ._native import _pool
from ._planes import Planes, allocate_storage, kv_scale_pairs
from ._validate import index_int

__all__ = ["PoolData"]


def _storage(backend, num_blocks, block_size, num_layers, num_kv_heads, head_dim, kind):
    """A pool's zeroed storage ``(2 * num_layers, num_blocks, num_kv_heads,
    block_size, head_dim)``; one it cannot have is refused naming the
    arguments that size it."""
    return allocate_storage(
        backend, (2 * num_layers, num_blocks, num_kv_heads, block_size, head_dim), kind,
        "the pool's storage",
        (f"num_blocks={num_blocks}", f"num_layers={num_layers}", "2 (K, V)",
         f"num_kv_heads={num_kv_heads}", f"block_size={block_size}", f"head_dim={head_dim}"))


class PoolData:
    """The storage of a pool of ``num_blocks`` blocks and its data ops; the
    arguments of each op are checked here (the layer by the caller)."""

    def __init__(self, backend, num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                 kind, layer_scales, head_scales):
        self.backend = backend
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.kind = num_kv_heads, head_dim, kind
        self.layer_scales, self.head_scales = layer_scales, head_scales
        self.storage = _storage(backend, num_blocks, block_size, num_layers, num_kv_heads,
                                head_dim, kind)
        # int8: the scale planes, one float32 scale per (plane, block, kv
        # head, token), addressed by the same block ids as the storage (None
        # for other dtypes)
        self.scale_planes = (backend.zeros(self.storage.shape[:4], np.float32)
                             if kind == dtypes.I8 else None)
        split = lambda a: None if a is None else a.reshape((a.shape[0] // 2, 2) + a.shape[1:])
        self.planes = Planes(backend, split(self.storage), kind, split(self.scale_planes),
                             layer_scales, head_scales,
                             owned=(self.storage, self.scale_planes))
        # write()'s scratch on a GPU (one int32 per slot), None on the CPU
        self.slot_owner = backend.slot_owner_table(num_blocks * block_size)
        # the pool's one native writer (None where the backend has none): a
        # sequence's append, and a decode step's K/V by slots, in one call
        self.writer = backend.position_writer(self.storage, kind, self.scale_planes,
                                              layer_scales, head_scales)

    def block_copy(self):
        """The one block copy within the pool (copy-on-write): a callable
        ``(src, dst)`` holding the storage, not the pool (no reference cycle
        keeps a dropped pool's memory alive)."""
        return functools.partial(_copy_blocks, self.backend, self.storage, self.scale_planes)

    # ------------------------------------------------------------ checks
    def kv_input(self, k, v, src_dtype, private=False):
        """Validated (k, v, kind): same shape (n, heads, dim), same dtype
        (bfloat16 as uint16 bits), each apart from this pool's storage (an
        input that is a view of any plane of it is copied once, so every
        plane written later reads it as it was); ``private``: copies
        (``_arrays.float_input``)."""
        backend = self.backend
        k, src_kind = _arrays.float_input(backend, k, "k", src_dtype, private)
        v, sv = _arrays.float_input(backend, v, "v", src_dtype, private)
        want = (self.num_kv_heads, self.head_dim)
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3 or a.shape[1:] != want:
                raise ValueError(
                    f"{name} must have shape (n, {want[0]}, {want[1]}) "
                    f"(n, num_kv_heads, head_dim), got {tuple(a.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if sv != src_kind:
            raise TypeError(f"k and v must have the same dtype, got "
                            f"{dtypes.KIND_NAME[src_kind]} and {dtypes.KIND_NAME[sv]}")
        return self.planes.apart(k), self.planes.apart(v), src_kind

    def slots(self, slots, n):
        """Checked int64 slots, one per token (-1 or in range)."""
        fast = _pool.checked_slots(slots, n, self.num_blocks * self.block_size)
        if fast is not None:
            return fast
        s = _arrays.index_array(self.backend, slots, "slots")
        if s.ndim != 1 or s.shape[0] != n:
            raise ValueError(f"slots must be 1-D of length {n} (one per token), got shape {s.shape}")
        if n and s.dtype.kind not in "iu":
            raise TypeError(f"slots must hold integers, got dtype {s.dtype}")
        if n:
            # Check the caller's values before the int64 cast: a uint64 slot
            # of 2**64 - 1 would otherwise wrap to -1 and be skipped.
            limit = self.num_blocks * self.block_size
            bad = (s >= limit) if s.dtype.kind == "u" else (s < -1) | (s >= limit)
            if bad.any():
                i = int(np.argmax(bad))
                raise IndexError(
                    f"slots must be -1 (skip) or in 0..{limit - 1} "
                    f"(num_blocks * block_size - 1), got {int(s[i])} at index {i}")
        return np.ascontiguousarray(s, dtype=np.int64)

    def _first_bad_block(self, ids):
        """The index of the first entry of 1-D ``ids`` outside
        ``0..num_blocks - 1``, or -1: the pool's one block-id range rule."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            return int(np.argmax((ids < 0) | (ids >= self.num_blocks)))
        return -1

    def table(self, block_table, arg="block_table"):
        """Checked int32 block ids (1-D, each in range)."""
        t = _arrays.index_array(self.backend, block_table, arg)
        if t.ndim != 1:
            raise ValueError(f"{arg} must be 1-D, got shape {t.shape}")
        if t.size and t.dtype.kind not in "iu":
            raise TypeError(f"{arg} must hold integers, got dtype {t.dtype}")
        i = self._first_bad_block(t)
        if i >= 0:
            raise IndexError(
                f"{arg} entries must be in 0..{self.num_blocks - 1}, "
                f"got {int(t[i])} at index {i}")
        return np.ascontiguousarray(t, dtype=np.int32)

    def table_range(self, block_table, start, end):
        """Checked ``(table, start, end)`` of a raw read of positions
        ``start .. end - 1`` through ``block_table``."""
        table = self.table(block_table)
        start = index_int(start, "start")
        end = index_int(end, "end")
        cap = len(table) * self.block_size
        if not 0 <= start <= end <= cap:
            raise ValueError(
                f"start and end must satisfy 0 <= start <= end <= {cap} "
                f"(len(block_table) * block_size), got start={start}, end={end}")
        return table, start, end

    def batch_tables(self, block_tables, lengths):
        """Checked ``(tables, lengths)`` of a batch read: every entry a
        sequence's length reaches in range."""
        t = _arrays.index_array(self.backend, block_tables, "block_tables")
        n = _arrays.index_array(self.backend, lengths, "lengths")
        if t.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [batch, max_blocks], got shape {t.shape}")
        if n.ndim != 1 or n.shape[0] != t.shape[0]:
            raise ValueError(f"lengths must be 1-D with one entry per row of block_tables "
                             f"({t.shape[0]}), got shape {n.shape}")
        if t.size and t.dtype.kind not in "iu":
            raise TypeError(f"block_tables must hold integers, got dtype {t.dtype}")
        if n.size and n.dtype.kind not in "iu":
            raise TypeError(f"lengths must hold integers, got dtype {n.dtype}")
        cap = t.shape[1] * self.block_size
        if n.size and (n.min() < 0 or n.max() > cap):
            i = int(np.argmax((n < 0) | (n > cap)))
            raise ValueError(f"lengths must lie in 0..{cap} (max_blocks * block_size), "
                             f"got {int(n[i])} at index {i}")
        need = -(-n.astype(np.int64) // self.block_size) if n.size else n
        for s in range(t.shape[0]):
            j = self._first_bad_block(t[s, :need[s]])
            if j >= 0:
                raise IndexError(f"block_tables[{s}, {j}] must be in 0..{self.num_blocks - 1}, "
                                 f"got {int(t[s, j])}")
        return t, n

    def copy_ids(self, src_block_ids, dst_block_ids, dst):
        """Checked int32 ``(src, dst)`` of a copy into ``dst`` (a PoolData):
        ids in range, as many on both sides, no destination twice."""
        src = self.table(src_block_ids, "src_block_ids")
        dst_ids = dst.table(dst_block_ids, "dst_block_ids")
        if src.shape != dst_ids.shape:
            raise ValueError(f"src_block_ids and dst_block_ids must have the same length, got "
                             f"{src.shape[0]} and {dst_ids.shape[0]}")
        uniq, counts = np.unique(dst_ids, return_counts=True)
        if uniq.size != dst_ids.size:
            i = int(np.flatnonzero(counts > 1)[0])
            raise ValueError(
                f"dst_block_ids must not repeat a block id, got {int(uniq[i])} at indices "
                f"{np.flatnonzero(dst_ids == uniq[i]).tolist()}")
        return src, dst_ids

    def same_scales(self, other):
        """Whether two fp8 pools' scales (or both None) are equal."""
        if self.layer_scales is None:
            return True
        return (np.array_equal(self.layer_scales, other.layer_scales)
                and (self.head_scales is None) == (other.head_scales is None)
                and (self.head_scales is None
                     or np.array_equal(self.head_scales, other.head_scales)))

    # ------------------------------------------------------------ ops
    def write(self, layer, k, v, slots, src_kind, check):
        """``BlockPool.write`` of validated ``layer``, K and V."""
        n = k.shape[0]
        backend = self.backend
        on_device = backend.device_slots(slots, n)  # GPU slots stay on the GPU
        if on_device is None:
            slots, check = self.slots(slots, n), False  # checked here, on the host
        else:
            slots = on_device
        k_plane, v_plane = self.planes.views[layer]
        k_codec, v_codec = self.planes.codecs[layer]
        backend.write_slots_kv(k_plane, v_plane, k, v, slots, src_kind, k_codec, v_codec,
                               self.slot_owner, bool(check))

    def write_positions(self, layer, k, v, slots, src_kind):
        """K and V (validated by :meth:`kv_input`) to the slots of a
        sequence's own positions in (validated) ``layer``."""
        backend = self.backend
        k_plane, v_plane = self.planes.views[layer]
        k_codec, v_codec = self.planes.codecs[layer]
        backend.write_slots(k_plane, k, slots, src_kind, k_codec)
        backend.write_slots(v_plane, v, slots, src_kind, v_codec)

    def gather(self, layer, table, start, end, dtype, out=None, out_check=None):
        """(k, v) of positions start..end-1 of (validated) ``layer`` and
        ``table`` (int32, aligned), into ``out`` when given (``out_check``:
        ``_arrays.out_guard``'s, run once ``out`` is converted)."""
        dst_kind = _arrays.read_kind(dtype, self.kind)
        backend = self.backend
        shape = (self.num_kv_heads, end - start, self.head_dim)
        outs = _arrays.out_pair(backend, out, shape, dst_kind)
        if out_check is not None:
            out_check()
        if end == start:
            return outs[0][1], outs[1][1]
        tmps = self._targets(outs, out, shape, dst_kind)
        # on a GPU: one upload of the blocks the range needs, for K and V
        table = backend.from_host(table[:-(-end // self.block_size)])
        for plane, codec, tmp in zip(self.planes.views[layer], self.planes.codecs[layer], tmps):
            backend.gather(plane, table, start, end, tmp, codec, dst_kind)
        return _deliver(outs, tmps)

    def gather_batch(self, layer, t, n, dtype, out, out_check=None):
        """``BlockPool.gather_batch`` of validated ``layer``, tables and
        lengths (``out_check``: as :meth:`gather`'s)."""
        dst_kind = _arrays.read_kind(dtype, self.kind)
        backend = self.backend
        width = int(n.max()) if n.size else 0
        shape = (t.shape[0], self.num_kv_heads, width, self.head_dim)
        # on a GPU: one upload each, shared by the K and the V gather
        t32 = backend.from_host(np.ascontiguousarray(t, np.int32))
        n32 = backend.from_host(np.ascontiguousarray(n, np.int32))
        outs = _arrays.out_pair(backend, out, shape, dst_kind)
        if out_check is not None:
            out_check()
        tmps = self._targets(outs, out, shape, dst_kind)
        for plane, codec, tmp in zip(self.planes.views[layer], self.planes.codecs[layer], tmps):
            backend.gather_batch(plane, t32, n32, tmp, codec, dst_kind)
        return _deliver(outs, tmps)

    def gather_scales(self, layer, table, start, end):
        """int8 pools: the scales of :meth:`gather`'s codes (validated arguments)."""
        pos = np.arange(start, end, dtype=np.int64)
        blocks = table.astype(np.int64)[pos // self.block_size]
        offs = pos % self.block_size
        xp = self.backend.xp
        if xp is not np:
            blocks, offs = self.backend.from_host(blocks), self.backend.from_host(offs)
        return tuple(xp.ascontiguousarray(self.scale_planes[2 * layer + i][blocks, :, offs].T)
                     for i in (0, 1))

    def _targets(self, outs, out, shape, kind):
        """What the kernels write for each of ``outs``: the array itself, or
        (a caller's ``out`` that is not C-contiguous, not aligned, or meets
        the storage) a temporary copied in by :func:`_deliver` once both
        K and V have been read."""
        if out is None:
            return [o[0] for o in outs]
        backend = self.backend
        return [dst if backend.direct_out(dst, self.storage)
                else backend.empty(shape, dtypes.STORAGE[kind]) for dst, _ in outs]

    def copy_blocks(self, src, dst):
        """Copy blocks ``src[i]`` to ``dst[i]`` (every layer, K and V, int8
        scales included)."""
        _copy_blocks(self.backend, self.storage, self.scale_planes, np.asarray(src, np.int32),
                     np.asarray(dst, np.int32))

    def copy_blocks_to(self, dst, src_block_ids, dst_block_ids, before_overwrite):
        """``BlockPool.copy_blocks_to`` into ``dst`` (another pool's PoolData,
        or this one): the geometry, ids and scales checked, then
        ``before_overwrite(ids)`` told which of ``dst``'s blocks the copy
        overwrites, then the copy."""
        mine, theirs = self._geometry(), dst._geometry()
        if mine != theirs:
            raise ValueError(
                "dst_pool must have the same (num_layers, num_kv_heads, block_size, head_dim, "
                f"dtype) as this pool, {mine[:4] + (dtypes.KIND_NAME[self.kind],)}; got "
                f"{theirs[:4] + (dtypes.KIND_NAME[dst.kind],)}")
        src, dst_ids = self.copy_ids(src_block_ids, dst_block_ids, dst)
        if not src.size:
            return
        if not self.same_scales(dst):
            raise ValueError(
                "dst_pool must have the same kv_scales as this pool, "
                f"{kv_scale_pairs(self.layer_scales, self.head_scales)}; got "
                f"{kv_scale_pairs(dst.layer_scales, dst.head_scales)}")
        before_overwrite(dst_ids)
        self.copy_to(dst, src, dst_ids)

    def _geometry(self):
        return (self.storage.shape[0] // 2, self.num_kv_heads, self.block_size, self.head_dim,
                self.kind)

    def copy_to(self, dst, src_ids, dst_ids):
        """Copy blocks ``src_ids`` into blocks ``dst_ids`` of ``dst`` (a
        PoolData, maybe this one or on another device; checked ids): every
        destination gets its source as it was before the call."""
        # a GPU on either side drives the copy (it can read and write host memory)
        backend = self.backend.copier_for(dst.backend)
        # the blocks' data, and their int8 scales (same block ids) with them
        arrays = [(self.storage, dst.storage)]
        if self.scale_planes is not None:
            arrays.append((self.scale_planes, dst.scale_planes))
        if dst is not self:
            for mine, theirs in arrays:
                backend.copy_blocks_between(mine, src_ids, theirs, dst_ids)
        else:
            self._copy_within(backend, [a for a, _ in arrays], src_ids, dst_ids)

    def _copy_within(self, backend, arrays, src, dst):
        """A copy within this pool.  Sources that are also destinations are
        read before anything is written: copied out to a buffer, then in
        from it last."""
        staged = np.isin(src, dst)
        if not staged.any():
            self.copy_blocks(src, dst)
            return
        stage_ids, where = np.unique(src[staged], return_inverse=True)
        stage_ids = stage_ids.astype(np.int32)
        bufs = []
        for a in arrays:
            buf = backend.empty((a.shape[0], stage_ids.size) + a.shape[2:], a.dtype)
            backend.copy_blocks_between(a, stage_ids, buf,
                                        np.arange(stage_ids.size, dtype=np.int32))
            bufs.append(buf)
        direct = ~staged
        if direct.any():
            self.copy_blocks(src[direct], dst[direct])
        for a, buf in zip(arrays, bufs):
            backend.copy_blocks_between(buf, where.astype(np.int32).ravel(), a,
                                        np.ascontiguousarray(dst[staged]))


def _deliver(outs, tmps):
    for (dst, _), tmp in zip(outs, tmps):
        if tmp is not dst:
            dst[...] = tmp
    return outs[0][1], outs[1][1]


def _copy_blocks(backend, storage, scale_planes, src, dst):
    """The one block copy within a pool (copy-on-write, ``copy_blocks_to``
    within the pool): ``storage[:, dst[i]] = storage[:, src[i]]``, and the
    int8 ``scale_planes`` (same block ids) with it."""
    backend.copy_blocks(storage, src, dst)
    if scale_planes is not None:
        backend.copy_blocks(scale_planes, src, dst)
