"""Arrays in: one adapter for every array argument of the public API.

NumPy arrays pass through untouched.  A torch tensor becomes, without a
copy, what the backends take: on the CPU a NumPy view of its memory (made
from its pointer when it is C-contiguous, ``tensor.numpy()`` otherwise), on
a GPU the tensor itself (CuPy imports it through DLPack).  A tensor that requires grad is read through ``detach()`` (its
data, no autograd), and a ``torch.bfloat16`` tensor through its raw bits
(a 16-bit integer view), marked as bfloat16, since neither NumPy nor CuPy
has that dtype.  torch is never imported here: a tensor can only exist
once its user has imported torch, so ``sys.modules`` tells.

Other objects (lists, ``__array_interface__``, DLPack producers, CuPy
arrays) are left to the backend's ``asarray``.
"""
import sys

import numpy as np

from . import dtypes
from .dtypes import BF16
from ._planes import outs_share_memory
from .backends import first_moved, host_address, runs_no_code, tensor_view

__all__ = ["unwrap", "host_view", "float_input", "writable", "out_array", "out_pair",
           "read_kind", "index_array", "aligned", "memory_guard", "out_guard", "private_inputs", "runs_no_code",
           "snapshot"]


def _torch_of(x):
    """The torch module if ``x`` is a torch tensor, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def _describe(x):
    """How an argument is named in an error: its dtype when it has one."""
    torch = _torch_of(x)
    if torch is not None:
        return f"torch tensor of dtype {x.dtype}"
    dt = getattr(x, "dtype", None)
    if isinstance(x, np.ndarray) or dt is not None:
        return f"{type(x).__name__} of dtype {dt}"
    return type(x).__name__


def unwrap(x, arg):
    """``(y, bf16)``: ``x`` in a form the backends take without a copy.

    For a torch tensor: detached; a bfloat16 one viewed as int16 bits
    (``bf16`` True); a CPU one as a NumPy array (bfloat16 bits as uint16).
    Anything else is returned as it is, with ``bf16`` False.
    """
    a = host_view(x)
    if a is not None:     # the common case: a C-contiguous CPU tensor
        return a, a.dtype == np.uint16    # (only a bfloat16 tensor gives uint16)
    torch = _torch_of(x)
    if torch is None:
        return x, False
    t = x
    # torch's fp8 tensors: their bits as ml_dtypes' fp8 (whose format every
    # reader checks); without ml_dtypes, refused: uint8 bits would let a
    # tensor of the other format through
    fp8 = {getattr(torch, "float8_e4m3fn", None): dtypes.E4M3_NUMPY,
           getattr(torch, "float8_e5m2", None): dtypes.E5M2_NUMPY}.get(x.dtype, False)
    if fp8 is None:
        raise TypeError(f"{arg} is a torch tensor of dtype {x.dtype}: kvcore reads torch's "
                        "float8 tensors as ml_dtypes' fp8 (pip install ml_dtypes), or pass "
                        "its bits as a uint8 view (tensor.view(torch.uint8))")
    try:
        if t.requires_grad:
            t = t.detach()
        if t.is_neg():                # a lazily negated view: its memory is not its values
            t = t.resolve_neg()
        bf16 = t.dtype == torch.bfloat16
        if bf16:
            t = t.view(torch.int16)   # same itemsize: any strides, no copy
        elif fp8 is not False:
            t = t.view(torch.uint8)
        if t.is_cpu:
            a = t.numpy()
            if fp8 is not False:
                return a.view(fp8), False
            return (a.view(np.uint16) if bf16 else a), bf16
        if not t.is_cuda:
            raise TypeError(f"it lives on device {t.device}; kvcore takes CPU tensors (CPU "
                            "pools and caches) and CUDA tensors (device='cuda')")
    except (TypeError, RuntimeError, ValueError) as e:
        raise TypeError(
            f"{arg} (a torch tensor of dtype {x.dtype} on {x.device}) cannot be read "
            f"without a copy: {e}") from None
    return t, bf16


# A NumPy view of a C-contiguous CPU torch tensor (bfloat16 as uint16 bits),
# or None for anything else: the cheap adapter the direct append path and
# ``unwrap`` try first (see kvcore.backends.tensor_view).
host_view = tensor_view


def float_input(be, x, arg, src_dtype=None, private=False):
    """``(bits, kind)`` for a float input (K, V, a tensor to convert).

    ``bits`` is the backend's array (bfloat16 as its uint16 bits), ``kind``
    its element kind: float32 and float16 arrays carry theirs; bfloat16 is
    an ``ml_dtypes.bfloat16`` array, a ``torch.bfloat16`` tensor, or uint16
    bits with ``src_dtype="bfloat16"``.  Raises TypeError naming ``arg``.
    ``private``: a copy of ``x``'s elements, made as soon as it is read (for
    a call whose other arguments may run the caller's code, which may free
    or resize ``x``'s memory: ``runs_no_code``).
    """
    if isinstance(x, np.ndarray):
        a, bf16 = be.asarray(x, arg), False
    else:
        y, bf16 = unwrap(x, arg)
        a = be.asarray(y, arg)
    if private:
        a = a.copy()
    if bf16:
        if src_dtype is not None and dtypes.storage_kind(src_dtype, "src_dtype") != BF16:
            raise TypeError(
                f"{arg} must have dtype {dtypes.STORAGE[dtypes.storage_kind(src_dtype)]} "
                f"for src_dtype={src_dtype!r}, got torch.bfloat16")
        if a.dtype != np.uint16:
            a = a.view(np.uint16)
        return a, BF16
    kind = dtypes.array_kind(a, arg, src_dtype)
    return dtypes.as_bits(a), kind


def _unwritable_tensor(t):
    """Why kvcore cannot write torch tensor ``t`` in place, or None."""
    if t.requires_grad:
        return ("one that requires grad (kvcore writes its memory outside autograd: pass one "
                "that does not, e.g. out.detach())")
    if t.is_neg():
        return ("one with the negative bit set (a lazily negated view, e.g. "
                "torch._neg_view(): its memory holds the negated values)")
    if t.is_conj():
        return ("one with the conjugate bit set (a lazily conjugated view: its memory holds "
                "the conjugated values)")
    return None


def _elements_overlap(a):
    """Whether two elements of array ``a`` may share memory (a broadcast or
    expanded view): each axis's stride, smallest first, must step over the
    span of the axes before it."""
    if a.flags.c_contiguous or a.size == 0:
        return False
    span = a.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def writable(be, out, arg, codes=None):
    """``(a, bf16)`` for an ``out=`` argument: ``a`` the backend array whose
    memory is ``out``'s (as :func:`unwrap`; ``codes(out)`` first, e.g. an fp8
    tensor's uint8 view), checked writable by the backend.  Refuses by name
    what kvcore cannot write in place: a torch tensor that requires grad
    (or has autograd history) or whose negative or conjugate bit is set
    (reading it takes a copy, and the result would land in the copy), and
    an array whose elements share memory."""
    if _torch_of(out) is not None:
        why = _unwritable_tensor(out)
        if why is not None:
            raise TypeError(f"{arg} must be a tensor kvcore can write in place, got {why}")
    y, bf16 = unwrap(out if codes is None else codes(out), arg)
    a = be.check_out(y, arg)
    if _elements_overlap(a):
        raise ValueError(f"{arg} must have its own memory for every element, got shape "
                         f"{tuple(a.shape)} with strides {tuple(a.strides)} (a broadcast or "
                         "expanded view)")
    return a, bf16


def out_array(be, out, arg, shape, kind):
    """``(bits, result)`` for an ``out=`` argument that must hold ``kind``
    elements in ``shape``: ``bits`` the writable backend array to fill
    (bfloat16 as uint16 bits), ``result`` what the call returns (``out``
    itself, e.g. the caller's torch tensor)."""
    a, bf16 = writable(be, out, arg)
    if bf16:
        if kind != BF16:
            raise TypeError(f"{arg} must have dtype {dtypes.STORAGE[kind]}, got torch.bfloat16")
        a = a.view(np.uint16) if a.dtype != np.uint16 else a
    else:
        want = dtypes.STORAGE[kind]
        ok = a.dtype == want or (kind == BF16 and dtypes.BF16_NUMPY is not None
                                 and a.dtype == dtypes.BF16_NUMPY) \
            or (kind in dtypes.FP8_KINDS and dtypes.lowprec_kind(a.dtype) == kind)
        if not ok:
            raise TypeError(f"{arg} must have dtype {want}"
                            + (" (bfloat16 bits) or ml_dtypes.bfloat16" if kind == BF16 else "")
                            + f", got {_describe(out)}")
        if not a.dtype.isnative:
            raise TypeError(f"{arg} must be in native byte order, got dtype {a.dtype}")
        a = dtypes.as_bits(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{arg} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    return a, out


def out_pair(be, out, shape, kind):
    """``[(k_bits, k_result), (v_bits, v_result)]`` for a read of K and V
    (``BlockPool.gather``, ``KVCache.get``): two fresh arrays for ``out=None``,
    else the caller's ``out=(k_out, v_out)`` checked as :func:`out_array`
    (shape, dtype, writable) and the two apart."""
    if out is None:
        return [(a, a) for a in (be.empty(shape, dtypes.STORAGE[kind]),
                                 be.empty(shape, dtypes.STORAGE[kind]))]
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a pair (k_out, v_out), got {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    pair = [out_array(be, o, f"out[{i}]", shape, kind) for i, o in enumerate(out)]
    if outs_share_memory(be, pair[0][0], pair[1][0]):
        raise ValueError("out[0] and out[1] must not share memory (k and v are "
                         "different arrays)")
    return pair


def read_kind(dtype, storage_kind):
    """The element kind a read with ``dtype=`` returns: the storage's for
    None, a float kind, or the storage's own low-precision kind (its codes);
    ValueError naming ``dtype`` for another low-precision kind."""
    if dtype is None:
        return storage_kind
    kind = dtypes.storage_kind(dtype, "dtype")
    if kind in dtypes.LOWPREC_KINDS and kind != storage_kind:
        raise ValueError(f"dtype must be the storage dtype ({dtypes.KIND_NAME[storage_kind]!r}) "
                         f"or a float dtype ('float32', 'float16', 'bfloat16'), got "
                         f"{dtypes.KIND_NAME[kind]!r}")
    return kind


def index_array(be, x, arg):
    """A 1-D or 2-D index input (slots, block tables, lengths, token ids)
    as a host NumPy array of its own (aligned, C-contiguous): lists, tuples,
    ranges, NumPy arrays, torch tensors, ``array.array`` and anything with
    ``__array_interface__`` or the buffer protocol; device arrays through
    the backend.  Always a copy, so what is checked is what is used, though
    another thread (or the call itself, writing the storage an input is a
    view of) rewrites the caller's input.  An input too large to copy
    (a broadcast view of 2**40 rows) raises MemoryError naming ``arg``."""
    try:
        return _index_copy(be, x, arg)
    except MemoryError as e:      # (NumPy's own names no argument)
        shape = getattr(x, "shape", None)
        given = f"shape {tuple(shape)} of {getattr(x, 'dtype', '?')}" \
            if isinstance(shape, tuple) else type(x).__name__
        raise MemoryError(f"{arg} is too large to copy ({given}: kvcore copies an index "
                          f"array before checking it): {e}") from None


def _index_copy(be, x, arg):
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    if isinstance(x, range):
        return np.arange(x.start, x.stop, x.step)
    y, bf16 = unwrap(x, arg)
    if bf16:
        raise TypeError(f"{arg} must hold integers, got torch.bfloat16")
    if isinstance(y, np.ndarray):
        return y.copy()
    a = np.array(be.to_host(y))
    if a.dtype.kind in "OUSV":     # None, a str, an object NumPy cannot read as numbers
        raise TypeError(f"{arg} must be an integer array, got {type(x).__name__} {x!r:.40}")
    return a


def aligned(a):
    """``a`` itself when its data is aligned for its dtype, else an aligned
    copy (the C kernels load and store typed elements)."""
    return a if a.flags.aligned else a.copy()


def snapshot(*args, names=None):
    """``args`` with each exact NumPy array and torch tensor among them
    replaced by a copy (copying them runs none of the caller's code): what
    a call works on when converting its other arguments may run the
    caller's code (``runs_no_code``), which may free or resize them.
    ``names``: their argument names, for the error of a copy too large."""
    torch = sys.modules.get("torch")
    tensors = () if torch is None else (torch.Tensor, torch.nn.Parameter)
    out = []
    for i, x in enumerate(args):
        try:
            if type(x) is np.ndarray:
                x = x.copy()
            elif type(x) in tensors:
                x = x.detach().clone()
        except MemoryError:
            # (a broadcast view of a wrong, huge shape: say which input)
            name = names[i] if names is not None else f"argument {i}"
            size = x.nbytes if type(x) is np.ndarray else x.numel() * x.element_size()
            raise MemoryError(
                f"{name} of shape {tuple(x.shape)} ({size} bytes) could not be copied: it is "
                "copied because another argument (a list, an object) is converted after it; "
                f"check {name}'s shape, or pass the other arguments as NumPy arrays") from None
        out.append(x)
    return out


def private_inputs(arrays, others=(), out=None, names=None):
    """For a call that reads ``arrays`` (a tuple) and converts ``others``
    and ``out`` (an array, or a pair as a tuple or list, or None):
    ``(arrays, private, out_check)``.  Where converting them surely runs
    none of the caller's code (``runs_no_code``): the arrays as they are,
    False and None.  Else copies of the arrays made before any such code
    runs (``snapshot``: it may free or resize them), True (copy them again
    once converted, if their conversion kept their memory), and
    ``out_guard``'s check of ``out``: run it after every conversion, before
    writing.  ``names``: the arrays' argument names (a copy too large for
    memory names its argument)."""
    outs = () if out is None else tuple(out) if type(out) in (tuple, list) else (out,)
    if runs_no_code(*arrays, *others, *outs):
        return tuple(arrays), False, None
    arrays = tuple(snapshot(*arrays, names=names))
    return arrays, True, out_guard(out, *arrays, *others)


def _resizable_owner(x):
    """The NumPy array that owns ``x``'s memory when ``ndarray.resize``
    can move it (an array owning its data), else None.  (NumPy keeps a
    view's ``base`` at the array holding the memory; a buffer exported to
    NumPy by another object, a bytearray or an mmap, cannot be resized or
    closed while the view lives.)"""
    owner = x
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner if owner.flags.owndata else None


_PLAN = ("the plan was made", "make a new AttentionPlan over the arrays as they are now")


def out_guard(out, *args):
    """For a call that writes ``out`` (an array, or a pair as a tuple or
    list): None when converting its other arguments ``args`` (and reading
    ``out``) surely runs none of the caller's code (``runs_no_code``), else
    a function that raises RuntimeError naming ``out`` once its memory is
    not what it was when the call began: run it after every argument is
    converted, before writing (that code may have freed or resized it)."""
    if out is None:
        return None
    members = tuple(out) if type(out) in (tuple, list) else (out,)
    if runs_no_code(*args, *members):
        return None
    names = ("out",) if len(members) == 1 and members[0] is out else \
        tuple(f"out[{i}]" for i in range(len(members)))
    return memory_guard(zip(names, members),
                        ("the call began (converting another argument ran code that freed or "
                         "resized it)", "pass an out that stays as it is for the call"))


def memory_guard(named, when=_PLAN):
    """For the arrays among ``named`` (``(arg, array)`` pairs) whose memory
    a caller keeps views of (a plan's planes): a function that raises
    RuntimeError naming the argument once an array's memory is no longer
    what it was; None when no array can lose its memory (CuPy arrays, NumPy
    views of buffers that stay put).

    A torch tensor: the guard holds its storage (so the storage itself is
    never freed) and checks the storage is still the tensor's, with the
    size and address it had: ``resize_`` frees a storage's bytes whoever
    holds it, and a freed block often comes back at the same address, so
    the address alone proves nothing.  A NumPy array: ``resize(...,
    refcheck=False)`` on the array that owns the memory moves it whoever
    views it; the guard holds that owner and checks its address and size
    (its memory cannot be freed while the owner lives, so an owner with the
    same address and size still holds the bytes the plan reads).  ``when``:
    ``(since what, what to do)`` for the message (a plan's planes by
    default; ``out_guard`` a call's ``out``)."""
    held, owners, names = [], [], []
    for arg, x in named:
        if _torch_of(x) is None:
            if isinstance(x, np.ndarray):
                owner = _resizable_owner(x)
                if owner is not None:
                    owners.append((owner, host_address(owner), owner.nbytes))
                    names.append((arg, owner.shape))
            continue
        storage = x.untyped_storage()
        held.append((arg, x, storage, storage.data_ptr(), storage.nbytes(), x.data_ptr()))
    if not held and not owners:
        return None
    owners = tuple(owners)

    def guard():
        for arg, x, storage, base, nbytes, ptr in held:
            if x.untyped_storage() is not storage or storage.nbytes() != nbytes \
                    or storage.data_ptr() != base or x.data_ptr() != ptr:
                raise RuntimeError(
                    f"{arg}'s memory moved or was freed since {when[0]} (the torch "
                    f"tensor's storage was resized or replaced): {when[1]}")
        i = first_moved(owners) if owners else -1
        if i >= 0:
            arg, shape = names[i]
            raise RuntimeError(
                f"{arg}'s memory moved since {when[0]} (the NumPy array holding "
                f"it, shape {shape} then, was resized: ndarray.resize with "
                f"refcheck=False): {when[1]}")
    return guard
