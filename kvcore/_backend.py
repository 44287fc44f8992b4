"""Data-movement backends.

A backend is the one small set of operations the public classes need to move
KV data on a device: allocate, take inputs, convert, write slots, gather,
copy blocks, write a contiguous cache.  ``CPUBackend`` runs the Cython/C
kernels of ``kvcore/_native``; the CUDA backend (``kvcore/_cuda``) runs CuPy
RawKernels and has the same methods.  The public classes pick a backend once,
from ``device=``, and never branch on the device elsewhere.

Arguments reaching these methods have been validated by the caller, except
where a method says it checks (``asarray``, ``check_out``).  Inputs reach
them through ``kvcore/_arrays.py`` (torch tensors, bfloat16 marking).
"""
import numpy as np

from . import _arrays, _dtypes
from ._native import _convert, _kernels


_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _is_cuda_array(x):
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__") or \
            type(x).__module__.split(".")[0] in ("cupy", "cupyx"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in _DLPACK_CUDA
        except Exception:
            return False
    return False


class CPUBackend:
    """NumPy arrays in host memory; Cython/C kernels."""

    name = "cpu"
    xp = np

    def normalize_device(self, device):
        return "cpu"

    # -------------------------------------------------------------- arrays
    def asarray(self, x, arg):
        """``x`` as a NumPy array; a GPU array is a TypeError, never a copy.

        A CPU torch tensor is its NumPy view (``torch.bfloat16`` as
        ``ml_dtypes.bfloat16`` when installed, else its uint16 bits; callers
        that must know go through ``_arrays.float_input``)."""
        if isinstance(x, np.ndarray):
            return x
        y, bf16 = _arrays.unwrap(x, arg)
        if isinstance(y, np.ndarray):
            return y.view(_dtypes.BF16_NUMPY) if bf16 and _dtypes.BF16_NUMPY is not None else y
        x = y
        if _is_cuda_array(x):
            raise TypeError(
                f"{arg} is a CUDA array ({type(x).__module__}.{type(x).__name__}) but this "
                "operation runs on the CPU; pass a NumPy array or use device='cuda'")
        if hasattr(x, "__dlpack_device__"):
            try:
                dev_type = x.__dlpack_device__()[0]
            except Exception as e:
                raise TypeError(f"{arg} ({type(x).__name__}) cannot say where its memory "
                                f"lives: {e}") from None
            if dev_type != 1:  # kDLCPU
                raise TypeError(
                    f"{arg} lives on DLPack device type {dev_type}, not the CPU; "
                    "pass a NumPy array or use device='cuda'")
        try:
            return np.asarray(x)
        except Exception as e:  # pragma: no cover - exotic inputs
            raise TypeError(f"{arg} must be an array, got {type(x).__name__}: {e}") from None

    def check_out(self, out, arg):
        if not isinstance(out, np.ndarray):
            y, _ = _arrays.unwrap(out, arg)
            if isinstance(y, np.ndarray):
                out = y
            else:
                raise TypeError(f"{arg} must be a NumPy array or a CPU torch tensor, "
                                f"got {type(out).__module__}.{type(out).__name__}")
        if not out.flags.writeable:
            raise ValueError(f"{arg} must be writeable, got a read-only array")
        return out

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def to_host(self, a):
        return a

    def from_host(self, a):
        return a

    def inner_contiguous(self, a):
        """``a`` aligned and with its last axis contiguous (a copy only when
        it is not)."""
        if not a.flags.aligned or (a.ndim and a.strides[-1] != a.itemsize and a.shape[-1] > 1):
            return np.array(a, order="C", copy=True)
        return a

    # ------------------------------------------------------------- kernels
    def convert(self, src, src_kind, dst, dst_kind):
        """dst[...] = src converted; same shape, any strides, any alignment,
        overlap allowed (src is read as it was before the call)."""
        if np.may_share_memory(src, dst) or not src.flags.aligned:
            src = src.copy()
        if not dst.flags.aligned:
            # the kernels store typed elements: convert into an aligned
            # temporary, then let NumPy copy the bytes into place
            tmp = np.empty(dst.shape, dst.dtype)
            _convert.convert_array(src, src_kind, tmp, dst_kind)
            dst[...] = tmp
            return
        _convert.convert_array(src, src_kind, dst, dst_kind)

    def apart(self, a, storage):
        """``a``, or a C-contiguous copy of it when its memory span meets
        ``storage``'s (one bounds check): an input that is a view of the
        storage is read as it was when the call began, whatever the call
        writes first."""
        return _kernels.apart(a, storage)

    def write_slots(self, cache, src, slots, src_kind, dst_kind):
        """src is read as it was, also when it is a view of ``cache`` (a
        caller that writes both planes of a layer stages its inputs with
        ``apart`` against the whole storage first)."""
        src = _kernels.apart(src, cache)
        flags = src.flags
        if not (flags.c_contiguous and flags.aligned):
            src = self.inner_contiguous(src)
        _kernels.write_slots(cache, src, slots, src_kind, dst_kind)

    def gather(self, cache, block_table, start, end, out, src_kind, dst_kind):
        """out: (heads, end - start, dim), C-contiguous, aligned, apart from
        cache; block_table: int32, C-contiguous, aligned."""
        _kernels.gather(cache, block_table, start, end, out, src_kind, dst_kind)

    def direct_out(self, out, storage):
        """Whether the kernels may write ``out`` in place: C-contiguous,
        aligned, and apart from ``storage`` (else a temporary is filled and
        copied into it)."""
        f = out.flags
        return f.c_contiguous and f.aligned and not _kernels.overlaps(out, storage)

    def gather_batch(self, cache, block_tables, lengths, out, src_kind, dst_kind):
        """out[s, :, :lengths[s]] = sequence s's positions (block table row s);
        the padding past each length is +0.  out: (batch, heads, max_len, dim)."""
        out[...] = 0
        for s in range(out.shape[0]):
            n = int(lengths[s])
            if n:
                _kernels.gather(cache, _arrays.aligned(np.ascontiguousarray(block_tables[s],
                                                                             np.int32)), 0, n,
                                out[s, :, :n] if n < out.shape[2] else out[s], src_kind,
                                dst_kind)

    def copy_blocks(self, storage, src, dst):
        _kernels.copy_blocks(storage, src, dst)

    # BlockPool.write (the CUDA backend's versions say more)
    def device_slots(self, slots, n):
        """None: there is no device memory apart from the host's, so the pool
        checks every slot on the host."""
        return None

    def slot_owner_table(self, num_slots):
        return None

    def write_slots_kv(self, k_cache, v_cache, k, v, slots, src_kind, dst_kind, owner, check):
        """K and V of one layer; slots checked by the caller.  The kernel
        walks the tokens in order, so of several tokens naming one slot the
        last one's values land."""
        self.write_slots(k_cache, k, slots, src_kind, dst_kind)
        self.write_slots(v_cache, v, slots, src_kind, dst_kind)

    def copy_blocks_between(self, src_storage, src, dst_storage, dst):
        _kernels.copy_blocks_between(src_storage, src, dst_storage, dst)

    def write_contiguous(self, dst, src, start, src_kind, dst_kind):
        # the kernel writes rows of dst back to back: dst must be C-contiguous
        assert dst.flags.c_contiguous, "write_contiguous needs a C-contiguous destination"
        src = _kernels.apart(src, dst)  # e.g. a view of the cache itself
        _kernels.write_contiguous(dst, self.inner_contiguous(src), start, src_kind, dst_kind)

    def synchronize(self):
        pass


CPU = CPUBackend()


def get_backend(device):
    """The backend for ``device`` ('cpu', 'cuda', 'cuda:N')."""
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {device!r}")
    d = device.strip().lower()
    if d == "cpu":
        return CPU
    if d == "cuda" or d.startswith("cuda:"):
        from ._cuda import get_cuda_backend

        return get_cuda_backend(d)
    raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")


def backend_of_array(x):
    """The backend whose device holds array ``x``."""
    if _is_cuda_array(x):
        from ._cuda import backend_for_array

        return backend_for_array(x)
    return CPU
