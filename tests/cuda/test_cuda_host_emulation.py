"""The CUDA backend with its kernels run on the host (no GPU, no CuPy needed).

Every kernel in ``kvcore/backends/cuda/kernels`` is a thin ``__global__`` loop that
calls ``kv_<name>_item(row, chunk, ...)`` once per (row, chunk).  Here the
item functions are compiled by the host C++ compiler (the headers' host
branch) and driven through the real ``CudaBackend`` methods, with only the
device hooks swapped: pointers, launches, the device context, and what
counts as a device array (``DevArray``, a NumPy subclass standing in for
device memory).  The shared cases in ``_cuda_cases.py`` then check, bit for
bit against the CPU backend, the kernels' index arithmetic and conversions,
the Python side of every method (layouts, temporaries, overlap, vector or
scalar path), that every 16-byte access of the vector path is aligned, and
that each launch's argument list matches the kernel's parameter list.
The ``emulated_cuda`` fixture installs this backend as device 'cuda', so
``BlockPool``, ``PagedKVCache`` and ``KVCache`` run on it end to end, and
records every host <-> device copy (a copy down is a sync on a GPU).

Not covered here (see test_cuda_backend.py, which runs on a GPU): CuPy
itself, NVRTC, streams and concurrency.
"""
import contextlib
import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest

from kvcore.backends.cuda import _sources
from kvcore.backends.cuda.backend import CudaBackend, launch_shape
from kvcore.backends.cuda.launch import CudaLaunches
from kvcore.dtypes import BF16, F16, F32
from kvcore.backends.codec import Codec

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_attention_emulation import AttentionEmulation, kernel_signature
    from ._cuda_cases import *  # noqa: F401,F403
    from ._cuda_cases import DeviceUnderTest, assert_bits_equal, rand_bits
except ImportError:
    from _cuda_attention_emulation import AttentionEmulation, kernel_signature
    from _cuda_cases import *  # noqa: F401,F403
    from _cuda_cases import DeviceUnderTest, assert_bits_equal, rand_bits

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="needs a C++17 compiler")

_HARNESS = r'''
#include <cstddef>
#include <type_traits>
#include <utility>

static long long kvemu_misaligned = 0;
void kv_host_check_aligned16(const void *p)
{
    if (reinterpret_cast<__UINTPTR_TYPE__>(p) % 16)
        ++kvemu_misaligned;
}
extern "C" long long kvemu_take_misaligned(void)
{
    long long n = kvemu_misaligned;
    kvemu_misaligned = 0;
    return n;
}

/* Launch emulation: every (row, chunk), last first (a GPU promises no
 * order, so results that depend on it show up as mismatches); p[k] points
 * at argument k (cuLaunchKernel's kernelParams convention). */
template <typename... A, std::size_t... I>
static void kvemu_run(void (*f)(kv_i64, kv_i64, A...), kv_i64 rows, kv_i64 chunks, void **p,
                      std::index_sequence<I...>)
{
    for (kv_i64 r = rows - 1; r >= 0; --r)
        for (kv_i64 c = chunks - 1; c >= 0; --c)
            f(r, c, *static_cast<A *>(p[I])...);
}

template <typename... A>
static void kvemu(void (*f)(kv_i64, kv_i64, A...), kv_i64 rows, kv_i64 chunks, void **p)
{
    kvemu_run(f, rows, chunks, p, std::index_sequence_for<A...>{});
}

/* The parameter list after (row, chunk): 0 for an integer, the pointee size
 * for a pointer. */
template <typename T> static int kvemu_code()
{
    if constexpr (std::is_pointer<T>::value)
        return (int)sizeof(typename std::remove_pointer<T>::type);
    else
        return 0;
}

template <typename... A>
static int kvemu_sig(void (*)(kv_i64, kv_i64, A...), int *out)
{
    int codes[] = {kvemu_code<A>()..., -1};
    for (std::size_t i = 0; i < sizeof...(A); ++i)
        out[i] = codes[i];
    return (int)sizeof...(A);
}
'''


class DevArray(np.ndarray):
    """A NumPy array standing in for device memory."""


def _put(a):
    return np.array(a, order="C").view(DevArray)


def _get(d):
    return np.array(d).view(np.ndarray)


class FakeCudaTensor:
    """A foreign array in (emulated) device memory, as a torch CUDA tensor
    presents itself: DLPack on device type 2 (kDLCUDA) and/or
    ``__cuda_array_interface__``; never ``__array__``."""

    def __init__(self, a, dlpack=True, cai=True):
        self.device_array = _put(a)
        self._dlpack, self._cai = dlpack, cai

    def __dlpack_device__(self):
        if not self._dlpack:
            raise AttributeError("__dlpack_device__")
        return (2, 0)

    @property
    def __cuda_array_interface__(self):
        if not self._cai:
            raise AttributeError("__cuda_array_interface__")
        a = self.device_array
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                "version": 3}


class HostCupy:
    """The few parts of CuPy the backend calls, on host memory: arrays are
    DevArrays; a foreign CUDA array (FakeCudaTensor) is imported zero-copy."""

    ndarray = DevArray
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDevice=lambda: 0,
        # copies between host and (emulated) device memory: plain memmoves
        memcpyHostToDevice=1, memcpyDeviceToHost=2,
        memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size),
        memcpy2DAsync=lambda dst, dpitch, src, spitch, width, height, kind, stream: [
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width) for r in range(height)]))

    def __getattr__(self, name):  # everything else as NumPy has it
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype).view(DevArray)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(DevArray)

    @staticmethod
    def ascontiguousarray(a):
        return np.ascontiguousarray(a).view(DevArray)

    @staticmethod
    def array(a, order="K", copy=True):
        # CuPy's copy kernel loads whole elements: off their alignment that
        # faults on a GPU (x86 does not mind), so the emulation refuses it
        if isinstance(a, DevArray) and a.size and a.itemsize > 1:
            assert a.ctypes.data % a.itemsize == 0 and all(
                st % a.itemsize == 0 for n, st in zip(a.shape, a.strides) if n > 1), (
                f"an element copy of a misaligned {a.dtype} array")
        return np.array(a, order=order, copy=copy).view(DevArray)

    @staticmethod
    def from_dlpack(x):
        return x.device_array

    @staticmethod
    def asarray(x):
        return x if isinstance(x, DevArray) else x.device_array


HOST_CUPY = HostCupy()


class EmulationLibrary:
    """Every instantiation the backend can ask for, compiled for the host."""

    def __init__(self, path, names):
        self._dir = path.parent
        self._attention = None
        self._lib = ctypes.CDLL(str(path))
        self._lib.kvemu_take_misaligned.restype = ctypes.c_longlong
        self.index = {name: i for i, name in enumerate(names)}
        self._fns, self._sigs = {}, {}

    def signature(self, name):
        sig = self._sigs.get(name)
        if sig is None:
            sig = self._sigs[name] = kernel_signature(self._lib, f"kvemu_{self.index[name]}_sig")
        return sig

    def run(self, name, rows, chunks, params):
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self._lib, f"kvemu_{self.index[name]}")
            fn.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = None
            self._fns[name] = fn
        fn(rows, chunks, params)

    def take_misaligned(self):
        return int(self._lib.kvemu_take_misaligned())

    def attention(self):
        """attention.cu's emulation (block kernels as fibers), built on first use."""
        if self._attention is None:
            self._attention = AttentionEmulation(self._dir)
        return self._attention


def build_emulation(tmpdir):
    names, parts = [], [_sources.source(f) for f in _sources.FILES]
    parts.append(_HARNESS)
    for _file, _sk, _dk, module_names in _sources.modules():
        for name in module_names:
            k = len(names)
            names.append(name)
            item = name.replace("<", "_item<", 1) if "<" in name else name + "_item"
            parts.append(
                f'extern "C" void kvemu_{k}(long long rows, long long chunks, void **p)'
                f" {{ kvemu(&{item}, rows, chunks, p); }}\n"
                f'extern "C" int kvemu_{k}_sig(int *out) {{ return kvemu_sig(&{item}, out); }}\n')
    src = tmpdir / "kvcore_cuda_emulation.cpp"
    src.write_text("\n".join(parts), encoding="utf-8")
    lib = tmpdir / "kvcore_cuda_emulation.so"
    cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           "-DKVCORE_HOST_EMULATION", str(src), "-o", str(lib)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    return EmulationLibrary(lib, names)


def _kernel_params(name, sig, args, any_width=False):
    """``(keep, params)``: the ctypes parameter block of a launch of kernel
    ``name`` (signature ``sig``: 0 an integer, -1 a float, -2 a void
    pointer, else a pointer to elements of that many bytes) with ``args``, each checked as the GPU
    would take it; ``keep`` holds the values alive.  ``any_width``: pointer
    arguments other than int32 ids may be words of any width (copy kernels)."""
    assert len(sig) == len(args), (
        f"{name}: kernel takes {len(sig)} arguments, given {len(args)}")
    keep, params = [], (ctypes.c_void_p * max(1, len(args)))()
    for k, (code, a) in enumerate(zip(sig, args)):
        if code == 0:
            assert isinstance(a, (int, np.integer)) and not isinstance(a, bool), (name, k, a)
            v = ctypes.c_longlong(int(a))
        elif code == -1:
            assert isinstance(a, float), (name, k, a)
            v = ctypes.c_float(a)
        elif a is None:  # a null pointer
            v = ctypes.c_void_p(None)
        elif type(a) is int:  # an address (attention's fast lane), aligned as the GPU needs
            assert a % max(1, code) == 0, (name, k, a)
            v = ctypes.c_void_p(a)
        elif code == -2:  # void *: q / out of a run-time kind, aligned to their itemsize
            assert isinstance(a, DevArray), (name, k, type(a))
            assert a.ctypes.data % a.itemsize == 0, (name, k)
            v = ctypes.c_void_p(a.ctypes.data)
        else:
            assert isinstance(a, DevArray), (name, k, type(a))
            if not any_width or a.dtype == np.int32:
                assert a.itemsize == code, (
                    f"{name}: argument {k} is {a.dtype}, kernel wants {code}-byte elements")
            # a GPU faults on an access off its size's alignment (x86 does not)
            assert a.ctypes.data % code == 0, (
                f"{name}: argument {k} at {a.ctypes.data:#x} is not {code}-byte aligned")
            v = ctypes.c_void_p(a.ctypes.data)
        keep.append(v)
        params[k] = ctypes.addressof(v)
    return keep, params


class EmulatedBackend(CudaBackend):
    """CudaBackend whose launches run the kernels' item functions on the host.

    Records every launch, upload (host -> device copy) and download (device
    -> host copy, a synchronisation on a GPU)."""

    def __init__(self, lib):  # no super().__init__: there is no CuPy here
        self._cp = HOST_CUPY
        self.xp = HOST_CUPY
        self.device_id = 0
        self.device = "cuda:0"
        self._lib = lib
        self.launches = []
        self.uploads = []
        self.downloads = []
        self.fences = []      # what was issued before each stream synchronisation
        self.launch_args = []  # the argument list of every launch, as given
        self._hold_parts(EmulatedLaunches(self, lib))   # the copies and attention, calling
        # the hooks below and launching through the emulated launcher

    def _fence(self):
        self.fences.append(len(self.launches))

    def _is_pinned(self, h):
        return False

    def _record_event(self):
        return None   # one host thread: every launch is complete on return

    def _ctx(self):
        return contextlib.nullcontext()

    def _ptr(self, a):
        return a.ctypes.data

    def _device_id_of(self, a):
        return 0

    def _stream_ptr(self):
        return 0

    def _upload(self, h):
        assert type(h) is np.ndarray and h.flags.c_contiguous
        self.uploads.append(h.copy())
        return _put(h)

    def _download(self, d):
        assert isinstance(d, DevArray)
        self.downloads.append(d.shape)
        return _get(d)

    def wrap_pointer(self, ptr, shape, strides, dtype, owner):
        """Host memory at ``ptr`` (a torch CPU tensor standing for device
        memory) as a DevArray, holding ``owner``."""
        dtype = np.dtype(dtype)
        extent = (sum((n - 1) * st for n, st in zip(shape, strides)) + dtype.itemsize
                  if all(shape) else 0)
        buf = (ctypes.c_char * max(1, extent)).from_address(ptr)
        a = np.ndarray(tuple(shape), dtype, buffer=buf, strides=tuple(strides)).view(DevArray)
        a.owner = owner
        return a


class EmulatedLaunches(CudaLaunches):
    """The launcher of an ``EmulatedBackend``: kernels' item functions (and
    attention.cu's block kernels) run on the host, each launch recorded in
    the backend's ``launches`` and ``launch_args``."""

    def __init__(self, backend, lib):  # no super().__init__: nothing is compiled by NVRTC
        self._be = backend
        self._lib = lib

    def launch(self, file, sk, dk, name, rows, chunks, args):
        assert name in _sources.module_names(file, sk, dk), (file, sk, dk, name)
        # copy kernels see storage as words of any width; ids are int32
        keep, params = _kernel_params(name, self._lib.signature(name), args,
                                      any_width=file == _sources.COPY_FILE)
        self._be.launches.append((name, rows, chunks))
        self._be.launch_args.append((name, list(args)))
        if rows <= 0 or chunks <= 0:
            return
        self._lib.run(name, rows, chunks, params)
        bad = self._lib.take_misaligned()
        assert bad == 0, f"{name}: {bad} vector accesses were not 16-byte aligned"

    def launch_grid(self, file, name, grid, block, args, smem=0):
        if self._collected(file, name, grid, block, args, smem):
            return
        lib = self._lib.attention()
        assert file == "attention.cu" and name in lib.names, (file, name)
        keep, params = _kernel_params(name, lib.signature(name), args)
        self._be.launches.append((name, grid, block))
        self._be.launch_args.append((name, list(args)))
        if grid <= 0:
            return
        assert smem <= self.smem_optin(), (name, smem)
        assert lib.launch(name, grid, block, params, smem), f"{name}: a barrier deadlocked"

    def smem_optin(self):
        return 227 * 1024   # an sm_90's

    def run_packed(self, launch, values):
        """An attention PackedLaunch: its arguments with the holes filled,
        run as launch_grid runs any launch."""
        args = list(launch.args)
        for i, hole in launch.holes:
            args[i] = values[hole.name]
        self.launch_grid(launch.file, launch.name, launch.grid, launch.block, args, launch.smem)

    # packed launches and pinned staging (kvcore/backends/cuda/lane.py)
    def function_ptr(self, file, sk, dk, name):
        if file == "attention.cu":
            assert name in self._lib.attention().names, name
        else:
            assert name in _sources.module_names(file, sk, dk), (file, sk, dk, name)
        return name

    def launch_packed(self, launch):
        """A row/chunk kernel from its packed argument block: the block's
        slots after (rows, chunks) are the item function's arguments, read
        through the same kernelParams pointers the GPU would read."""
        file, sk, dk, name = launch.kernel
        if launch.rows is None:    # a grid kernel (attention.cu): all of its arguments
            lib = self._lib.attention()
            sig = lib.signature(name)
            assert len(launch.slots) == len(sig), (
                f"{name}: kernel takes {len(sig)} arguments, packed {len(launch.slots)}")
            for k, (code, val) in enumerate(zip(sig, launch.slots)):
                if code > 0 and val:
                    assert val % code == 0, f"{name}: argument {k} at {val:#x} is not aligned"
            self._be.launches.append((name, launch.grid[0], launch.block[0]))
            self._be.launch_args.append((name, [int(x) for x in launch.slots]))
            params = ctypes.cast(launch.params_ptr, ctypes.POINTER(ctypes.c_void_p))
            assert launch.smem <= self.smem_optin(), (name, launch.smem)
            assert lib.launch(name, launch.grid[0], launch.block[0], params, launch.smem), (
                f"{name}: a barrier deadlocked")
            return
        sig = self._lib.signature(name)
        values = [int(x) for x in launch.slots[2:2 + len(sig)]]
        assert len(launch.slots) == len(sig) + 2, (
            f"{name}: kernel takes {len(sig)} arguments, packed {len(launch.slots) - 2}")
        for k, (code, val) in enumerate(zip(sig, values)):
            if code > 0 and val:   # a GPU faults on an access off its size's alignment
                assert val % code == 0, f"{name}: argument {k} at {val:#x} is not aligned"
        self._be.launches.append((name, launch.rows, launch.chunks))
        self._be.launch_args.append((name, values))
        if launch.rows <= 0 or launch.chunks <= 0:
            return
        params = ctypes.cast(launch.params_ptr + 16, ctypes.POINTER(ctypes.c_void_p))
        self._lib.run(name, launch.rows, launch.chunks, params)
        bad = self._lib.take_misaligned()
        assert bad == 0, f"{name}: {bad} vector accesses were not 16-byte aligned"

    def pinned(self, nbytes):
        return np.zeros(nbytes, np.uint8)

    def copy_up(self, dst, host):
        assert isinstance(dst, DevArray) and dst.nbytes >= host.nbytes
        self._be.uploads.append(host.copy())
        ctypes.memmove(dst.ctypes.data, host.ctypes.data, host.nbytes)


_EMU_LIB = []   # built once per process: the modules that import emu_lib share it


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a C++17 compiler")
    if not _EMU_LIB:
        _EMU_LIB.append(build_emulation(tmp_path_factory.mktemp("cuda_emulation")))
    return _EMU_LIB[0]


@pytest.fixture
def dev(emu_lib):
    return DeviceUnderTest(EmulatedBackend(emu_lib), _put, _get, 1 << 20,
                           foreign=[lambda a: FakeCudaTensor(a, cai=False),
                                    lambda a: FakeCudaTensor(a, dlpack=False)])


# ------------------------------------------------ emulation-only checks

@needs_cxx
def test_emulation_library_has_every_instantiation(emu_lib):
    for _file, _sk, _dk, names in _sources.modules():
        for name in names:
            assert emu_lib.signature(name)[0] > 0  # the first argument is an output pointer


@needs_cxx
@pytest.mark.parametrize("sk,dk,dim,offset,want_v", [
    (F16, F16, 128, 0, 8), (F32, F16, 128, 0, 8), (F32, F32, 64, 0, 4), (BF16, F32, 64, 0, 8),
    (F32, F32, 60, 0, 4), (F16, F16, 60, 0, 1), (F16, F16, 33, 0, 1), (F16, F16, 128, 1, 1),
])
def test_vector_path_is_chosen_when_possible(dev, sk, dk, dim, offset, want_v):
    rng = np.random.default_rng(0)
    src = rand_bits(rng, (5, 2, dim), sk)
    flat = _put(np.zeros(src.size + offset, src.dtype))
    flat[offset:] = src.ravel()
    cache = _put(rand_bits(rng, (3, 2, 8, dim), dk))
    dev.be.write_slots(cache, flat[offset:].reshape(src.shape), np.arange(5), sk, Codec(dk))
    name, rows, chunks = dev.be.launches[-1]
    assert name == _sources.kernel_name("kv_write_slots", sk, dk, want_v)
    assert (rows, chunks) == (10, dim // want_v)


@pytest.mark.parametrize("rows,chunks", [(1, 1), (7, 3), (300, 1), (5, 16), (3, 300),
                                         (1000, 32), (2, 1024), (513, 24)])
def test_launch_shape_covers_every_row_and_chunk(rows, chunks):
    """Replays KV_ROW_LOOP (kv_half.cuh) over the grid launch_shape picks:
    every (row, chunk) exactly once, blocks of at most 256 threads."""
    (grid, gy, gz), (bx, by, bz) = launch_shape(rows, chunks)
    assert gy == gz == bz == 1 and 1 <= bx * by <= 256 and grid >= 1
    seen = np.zeros((rows, chunks), np.int64)
    for b in range(grid):
        for ty in range(by):
            row = b * by + ty
            while row < rows:
                for tx in range(bx):
                    c = tx
                    while c < chunks:
                        seen[row, c] += 1
                        c += bx
                row += grid * by
    assert (seen == 1).all()


def test_launch_shape_caps_the_grid():
    (grid, _, _), (bx, by, _) = launch_shape(2**31 - 1, 16)
    assert grid <= 2**31 - 1 and grid * by < 2**31 - 1 and bx == 16


# ------------------------------------ the public classes on device='cuda'

@pytest.fixture
def emulated_cuda(emu_lib, monkeypatch):
    """An EmulatedBackend installed as device 'cuda' (= 'cuda:0'): BlockPool,
    PagedKVCache and KVCache built with device='cuda' run on it, their
    arrays DevArrays, their kernels the host-compiled item functions."""
    import kvcore.backends.cuda as kc

    be = EmulatedBackend(emu_lib)
    monkeypatch.setattr(kc, "_cupy", HOST_CUPY)
    monkeypatch.setattr(kc, "_cupy_error", None)
    monkeypatch.setattr(kc, "_device_count", 1)
    monkeypatch.setattr(kc, "_backends", {0: be})
    return be


def _pools(dtype="float16", num_blocks=8, block_size=4, layers=2, heads=2, head_dim=16):
    import kvcore

    args = (num_blocks, block_size, layers, heads, head_dim)
    return kvcore.BlockPool(*args, dtype=dtype), kvcore.BlockPool(*args, dtype=dtype, device="cuda")


def _same(a, b):
    assert_bits_equal(_get(a) if isinstance(a, DevArray) else np.asarray(a),
                      _get(b) if isinstance(b, DevArray) else np.asarray(b))


def test_cuda_pool_gather_batch_checks_tables_and_lengths(emulated_cuda):
    """The public layer checks gather_batch's lengths and tables on every
    device (the CUDA backend trusts them: no second check there)."""
    _, pool = _pools()                       # blocks of 4: two blocks hold 8
    tables = np.zeros((2, 2), np.int32)
    for lengths in ([3, 9], [3, -1]):
        with pytest.raises(ValueError, match=r"lengths must lie in 0\.\.8"):
            pool.gather_batch(0, tables, lengths)
    with pytest.raises(ValueError, match="lengths must be 1-D with one entry per row"):
        pool.gather_batch(0, tables, [3])
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        pool.gather_batch(0, tables[0], [3, 4])


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
def test_kvcache_on_cuda_takes_ml_dtypes_bfloat16(emulated_cuda, storage):
    """Issue 9 item 8: a bf16 array moved to the device stays bf16, and
    KVCache.update reads it as bf16 (it raised TypeError: uint16 without
    src_dtype)."""
    import ml_dtypes

    import kvcore

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(20)
    cpu = kvcore.KVCache(2, 2, 64, 16, dtype=storage)
    gpu = kvcore.KVCache(2, 2, 64, 16, dtype=storage, device="cuda")
    assert gpu.device == "cuda:0"
    for n in (5, 1):
        k = rand_bits(rng, (1, 2, n, 64), BF16).view(bf16)
        v = rand_bits(rng, (1, 2, n, 64), BF16).view(bf16)
        cpu.update(0, k, v)
        gpu.update(0, emulated_cuda.from_host(k), emulated_cuda.from_host(v))
    for a, b in zip(cpu.get(0), gpu.get(0)):
        _same(a, b)


def _index_forms(values):
    """The forms of an index argument a CPU pool takes, and device ones."""
    import array

    a = np.asarray(values)
    return {"list": list(values), "tuple": tuple(values),
            "array.array": array.array("q", a.tolist()),
            "int32": a.astype(np.int32), "array-like": _ArrayLike(a),
            "device": _put(a), "cai": FakeCudaTensor(a, dlpack=False),
            "dlpack-cuda": FakeCudaTensor(a, cai=False)}


class _ArrayLike:
    """Host data with only ``__array__`` (a torch CPU tensor's protocol)."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


def test_cuda_pool_takes_the_index_inputs_a_cpu_pool_takes(emulated_cuda):
    """Issue 9 item 9: slots, block tables and lengths as range, array.array,
    array-likes and CUDA arrays (AttributeError: no .get() before)."""
    rng = np.random.default_rng(21)
    cpu, gpu = _pools()
    slots = [5, -1, 17, 2, 30]
    for s in [*_index_forms(slots).values(), range(3, 8)]:
        k, v = rand_bits(rng, (5, 2, 16), F32), rand_bits(rng, (5, 2, 16), F32)
        cpu.write(1, k, v, slots if not isinstance(s, range) else s)
        gpu.write(1, emulated_cuda.from_host(k), emulated_cuda.from_host(v), s)
        _same(gpu.storage, cpu.storage)
    table = [3, 0, 7, 4]
    for name, t in dict(_index_forms(table), range=range(0, 4)).items():
        ref_table = list(range(0, 4)) if name == "range" else table
        for a, b in zip(gpu.gather(1, t, 2, 15, dtype="float32"),
                        cpu.gather(1, ref_table, 2, 15, dtype="float32")):
            _same(a, b)
    tables, lengths = [[3, 0, 7], [4, 1, 0]], [9, 5]
    for name, (t, n) in {"list": (tables, lengths),
                         "array.array": (np.array(tables), __import__("array").array("i", lengths)),
                         "device": (_put(np.array(tables)), _put(np.array(lengths))),
                         "foreign": (FakeCudaTensor(np.array(tables)),
                                     FakeCudaTensor(np.array(lengths), cai=False)),
                         "range": (np.array(tables), range(9, 4, -4))}.items():
        for a, b in zip(gpu.gather_batch(1, t, n), cpu.gather_batch(1, tables, lengths)):
            _same(a, b)


def test_cuda_pool_repeated_slots_keep_the_last_token_as_on_the_cpu(emulated_cuda):
    """Issue 9 item 12: one rule for both devices."""
    rng = np.random.default_rng(22)
    for dtype in ("float32", "bfloat16"):
        cpu, gpu = _pools(dtype)
        slots = np.array([6, 6, 1, 6, 1, 9], np.int64)
        k, v = rand_bits(rng, (6, 2, 16), F16), rand_bits(rng, (6, 2, 16), F16)
        cpu.write(0, k, v, slots)
        for s in (slots, _put(slots)):
            gpu.write(0, _put(k), _put(v), s)
            _same(gpu.storage, cpu.storage)


def test_cuda_pool_write_with_device_slots_stays_on_the_device(emulated_cuda):
    """Issue 9 item 13: device slots are not copied to the host and back
    (they were: one blocking download and two uploads per layer).  Checked:
    one 8-byte verdict comes down; check=False: nothing moves at all, so a
    CUDA graph can capture the call."""
    rng = np.random.default_rng(23)
    cpu, gpu = _pools()
    slots = np.array([1, 14, -1, 30, 7], np.int64)
    k, v = rand_bits(rng, (5, 2, 16), F32), rand_bits(rng, (5, 2, 16), F32)
    dk, dv, ds = _put(k), _put(v), _put(slots)
    cpu.write(1, k, v, slots)
    be = emulated_cuda
    be.uploads.clear()
    be.downloads.clear()
    gpu.write(1, dk, dv, ds, check=False)
    assert be.uploads == [] and be.downloads == []
    _same(gpu.storage, cpu.storage)
    gpu.write(1, dk, dv, ds)  # checked on the device
    assert be.downloads == [(1,)]  # the verdict, nothing else
    assert [u.nbytes for u in be.uploads] == [8]  # the verdict's initial value
    _same(gpu.storage, cpu.storage)
    # a bad device slot: IndexError naming it, nothing written
    before = _get(gpu.storage)
    bad = slots.copy()
    bad[3] = gpu.num_blocks * gpu.block_size
    with pytest.raises(IndexError, match=r"got 32 at index 3"):
        gpu.write(0, dk, dv, _put(bad))
    _same(gpu.storage, before)
    # unchecked, the bad slot is skipped and nothing outside the pool is written
    gpu.write(0, dk, dv, _put(bad), check=False)
    skip = bad.copy()
    skip[3] = -1
    cpu.write(0, k, v, skip)
    _same(gpu.storage, cpu.storage)
    with pytest.raises(TypeError, match="check must be a bool"):
        gpu.write(0, dk, dv, ds, check=None)


def test_paged_gather_uploads_only_the_needed_blocks_once(emulated_cuda):
    """Issue 9 item 13: a PagedKVCache.gather on a GPU pool copies its block
    table up once for K and V together, and only the blocks in range."""
    import kvcore

    rng = np.random.default_rng(24)
    pool = kvcore.BlockPool(16, 4, 1, 2, 16, device="cuda")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(22)))
    seq.append(0, _put(rand_bits(rng, (22, 2, 16), F16)), _put(rand_bits(rng, (22, 2, 16), F16)))
    be = emulated_cuda
    be.uploads.clear()
    k, v = seq.gather(0, 0, 9)
    assert len(be.uploads) == 1 and be.uploads[0].tolist() == seq.block_table[:3].tolist()
    assert k.shape == v.shape == (2, 9, 16)


# ------------------------------------------ paged_attention on a CUDA pool

def _attention_pools(dtype, rng, num_blocks=12, block_size=8, kv_heads=2, head_dim=64):
    import kvcore

    cpu = kvcore.BlockPool(num_blocks, block_size, 2, kv_heads, head_dim, dtype=dtype)
    gpu = kvcore.BlockPool(num_blocks, block_size, 2, kv_heads, head_dim, dtype=dtype,
                           device="cuda")
    vals = rng.standard_normal((num_blocks * block_size, kv_heads, head_dim)).astype(np.float32)
    slots = np.arange(num_blocks * block_size)
    for layer in (0, 1):
        cpu.write(layer, vals, vals[::-1].copy(), slots)
        gpu.write(layer, _put(vals), _put(vals[::-1].copy()), slots)
    return cpu, gpu


def _attention_batch(rng):
    """The batch the CUDA attention tests run: two sequences over shuffled
    blocks (37 and 11 positions), 3 + 1 queries of 8 heads, head_dim 64."""
    tables = np.array([[3, 0, 7, 4, 9], [1, 2, 5, 6, 8]], np.int32)
    lens = np.array([37, 11], np.int64)
    qsl = np.array([0, 3, 4], np.int64)
    return tables, lens, qsl, rng.standard_normal((4, 8, 64)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_attention_on_a_cuda_pool(emulated_cuda, dtype):
    """Issue 11: a CUDA pool runs kernels/attention.cu (it raised
    NotImplementedError); device index arrays, q float16, out= float32 and
    float16 device arrays; same results as the CPU pool within tolerance."""
    import kvcore

    rng = np.random.default_rng(30)
    cpu, gpu = _attention_pools(dtype, rng)
    tables, lens, qsl, q = _attention_batch(rng)
    want = kvcore.paged_attention(q, cpu, 1, tables, lens, qsl, sliding_window=30)
    be = emulated_cuda
    be.launches.clear()
    got = kvcore.paged_attention(_put(q), gpu, 1, _put(tables), lens, _put(qsl),
                                 sliding_window=30)
    assert isinstance(got, DevArray) and got.dtype == np.float32
    assert [n for n, _, _ in be.launches] == [f"kva_attention_split<{gpu._kind}, 64>"]
    np.testing.assert_allclose(_get(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    out = _put(np.zeros(q.shape, np.float16))
    assert kvcore.paged_attention(_put(q.astype(np.float16)), gpu, 1, tables, lens, qsl,
                                  sliding_window=30, out=out) is out
    want16 = kvcore.paged_attention(q.astype(np.float16), cpu, 1, tables, lens, qsl,
                                    sliding_window=30, out=np.zeros(q.shape, np.float16))
    # float16 results: one rounding of values within 1e-5 of each other
    np.testing.assert_allclose(_get(out).astype(np.float32), want16.astype(np.float32),
                               rtol=2 ** -10, atol=1e-5)


def test_paged_attention_on_a_cuda_pool_checks_before_any_work(emulated_cuda):
    import kvcore

    rng = np.random.default_rng(31)
    _, gpu = _attention_pools("float16", rng)
    q = _put(rng.standard_normal((2, 8, 64)).astype(np.float32))
    tables, lens = np.array([[3, 0], [1, 2]], np.int32), np.array([9, 16], np.int64)
    be = emulated_cuda
    be.launches.clear()
    with pytest.raises(IndexError, match=r"block_tables\[1, 1\] must be a block id in 0\.\.11"):
        kvcore.paged_attention(q, gpu, 0, _put(np.array([[3, 0], [1, 12]], np.int32)), lens)
    with pytest.raises(ValueError, match="seq_lens must lie in 0..16"):
        kvcore.paged_attention(q, gpu, 0, tables, [9, 17])
    with pytest.raises(ValueError, match="multiple of the pool's num_kv_heads=2"):
        kvcore.paged_attention(_put(np.zeros((2, 3, 64), np.float32)), gpu, 0, tables, lens)
    with pytest.raises(TypeError, match="q is a NumPy array in host memory"):
        kvcore.paged_attention(_get(q), gpu, 0, tables, lens)
    with pytest.raises(ValueError, match="out must have shape"):
        kvcore.paged_attention(q, gpu, 0, tables, lens, out=_put(np.zeros((2, 8, 32), np.float32)))
    with pytest.raises(ValueError, match="out must not overlap"):
        kvcore.paged_attention(q, gpu, 0, tables, lens, out=gpu.key_cache(0)[:2, 0, :8, :])
    assert be.launches == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kvcache_attention_on_cuda(emulated_cuda, dtype):
    """KVCache.attention on a CUDA cache (it raised NotImplementedError):
    as on the CPU within tolerance; out= a bfloat16 device array."""
    import ml_dtypes

    import kvcore

    rng = np.random.default_rng(32)
    cpu = kvcore.KVCache(2, 2, 64, 40, batch_size=3, dtype=dtype)
    gpu = kvcore.KVCache(2, 2, 64, 40, batch_size=3, dtype=dtype, device="cuda")
    k = rng.standard_normal((3, 2, 29, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 29, 64)).astype(np.float32)
    cpu.update(1, k, v)
    gpu.update(1, _put(k), _put(v))
    q = rng.standard_normal((3, 8, 4, 64)).astype(np.float32)
    want = cpu.attention(1, q, logits_soft_cap=3.0)
    got = gpu.attention(1, _put(q), logits_soft_cap=3.0)
    assert isinstance(got, DevArray) and got.shape == (3, 8, 4, 64)
    np.testing.assert_allclose(_get(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    out = _put(np.zeros((3, 8, 4, 64), ml_dtypes.bfloat16))
    assert gpu.attention(1, _put(q), logits_soft_cap=3.0, out=out) is out
    np.testing.assert_allclose(_get(out).astype(np.float32), want, rtol=2 ** -7, atol=1e-5)


# ---------------------------------------- fp8 / int8 pools and caches on CUDA

LOWPREC = ("float8_e4m3fn", "float8_e5m2", "int8")


def _lp_rows(rng, shape):
    """float32 rows over many magnitudes, with NaN / inf rows, zeros and
    subnormal rows."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-10, 10, shape))).astype(np.float32)
    x[rng.random(shape) < 0.05] = 0
    x[rng.random(shape) < 0.02] *= np.float32(1e5)
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] > 3:
        flat[1] = 0
        flat[2, 0] = np.nan
        flat[3, -1] = -np.inf
    if flat.shape[0] > 5:
        # tiny rows: int8's max|x| / 127 underflows to 0 (the scale is then
        # 2**-149), or is subnormal (fp8: subnormal inputs)
        flat[4] = np.float32(2.0**-149) * rng.integers(-63, 64, shape[-1])
        flat[5] = flat[0] * np.float32(1e-38)
    return x


def _same_pool(cpu, gpu):
    _same(gpu.storage, cpu.storage)
    if cpu.dtype == "int8":
        _same(gpu.scales, cpu.scales)


@pytest.mark.parametrize("dtype", LOWPREC)
def test_lowprec_pool_on_cuda_matches_the_cpu_pool(emulated_cuda, dtype):
    """Issue 12's CUDA part: fp8 / int8 pools on device='cuda' (a ValueError
    before) give the CPU pool's bits: writes (repeated and device slots,
    float16 / bfloat16 / float32 input), appends, copy-on-write, raw and
    widened gathers, gather_batch, gather_scales, copy_blocks_to both ways."""
    import kvcore

    rng = np.random.default_rng(40)
    kw = {} if dtype == "int8" else {"kv_scales": [(0.5, 2.0), (1.0, 0.25)]}
    args = (12, 4, 2, 2, 16)
    cpu = kvcore.BlockPool(*args, dtype=dtype, **kw)
    gpu = kvcore.BlockPool(*args, dtype=dtype, device="cuda", **kw)
    assert gpu.dtype == dtype and gpu.device == "cuda:0"
    _same_pool(cpu, gpu)
    # BlockPool.write: repeated slots (the last lands), skips, device slots, input kinds
    slots = np.array([5, 9, 5, 31, -1, 9, 0, 47], np.int64)
    for layer, src in ((0, "float32"), (1, "float16"), (1, "bfloat16")):
        k = _lp_rows(rng, (8, 2, 16))
        v = _lp_rows(rng, (8, 2, 16))
        if src == "float16":
            with np.errstate(over="ignore"):
                k, v = k.astype(np.float16), v.astype(np.float16)
            cpu.write(layer, k, v, slots)
            gpu.write(layer, _put(k), _put(v), _put(slots))
        elif src == "bfloat16":
            kb, vb = cpu_bits(k, BF16), cpu_bits(v, BF16)
            cpu.write(layer, kb, vb, slots, src_dtype="bfloat16")
            gpu.write(layer, _put(kb), _put(vb), slots, src_dtype="bfloat16")
        else:
            cpu.write(layer, k, v, slots)
            gpu.write(layer, _put(k), _put(v), slots)
        _same_pool(cpu, gpu)
    with pytest.raises(IndexError, match="got 48 at index 1"):
        gpu.write(0, _put(k), _put(v), _put(np.array([1, 48, 2, 3, 4, 5, 6, 7])))
    _same_pool(cpu, gpu)
    # sequences: append, fork + append (copy-on-write of the shared block)
    seqs = []
    for pool in (cpu, gpu):
        s = kvcore.PagedKVCache(pool)
        s.allocate(list(range(100, 106)))
        seqs.append(s)
    rows = [_lp_rows(rng, (6, 2, 16)) for _ in range(4)]
    for layer in (0, 1):
        seqs[0].append(layer, rows[2 * layer], rows[2 * layer + 1])
        seqs[1].append(layer, _put(rows[2 * layer]), _put(rows[2 * layer + 1]))
    forks = [s.fork() for s in seqs]
    extra = _lp_rows(rng, (2, 1, 2, 16))
    for f, put in zip(forks, (np.asarray, _put)):
        f.append_token(7)
        for layer in (0, 1):
            f.append(layer, put(extra[0]), put(extra[1]))
    _same_pool(cpu, gpu)
    # reads
    for a, b in ((seqs[0], seqs[1]), (forks[0], forks[1])):
        for layer in (0, 1):
            for dt in (None, "float32", "float16", "bfloat16"):
                for x, y in zip(a.gather(layer, 0, a.num_computed, dtype=dt),
                                b.gather(layer, 0, b.num_computed, dtype=dt)):
                    _same(x, y)
    table = forks[0].block_table
    assert table.tolist() == forks[1].block_table.tolist()
    tables = np.stack([seqs[0].block_table, table])
    lens = np.array([6, 7])
    for dt in (None, "float32", "float16"):
        for x, y in zip(cpu.gather_batch(1, tables, lens, dtype=dt),
                        gpu.gather_batch(1, _put(tables), lens, dtype=dt)):
            _same(x, y)
    if dtype == "int8":
        for x, y in zip(cpu.gather_scales(0, table, 1, 7), gpu.gather_scales(0, table, 1, 7)):
            _same(x, y)
    # copy_blocks_to: CUDA -> CPU, CPU -> CUDA, CUDA -> CUDA
    src_ids = np.array([0, 1, 2, 9], np.int32)
    dst_ids = np.array([11, 3, 4, 10], np.int32)
    host = kvcore.BlockPool(*args, dtype=dtype, **kw)
    gpu.copy_blocks_to(host, src_ids, dst_ids)
    cpu2 = kvcore.BlockPool(*args, dtype=dtype, **kw)
    cpu.copy_blocks_to(cpu2, src_ids, dst_ids)
    _same_pool(cpu2, host)
    gpu2 = kvcore.BlockPool(*args, dtype=dtype, device="cuda", **kw)
    cpu.copy_blocks_to(gpu2, src_ids, dst_ids)
    _same_pool(cpu2, gpu2)
    gpu3 = kvcore.BlockPool(*args, dtype=dtype, device="cuda", **kw)
    gpu.copy_blocks_to(gpu3, src_ids, dst_ids)
    _same_pool(cpu2, gpu3)
    # within one pool (chained ids: in order)
    cpu.copy_blocks_to(cpu, [0, 1], [1, 2])
    gpu.copy_blocks_to(gpu, [0, 1], [1, 2])
    _same_pool(cpu, gpu)


def cpu_bits(x, kind):
    out = np.empty(x.shape, np.uint16)
    from kvcore.backends import CPU
    CPU.convert(x, F32, out, kind)
    return out


@pytest.mark.parametrize("dtype", LOWPREC)
def test_lowprec_kvcache_on_cuda_matches_the_cpu_cache(emulated_cuda, dtype):
    import kvcore

    rng = np.random.default_rng(41)
    kw = {} if dtype == "int8" else {"kv_scales": [(0.5, 2.0), (1.0, 3.0)]}
    cpu = kvcore.KVCache(2, 2, 16, 24, batch_size=2, dtype=dtype, **kw)
    gpu = kvcore.KVCache(2, 2, 16, 24, batch_size=2, dtype=dtype, device="cuda", **kw)
    for n in (9, 1, 5):
        for layer in (0, 1):
            k = _lp_rows(rng, (2, 2, n, 16))
            raw = _lp_rows(rng, (2, n, 2, 16))   # (batch, n, heads, dim), transposed
            with np.errstate(over="ignore"):
                k = k.astype(np.float16)
            cpu.update(layer, k, raw.transpose(0, 2, 1, 3))
            gpu.update(layer, _put(k), _put(raw).transpose(0, 2, 1, 3))
    for layer in (0, 1):
        for dt in (None, "float32", "float16", "bfloat16"):
            for x, y in zip(cpu.get(layer, dtype=dt), gpu.get(layer, dtype=dt)):
                _same(x, y)
            for x, y in zip(cpu.get(layer, 3, 11, dtype=dt), gpu.get(layer, 3, 11, dtype=dt)):
                _same(x, y)
        if dtype == "int8":
            for x, y in zip(cpu.get_scales(layer, 2, 9), gpu.get_scales(layer, 2, 9)):
                _same(x, y)


def _lowprec_attention_pools(dtype, rng, num_blocks=12, block_size=8, kv_heads=2, head_dim=64):
    """The same fp8 / int8 pool on the CPU and on the (emulated) GPU, both
    layers written from the same float32 rows (a NaN row in layer 1's keys
    at slot 21, kv head 0: an int8 NaN scale, an fp8 NaN code)."""
    import kvcore

    kw = {} if dtype == "int8" else {"kv_scales": [(0.5, 2.0), (0.37, 3.0)]}
    args = (num_blocks, block_size, 2, kv_heads, head_dim)
    cpu = kvcore.BlockPool(*args, dtype=dtype, **kw)
    gpu = kvcore.BlockPool(*args, dtype=dtype, device="cuda", **kw)
    n = num_blocks * block_size
    slots = np.arange(n)
    for layer in (0, 1):
        k = (rng.standard_normal((n, kv_heads, head_dim)) * 3).astype(np.float32)
        v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        if layer == 1:
            k[21, 0, 5] = np.nan
        cpu.write(layer, k, v, slots)
        gpu.write(layer, _put(k), _put(v), slots)
    _same_pool(cpu, gpu)
    return cpu, gpu


def _close(got, want):
    """Same NaN pattern; the rest within 1e-5 of the largest magnitude."""
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), np.argwhere(np.isnan(got) != nan)[:5]
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=0,
                               atol=1e-5 * np.abs(want[~nan]).max())


@pytest.mark.parametrize("dtype", LOWPREC)
def test_paged_attention_over_lowprec_pages_on_cuda(emulated_cuda, dtype):
    """Issue 12 on CUDA (it raised NotImplementedError): paged_attention and
    seq.attention over fp8 / int8 pages run kernels/attention.cu with the
    pool's scales; the results match the CPU pool's within 1e-5 relative
    and the float64 reference over the dequantized pages; a NaN row (layer
    1, slot 21) is NaN for the queries that see it."""
    import kvcore
    from kvcore.backends.base import paged_attention_reference

    rng = np.random.default_rng(60)
    cpu, gpu = _lowprec_attention_pools(dtype, rng)
    tables, lens, qsl, q = _attention_batch(rng)
    be = emulated_cuda
    for layer, kw in ((0, {}), (0, dict(sliding_window=30)), (1, dict(logits_soft_cap=5.0)),
                      (1, dict(sliding_window=14))):
        want = kvcore.paged_attention(q, cpu, layer, tables, lens, qsl, **kw)
        be.launches.clear()
        got = kvcore.paged_attention(_put(q), gpu, layer, _put(tables), lens, _put(qsl), **kw)
        assert isinstance(got, DevArray) and got.dtype == np.float32
        assert [n for n, _, _ in be.launches] == [f"kva_attention_split<{gpu._kind}, 64>"]
        got = _get(got)
        _close(got, want)
        if dtype == "int8":
            rk = dict(key_scales=cpu.key_scales(layer), value_scales=cpu.value_scales(layer))
        else:
            rk = dict(zip(("key_scales", "value_scales"), cpu.kv_scales[layer]))
        ref = paged_attention_reference(q, cpu.key_cache(layer), cpu.value_cache(layer),
                                        tables, lens, qsl, kind=dtype, **kw, **rk)
        _close(got, ref)
        # the NaN row (slot 21: block 2, offset 5) would be position 13 of
        # sequence 1, which reads positions 0..10 only
        assert np.isfinite(got).all()
    # a table whose queries (positions 12..14) see the NaN row at position 5
    t2 = np.array([[2, 1]], np.int32)
    q2 = rng.standard_normal((3, 8, 64)).astype(np.float32)
    want = kvcore.paged_attention(q2, cpu, 1, t2, [8 + 7], [0, 3])
    got = _get(kvcore.paged_attention(_put(q2), gpu, 1, t2, [8 + 7], [0, 3]))
    _close(got, want)
    assert np.isnan(got[:, :4]).all() and np.isfinite(got[:, 4:]).all()
    # out= a float16 device array, q float16
    out = _put(np.zeros(q.shape, np.float16))
    assert kvcore.paged_attention(_put(q.astype(np.float16)), gpu, 0, tables, lens, qsl,
                                  out=out) is out
    want16 = kvcore.paged_attention(q.astype(np.float16), cpu, 0, tables, lens, qsl,
                                    out=np.zeros(q.shape, np.float16))
    np.testing.assert_allclose(_get(out).astype(np.float32), want16.astype(np.float32),
                               rtol=2 ** -10, atol=1e-5)
    # seq.attention: 16 committed positions, then a step of 3
    seqs = []
    rows = [rng.standard_normal((19, 2, 64)).astype(np.float32) for _ in range(4)]
    for pool, put in ((cpu, np.asarray), (gpu, _put)):
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(list(range(1, 20)))
        for layer in (0, 1):
            seq.append(layer, put(rows[2 * layer][:16]), put(rows[2 * layer + 1][:16]))
        seq.commit(16)
        for layer in (0, 1):
            seq.append(layer, put(rows[2 * layer][16:]), put(rows[2 * layer + 1][16:]))
        seqs.append(seq)
    q3 = rng.standard_normal((3, 8, 64)).astype(np.float32)
    for layer in (0, 1):
        _close(_get(seqs[1].attention(layer, _put(q3))), seqs[0].attention(layer, q3))


@pytest.mark.parametrize("dtype", LOWPREC)
def test_kvcache_attention_over_lowprec_on_cuda(emulated_cuda, dtype):
    """KVCache.attention on an fp8 / int8 CUDA cache (it raised
    NotImplementedError): as on the CPU cache within tolerance, soft cap and
    window, out= a bfloat16 device array."""
    import ml_dtypes

    import kvcore

    rng = np.random.default_rng(62)
    kw = {} if dtype == "int8" else {"kv_scales": [(0.5, 2.0), (0.37, 3.0)]}
    cpu = kvcore.KVCache(2, 2, 64, 40, batch_size=3, dtype=dtype, **kw)
    gpu = kvcore.KVCache(2, 2, 64, 40, batch_size=3, dtype=dtype, device="cuda", **kw)
    for n in (20, 9):
        for layer in (0, 1):
            k = (rng.standard_normal((3, 2, n, 64)) * 3).astype(np.float32)
            v = rng.standard_normal((3, 2, n, 64)).astype(np.float32)
            cpu.update(layer, k, v)
            gpu.update(layer, _put(k), _put(v))
    q = rng.standard_normal((3, 8, 4, 64)).astype(np.float32)
    for layer, kw2 in ((0, {}), (1, dict(logits_soft_cap=3.0, sliding_window=12))):
        want = cpu.attention(layer, q, **kw2)
        got = gpu.attention(layer, _put(q), **kw2)
        assert isinstance(got, DevArray) and got.shape == (3, 8, 4, 64)
        _close(_get(got), want)
        assert np.isfinite(want).all()
    out = _put(np.zeros((3, 8, 4, 64), ml_dtypes.bfloat16))
    assert gpu.attention(1, _put(q), out=out) is out
    np.testing.assert_allclose(_get(out).astype(np.float32), cpu.attention(1, q), rtol=2 ** -7,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", LOWPREC)
def test_paged_attention_over_lowprec_pages_checks_the_scales(emulated_cuda, dtype):
    """The backend checks the scale arguments on the host, before any
    launch: a missing, misshapen or host scale plane, a non-finite or
    non-positive fp8 scale, scales on float pages."""
    import kvcore
    from kvcore.dtypes import NAME_KIND

    rng = np.random.default_rng(63)
    _, gpu = _lowprec_attention_pools(dtype, rng)
    be = emulated_cuda
    kind = NAME_KIND[dtype]
    q = _put(rng.standard_normal((1, 4, 64)).astype(np.float32))
    out = be.empty(q.shape, "float32")
    args = (q, out, gpu.key_cache(0), gpu.value_cache(0), kind, np.array([[0]], np.int32),
            np.array([3], np.int64), np.array([0, 1], np.int64), 0.125, 0, 0.0)
    pair = lambda k, v, ks=1.0, vs=1.0: (Codec(kind, ks, k), Codec(kind, vs, v))
    if dtype == "int8":
        ks, vs = gpu.key_scales(0), gpu.value_scales(0)
        good = pair(ks, vs)
        bad = [(None, TypeError, "int8 pages need codecs"),
               (pair(_get(ks), vs), TypeError,
                r"key_codec.scale_plane must be a float32 array on"),
               (pair(ks, vs[:5]), ValueError, r"value_codec.scale_plane must be float32 of shape"),
               (pair(ks, _put(np.asarray(vs, np.float64))), ValueError, "float32"),
               (pair(ks, vs, 2.0), ValueError, "the codecs' layer_scale must be 1.0"),
               (pair(ks, _put(np.zeros((12, 2, 8, 2), np.float32))[..., 0]), ValueError,
                "same layout")]
    else:
        k_scale, v_scale = gpu.kv_scales[0]
        good = pair(None, None, k_scale, v_scale)
        bad = [((None, v_scale), TypeError, r"codecs must be a \(key_codec, value_codec\) pair"),
               (pair(None, None, 0.0, v_scale), ValueError,
                r"key_codec.layer_scale must be finite and positive"),
               (pair(None, None, k_scale, float("nan")), ValueError,
                r"value_codec.layer_scale must be finite"),
               (pair(None, None, k_scale, 1e39), ValueError,
                r"value_codec.layer_scale must be finite"),
               (pair(None, None, "2", v_scale), TypeError,
                r"key_codec.layer_scale must be a real number"),
               (pair(gpu.key_cache(0), None, k_scale, v_scale), ValueError,
                "scale_plane must be None"),
               ((Codec(kind, 1.0, head_scales=np.ones(2, np.float32)), good[1]), ValueError,
                "per-kv-head scales"),
               ((Codec(F16), Codec(F16)), ValueError, "key_codec must be of the pages' kind")]
    be.launches.clear()
    for codecs, exc, match in bad:
        with pytest.raises(exc, match=match):
            be.paged_attention(*args, codecs=codecs)
    with pytest.raises(ValueError, match="key_codec must be of the pages' kind float16"):
        be.paged_attention(q, out, _put(np.zeros((4, 2, 8, 64), np.float16)),
                           _put(np.zeros((4, 2, 8, 64), np.float16)), F16, *args[5:],
                           codecs=good)
    assert be.launches == []
    be.paged_attention(*args, codecs=good)
    assert len(be.launches) == 1


# ------------------------------ issue 23: streams, host copies (emulated)

def test_a_cuda_pool_is_filled_before_any_stream_uses_it(emulated_cuda):
    """Issue 23, item 2: the zero fill of a pool's storage (and int8 scales)
    is waited for before the pool is handed out, so a write issued on
    another stream cannot run before it (or be overwritten by it)."""
    import kvcore

    for dtype in ("float16", "int8"):
        del emulated_cuda.fences[:]
        pool = kvcore.BlockPool(8, 4, 2, 2, 16, dtype=dtype, device="cuda")
        planes = 2 if dtype == "int8" else 1   # storage (+ scales)
        assert len(emulated_cuda.fences) >= planes, dtype
        assert not _get(pool.storage).any()


def _claim_tables(be):
    """The owner-table address of every kv_claim_slots launch so far."""
    return [args[0].ctypes.data for name, args in be.launch_args if name == "kv_claim_slots"]


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn", "int8"])
def test_each_layer_writes_through_its_own_slot_owner_table(emulated_cuda, dtype):
    """Issue 23, item 2: two layers written on two streams must not share
    the claim/release state (one write's release would reset the entries
    the other's kernels read, dropping its K/V).  Each layer claims in a
    table of its own, the same table every time (a CUDA graph keeps its
    address), filled on the stream of its first write (nothing copied up);
    the data is the CPU pool's."""
    import kvcore

    kw = {"kv_scales": [(0.5, 2.0)] * 3} if dtype.startswith("float8") else {}
    cpu = kvcore.BlockPool(8, 4, 3, 2, 16, dtype=dtype, **kw)
    gpu = kvcore.BlockPool(8, 4, 3, 2, 16, dtype=dtype, device="cuda", **kw)
    rng = np.random.default_rng(23)
    slots = np.array([3, 7, 3, -1, 30], np.int64)
    for layer in (0, 2, 1, 0, 2):
        k = rng.standard_normal((5, 2, 16)).astype(np.float32)
        v = rng.standard_normal((5, 2, 16)).astype(np.float32)
        cpu.write(layer, k, v, slots)
        gpu.write(layer, _put(k), _put(v), _put(slots) if layer == 1 else slots)
    tables = _claim_tables(emulated_cuda)
    assert len(tables) == 5
    assert len({tables[0], tables[1], tables[2]}) == 3      # one table per layer
    assert tables[3] == tables[0] and tables[4] == tables[1]  # and always the same
    _same(gpu.storage, cpu.storage)
    if dtype == "int8":
        _same(gpu.scales, cpu.scales)


@pytest.mark.parametrize("pinned", [False, True])
def test_copies_between_a_gpu_and_pageable_host_memory_wait(emu_lib, pinned):
    """Issue 23, item 3: copy_blocks_between into (or out of) pageable host
    memory waits for its copies before returning, so the host array may be
    read or reused at once; pinned memory stays asynchronous."""
    be = EmulatedBackend(emu_lib)
    be._is_pinned = lambda h: pinned
    rng = np.random.default_rng(24)
    bits = rand_bits(rng, (2, 6, 2, 4, 8), F16)
    host = np.zeros((2, 6, 2, 4, 8), np.float16)
    dev_storage = _put(bits)
    for src, dst in ((dev_storage, host), (host, dev_storage)):
        del be.fences[:]
        be.copy_blocks_between(src, np.array([1, 2, 5]), dst, np.array([0, 1, 3]))
        assert len(be.fences) == (0 if pinned else 1)
        if dst is host:
            assert_bits_equal(host[:, [0, 1, 3]], bits[:, [1, 2, 5]])
    assert_bits_equal(_get(dev_storage)[:, [0, 1, 3]], host[:, [1, 2, 5]])


# --------------------- issue 23, item 6: attention plan once, run per layer

@pytest.mark.parametrize("kind_name", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("split_keys", [None, 8])   # 8: several splits, merge rows
def test_attention_plan_uploads_once_and_runs_each_layer_with_launches_only(
        emu_lib, monkeypatch, kind_name, split_keys):
    """CudaBackend.attention_plan puts the step's metadata on the device
    once; attention_run then only launches (nothing copied up or down, no
    host sync: what a CUDA graph captures) and gives, layer after layer,
    the bits of paged_attention, which is run(plan(...)), within the
    contract's 1e-5 of the float64 reference."""
    from kvcore import dtypes
    from kvcore.backends.base import fp8_encode
    from kvcore.backends.cuda import attention_kernels
    from kvcore.backends.base import paged_attention_reference

    if split_keys is not None:
        monkeypatch.setattr(attention_kernels, "SPLIT_KEYS", split_keys)
    be = EmulatedBackend(emu_lib)
    kind = dtypes.storage_kind(kind_name)
    rng = np.random.default_rng([60, kind, split_keys or 0])
    tables, lens, qsl, q = _attention_batch(rng)
    num_blocks, kv_heads, bs, dim = 10, 2, 8, 64
    layers, codecs = [], None
    for _ in range(3):
        vals = rng.standard_normal((2, num_blocks, kv_heads, bs, dim)).astype(np.float32)
        if kind == F16:
            pages = vals.astype(np.float16)
        elif kind == BF16:
            pages = (vals.view(np.uint32) >> 16).astype(np.uint16)
        else:
            pages = np.stack([fp8_encode(vals[i], kind, 0.5) for i in (0, 1)])
            codecs = (Codec(kind, 0.5), Codec(kind, 0.5))
        layers.append((pages, _put(pages[0]), _put(pages[1])))
    plan = be.attention_plan(tables, lens, qsl, num_heads=8, num_kv_heads=kv_heads,
                             head_dim=dim, block_size=bs, num_blocks=num_blocks, kind=kind,
                             scale=0.125, sliding_window=30, soft_cap=0.0, num_threads=1)
    assert len(be.uploads) == (6 if split_keys else 5)
    dq = _put(q)
    outs = []
    be.uploads.clear()
    for _, k, v in layers:
        out = _put(np.zeros(q.shape, np.float32))
        be.attention_run(plan, dq, out, k, v, codecs)
        outs.append(_get(out))
    assert be.uploads == [] and be.downloads == []
    merges = [n for n, _, _ in be.launches if n.startswith("kva_attention_merge")]
    assert len(merges) == (3 if split_keys else 0)
    for (pages, k, v), got in zip(layers, outs):
        once = _put(np.zeros(q.shape, np.float32))
        be.paged_attention(dq, once, k, v, kind, tables, lens, qsl, 0.125, 30, 0.0, codecs)
        assert_bits_equal(got, _get(once))
        ref_kw = {} if codecs is None else {"key_scales": 0.5, "value_scales": 0.5}
        want = np.asarray(paged_attention_reference(
            q, pages[0], pages[1], tables, lens, qsl, scale=0.125, sliding_window=30,
            kind=kind_name, **ref_kw))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_attention_run_checks_what_it_is_given_against_the_plan(emu_lib):
    be = EmulatedBackend(emu_lib)
    rng = np.random.default_rng(61)
    tables, lens, qsl, q = _attention_batch(rng)
    plan = be.attention_plan(tables, lens, qsl, num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=8, num_blocks=10, kind=F16, scale=0.125,
                             sliding_window=0, soft_cap=0.0, num_threads=1)
    k = _put(np.zeros((10, 2, 8, 64), np.float16))
    out = _put(np.zeros(q.shape, np.float32))
    with pytest.raises(ValueError, match=r"q must have the planned shape \(4, 8, 64\)"):
        be.attention_run(plan, _put(q[:3]), out, k, k)
    with pytest.raises(ValueError, match=r"key_cache must have the planned shape"):
        be.attention_run(plan, _put(q), out, k[:9], k)
    with pytest.raises(TypeError, match="plan must come from this backend's attention_plan"):
        be.attention_run(object(), _put(q), out, k, k)
    with pytest.raises(ValueError, match="head_dim in"):
        be.attention_plan(tables, lens, qsl, num_heads=8, num_kv_heads=2, head_dim=48,
                          block_size=8, num_blocks=10, kind=F16, scale=0.125,
                          sliding_window=0, soft_cap=0.0, num_threads=1)
    assert not _get(out).any()   # nothing ran
