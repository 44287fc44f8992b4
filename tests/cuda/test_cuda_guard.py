"""The optional-CuPy guard (kvcore/backends/cuda/__init__.py), on any machine.

CuPy's presence and the GPU count are simulated (a None entry in
sys.modules, a stand-in module), so these run the same with or without a
real GPU.
"""
import importlib.abc
import importlib.util
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

import kvcore
import kvcore.backends.cuda as kc
from kvcore.backends import get_backend


@pytest.fixture
def fresh_guard(monkeypatch):
    """The guard with its caches empty, restored afterwards."""
    monkeypatch.setattr(kc, "_cupy", None)
    monkeypatch.setattr(kc, "_cupy_error", None)
    monkeypatch.setattr(kc, "_device_count", None)
    monkeypatch.setattr(kc, "_backends", {})
    return monkeypatch


def _fake_cupy(count=None, error=None, current=0):
    def get_device_count():
        if error is not None:
            raise error
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_device_count, getDevice=lambda: current)
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i: ("device", i))
    return types.SimpleNamespace(__version__="99.0-fake", cuda=cuda, ndarray=type("nd", (), {}))


def test_importing_kvcore_does_not_import_cupy():
    code = ("import sys, kvcore, kvcore.backends.cuda, kvcore.backends; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_without_cupy_the_error_says_what_is_missing(fresh_guard):
    fresh_guard.setitem(sys.modules, "cupy", None)  # `import cupy` fails
    assert kc.cuda_available() is False
    for device in ("cuda", "cuda:1", " CUDA "):
        with pytest.raises(kc.CudaUnavailableError, match="needs CuPy and an NVIDIA GPU") as e:
            get_backend(device)
        assert "CuPy" in str(e.value) and "device='cpu'" in str(e.value)
        assert isinstance(e.value, kvcore.KVCacheError) and isinstance(e.value, RuntimeError)


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "gpu", "cuda:-1", 3])
def test_malformed_devices_are_value_or_type_errors(device):
    with pytest.raises((ValueError, TypeError)):
        kc.get_cuda_backend(device)


@pytest.mark.parametrize("count,error,match", [
    (None, RuntimeError("cudaErrorInsufficientDriver"), "no usable device"),
    (0, None, "no CUDA device is visible"),
])
def test_cupy_without_a_gpu(fresh_guard, count, error, match):
    fresh_guard.setitem(sys.modules, "cupy", _fake_cupy(count, error))
    assert kc.cuda_available() is False
    with pytest.raises(kc.CudaUnavailableError, match=match):
        kc.get_cuda_backend("cuda")


@pytest.mark.parametrize("version", ["13.0.0", "13.6.0", "14.0.2", "12.3.0"])
def test_a_cupy_older_than_14_1_is_refused_saying_why(fresh_guard, version):
    """CuPy 13.x cannot find pip's NVRTC and 13.0-14.0.x skip their kernel
    cache for kvcore's modules (issue 23, item 1): refused at the first
    device='cuda', with the version, the minimum and the fix."""
    cp = _fake_cupy(1)
    cp.__version__ = version
    fresh_guard.setitem(sys.modules, "cupy", cp)
    assert kc.cuda_available() is False
    for _ in range(2):  # the verdict is cached, and raised again each time
        with pytest.raises(kc.CudaUnavailableError,
                           match=rf"CuPy {version} is too old: kvcore needs CuPy >= 14\.1") as e:
            kc.get_cuda_backend("cuda")
        assert "pip install" in str(e.value) and "device='cpu'" in str(e.value)


@pytest.mark.parametrize("version", ["14.1.0", "14.2.0", "15.0.0a1", "99.0-fake", "dev"])
def test_cupy_14_1_and_later_are_accepted(fresh_guard, version):
    cp = _fake_cupy(1)
    cp.__version__ = version
    fresh_guard.setitem(sys.modules, "cupy", cp)
    assert kc.get_cuda_backend("cuda").device == "cuda:0"


def test_the_extras_ask_for_the_cupy_the_guard_accepts():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    need = ".".join(map(str, kc.CUPY_MIN_VERSION))
    for extra in ("cuda12", "cuda13"):
        cupy = [r for r in extras[extra] if r.startswith("cupy-")]
        assert cupy and all(r.endswith(f">={need}") for r in cupy), (extra, cupy)


def test_one_backend_per_device(fresh_guard):
    fresh_guard.setitem(sys.modules, "cupy", _fake_cupy(2, current=1))
    assert kc.cuda_available() is True
    be = kc.get_cuda_backend("cuda")  # the current device
    assert be.device == "cuda:1" and be.name == "cuda"
    assert kc.get_cuda_backend("cuda:1") is be is get_backend("cuda:1")
    assert kc.get_cuda_backend("cuda:0").device == "cuda:0"
    with pytest.raises(kc.CudaUnavailableError, match="no CUDA device 2"):
        kc.get_cuda_backend("cuda:2")


# ------------------------------------------------- when GPU tests may skip

try:  # tests/ as a package or as a plain directory on sys.path
    from . import _cuda_env
except ImportError:
    import _cuda_env


class _FakeDriver:
    """libcuda as ctypes sees it: cuInit's result and the device count."""

    def __init__(self, init_rc=0, count=1, count_rc=0):
        self.init_rc, self.count, self.count_rc = init_rc, count, count_rc

    def cuInit(self, flags):
        return self.init_rc

    def cuDeviceGetCount(self, ref):
        ref._obj.value = self.count
        return self.count_rc


def _loader(driver):
    def load(name):
        if driver is None:
            raise OSError(f"{name}: cannot open shared object file")
        return driver
    return load


@pytest.mark.parametrize("driver,visible,words", [
    (None, False, "no NVIDIA driver"),
    (_FakeDriver(init_rc=_cuda_env.CUDA_ERROR_NO_DEVICE), False, "no device"),
    (_FakeDriver(init_rc=_cuda_env.CUDA_ERROR_STUB_LIBRARY), False, "stub"),
    (_FakeDriver(count=0), False, "no device"),
    (_FakeDriver(count=2), True, "2 device(s)"),
    (_FakeDriver(init_rc=999), True, "cuInit failed (999)"),        # broken driver
    (_FakeDriver(count_rc=3), True, "failed to count devices (3)"),
])
def test_driver_status_asks_the_driver_not_cupy(driver, visible, words):
    got, detail = _cuda_env.driver_status(_loader(driver))
    assert got is visible and words in detail


def _backend_ok(device):
    return ("backend", device)


def _backend_broken(device):
    # what kvcore raises when `import cupy` warned under filterwarnings=error
    raise kc.CudaUnavailableError(
        f"device={device!r} needs CuPy and an NVIDIA GPU, but CuPy failed to import "
        "(UserWarning: CuPy may not function correctly because multiple CuPy packages "
        "are installed)")


@pytest.mark.parametrize("installed,visible", [(False, False), (False, True), (True, False)])
def test_gpu_tests_skip_only_without_cupy_or_without_a_device(installed, visible):
    with pytest.raises(pytest.skip.Exception) as e:
        _cuda_env.decide(installed, visible, "the NVIDIA driver reports no device",
                         _backend_broken)
    reason = str(e.value)
    assert reason.startswith(_cuda_env.SKIP_REASON)
    assert ("CuPy is not installed" in reason) is (not installed)


def test_gpu_tests_fail_when_cupy_and_a_device_are_there_but_the_backend_is_not():
    with pytest.raises(pytest.fail.Exception) as e:
        _cuda_env.decide(True, True, "the NVIDIA driver reports 1 device(s)", _backend_broken)
    msg = str(e.value)
    assert "unusable" in msg and "multiple CuPy packages" in msg
    assert not msg.startswith(_cuda_env.SKIP_REASON)  # the smoke script would call it a skip


def test_gpu_tests_run_when_the_backend_works():
    assert _cuda_env.decide(True, True, "1 device", _backend_ok, "cuda:0") == ("backend", "cuda:0")


class _WarningCupyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a `cupy` whose import warns, as CuPy does when two CuPy
    packages are installed."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "cupy" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        warnings.warn("CuPy may not function correctly because multiple CuPy packages are "
                      "installed", UserWarning)


def test_a_warning_while_importing_cupy_fails_the_gpu_tests(fresh_guard):
    """The whole chain: `import cupy` warns, pytest's filterwarnings=error
    makes that an exception, kvcore reports the backend unusable, and with
    a device visible the GPU tests fail instead of skipping."""
    fresh_guard.delitem(sys.modules, "cupy", raising=False)
    fresh_guard.setattr(sys, "meta_path", [_WarningCupyFinder(), *sys.meta_path])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kc.cuda_available() is False
        with pytest.raises(pytest.fail.Exception, match="multiple CuPy packages"):
            _cuda_env.decide(True, True, "1 device", kc.get_cuda_backend)


# ------------------------------------------------- kernel compile failures

class _CompileException(Exception):
    """Stands in for cupy.cuda.compiler.CompileException (matched by name)."""


_CompileException.__name__ = "CompileException"


class _CUDADriverError(RuntimeError):
    pass


_CUDADriverError.__name__ = "CUDADriverError"


def _backend_whose_compile_raises(error):
    from kvcore.backends.cuda.backend import CudaBackend

    class Module:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def get_function(self, name):
            raise error

    cupy = _fake_cupy(1)
    cupy.RawModule = Module
    return CudaBackend(cupy, 0)


@pytest.mark.parametrize("error,why,fix", [
    (RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open "
                  "shared object file: No such file or directory"),
     "NVRTC (libnvrtc), which compiles kvcore's kernels, is missing", "kvcore[cuda12]"),
    (RuntimeError("Failed to find CUDA headers. Please install CUDA toolkit headers (e.g., pip "
                  "install cupy-cuda12x[ctk]) or specify CUDA_PATH environment variable."),
     "the CUDA headers NVRTC needs were not found", "cuda-toolkit[nvrtc,cudart]"),
    (_CompileException('kvcore.cu(1): catastrophic error: cannot open source file '
                       '"cuda_fp16.h"'),
     "the CUDA headers NVRTC needs were not found", "kvcore[cuda13]"),
    (_CompileException("nvrtc: error: failed to open libnvrtc-builtins.so.13.0."),
     "NVRTC (libnvrtc), which compiles kvcore's kernels, is missing", "CUDA_PATH"),
    (_CUDADriverError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with "
                      "an unsupported toolchain."),
     "the NVIDIA driver could not load the kernels", "update the NVIDIA driver"),
    (_CompileException("paged.cu(40): error: identifier \"x\" is undefined"),
     "NVRTC failed to compile kvcore's kernels", "please report"),
])
def test_kernel_compile_failures_are_cuda_unavailable_errors(error, why, fix):
    be = _backend_whose_compile_raises(error)
    from kvcore.backends.cuda import _sources

    name = _sources.kernel_name("kv_write_slots", 1, 1, 8)
    with pytest.raises(kc.CudaUnavailableError) as e:
        be.launcher.function("paged.cu", 1, 1, name)
    msg = str(e.value)
    assert why in msg and fix in msg and "paged.cu" in msg and "device='cpu'" in msg
    assert str(error) in msg          # CuPy's own words are kept
    assert e.value.__cause__ is error
    assert isinstance(e.value, kvcore.KVCacheError)
    # nothing half-built is cached: the next call tries again
    assert not be.launcher._functions and not be.launcher._modules


def test_backend_holds_its_launcher_rather_than_inheriting_it():
    """Issue 43: CudaBackend by composition.  The launch machinery (NVRTC
    modules, launches, packed launches, pinned staging) is one object the
    backend holds and hands to its parts, not a base class."""
    from kvcore.backends.cuda.backend import CudaBackend
    from kvcore.backends.cuda.launch import CudaLaunches

    be = CudaBackend(_fake_cupy(1), 0)
    assert not isinstance(be, CudaLaunches)
    assert isinstance(be.launcher, CudaLaunches)
    for name in ("_launch", "_launch_grid", "_run_packed", "_function", "_pinned",
                 "collect_launches"):
        assert not hasattr(be, name), name


def test_attention_modules_hold_one_page_kind_each():
    """kernels/attention.cu is compiled per (kernel family, page kind) plus
    one module of merge kernels: a call over float16 pages never compiles
    the fp8 / int8 instantiations, nor the tensor-core decode when it runs
    the float32 kernels, and each module is built once."""
    from kvcore.backends.cuda import attention_kernels as ak
    from kvcore.backends.cuda.backend import CudaBackend
    from kvcore.dtypes import F16, I8

    built = []

    class Module:
        def __init__(self, **kwargs):
            built.append(kwargs["name_expressions"])
            self.names = kwargs["name_expressions"]

        def get_function(self, name):
            assert name in self.names
            return ("fn", name)

    cupy = _fake_cupy(1)
    cupy.RawModule = Module
    be = CudaBackend(cupy, 0)
    file = ak.ATTENTION_FILE.name
    for kind in (F16, I8):
        for d in (64, 128):
            assert be.launcher.function(file, None, None, ak.split_name(kind, d)) == \
                ("fn", ak.split_name(kind, d))
        assert be.launcher.function(file, None, None, ak.merge_name(64)) == \
            ("fn", ak.merge_name(64))
    assert be.launcher.function(file, None, None, ak.tc_name(F16, 128, F16)) == \
        ("fn", ak.tc_name(F16, 128, F16))
    assert built == [ak.module_names((ak.CORE, F16)), ak.module_names(ak.MERGE_MODULE),
                     ak.module_names((ak.CORE, I8)), ak.module_names((ak.TC, F16))]
    assert {ak.module_key(n) for n in built[0]} == {(ak.CORE, F16)}
    assert {ak.split_name(F16, d) for d in ak.HEAD_DIMS} <= set(built[0])
    assert {ak.module_key(n) for n in built[3]} == {(ak.TC, F16)}
    # every instantiation is in exactly one module
    every = [n for _, names in ak.modules() for n in names]
    assert sorted(every) == sorted(ak.attention_names())


# --------------------------------- uploads staged through pinned memory

class _FakeEvent:
    def __init__(self):
        self.done = False


class _FakeStream:
    ptr = 0

    def __init__(self):
        self.events = []

    def record(self):
        self.events.append(_FakeEvent())
        return self.events[-1]


def _staging_cupy():
    """A stand-in CuPy recording what ``ndarray.set`` is handed."""
    stream = _FakeStream()
    pinned, sets = [], []

    class Dev:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

        def set(self, arr, stream=None):
            sets.append((arr, stream))

    def alloc_pinned_memory(nbytes):
        pinned.append(bytearray(nbytes))
        return pinned[-1]

    cuda = types.SimpleNamespace(Device=lambda i: ("device", i),
                                 get_current_stream=lambda: stream,
                                 alloc_pinned_memory=alloc_pinned_memory)
    cp = types.SimpleNamespace(cuda=cuda, ndarray=Dev, empty=Dev, __version__="14.2.0")
    return cp, stream, pinned, sets


def test_uploads_are_staged_through_pinned_memory_kept_until_the_copy_is_done():
    """Issue 23, item 3 (CuPy issue #6785): ``ndarray.set`` from pageable
    host memory may still read it after the call returns.  Every upload
    copies into a pinned buffer, hands that to ``set`` on the current
    stream, and holds it until the copy's event completes."""
    from kvcore.backends.cuda.backend import CudaBackend

    cp, stream, pinned, sets = _staging_cupy()
    be = CudaBackend(cp, 0)
    h = np.arange(12, dtype=np.int64).reshape(3, 4)
    d = be._upload(h)
    assert (d.shape, d.dtype) == ((3, 4), np.int64)
    (arr, on), = sets
    assert on is stream and len(pinned) == 1
    assert np.shares_memory(arr, np.frombuffer(pinned[0], np.uint8))  # the pinned copy
    assert not np.shares_memory(arr, h)
    np.testing.assert_array_equal(arr, h)
    h[...] = -1                               # reusing the source changes nothing staged
    np.testing.assert_array_equal(arr, np.arange(12).reshape(3, 4))
    # held while its copy is in flight, let go once the event is done
    assert [b for _, b in be._staged] == [pinned[0]]
    stream.events[0].done = True
    be._upload(np.zeros(2, np.int32))
    assert [b for _, b in be._staged] == [pinned[1]]


def test_packed_launch_writes_the_kernel_parameter_block():
    """An attention PackedLaunch (kvcore/backends/cuda/attention.py): its
    parameter block is one 8-byte slot per argument (pointers, long longs,
    floats in the low 4 bytes), the fixed ones written once, the holes per
    call, and the launch is one cuLaunchKernel with the block's address
    table, on the current stream, with the kernel's dynamic shared memory
    allowed once."""
    import ctypes

    import numpy as np

    from kvcore.backends.cuda import attention_kernels as ak
    from kvcore.backends.cuda.attention import Hole, PackedLaunch
    from kvcore.backends.cuda.backend import CudaBackend

    class Arr:
        def __init__(self, ptr):
            self.data = types.SimpleNamespace(ptr=ptr)

    calls, attrs = [], []

    class Fn:
        kernel = types.SimpleNamespace(ptr=0xF00D)

        def __setattr__(self, name, value):
            attrs.append((name, value))

    cupy = _fake_cupy(1)
    cupy.ndarray = Arr
    cupy.cuda.driver = types.SimpleNamespace(launchKernel=lambda *a: calls.append(a))
    be = CudaBackend(cupy, 0)
    be.launcher.function = lambda file, sk, dk, name: Fn()
    be._stream_ptr = lambda: 0x5EED
    fixed = Arr(0x1000)
    launch = PackedLaunch(be, ak.ATTENTION_FILE.name, "kernel", 7, 128,
                          [Hole("out", "p"), fixed, None, -3, 0.5, Hole("n", "i"),
                           Hole("x", "f")], smem=60000)
    for out, n, x in ((0x2000, 9, 2.5), (0x3000, -1, -0.25)):
        launch({"out": Arr(out), "n": n, "x": x})
        (fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra) = calls[-1]
        assert (fn, gx, gy, gz, bx, by, bz, smem, stream, extra) == \
            (0xF00D, 7, 1, 1, 128, 1, 1, 60000, 0x5EED, 0)
        table = (ctypes.c_uint64 * 7).from_address(params)
        slot = [ctypes.c_uint64.from_address(a).value for a in table]
        assert slot[:4] == [out, 0x1000, 0, (-3) % 2 ** 64]
        assert np.uint32(slot[4] & 0xFFFFFFFF).view(np.float32) == np.float32(0.5)
        assert slot[5] == n % 2 ** 64
        assert np.uint32(slot[6] & 0xFFFFFFFF).view(np.float32) == np.float32(x)
    assert attrs == [("max_dynamic_shared_size_bytes", 60000)]   # once
