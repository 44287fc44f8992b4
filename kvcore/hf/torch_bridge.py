"""The torch side of a pool: its pages as torch views, torch's caching
allocator and current stream for CUDA pools (no kvcore backend knows torch)."""
import contextlib

import numpy as np
import torch


def _on_cuda(device):
    """Whether ``device`` (a pool's device) is a CUDA one: the torch side of
    a pool (torch's caching allocator, its streams, ``from_dlpack`` against
    ``from_numpy``) differs per device, and no kvcore backend knows torch,
    so this is the one place kvcore.hf asks."""
    return str(device).strip().lower().startswith("cuda")


_ALLOCATOR_SET = []


def use_torch_allocator():
    """Make CuPy (and so kvcore's CUDA pools, caches and temporaries)
    allocate device memory from torch's caching allocator, on torch's
    current stream, instead of CuPy's own memory pool.

    Process-wide (``cupy.cuda.set_allocator``); idempotent.  Without it the
    two pools each keep freed memory for themselves and a model plus a
    large KV pool can run out of memory that one of them holds unused.
    Needs CuPy and a CUDA build of torch.
    """
    if _ALLOCATOR_SET:
        return
    import cupy

    def malloc(size):
        device = cupy.cuda.Device().id
        stream = torch.cuda.current_stream(device)
        ptr = torch.cuda.caching_allocator_alloc(size, device, stream)
        # the owner gives the block back to torch when CuPy lets go of it
        mem = cupy.cuda.UnownedMemory(ptr, size, _TorchBlock(ptr), device)
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(malloc)
    _ALLOCATOR_SET.append(malloc)


class _TorchBlock:
    """A block of torch's caching allocator, freed when CuPy drops it."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        torch.cuda.caching_allocator_delete(self.ptr)


class _TorchSide:
    """A pool as torch sees it: the device of its pages, the stream
    kvcore's kernels run on (torch's current stream, on a CUDA pool), and
    torch tensors as the raw rows and device arrays a CUDA pool's step lane
    takes (``device.py``)."""

    def __init__(self, pool):
        self.device = torch.device(pool.device)
        self.cuda = _on_cuda(pool.device)
        self._tensors = _cuda_tensors(pool) if self.cuda else None
        if self.cuda:
            self.device = self._tensors.device

    def pages(self, a, bfloat16):
        """A torch view (no copy) of a plane of the pool's storage."""
        t = self._tensors.from_device(a) if self.cuda else torch.from_numpy(a)
        return t.view(torch.bfloat16) if bfloat16 else t   # bfloat16: raw bits

    def tensor(self, a):
        """A host NumPy array as a tensor on the pages' device."""
        t = torch.from_numpy(a)
        return t.to(self.device, non_blocking=True) if self.cuda else t

    def stream(self):
        """Run the enclosed kvcore calls on torch's current stream (CUDA
        pools): the model's kernels and kvcore's are then ordered, with no
        synchronisation between them."""
        if not self.cuda:
            return contextlib.nullcontext()
        return self._tensors.stream()

    def kv_rows(self, t):
        """``(address, token_stride, head_stride, kind)`` of a K/V tensor
        ``(batch, heads, q, dim)`` on the pool's device read as ``batch *
        q`` rows (strides in elements), or None when it cannot be read so
        (another device or dtype, a non-contiguous last axis, batch and
        query axes that do not flatten to one stride, a negative or
        conjugate bit: memory that is not its values)."""
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or not self._tensors.holds(t):
            return None
        kind = _KINDS.get(t.dtype)
        if kind is None or t.is_neg() or t.is_conj():
            return None
        b, _, q, d = t.shape
        sb, sh, sq, sd = t.stride()
        if sd != 1 and d > 1:
            return None
        if q == 1:
            tok = sb
        elif b == 1 or sb == q * sq:
            tok = sq
        else:
            return None
        ptr = t.data_ptr()
        if ptr == 0 and t.numel():
            return None
        return ptr, tok, sh, kind

    def device_array(self, t, backend):
        """A C-contiguous tensor on the pool's device as the backend's
        device array (bfloat16 as its uint16 bits), no copy; None for
        anything else.  The array holds the tensor."""
        dtype = _NUMPY.get(t.dtype)
        if dtype is None or not self._tensors.holds(t) or not t.is_contiguous() \
                or t.is_neg() or t.is_conj():
            return None
        size = dtype.itemsize
        return backend.wrap_pointer(t.data_ptr(), tuple(t.shape),
                                    [st * size for st in t.stride()], dtype, t)

    def on_side_stream(self, fn):
        """``fn()`` on a side stream of a CUDA pool's device, ordered after
        and before the current stream's work (how torch's CUDA graph
        examples warm up before a capture); as it is on a CPU pool."""
        return self._tensors.on_side_stream(fn) if self.cuda else fn()

    def holds(self, t):
        """Whether tensor ``t`` lives on a CUDA pool's device (False for a
        CPU pool: only a CUDA pool's step lane and graphs ask)."""
        return self.cuda and self._tensors.holds(t)

    def input(self, t):
        """A tensor as ``BlockPool.write`` takes it on this pool's device
        (torch CUDA tensors as they are)."""
        return self._tensors.input(t) if self.cuda else t


# torch dtypes the step lane reads and writes (kvcore.dtypes kinds and the
# NumPy dtype of their bits)
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_NUMPY = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
          torch.bfloat16: np.dtype(np.uint16)}


class _CudaTensors:
    """torch CUDA tensors of one device: its streams as CuPy streams, a
    pool plane as a tensor."""

    def __init__(self, pool):
        import cupy
        self.device = torch.device(pool.device)
        self._index = self.device.index or 0
        self.device = torch.device("cuda", self._index)
        cuda = cupy.cuda
        # how torch's stream becomes a CuPy stream, chosen once
        if hasattr(cuda.Stream, "from_external"):   # CuPy 14+ (ExternalStream is deprecated)
            self._cupy_stream = lambda s: cuda.Stream.from_external(_StreamProtocol(s))
        else:
            index = self._index
            self._cupy_stream = lambda s: cuda.ExternalStream(s.cuda_stream, index)
        # torch stream handle -> its CuPy stream (made once: a step enters
        # it at every layer); a handle names one stream while it lives
        self._streams = {}

    def stream(self):
        s = torch.cuda.current_stream(self._index)
        handle = s.cuda_stream
        cs = self._streams.get(handle)
        if cs is None:
            if len(self._streams) > 64:
                self._streams.clear()
            cs = self._streams[handle] = self._cupy_stream(s)
        return cs

    def from_device(self, a):
        return torch.from_dlpack(a)

    def holds(self, t):
        return t.get_device() == self._index

    def on_side_stream(self, fn):
        here = torch.cuda.current_stream(self._index)
        side = torch.cuda.Stream(self._index)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            out = fn()
        here.wait_stream(side)
        return out

    def input(self, t):
        return t


def _cuda_tensors(pool):
    """The torch side of a CUDA pool's device (the tests' host emulation of
    the CUDA backend puts its own here: CPU tensors standing for device
    memory)."""
    return _CudaTensors(pool)


class _StreamProtocol:
    """A torch CUDA stream under the CUDA stream protocol (``__cuda_stream__``:
    version 0 and the cudaStream_t), which CuPy's ``Stream.from_external``
    takes; it keeps the torch stream alive while CuPy uses it."""
    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return 0, self.stream.cuda_stream
