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

This package is the backends layer's one door: the public layer imports
what it needs from here (``tests/project/test_layers.py`` checks it never reaches
into ``cpu``, ``cuda`` or a private module).  Besides the backends it
exports a few host-side helpers that serve every device:

* ``xxh3_64(data, seed)``: XXH3-64 of host bytes, the prefix-store entries'
  checksum (the CPU kernel, SIMD by run-time dispatch);
* ``tensor_view(t)``: a NumPy view of a C-contiguous CPU torch tensor, or
  None (the cheap first try of ``kvcore._arrays``);
* ``owned_index_arrays(...)``: a plan's own read-only copies of a step's
  index arrays (every plan, public or backend, holds these);
* ``host_address(a)``, ``first_moved(held)``: a NumPy array's address, and
  which of ``(array, address, nbytes)`` entries no longer has them (the
  check of a plan over NumPy planes resized in place), each at C speed;
  ``runs_no_code(*args)``: whether converting the arguments surely runs
  none of the caller's code (then a call needs no such check of its inputs);
* ``simd_levels()``, ``set_simd_level()``, ``CudaUnavailableError``, ``cuda_available()``: what
  ``kvcore`` exports about the devices.
"""
from .base import Backend, is_cuda_array, owned_index_arrays
from .codec import Codec, codec_of
from .cpu import set_simd_level, simd_levels
from .cpu._attention import address as host_address, first_moved
from .cpu._checksum import xxh3_64
from .cpu._kernels import runs_no_code, tensor_view
from .cpu.backend import CPU, CPUBackend
from .cuda import CudaUnavailableError, cuda_available

__all__ = ["Backend", "CPUBackend", "CPU", "Codec", "codec_of", "get_backend",
           "backend_of_array", "owned_index_arrays", "host_address", "first_moved", "runs_no_code", "xxh3_64", "tensor_view", "simd_levels",
           "set_simd_level", "CudaUnavailableError", "cuda_available"]


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
