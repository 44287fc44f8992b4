"""Optional CUDA backend (CuPy).  Internal.

This is the one module in kvcore that imports CuPy, and it does so lazily:
importing ``kvcore`` or ``kvcore.backends.cuda`` never needs CuPy or a GPU.
``get_cuda_backend`` hands out one ``CudaBackend`` per device, or raises
``CudaUnavailableError`` saying what is missing; ``cuda_available`` answers
without raising (for tests and feature checks).
"""
import re
import threading

from ..._errors import KVCacheError

__all__ = ["CudaUnavailableError", "cuda_available", "get_cuda_backend", "backend_for_array"]


class CudaUnavailableError(KVCacheError, RuntimeError):
    """device='cuda' was asked for but CuPy or a usable NVIDIA GPU is missing,
    or CuPy cannot compile kvcore's kernels (NVRTC or the CUDA headers
    missing, a driver older than NVRTC)."""


_lock = threading.Lock()
_backends = {}           # device id -> CudaBackend
_cupy = None             # the module, once imported
_cupy_error = None       # why importing it failed, once it has
_device_count = None     # cached after the first successful query

_DEVICE = re.compile(r"^cuda(?::(\d+))?$")

# The oldest CuPy kvcore runs on.  CuPy 13.x opens NVRTC by library name only,
# so it does not find the libnvrtc that cuda-toolkit[nvrtc] (kvcore's cuda12 /
# cuda13 extras) installs into site-packages: the first kernel would fail.
# CuPy 13.0-14.0.x also skip the on-disk kernel cache for kvcore's modules,
# so every process would recompile every kernel.  (pyproject.toml's extras
# ask for the same.)
CUPY_MIN_VERSION = (14, 1)


def cupy_version_problem(version):
    """Why CuPy ``version`` (its ``__version__``) cannot run kvcore, or None.

    A version string that does not start with ``MAJOR.MINOR`` is let
    through (a development build names itself as it likes)."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if m is None or (int(m.group(1)), int(m.group(2))) >= CUPY_MIN_VERSION:
        return None
    need = ".".join(map(str, CUPY_MIN_VERSION))
    return (f"CuPy {version} is too old: kvcore needs CuPy >= {need} (older CuPy does not "
            "find the NVRTC that pip installs, and skips its kernel cache for kvcore's "
            f"kernels); pip install -U 'cupy-cuda12x>={need}' (or cupy-cuda13x), or "
            "'kvcore[cuda12]' / 'kvcore[cuda13]'")


def _import_cupy(device):
    """The CuPy module, or CudaUnavailableError naming what went wrong."""
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy
        except Exception as e:  # ImportError, or a CuPy whose CUDA libraries fail to load
            _cupy_error = e
        else:
            problem = cupy_version_problem(getattr(cupy, "__version__", ""))
            if problem is None:
                _cupy = cupy
            else:
                _cupy_error = CudaUnavailableError(problem)
    if _cupy is None:
        e = _cupy_error
        if isinstance(e, CudaUnavailableError):  # a CuPy too old
            raise CudaUnavailableError(f"device={device!r}: {e}; or use device='cpu'")
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cupy":
            why = "CuPy is not installed"
        else:
            why = f"CuPy failed to import ({type(e).__name__}: {e})"
        raise CudaUnavailableError(
            f"device={device!r} needs CuPy and an NVIDIA GPU, but {why}; install CuPy for "
            "your driver's CUDA version with the NVRTC and headers it compiles with (pip "
            "install 'kvcore[cuda12]' or 'kvcore[cuda13]'; keep one CuPy package), "
            "or use device='cpu'") from e
    return _cupy


def _count_devices(cp, device):
    global _device_count
    if _device_count is None:
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as e:  # no driver, driver too old, no device node, ...
            raise CudaUnavailableError(
                f"device={device!r} needs CuPy and an NVIDIA GPU: CuPy {cp.__version__} is "
                f"installed but CUDA reports no usable device ({type(e).__name__}: {e}); "
                "use device='cpu'") from e
        if count <= 0:
            raise CudaUnavailableError(
                f"device={device!r} needs CuPy and an NVIDIA GPU: CuPy {cp.__version__} is "
                "installed but no CUDA device is visible (check the driver and "
                "CUDA_VISIBLE_DEVICES); use device='cpu'")
        _device_count = count
    return _device_count


def get_cuda_backend(device="cuda"):
    """The ``CudaBackend`` of ``device`` ('cuda' or 'cuda:N'), cached per device.

    'cuda' means CuPy's current device (as in PyTorch).

    Raises
    ------
    CudaUnavailableError
        CuPy is missing or fails to import, no GPU is visible, or device N
        does not exist.
    ValueError
        ``device`` is not of the form 'cuda' / 'cuda:N'.
    """
    m = _DEVICE.match(device.strip().lower()) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"device must be 'cuda' or 'cuda:N', got {device!r}")
    cp = _import_cupy(device)
    count = _count_devices(cp, device)
    if m.group(1) is None:
        index = int(cp.cuda.runtime.getDevice())
    else:
        index = int(m.group(1))
    if index >= count:
        raise CudaUnavailableError(
            f"device={device!r}: there is no CUDA device {index} ({count} visible)")
    be = _backends.get(index)
    if be is None:
        with _lock:
            be = _backends.get(index)
            if be is None:
                from .backend import CudaBackend

                be = _backends[index] = CudaBackend(cp, index)
    return be


def backend_for_array(x):
    """The backend of the GPU holding CUDA array ``x`` (CuPy arrays carry
    their device; other CUDA arrays get the current device's backend)."""
    dev = getattr(x, "device", None)
    index = getattr(dev, "id", None)
    if isinstance(index, int):
        return get_cuda_backend(f"cuda:{index}")
    return get_cuda_backend("cuda")


def cuda_available():
    """True when CuPy imports and at least one CUDA device is visible.

    Never raises.  Kernels are compiled (NVRTC) only on first use, so this
    does not prove that compilation works: when it does not, the first
    kernel raises ``CudaUnavailableError`` saying what to install.
    """
    try:
        cp = _import_cupy("cuda")
        return _count_devices(cp, "cuda") > 0
    except Exception:
        return False
