"""The CUDA kernel sources and the template instantiations kvcore uses.

Pure Python (no CuPy): the loader in ``launch.py``, the nvcc/NVRTC compile
test and the host-emulation test all read the same tables, so the names a
test compiles are the names the backend asks for.

A *module* is one ``.cu`` file compiled for one (source kind, destination
kind) pair, holding every kernel of that file in its scalar and its vector
variant; ``blocks.cu`` (no conversion) is a single module.  Modules are
compiled lazily, the first time a pair is used on a device.  ``slots.cu``
(the claim and release passes of ``BlockPool.write``, plain kernels) is a
single module too.
"""
import re
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
HEADER = "kv_half.cuh"

# Element kinds: kvcore.dtypes's (kv_kinds.h's numbering; kv_half.cuh's
# KV_* carry the same values, checked by tests/native/test_kinds.py).
from ... import dtypes  # noqa: E402
from ...dtypes import BF16, F16, F32, F8E4M3, F8E5M2, I8  # noqa: E402
KINDS = (F32, F16, BF16)
LOWPREC_KINDS = (F8E4M3, F8E5M2, I8)

# .cu files whose kernels are templated on <SK, DK, V>.
CONVERTING = {
    "convert.cu": ("kv_convert_flat",),
    "paged.cu": ("kv_write_slots", "kv_gather", "kv_gather_batch"),
    "contiguous.cu": ("kv_write_contiguous",),
}
# blocks.cu: kv_copy_blocks<WB>, WB = bytes per word.
COPY_FILE = "blocks.cu"
COPY_KERNEL = "kv_copy_blocks"
COPY_WORDS = (16, 4, 2, 1)

# slots.cu: plain (non-template) kernels around BlockPool.write.
SLOTS_FILE = "slots.cu"
SLOTS_KERNELS = ("kv_claim_slots", "kv_release_slots", "kv_reset_owner")
# What kv_claim_slots leaves in *bad when every slot is in range.
NO_BAD = 2**63 - 1

# convert_fp8.cu: float32 <-> fp8, templated on the format (0 e4m3fn,
# 1 e5m2) and, narrowing, on saturation; a single module.
FP8_FILE = "convert_fp8.cu"


def fp8_kernel_name(fmt, narrow, saturate=False):
    """The name expression of one fp8 conversion kernel."""
    if narrow:
        return f"kv_f32_to_fp8<{fmt}, {int(saturate)}>"
    return f"kv_fp8_to_f32<{fmt}>"


FP8_KERNELS = tuple([fp8_kernel_name(f, True, s) for f in (0, 1) for s in (False, True)]
                    + [fp8_kernel_name(f, False) for f in (0, 1)])

# lowprec.cu: fp8 / int8 pools and caches, templated on <FK, QK> (the float
# kind on the other side, the storage kind); one module per pair.
LOWPREC_FILE = "lowprec.cu"
LOWPREC_KERNELS = ("kv_write_slots_q", "kv_gather_q", "kv_gather_batch_q",
                   "kv_write_contiguous_q", "kv_dequantize")
# <QK, QK>: raw reads of the codes (the stored bytes, copied)
LOWPREC_RAW_KERNELS = ("kv_gather_q", "kv_gather_batch_q")


def lowprec_name(kernel, float_kind, q_kind):
    """The name expression of one lowprec.cu kernel."""
    return f"{kernel}<{float_kind}, {q_kind}>"


FILES = tuple(CONVERTING) + (COPY_FILE, SLOTS_FILE, FP8_FILE, LOWPREC_FILE)

# NVRTC options.  C++17 for `if constexpr` (CuPy >= 14 defaults to it; older
# CuPy needs it said).  No fast-math or FTZ flags, ever: the conversion
# kernels do integer arithmetic on the bits, and lowprec.cu's float32
# divisions and multiplications (int8 scales and codes, fp8 scales) must be
# IEEE-rounded with subnormals kept (NVRTC's defaults) to give the CPU's bits.
COMPILE_OPTIONS = ("--std=c++17",)

# A kernel file or header including one of the headers beside it.
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"(kv_[a-z0-9_]+\.cuh)"[ \t]*$', re.M)
_cache = {}


def vector_width(src_kind, dst_kind):
    """Elements per 16-byte vector run: 4 when both sides are float32, else 8
    (8 halves = 16 bytes; 8 floats = 32 bytes, two 128-bit accesses)."""
    return 4 if src_kind == dst_kind == F32 else 8


def kernel_name(kernel, src_kind, dst_kind, v):
    """The name expression of one instantiation (as NVRTC and CuPy spell it)."""
    return f"{kernel}<{src_kind}, {dst_kind}, {v}>"


def copy_name(word_bytes):
    return f"{COPY_KERNEL}<{word_bytes}>"


def module_names(file, src_kind=None, dst_kind=None):
    """Name expressions compiled into the module (file, src_kind, dst_kind)."""
    if file == COPY_FILE:
        return [copy_name(w) for w in COPY_WORDS]
    if file == SLOTS_FILE:
        return list(SLOTS_KERNELS)
    if file == FP8_FILE:
        return list(FP8_KERNELS)
    if file == LOWPREC_FILE:   # (src_kind, dst_kind) = (float kind, storage kind)
        kernels = LOWPREC_RAW_KERNELS if src_kind == dst_kind else LOWPREC_KERNELS
        return [lowprec_name(k, src_kind, dst_kind) for k in kernels]
    v = vector_width(src_kind, dst_kind)
    return [kernel_name(k, src_kind, dst_kind, w) for k in CONVERTING[file] for w in (1, v)]


def modules():
    """Every module kvcore can ask for: ``[(file, src_kind, dst_kind, names)]``."""
    out = []
    for file in CONVERTING:
        for sk in KINDS:
            for dk in KINDS:
                out.append((file, sk, dk, module_names(file, sk, dk)))
    out.append((COPY_FILE, None, None, module_names(COPY_FILE)))
    out.append((SLOTS_FILE, None, None, module_names(SLOTS_FILE)))
    out.append((FP8_FILE, None, None, module_names(FP8_FILE)))
    for fk in KINDS + LOWPREC_KINDS:
        for qk in LOWPREC_KINDS:
            if fk in KINDS or fk == qk:
                out.append((LOWPREC_FILE, fk, qk, module_names(LOWPREC_FILE, fk, qk)))
    return out


def source(file):
    """The text NVRTC compiles for ``file``: the .cu with its headers
    (kv_half.cuh, kv_fp8.cuh) pasted in, each once.

    Pasting (rather than an include path) keeps the compiled text
    self-contained, so CuPy's kernel cache, keyed on the text, can never hand
    back a binary built from an older header.
    """
    text = _cache.get(file)
    if text is None:
        body = (KERNEL_DIR / file).read_text(encoding="utf-8")
        if not _INCLUDE.search(body) or HEADER not in _headers_of(body, set()):
            raise RuntimeError(f"{file} does not include {HEADER}")
        text = _paste(body, file, set())
        _cache[file] = text
    return text


def _headers_of(body, seen):
    """The headers ``body`` includes, directly or through another header."""
    for m in _INCLUDE.finditer(body):
        name = m.group(1)
        if name not in seen:
            seen.add(name)
            _headers_of((KERNEL_DIR / name).read_text(encoding="utf-8"), seen)
    return seen


def _paste(body, name, pasted):
    """``body`` (of file ``name``) with each kv_*.cuh include replaced by the
    header's text, pasted once (a later include of it is dropped), with
    #line markers so compile errors name the right file and line."""
    out, pos = [], 0
    for m in _INCLUDE.finditer(body):
        header = m.group(1)
        out.append(body[pos:m.start()])
        line = body.count("\n", 0, m.start()) + 1
        if header not in pasted:
            pasted.add(header)
            text = (KERNEL_DIR / header).read_text(encoding="utf-8")
            out.append(f'#line 1 "{header}"\n' + _paste(text, header, pasted)
                       + f'\n#line {line + 1} "{name}"')
        pos = m.end()
    out.append(body[pos:])
    return "".join(out)


def bits_dtype(dtype):
    """The unsigned integer dtype with the same itemsize as float ``dtype``.

    Every copy the CUDA backend makes goes through these views, so no float
    instruction (which might quiet a NaN) ever touches the data."""
    if dtype == np.float32:
        return np.dtype(np.uint32)
    if dtype == np.float16 or (dtypes.BF16_NUMPY is not None and dtype == dtypes.BF16_NUMPY):
        return np.dtype(np.uint16)
    return dtype
