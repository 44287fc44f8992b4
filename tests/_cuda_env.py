"""When a GPU test may skip: only when CuPy is not installed, or when no
NVIDIA device is visible.

Anything else on a machine that has both (CuPy failing to import, e.g. a
warning made an error by pytest's ``filterwarnings = error``; a driver too
old for CuPy's CUDA; a missing NVRTC) is a broken GPU setup, and the tests
must fail saying so rather than skip: a skipped GPU suite looks like a
passing one.

Whether a device is visible is asked of the NVIDIA driver directly
(libcuda through ctypes), not of CuPy, so that a CuPy that cannot start
cannot hide the GPU.  Every skip reason starts with ``SKIP_REASON`` (the
GPU smoke script looks for it).
"""
import ctypes
import functools
import importlib.util
import sys

import pytest

SKIP_REASON = "needs CuPy and an NVIDIA GPU"

# CUresult values (cuda.h)
CUDA_SUCCESS = 0
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100

_DRIVER_LIBS = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def cupy_installed():
    """Whether a ``cupy`` package is installed (importing it is not tried)."""
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):
        return False


def driver_status(load=ctypes.CDLL):
    """``(visible, detail)``: whether the NVIDIA driver reports a device.

    Not visible: no driver library loads, the driver is the toolkit's stub,
    or it reports no device (``CUDA_VISIBLE_DEVICES`` included).  A driver
    that loads but fails otherwise counts as visible: a GPU machine with a
    broken driver must not pass for a machine without a GPU.  ``load``
    opens a library by name (ctypes.CDLL; tests pass a stand-in).
    """
    for name in _DRIVER_LIBS:
        try:
            lib = load(name)
        except OSError:
            continue
        rc = lib.cuInit(0)
        if rc == CUDA_ERROR_NO_DEVICE:
            return False, "the NVIDIA driver reports no device (see CUDA_VISIBLE_DEVICES)"
        if rc == CUDA_ERROR_STUB_LIBRARY:
            return False, f"{name} is the CUDA toolkit's stub, not a driver"
        if rc != CUDA_SUCCESS:
            return True, f"the NVIDIA driver ({name}) is installed but cuInit failed ({rc})"
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
        if rc != CUDA_SUCCESS:
            return True, f"the NVIDIA driver ({name}) failed to count devices ({rc})"
        if count.value <= 0:
            return False, "the NVIDIA driver reports no device"
        return True, f"the NVIDIA driver reports {count.value} device(s)"
    return False, "no NVIDIA driver is installed (libcuda does not load)"


@functools.lru_cache(maxsize=None)
def _machine():
    return cupy_installed(), driver_status()


def decide(installed, visible, detail, get_backend, device="cuda",
           allow_module_level=False):
    """The backend of ``device``, or a skip (no CuPy, no device), or a
    failure (both present, backend unusable).  ``get_backend(device)``
    returns the backend or raises."""
    if not installed:
        pytest.skip(f"{SKIP_REASON}: CuPy is not installed",
                    allow_module_level=allow_module_level)
    if not visible:
        pytest.skip(f"{SKIP_REASON}: {detail}", allow_module_level=allow_module_level)
    try:
        return get_backend(device)
    except Exception as e:
        pytest.fail(
            f"CuPy is installed and {detail}, but kvcore's CUDA backend for {device!r} is "
            f"unusable, so the GPU tests cannot run: {type(e).__name__}: {e}", pytrace=False)


def cuda_backend_or_skip(device="cuda", allow_module_level=False):
    """This machine's CUDA backend for a GPU test; see ``decide``."""
    from kvcore.backends.cuda import get_cuda_backend

    installed, (visible, detail) = _machine()
    return decide(installed, visible, detail, get_cuda_backend, device, allow_module_level)
