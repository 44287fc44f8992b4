"""The optional-CuPy guard (kvcore/_cuda/__init__.py), on any machine.

CuPy's presence and the GPU count are simulated (a None entry in
sys.modules, a stand-in module), so these run the same with or without a
real GPU.
"""
import subprocess
import sys
import types

import pytest

import kvcore
import kvcore._cuda as kc
from kvcore._backend import get_backend


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
    code = ("import sys, kvcore, kvcore._cuda, kvcore._backend; "
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


def test_one_backend_per_device(fresh_guard):
    fresh_guard.setitem(sys.modules, "cupy", _fake_cupy(2, current=1))
    assert kc.cuda_available() is True
    be = kc.get_cuda_backend("cuda")  # the current device
    assert be.device == "cuda:1" and be.name == "cuda"
    assert kc.get_cuda_backend("cuda:1") is be is get_backend("cuda:1")
    assert kc.get_cuda_backend("cuda:0").device == "cuda:0"
    with pytest.raises(kc.CudaUnavailableError, match="no CUDA device 2"):
        kc.get_cuda_backend("cuda:2")
