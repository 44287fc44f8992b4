"""The slot writes of the CUDA backend: K/V rows into their slots
(``write_slots``, ``write_slots_kv``: vLLM's reshape_and_cache), and the
per-layer slot-owner tables whose claim and release passes (``kernels/slots.cu``)
let several tokens name one slot, the last one's values landing.

``CudaBackend`` (``backend.py``) holds a ``CudaSlotWrites``, which calls
the backend's device hooks (``_ctx``, ``_upload``, ...) and launches
through the backend's launcher, so the tests' host emulation, which
overrides those, runs it too.
"""
import threading

import numpy as np

from ... import dtypes
from . import _sources
from .arrays import on_cuda_device


class CudaSlotWrites:
    """``write_slots``, ``write_slots_kv``, ``slot_owner_table`` and
    ``device_slots`` of ``CudaBackend`` ``backend``."""

    def __init__(self, backend, launcher):
        self._be = backend
        self._launcher = launcher

    def write_slots(self, cache, src, slots, src_kind, codec):
        """cache[b, h, off, :] = src[i, h, :] stored by ``codec``, for slot
        s = slots[i] >= 0, b = s // block_size, off = s % block_size (vLLM's
        reshape_and_cache).  cache: (num_blocks, heads, block_size, dim);
        src: (n, heads, dim); slots: int64, host or device, distinct (a
        sequence's own positions; ``write_slots_kv`` takes repeats).  A slot
        past the cache is skipped by the kernel, never written.  An int8
        row's max-abs takes one thread per (token, head) row; fp8 one per
        element."""
        n = src.shape[0]
        if n == 0 or src.shape[1] == 0 or src.shape[2] == 0:
            return
        with self._be._ctx():
            self._write_plane(cache, src, self._be._index_array(slots, np.int64), None,
                              src_kind, codec)

    def _write_plane(self, cache, src, slots, owner, src_kind, codec):
        """One kv_write_slots (float, paged.cu) or kv_write_slots_q (fp8 /
        int8, lowprec.cu) launch; ``slots`` a device int64 array, ``owner``
        the claimed owner table or None."""
        n, heads, dim = src.shape
        plane = codec.scale_plane
        be = self._be
        if be._overlaps(src, cache) or (plane is not None and be._overlaps(src, plane)):
            src = self._be._contiguous_copy(src)   # e.g. a view of the pool itself
        src = self._be.inner_contiguous(src)
        ss = self._be._estrides(src, (0, 1))
        self._be._check_rows(n * heads, "write_slots")
        v = 1 if codec.lowprec else self._be._vector(src_kind, codec.kind, dim,
                                                  [(src, (0, 1)), (cache, (0, 1, 2))])
        self._launcher.launch(*self.write_call(cache, src, ss, slots, owner, n, src_kind, codec,
                                               v))

    def write_call(self, cache, src, src_strides, slots, owner, n, src_kind, codec, v):
        """``(file, sk, dk, name, rows, chunks, args)`` of the launch that
        writes ``n`` rows of ``src`` (an array, or the device address of
        rows ``src_strides`` = (token, head) elements apart) into plane
        ``cache`` through ``slots`` (an array or an address): the one
        place the write kernels' argument lists are spelled, for
        ``CudaLaunches.launch`` and for packed launches (``lane.py``).  ``v``: the
        vector width (1 for fp8 / int8 planes)."""
        heads, dim = cache.shape[1], cache.shape[3]
        dst_kind, plane = codec.kind, codec.scale_plane
        cs = self._be._estrides(cache, (0, 1, 2))
        rows, num_slots = n * heads, cache.shape[0] * cache.shape[2]
        if codec.lowprec:
            scs = self._be._scale_strides(plane, (0, 1, 2))
            return (_sources.LOWPREC_FILE, src_kind, dst_kind,
                    _sources.lowprec_name("kv_write_slots_q", src_kind, dst_kind), rows,
                    1 if dst_kind == dtypes.I8 else dim,
                    [cache, plane, src, slots, owner, num_slots, heads, cache.shape[2], dim,
                     src_strides[0], src_strides[1], cs[0], cs[1], cs[2], scs[0], scs[1],
                     scs[2], self._be._scale_bits(codec.layer_scale)])
        return ("paged.cu", src_kind, dst_kind,
                _sources.kernel_name("kv_write_slots", src_kind, dst_kind, v), rows, dim // v,
                [cache, src, slots, owner, num_slots, heads, cache.shape[2], src_strides[0],
                 src_strides[1], cs[0], cs[1], cs[2]])

    # ------------------------------------------------- BlockPool.write
    def slot_owner_table(self, num_slots):
        """The scratch ``write_slots_kv`` needs for a pool of ``num_slots``
        slots: a ``SlotOwners``, which holds one owner table (one int32 per
        slot, -1 between writes) per K plane written, so writes of
        different layers issued on different streams never share one.
        Kept by the pool for its lifetime (a CUDA graph holds the tables'
        addresses)."""
        return SlotOwners(num_slots, self.new_owner_table, self._be._ptr)

    def new_owner_table(self, num_slots):
        """One owner table, all -1, filled by a kernel on the current stream
        (the stream of the layer's first write, which its claim pass
        follows): nothing is copied up, so even a layer's first write can
        be captured in a CUDA graph (where CuPy can allocate; a warm-up
        write of every layer before capturing avoids the question)."""
        with self._be._ctx():
            table = self._be.xp.empty(num_slots, np.int32)
            self._launcher.launch(_sources.SLOTS_FILE, None, None, "kv_reset_owner", num_slots, 1,
                              [table])
            return table

    def device_slots(self, slots, n):
        """``slots`` as a C-contiguous int64 array on this device when they
        live on a CUDA device, else None (host data, which the caller checks
        on the host).

        Zero-copy for CuPy arrays, ``__cuda_array_interface__`` and DLPack
        (torch CUDA tensors); an integer dtype other than int64 is cast on
        the device.  Shape and dtype are checked from the metadata: nothing
        is read back.  Slots on another GPU are a ValueError; uint64 slots a
        TypeError (2**64 - 1 would become -1, a skip).
        """
        if not (self._be._is_device(slots) or on_cuda_device(slots)):
            return None
        a = self._be.asarray(slots, "slots")
        if a.ndim != 1 or a.shape[0] != n:
            raise ValueError(
                f"slots must be 1-D of length {n} (one per token), got shape {tuple(a.shape)}")
        if n and a.dtype.kind not in "iu":
            raise TypeError(f"slots must hold integers, got dtype {a.dtype}")
        if a.dtype == np.uint64:
            raise TypeError(
                "slots on the device must be a signed integer array (int64 or int32), got "
                "uint64: its largest values would wrap to -1 (a skip) in the int64 the "
                "kernels read")
        with self._be._ctx():
            return self._be._index_array(a, np.int64)

    def write_slots_kv(self, k_cache, v_cache, k, v, slots, src_kind, k_codec, v_codec,
                       owner, check):
        """``BlockPool.write`` for one layer: K and V of n tokens into their
        slots (stored by ``k_codec`` / ``v_codec``); of several tokens naming
        one slot, the last one's values (and int8 scales) land (as the CPU
        backend's in-order loop gives).

        Parameters
        ----------
        k_cache, v_cache : (num_blocks, heads, block_size, dim) device arrays
        k, v : (n, heads, dim) device arrays
        slots : int64 array
            Host slots have been checked by the caller.  Device slots (from
            ``device_slots``) have not: with ``check`` the claim pass checks
            them on the device and this call waits for its verdict (one
            8-byte read) before writing anything, raising IndexError like
            the host check; without ``check`` nothing waits or is read back
            (a CUDA graph can capture the call), and an out-of-range slot
            is skipped by the kernels (never written) but not reported.
        owner : the pool's ``slot_owner_table`` (a ``SlotOwners``)
        check : bool

        Slots that cannot name a slot twice need no claim pass (two
        launches): host slots without repeats (one token, or distinct ones:
        the usual case), and one unchecked device slot.
        """
        n = k.shape[0]
        if n == 0:
            return

        def write(d_slots, table):
            if k.shape[1] and k.shape[2]:
                v_ = v
                k_plane = k_codec.scale_plane
                if self._be._overlaps(v_, k_cache) or (k_plane is not None
                                                  and self._be._overlaps(v_, k_plane)):
                    v_ = self._be._contiguous_copy(v_)   # read v before the keys change
                self._write_plane(k_cache, k, d_slots, table, src_kind, k_codec)
                self._write_plane(v_cache, v_, d_slots, table, src_kind, v_codec)

        if (n == 1 and not check) or (not self._be._is_device(slots) and _distinct(slots)):
            with self._be._ctx():
                write(self._be._index_array(slots, np.int64), None)
            return
        self._claimed_write(k_cache, slots, n, owner, check, write)

    def _claimed_write(self, plane, slots, n, owner, check, write):
        """Run ``write(device_slots, table)`` between the claim and the
        release passes of slots.cu (``write_slots_kv``'s protocol), in the
        owner table of K plane ``plane``: with ``check`` and slots on the
        device, wait for the claim pass's range verdict first and raise
        IndexError (nothing written) on a bad slot."""
        table = owner.table(plane)
        num_slots = owner.num_slots
        with self._be._ctx():
            d_slots = self._be._index_array(slots, np.int64)
            bad = None
            if check and self._be._is_device(slots):
                bad = self._be._upload(np.array([_sources.NO_BAD], np.int64))
            self._launcher.launch(_sources.SLOTS_FILE, None, None, "kv_claim_slots", n, 1,
                              [table, bad, d_slots, num_slots])
            try:
                if bad is not None:
                    first = int(self._be._download(bad)[0])
                    if first != _sources.NO_BAD:
                        value = int(self._be._download(d_slots[first:first + 1])[0])
                        raise IndexError(
                            f"slots must be -1 (skip) or in 0..{num_slots - 1} "
                            f"(num_blocks * block_size - 1), got {value} at index {first}")
                write(d_slots, table)
            finally:
                self._launcher.launch(_sources.SLOTS_FILE, None, None, "kv_release_slots", n, 1,
                                  [table, d_slots, num_slots])


class SlotOwners:
    """A pool's slot-owner state for ``write_slots_kv`` (slots.cu): one owner
    table per K plane the pool writes, made on the plane's first write.

    One table per layer, not one per pool: the claim and release passes of
    a write are ordered on its stream only, so two layers written on two
    streams sharing a table would let one write's release reset the entries
    the other write's kernels are about to read, dropping that layer's K/V
    without an error.  Writes of one layer on several streams at once must
    still name different slots (they would race on the data anyway).
    """

    def __init__(self, num_slots, new_table, address):
        # new_table(num_slots): a fresh all -1 table; address(plane): its key
        self._new_table, self._address = new_table, address
        self.num_slots = int(num_slots)
        self._tables = {}
        self._lock = threading.Lock()

    def table(self, plane):
        """The owner table of K plane ``plane`` (keyed by its address)."""
        key = self._address(plane)
        t = self._tables.get(key)
        if t is None:
            with self._lock:
                t = self._tables.get(key)
                if t is None:
                    t = self._tables[key] = self._new_table(self.num_slots)
        return t

    def tables(self):
        """Every table made so far (mainly for tests: each is all -1 between
        writes)."""
        return list(self._tables.values())


# Host slot lists longer than this go through the claim pass without a
# look for repeats (sorting them would cost more than the pass saves).
_DISTINCT_CHECK_MAX = 1024


def _distinct(slots):
    """Whether host slots (checked int64) name no slot twice (-1 skips
    may repeat)."""
    n = slots.shape[0]
    if n <= 1:
        return True
    if n > _DISTINCT_CHECK_MAX:
        return False
    named = np.sort(slots[slots >= 0])
    return not named.size or bool((named[1:] != named[:-1]).all())
