"""The torch side of a pool: its pages as torch views, torch's caching
allocator and current stream for CUDA pools (no kvcore backend knows torch)."""
import contextlib

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
    """A pool as torch sees it: the device of its pages, and the stream
    kvcore's kernels run on (torch's current stream, on a CUDA pool)."""

    def __init__(self, pool):
        self.device = torch.device(pool.device)
        self.cuda = _on_cuda(pool.device)
        if self.cuda:
            import cupy
            cuda, index = cupy.cuda, self.device.index or 0
            # how torch's stream becomes a CuPy stream, chosen once
            if hasattr(cuda.Stream, "from_external"):   # CuPy 14+ (ExternalStream is deprecated)
                self._cupy_stream = lambda s: cuda.Stream.from_external(_StreamProtocol(s))
            else:
                self._cupy_stream = lambda s: cuda.ExternalStream(s.cuda_stream, index)

    def pages(self, a, bfloat16):
        """A torch view (no copy) of a plane of the pool's storage."""
        t = torch.from_dlpack(a) if self.cuda else torch.from_numpy(a)
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
        return self._cupy_stream(torch.cuda.current_stream(self.device))


class _StreamProtocol:
    """A torch CUDA stream under the CUDA stream protocol (``__cuda_stream__``:
    version 0 and the cudaStream_t), which CuPy's ``Stream.from_external``
    takes; it keeps the torch stream alive while CuPy uses it."""
    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return 0, self.stream.cuda_stream
