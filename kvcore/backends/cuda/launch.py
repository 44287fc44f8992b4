"""Kernels of ``CudaBackend``: compiled with NVRTC on first use (one module
per .cu file and kind pair, cached per device) and launched on the current
stream: row/chunk launches, grid launches, attention's packed launches and
what ``lane.py`` packs (collected launches, pinned staging).

``CudaLaunches`` is the part of a ``CudaBackend`` that meets the driver: the
backend holds one as ``launcher`` and hands it to its block copies, slot
writes, attention and step lanes.  The tests' host emulation
(tests/cuda/test_cuda_host_emulation.py) holds a subclass instead that runs
the kernels' C++ bodies on NumPy arrays.
"""
import threading

import numpy as np

from . import CudaUnavailableError, _sources, attention_kernels
from .attention import Hole

# The launches collect_launches is gathering on this thread (else None).
_COLLECT = threading.local()

# Threads per block and a cap on the grid (the kernels grid-stride over rows).
_BLOCK_THREADS = 256
_MAX_GRID = 1 << 20


def launch_shape(rows, chunks):
    """``(grid, block)`` for a row/chunk kernel (see KV_ROW_LOOP in
    kv_half.cuh): threadIdx.x walks the chunks of a row, (blockIdx.x,
    threadIdx.y) the rows; the kernel grid-strides over rows beyond the grid."""
    bx = min(chunks, _BLOCK_THREADS)
    by = max(1, _BLOCK_THREADS // bx)
    grid = min(-(-rows // by), _MAX_GRID)
    return (grid, 1, 1), (bx, by, 1)


class CudaLaunches:
    """Compiling and launching the kernels of ``CudaBackend`` ``backend`` (its
    device, stream and CuPy), with the caches of compiled modules and
    kernels."""

    def __init__(self, backend):
        self._be = backend
        self._cp = backend._cp
        self._functions = {}
        self._modules = {}
        self._lock = threading.Lock()
        self._smem_max = None
        self._smem_set = {}   # kernel name -> the dynamic shared memory it was allowed

    def function(self, file, sk, dk, name):
        key = (file, sk, dk, name)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    attention = file == attention_kernels.ATTENTION_FILE.name
                    # attention.cu: one module per page kind, one for the merges
                    mkey = (file, attention_kernels.module_key(name), None) if attention \
                        else (file, sk, dk)
                    try:
                        mod = self._modules.get(mkey)
                        if mod is None:
                            if attention:
                                code = attention_kernels.source()
                                names = attention_kernels.module_names(mkey[1])
                            else:
                                code = _sources.source(file)
                                names = _sources.module_names(file, sk, dk)
                            mod = self._cp.RawModule(code=code,
                                                     options=_sources.COMPILE_OPTIONS,
                                                     name_expressions=names)
                            self._modules[mkey] = mod
                        fn = mod.get_function(name)  # compiles the module on first use
                    except Exception as e:  # NVRTC or headers missing, compile or load error
                        self._modules.pop(mkey, None)  # the next call starts afresh
                        raise compile_error(e, self._be.device, file) from e
                    self._functions[key] = fn
        return fn

    def launch(self, file, sk, dk, name, rows, chunks, args):
        """Run kernel ``name`` of module (file, sk, dk) over rows x chunks on
        the current stream.  ``args`` after (rows, chunks): device arrays
        (passed as pointers), None (a null pointer) and Python ints (passed
        as long long)."""
        if rows <= 0 or chunks <= 0:
            return
        fn = self.function(file, sk, dk, name)
        grid, block = launch_shape(rows, chunks)
        cp = self._cp
        kargs = [np.int64(rows), np.int64(chunks)]
        kargs += [a if isinstance(a, cp.ndarray) else np.uint64(0) if a is None else np.int64(a)
                  for a in args]  # None: a null pointer
        fn(grid, block, tuple(kargs))

    def launch_grid(self, file, name, grid, block, args, smem=0):
        """Run kernel ``name`` of ``file``'s module on ``grid`` blocks of
        ``block`` threads with ``smem`` bytes of dynamic shared memory on the
        current stream.  ``args``: device arrays (pointers), None (a null
        pointer), Python floats (passed as float) and ints (passed as long
        long)."""
        if grid <= 0:
            return
        fn = self.function(file, None, None, name)
        self._allow_smem(fn, name, smem)
        # (after everything that readies the kernel itself: a packed launch
        # of a collected one calls the driver with nothing else)
        if self._collected(file, name, grid, block, args, smem):
            return
        cp = self._cp
        kargs = tuple(a if isinstance(a, cp.ndarray) else np.uint64(0) if a is None
                      else np.float32(a) if isinstance(a, (float, np.floating))
                      else np.int64(a) for a in args)
        fn((int(grid), 1, 1), (int(block), 1, 1), kargs, shared_mem=int(smem))

    def run_packed(self, launch, values):
        """Issue ``launch`` (an attention ``PackedLaunch``) on the current
        stream with its holes set from ``values``: the parameter block is
        built at its first launch (the kernel compiled then), later ones
        write the holes' slots and make one cuLaunchKernel call."""
        if launch.grid <= 0:
            return
        if getattr(_COLLECT, "calls", None) is not None:
            # lane.py collects this thread's launches: the holes filled,
            # recorded as any grid launch (and packed there)
            args = list(launch.args)
            for i, hole in launch.holes:
                args[i] = values[hole.name]
            self.launch_grid(launch.file, launch.name, launch.grid, launch.block, args,
                              launch.smem)
            return
        native = launch.native
        if native is None:
            native = launch.native = self._pack(launch)
        slots, as_i64, as_f32, fn_ptr, params, _ = native
        for i, hole in launch.holes:
            v = values[hole.name]
            if hole.type == "p":   # an array, an address (the fast lane's) or None
                slots[i] = v if type(v) is int else 0 if v is None else v.data.ptr
            elif hole.type == "i":
                as_i64[i] = v
            else:
                as_f32[2 * i] = v
        self._cp.cuda.driver.launchKernel(fn_ptr, launch.grid, 1, 1, launch.block, 1, 1,
                                          launch.smem, self._be._stream_ptr(), params, 0)

    def _pack(self, launch):
        """``launch``'s parameter block: one 8-byte slot per argument (a
        float in the low 4 bytes), the fixed ones written now; and the
        kernel (compiled on first use; its dynamic shared memory allowed)."""
        fn = self.function(launch.file, None, None, launch.name)
        self._allow_smem(fn, launch.name, launch.smem)
        n = len(launch.args)
        slots = np.zeros(max(1, n), np.uint64)
        as_i64, as_f32 = slots.view(np.int64), slots.view(np.float32)
        for i, a in enumerate(launch.args):
            if a is None or isinstance(a, Hole):
                continue
            if isinstance(a, self._cp.ndarray):
                slots[i] = a.data.ptr
            elif isinstance(a, (float, np.floating)):
                as_f32[2 * i] = a
            else:
                as_i64[i] = int(a)
        params = np.array([slots.ctypes.data + 8 * i for i in range(max(1, n))], np.uint64)
        # the arrays stay alive with the tuple (kept on the launch)
        return slots, as_i64, as_f32, fn.kernel.ptr, params.ctypes.data, params

    def _allow_smem(self, fn, name, smem):
        """Let kernel ``fn`` take ``smem`` bytes of dynamic shared memory
        (above 48 KB a kernel must ask: once per kernel, a host call)."""
        if smem > self._DEFAULT_SMEM and self._smem_set.get(name, 0) < smem:
            fn.max_dynamic_shared_size_bytes = int(smem)
            self._smem_set[name] = smem

    # dynamic shared memory a kernel gets without asking (above it:
    # cudaFuncAttributeMaxDynamicSharedMemorySize)
    _DEFAULT_SMEM = 48 * 1024

    def smem_optin(self):
        """The most dynamic shared memory a block may ask for on the device."""
        if self._smem_max is None:
            self._smem_max = int(self._be._device.attributes["MaxSharedMemoryPerBlockOptin"])
        return self._smem_max

    # ------------------------------------------------- packed launches
    # What lane.py (a step's writes and attention issued per layer) needs of
    # the device: the tests' host emulation overrides these, as it does the
    # hooks above.
    def collect_launches(self, call):
        """Run ``call()`` with the grid launches it makes collected instead
        of issued, on this thread only: the list of ``(file, name, grid,
        block, args, smem)`` (what ``lane.py`` packs once and reissues).
        Anything else ``call`` does happens as usual."""
        calls = []
        _COLLECT.calls = calls
        try:
            call()
        finally:
            _COLLECT.calls = None
        return calls

    @staticmethod
    def _collected(file, name, grid, block, args, smem=0):
        """Whether this thread collects launches (``collect_launches``):
        then the launch is recorded, not issued."""
        calls = getattr(_COLLECT, "calls", None)
        if calls is None:
            return False
        calls.append((file, name, int(grid), int(block), list(args), int(smem)))
        return True

    def function_ptr(self, file, sk, dk, name):
        """The driver handle (CUfunction) of kernel ``name`` of module
        (file, sk, dk), compiled on first use: what a packed launch calls."""
        with self._be._ctx():
            return self.function(file, sk, dk, name).kernel.ptr

    def launch_packed(self, launch):
        """Issue a ``lane.PackedLaunch`` on the current stream: one driver
        call with the argument block as packed (cuLaunchKernel copies the
        arguments when it is called: the block may be repacked at once)."""
        g, b = launch.grid, launch.block
        stream = self._be._stream_ptr()
        self._cp.cuda.driver.launchKernel(launch.function, g[0], g[1], g[2], b[0], b[1], b[2],
                                          launch.smem, stream, launch.params_ptr, 0)

    def pinned(self, nbytes):
        """A uint8 NumPy array of ``nbytes`` in page-locked host memory (the
        memory lives as long as the array)."""
        mem = self._cp.cuda.alloc_pinned_memory(max(1, nbytes))
        return np.frombuffer(mem, np.uint8, nbytes)

    def copy_up(self, dst, host):
        """Copy host array ``host`` (pinned, C-contiguous) into the first
        ``host.nbytes`` bytes of device array ``dst`` on the current stream
        (asynchronous: ``host`` must not change until the copy is done)."""
        self._cp.cuda.runtime.memcpyAsync(self._be._ptr(dst), host.ctypes.data, host.nbytes, 1,
                                          self._be._stream_ptr())   # 1: host to device

    def wait_host(self, event):
        """Block the host until ``event`` (from ``_record_event``) completed."""
        if event is not None:
            event.synchronize()


# What to install when kernels cannot be compiled (docs/gpu.md says the same).
_INSTALL_FIX = ("install NVRTC and the CUDA headers matching your CuPy: "
                "pip install 'kvcore[cuda12]' (CuPy for CUDA 12) or 'kvcore[cuda13]' "
                "(CUDA 13), which add cuda-toolkit[nvrtc,cudart]; or set CUDA_PATH to "
                "a CUDA toolkit that has them")


def compile_error(e, device, file):
    """The CudaUnavailableError for exception ``e`` raised while CuPy
    compiled (NVRTC) or loaded module ``file``: what failed, and the fix."""
    text = f"{type(e).__name__}: {e}".strip()
    low = text.lower()
    kind = type(e).__name__
    if "header" in low or "source file" in low or "cuda_path" in low:
        why, fix = "the CUDA headers NVRTC needs were not found", _INSTALL_FIX
    elif "libnvrtc" in low or ("nvrtc" in low and kind != "CompileException"):
        why, fix = "NVRTC (libnvrtc), which compiles kvcore's kernels, is missing", _INSTALL_FIX
    elif kind == "CUDADriverError" or "driver" in low or "ptx" in low:
        why = "the NVIDIA driver could not load the kernels NVRTC compiled"
        fix = ("update the NVIDIA driver, or install the NVRTC of the driver's CUDA "
               "version (kvcore[cuda12] for a CUDA 12 driver)")
    else:
        why = "NVRTC failed to compile kvcore's kernels"
        fix = ("please report this with the message above; " + _INSTALL_FIX
               + " if they are missing")
    if len(text) > 2000:  # a compile log can be long
        text = text[:2000] + " ..."
    return CudaUnavailableError(
        f"device={device!r}: {why} (compiling {file}: {text}); {fix}; or use device='cpu'")
