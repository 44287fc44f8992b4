"""The CUDA backend with its kernels run on the host (no GPU, no CuPy needed).

Every kernel in ``kvcore/_cuda/kernels`` is a thin ``__global__`` loop that
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

Not covered here (see test_cuda_backend.py, which runs on a GPU): CuPy
itself, NVRTC, streams and concurrency.
"""
import contextlib
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from kvcore._cuda import _sources
from kvcore._cuda.backend import CudaBackend, launch_shape
from kvcore._dtypes import BF16, F16, F32

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_cases import *  # noqa: F401,F403
    from ._cuda_cases import DeviceUnderTest, rand_bits
except ImportError:
    from _cuda_cases import *  # noqa: F401,F403
    from _cuda_cases import DeviceUnderTest, rand_bits

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


class EmulationLibrary:
    """Every instantiation the backend can ask for, compiled for the host."""

    def __init__(self, path, names):
        self._lib = ctypes.CDLL(str(path))
        self._lib.kvemu_take_misaligned.restype = ctypes.c_longlong
        self.index = {name: i for i, name in enumerate(names)}
        self._fns, self._sigs = {}, {}

    def signature(self, name):
        sig = self._sigs.get(name)
        if sig is None:
            f = getattr(self._lib, f"kvemu_{self.index[name]}_sig")
            f.restype = ctypes.c_int
            buf = (ctypes.c_int * 64)()
            n = f(buf)
            sig = self._sigs[name] = tuple(buf[:n])
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


def build_emulation(tmpdir):
    names, parts = [], [_sources.source(f) for f in _sources.FILES]
    parts.append(_HARNESS)
    for _file, _sk, _dk, module_names in _sources.modules():
        for name in module_names:
            k = len(names)
            names.append(name)
            item = name.replace("<", "_item<", 1)
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


class EmulatedBackend(CudaBackend):
    """CudaBackend whose launches run the kernels' item functions on the host."""

    def __init__(self, lib):  # no super().__init__: there is no CuPy here
        self._cp = None
        self.xp = np
        self.device_id = 0
        self.device = "cuda:0"
        self._lib = lib
        self.launches = []

    def _ctx(self):
        return contextlib.nullcontext()

    def _ptr(self, a):
        return a.ctypes.data

    def _is_device(self, a):
        return isinstance(a, DevArray)

    def _device_id_of(self, a):
        return 0

    def _index_array(self, x, dtype):
        return np.ascontiguousarray(x, dtype=dtype)

    def _launch(self, file, sk, dk, name, rows, chunks, args):
        assert name in _sources.module_names(file, sk, dk), (file, sk, dk, name)
        sig = self._lib.signature(name)
        assert len(sig) == len(args), (
            f"{name}: kernel takes {len(sig)} arguments, given {len(args)}")
        keep, params = [], (ctypes.c_void_p * max(1, len(args)))()
        for k, (code, a) in enumerate(zip(sig, args)):
            if code == 0:
                assert isinstance(a, (int, np.integer)) and not isinstance(a, bool), (name, k, a)
                v = ctypes.c_longlong(int(a))
            else:
                assert isinstance(a, np.ndarray), (name, k, type(a))
                # copy kernels see storage as words of any width; ids are int32
                if file != _sources.COPY_FILE or a.dtype == np.int32:
                    assert a.itemsize == code, (
                        f"{name}: argument {k} is {a.dtype}, kernel wants {code}-byte elements")
                v = ctypes.c_void_p(a.ctypes.data)
            keep.append(v)
            params[k] = ctypes.addressof(v)
        self.launches.append((name, rows, chunks))
        if rows <= 0 or chunks <= 0:
            return
        self._lib.run(name, rows, chunks, params)
        bad = self._lib.take_misaligned()
        assert bad == 0, f"{name}: {bad} vector accesses were not 16-byte aligned"


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a C++17 compiler")
    return build_emulation(tmp_path_factory.mktemp("cuda_emulation"))


@pytest.fixture
def dev(emu_lib):
    return DeviceUnderTest(EmulatedBackend(emu_lib), _put, _get, 1 << 20)


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
    dev.be.write_slots(cache, flat[offset:].reshape(src.shape), np.arange(5), sk, dk)
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
