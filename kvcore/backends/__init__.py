"""Data-movement backends (layer 3).  Internal.

A backend is the one small set of operations the public classes need to
move KV data on a device: convert, write slots, write a sequence's
positions, gather, copy blocks, write a contiguous cache (``base.Backend``
lists them, with a plain NumPy reference implementation that is the oracle
of the tests).  ``cpu`` runs Cython/C kernels; ``cuda`` runs CuPy RawKernels
from ``.cu`` files.  A backend never sees a pool or a sequence, only arrays
and block ids.  Every data op takes the ``Codec`` of the plane it touches
(the storage kind, an fp8 layer scale, an int8 scale plane) and dispatches
on it inside: one op per verb.  The public classes pick a backend once,
from ``device=``, and never branch on the device elsewhere.
"""
from .base import Backend, is_cuda_array
from .codec import Codec, codec_of
from .cpu.backend import CPU, CPUBackend

__all__ = ["Backend", "CPUBackend", "CPU", "Codec", "codec_of", "get_backend",
           "backend_of_array"]


def get_backend(device):
    """The backend for ``device`` ('cpu', 'cuda', 'cuda:N')."""
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {device!r}")
    d = device.strip().lower()
    if d == "cpu":
        return CPU
    if d == "cuda" or d.startswith("cuda:"):
        from .cuda import get_cuda_backend

        return get_cuda_backend(d)
    raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")


def backend_of_array(x):
    """The backend whose device holds array ``x``."""
    if is_cuda_array(x):
        from .cuda import backend_for_array

        return backend_for_array(x)
    return CPU
