"""Arrays crossing into ``CudaBackend``: CuPy arrays as they are, torch CUDA
tensors from their raw fields, anything else through DLPack or
``__cuda_array_interface__`` (zero-copy, never from host memory); host data
read as NumPy reads it; bfloat16 held on the device as its uint16 bits.
"""
import sys

import numpy as np

from ... import dtypes

# DLPack device types (dlpack.h).
_KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 2, 3, 13
_KDL_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan",
              8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host", 13: "CUDA managed",
              14: "oneAPI"}


def device_array(be, x, arg):
    """``x`` as a CuPy array on this device, zero-copy.

    CuPy arrays are returned as they are; objects with
    ``__dlpack__`` on a CUDA device or ``__cuda_array_interface__``
    (torch CUDA tensors, Numba, JAX, ...) are wrapped without a copy.  A
    NumPy array, or anything else in host memory, is a TypeError naming
    ``arg``: kvcore never copies between host and device behind the
    caller's back.  An array on another GPU is a ValueError.
    """
    cp = be._cp
    if isinstance(x, cp.ndarray):
        a = x
    elif isinstance(x, np.ndarray):
        raise TypeError(
            f"{arg} is a NumPy array in host memory but this operation runs on "
            f"{be.device}; pass a CUDA array (e.g. cupy.asarray({arg})) or use "
            "device='cpu' (kvcore never copies between host and device implicitly)")
    else:
        a = import_torch(be, x)
        if a is None:
            a = import_foreign(be, x, arg)
    if be._device_id_of(a) != be.device_id:
        raise ValueError(
            f"{arg} is on cuda:{be._device_id_of(a)} but this operation runs on "
            f"{be.device}")
    return a


def import_torch(be, x):
    """A torch CUDA tensor as a CuPy array from its pointer, shape and
    strides (no DLPack capsule: several times cheaper per call), or None
    for anything else, and for a tensor whose stream order DLPack would
    have to bridge (torch's current stream on its device is not CuPy's
    current stream) or that DLPack would refuse (negative or conjugate
    bit, a dtype CuPy has not).  Nothing is cached: the tensor's fields
    are read at each call (its storage may be resized or swapped)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or not x.is_cuda:
        return None
    dtype = _torch_numpy_dtypes(torch).get(x.dtype)
    if dtype is None or x.is_neg() or x.is_conj() or x.requires_grad:
        return None
    index = x.device.index
    if index != be.device_id \
            or torch.cuda.current_stream(index).cuda_stream != be._stream_ptr():
        return None
    ptr = x.data_ptr()
    if ptr == 0 and x.numel():
        return None
    size = dtype.itemsize
    return be.wrap_pointer(ptr, x.shape, [st * size for st in x.stride()], dtype, x)


def import_foreign(be, x, arg):
    cp = be._cp
    what = f"{type(x).__module__}.{type(x).__name__}"
    problem = None
    dl_device = None
    if hasattr(type(x), "__dlpack_device__"):
        try:
            dl_device = x.__dlpack_device__()
        except Exception as e:  # e.g. a tensor that refuses export
            problem = f"__dlpack_device__ failed: {e}"
    if dl_device is not None:
        dev_type = int(dl_device[0])
        if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            where = _KDL_NAMES.get(dev_type, f"type {dev_type}")
            raise TypeError(
                f"{arg} ({what}) lives on DLPack device {where}, not a CUDA device; "
                f"this operation runs on {be.device} and kvcore never copies host "
                "data to the device implicitly")
        try:
            return cp.from_dlpack(x)
        except Exception as e:  # unsupported dtype (bfloat16 tensors), ...
            problem = f"DLPack import failed: {e}"
    try:
        cai = x.__cuda_array_interface__
    except Exception as e:  # AttributeError, or a tensor that requires grad
        cai = None
        if not isinstance(e, AttributeError) and problem is None:
            problem = f"__cuda_array_interface__ failed: {e}"
    if cai is not None:
        try:
            return cp.asarray(x)
        except Exception as e:
            problem = f"__cuda_array_interface__ import failed: {e}"
    if problem is not None:
        raise TypeError(
            f"{arg} ({what}) could not be taken as a CUDA array without a copy: "
            f"{problem}. (bfloat16 tensors: pass their raw bits, e.g. "
            "t.view(torch.uint16), with src_dtype='bfloat16')")
    raise TypeError(
        f"{arg} must be a CUDA array (a CuPy array, or an object with "
        f"__cuda_array_interface__ or __dlpack__ on a CUDA device) because this "
        f"operation runs on {be.device}; got {what}")


def _dlpack_device_type(x):
    """The DLPack device type ``x`` reports, or None."""
    if not hasattr(type(x), "__dlpack_device__"):
        return None
    try:
        return int(x.__dlpack_device__()[0])
    except Exception:  # a tensor that refuses export: not ours to judge here
        return None


def on_cuda_device(x):
    """Whether ``x`` (not a NumPy or CuPy array) is an array in CUDA device
    memory: DLPack on a CUDA device, or ``__cuda_array_interface__``."""
    dev_type = _dlpack_device_type(x)
    if dev_type is not None:
        return dev_type in (_KDL_CUDA, _KDL_CUDA_MANAGED)
    try:
        return getattr(x, "__cuda_array_interface__", None) is not None
    except Exception:  # e.g. torch on a tensor that requires grad
        return True


def host_array(x):
    """Host data as NumPy reads it: arrays, lists, tuples, range,
    array.array, buffers, torch CPU tensors (``__array__``), DLPack on the
    CPU."""
    if _dlpack_device_type(x) == 1 and not hasattr(x, "__array__"):  # kDLCPU only
        return np.from_dlpack(x)
    try:
        return np.asarray(x)
    except Exception as e:
        raise TypeError(
            f"expected an array or a sequence of integers, got "
            f"{type(x).__module__}.{type(x).__name__} ({e})") from None


_TORCH_DTYPES = {}


def _torch_numpy_dtypes(torch):
    """torch dtype -> the NumPy dtype a CuPy array of its elements has
    (those DLPack maps too; bfloat16 and the fp8 kinds are not among them)."""
    if not _TORCH_DTYPES:
        for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                     "uint8", "bool"):
            _TORCH_DTYPES[getattr(torch, name)] = np.dtype(name)
    return _TORCH_DTYPES


def is_bf16(dtype):
    return dtypes.BF16_NUMPY is not None and np.dtype(dtype) == dtypes.BF16_NUMPY


def device_dtype(dtype):
    """bfloat16 lives on the device as its uint16 bits."""
    return np.dtype(np.uint16) if is_bf16(dtype) else dtype
