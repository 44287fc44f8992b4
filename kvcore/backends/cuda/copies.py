"""The block copies of the CUDA backend: within a pool's storage (a copy
kernel), between two storages on the device, and between the device and
host memory (``cudaMemcpy2DAsync`` per run of consecutive ids).

``CudaBackend`` (``backend.py``) holds a ``CudaBlockCopies``: it has no state
of its own beside its backend, whose device hooks (``_ctx``, ``_is_device``,
``_fence``, ...) it calls, and the backend's launcher, so the tests' host
emulation, which overrides those hooks and the launcher, runs the copies too.
"""
import numpy as np

from . import _sources

# cudaMemcpy2D rejects pitches above the device's maximum pitch (2**31 - 1
# on current GPUs); larger plane strides take one copy per plane.
_MAX_PITCH = 2**31 - 1


class CudaBlockCopies:
    """``copy_blocks`` and ``copy_blocks_between`` of ``CudaBackend`` ``backend``."""

    def __init__(self, backend, launcher):
        self._be = backend
        self._launcher = launcher

    def copy_blocks(self, storage, src, dst):
        """storage[:, dst[i]] = storage[:, src[i]] for every layer and K/V
        plane.  storage: (planes, num_blocks, heads, block_size, dim).

        The pairs are copied in parallel when the ids allow it (distinct
        ``dst`` ids, none of them a ``src`` id: copy-on-write, which copies
        into fresh blocks).  Host ids that chain (a block copied on after it
        was written) are copied pair by pair, in order, as the CPU backend
        does; device ids are not inspected (that would need a sync) and must
        not chain."""
        n = len(src)
        if n == 0:
            return
        with self._be._ctx():
            if not (self._be._is_device(src) or self._be._is_device(dst)):
                hs, hd = np.asarray(src), np.asarray(dst)
                if len(np.unique(hd)) != n or np.intersect1d(hs, hd).size:
                    for i in range(n):
                        self._copy_blocks_kernel(
                            storage, self._be._index_array(hs[i:i + 1], np.int32),
                            storage, self._be._index_array(hd[i:i + 1], np.int32), 1)
                    return
            s = self._be._index_array(src, np.int32)
            d = self._be._index_array(dst, np.int32)
            self._copy_blocks_kernel(storage, s, storage, d, n)

    def copy_blocks_between(self, src_storage, src_ids, dst_storage, dst_ids):
        """dst_storage[:, dst_ids[i]] = src_storage[:, src_ids[i]]: two pools
        of the same geometry and dtype.

        Either side may be a NumPy array (host memory), for offloading
        blocks to the host and bringing them back; device <-> device runs one
        kernel.  Host copies are issued per run of consecutive ids, one 2-D
        copy across all planes each, on the current stream.  With pinned
        host memory (``cupyx.empty_pinned``) they are asynchronous: call
        ``synchronize()`` before reading or reusing the host array.  With
        pageable memory this call waits for the copies (either way), so
        the host array may be read or reused on return.  Ids on the device
        are read back to the host for a host copy (a sync point); host ids
        are checked to be in range.
        """
        n = len(src_ids)
        if len(dst_ids) != n:
            raise ValueError(
                f"src_ids and dst_ids must have the same length, got {n} and {len(dst_ids)}")
        if (src_storage.shape[0] != dst_storage.shape[0]
                or src_storage.shape[2:] != dst_storage.shape[2:]):
            raise ValueError(
                "src_storage and dst_storage must have the same geometry (planes, -, heads, "
                f"block_size, dim), got {src_storage.shape} and {dst_storage.shape}")
        if _sources.bits_dtype(src_storage.dtype) != _sources.bits_dtype(dst_storage.dtype):
            raise TypeError(
                "src_storage and dst_storage must have the same dtype, got "
                f"{src_storage.dtype} and {dst_storage.dtype}")
        if n == 0:
            return
        on_dev = self._be._is_device(src_storage), self._be._is_device(dst_storage)
        if on_dev == (True, True):
            for a, arg in ((src_storage, "src_storage"), (dst_storage, "dst_storage")):
                if self._be._device_id_of(a) != self._be.device_id:
                    raise ValueError(
                        f"{arg} is on cuda:{self._be._device_id_of(a)} but this operation runs "
                        f"on {self._be.device}")
            with self._be._ctx():
                s = self._be._index_array(src_ids, np.int32)
                d = self._be._index_array(dst_ids, np.int32)
                self._copy_blocks_kernel(src_storage, s, dst_storage, d, n)
        elif on_dev == (False, False):
            from ..cpu import _kernels

            _kernels.copy_blocks_between(
                src_storage, np.ascontiguousarray(self._host_ids(src_ids), dtype=np.int32),
                dst_storage, np.ascontiguousarray(self._host_ids(dst_ids), dtype=np.int32))
        else:
            self._copy_host_device(src_storage, src_ids, dst_storage, dst_ids, on_dev[1])

    def _host_ids(self, ids):
        return np.asarray(self._be.to_host(ids))

    @staticmethod
    def _block_bytes(storage, arg):
        """Bytes of one block; checks that each block is one contiguous run."""
        shape, strides = storage.shape[2:], storage.strides[2:]
        expect = storage.itemsize
        for n, st in zip(reversed(shape), reversed(strides)):
            if n > 1 and st != expect:
                raise ValueError(
                    f"{arg} must hold each block contiguously (axes 2.. C-contiguous), "
                    f"got strides {storage.strides} for shape {storage.shape}")
            expect *= n
        return expect

    def _copy_blocks_kernel(self, src_st, s_ids, dst_st, d_ids, n):
        block_bytes = self._block_bytes(src_st, "src_storage")
        self._block_bytes(dst_st, "dst_storage")
        planes = src_st.shape[0]
        if planes == 0 or block_bytes == 0:
            return
        ptrs = (self._be._ptr(src_st), self._be._ptr(dst_st))
        strides = (src_st.strides[0], src_st.strides[1], dst_st.strides[0], dst_st.strides[1])
        for wb in _sources.COPY_WORDS:
            if block_bytes % wb == 0 and all(p % wb == 0 for p in ptrs) and all(
                    st % wb == 0 for st in strides):
                break
        else:  # pragma: no cover - 1-byte words copy anything
            raise ValueError(f"blocks of {block_bytes} bytes cannot be copied in words")
        rows = planes * n
        self._be._check_rows(rows, "copy_blocks")
        self._launcher.launch(_sources.COPY_FILE, None, None, _sources.copy_name(wb),
                          rows, block_bytes // wb,
                          [dst_st, src_st, s_ids, d_ids, n,
                           strides[0] // wb, strides[1] // wb, strides[2] // wb, strides[3] // wb])

    def _copy_host_device(self, src_st, src_ids, dst_st, dst_ids, to_device):
        rt = self._be._cp.cuda.runtime
        s = self._host_ids(src_ids).astype(np.int64, copy=False).ravel()
        d = self._host_ids(dst_ids).astype(np.int64, copy=False).ravel()
        for ids, st, arg in ((s, src_st, "src_ids"), (d, dst_st, "dst_ids")):
            if ids.size and (ids.min() < 0 or ids.max() >= st.shape[1]):
                raise IndexError(
                    f"{arg} must lie in 0..{st.shape[1] - 1}, got "
                    f"{int(ids.min())}..{int(ids.max())}")
        if not to_device and not dst_st.flags.writeable:
            raise ValueError("dst_storage must be writeable, got a read-only array")
        block_bytes = self._block_bytes(src_st, "src_storage")
        self._block_bytes(dst_st, "dst_storage")
        planes = src_st.shape[0]
        if planes == 0 or block_bytes == 0:
            return
        if to_device:
            sp, dp, kind = src_st.ctypes.data, self._be._ptr(dst_st), rt.memcpyHostToDevice
        else:
            sp, dp, kind = self._be._ptr(src_st), dst_st.ctypes.data, rt.memcpyDeviceToHost
        s_plane, s_block = src_st.strides[0], src_st.strides[1]
        d_plane, d_block = dst_st.strides[0], dst_st.strides[1]
        adjacent = s_block == block_bytes and d_block == block_bytes
        with self._be._ctx():
            stream = self._be._stream_ptr()
            i, n = 0, s.size
            while i < n:
                j = i + 1
                while (adjacent and j < n and s[j] == s[j - 1] + 1 and d[j] == d[j - 1] + 1):
                    j += 1
                width = (j - i) * block_bytes
                so, do = int(s[i]) * s_block, int(d[i]) * d_block
                if (planes > 1 and width <= s_plane <= _MAX_PITCH
                        and width <= d_plane <= _MAX_PITCH):
                    rt.memcpy2DAsync(dp + do, d_plane, sp + so, s_plane, width, planes,
                                     kind, stream)
                else:
                    for p in range(planes):
                        rt.memcpyAsync(dp + p * d_plane + do, sp + p * s_plane + so, width,
                                       kind, stream)
                i = j
            # Pageable host memory: the caller may read (device -> host) or
            # reuse (host -> device) it as soon as this returns, and CUDA does
            # not promise an asynchronous copy is done with it by then.
            # Pinned memory stays asynchronous (synchronize() before use).
            if not self._be._is_pinned(dst_st if not to_device else src_st):
                self._be._fence()
