"""The backend interface, and its plain NumPy reference implementation.

A backend moves KV data on one device: it converts between the element
kinds, writes tokens into slots of a paged plane, gathers positions back,
copies blocks and writes a contiguous cache.  It sees arrays and block ids
only, never a pool or a sequence, and it trusts its arguments: the public
classes have validated shapes, kinds, ranges, alignment and overlap before
calling (one layer validates; see ``docs/architecture.md``).

``Backend`` is both the interface and the oracle: every operation here is
written in plain NumPy, element by element where the order matters, so that
it is easy to read and obviously right.  Device backends (``cpu.CPUBackend``,
``cuda.CudaBackend``) override the operations they run faster and must give
the same bits; ``tests/test_backends.py`` checks each one against this class,
operation by operation.  A new kernel gets its reference here first.

Element kinds are ``kvcore.dtypes.F32 / F16 / BF16``; a bfloat16 array is
held as its uint16 bits.  Layouts:

* a paged plane (one layer's keys or values): ``(num_blocks, heads,
  block_size, dim)``; a pool's storage stacks ``2 * num_layers`` planes;
* tokens in: ``(n, heads, dim)``; a gather's output: ``(heads, n, dim)``;
* a contiguous cache: ``(batch, heads, max_seq_len, dim)``.
"""
import numpy as np

from .. import dtypes

__all__ = ["Backend", "REFERENCE", "is_cuda_array", "paged_attention_reference",
           "stored_values"]

_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
_F32_IO = (frozenset({dtypes.F32}), frozenset({dtypes.F32}))  # attention_io_kinds


def is_cuda_array(x):
    """Whether ``x`` is an array in GPU memory (CuPy, ``__cuda_array_interface__``,
    or a DLPack producer on a CUDA device)."""
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__") or \
            type(x).__module__.split(".")[0] in ("cupy", "cupyx"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in _DLPACK_CUDA
        except Exception:
            return False
    return False


# ---------------------------------------------------------------- conversion
# Every conversion goes through float32 bits (uint32): widening is exact, so
# one round-to-nearest-even narrowing is the single correct rounding.  NaNs
# follow the hardware convention the C and CUDA kernels use: narrowing keeps
# the sign and the top payload bits and sets the quiet bit; widening a half
# NaN quiets it.

def _to_f32_bits(a, kind):
    """uint32 float32 bits of the elements of ``a`` (storage bits of ``kind``)."""
    if kind == dtypes.F32:
        return a.view(np.uint32).copy()
    h = a.view(np.uint16).astype(np.uint32)
    if kind == dtypes.BF16:
        return h << 16
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    # normal halves: re-bias the exponent (15 -> 127)
    out = sign | ((exp + 112) << 23) | (man << 13)
    out = np.where(exp == 0x1F, sign | 0x7F800000 | (man << 13)
                   | np.where(man != 0, 0x00400000, 0).astype(np.uint32), out)
    # zeros and subnormals: man * 2**-24, exact in float32
    sub = exp == 0
    if sub.any():
        vals = man[sub].astype(np.float32) * np.float32(2.0 ** -24)
        out[sub] = sign[sub] | vals.view(np.uint32)
    return out.astype(np.uint32)


def _round_shift(x, shift):
    """``x >> shift`` rounded to nearest, ties to even (uint32, shift >= 1)."""
    shift = np.asarray(shift, np.uint32)
    r = x >> shift
    rem = x & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    up = (rem > half) | ((rem == half) & ((r & 1) == 1))
    return r + up.astype(np.uint32)


def _from_f32_bits(x, kind):
    """Storage bits of ``kind`` for float32 bits ``x`` (uint32), RNE."""
    x = x.astype(np.uint32)
    if kind == dtypes.F32:
        return x
    ax = x & 0x7FFFFFFF
    nan = ax > 0x7F800000
    if kind == dtypes.BF16:
        # (a carry into the exponent gives +-inf on overflow, as RNE asks;
        # only a NaN could carry out of 16 bits)
        rounded = _round_shift(x, 16) & 0xFFFF
        quiet = (x >> 16) | 0x0040
        return np.where(nan, quiet, rounded).astype(np.uint16)
    sign = (x >> 16) & 0x8000
    exp = ax >> 23
    out = np.zeros(x.shape, np.uint32)
    # normal results: re-bias the exponent, round the 13 dropped bits (a
    # carry into the exponent is the right answer, up to infinity)
    normal = (ax >= 0x38800000) & (ax < 0x477FF000)
    out = np.where(normal, _round_shift(np.where(normal, ax - 0x38000000, 0), 13), out)
    # subnormal results (unit 2**-24): the full mantissa shifted by 126 - exp
    sub = (ax < 0x38800000) & (exp >= 102)
    mant = (ax & 0x7FFFFF) | 0x800000
    out = np.where(sub, _round_shift(mant, np.where(sub, 126 - exp, 1)), out)
    out = np.where(ax >= 0x477FF000, 0x7C00, out)
    out = np.where(nan, 0x7E00 | ((ax >> 13) & 0x3FF), out)
    return (sign | out).astype(np.uint16)


def _bits_view(a):
    """``a`` viewed as unsigned integers of its itemsize (same memory)."""
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def convert_bits(src, src_kind, dst_kind):
    """A new array: ``src`` (storage bits of ``src_kind``) as ``dst_kind``
    storage bits (uint32 for float32, uint16 otherwise).  The same kind is
    a copy of the bits (signalling NaNs stay as they are); the same
    low-precision kind too (uint8 bits)."""
    if src_kind == dst_kind and src_kind in dtypes.LOWPREC_KINDS:
        return np.array(src, dtype=np.uint8)
    if src_kind == dst_kind:
        return np.array(src, dtype=np.uint32 if src_kind == dtypes.F32 else np.uint16)
    return _from_f32_bits(_to_f32_bits(np.asarray(src), src_kind), dst_kind)


# ---------------------------------------------------------------- fp8
# float32 <-> fp8 (kv_fp8.h's definition, fmt 0 = e4m3fn, 1 = e5m2):
# narrowing is one RNE right shift of the float32 bits (re-biased for a
# normal result, the whole significand for a subnormal one), then overflow
# (NaN for e4m3fn, inf for e5m2, or the largest finite value when
# saturating) and NaN (0x7F / 0x7E, the input's sign); widening is exact,
# every NaN the quiet float32 NaN of its sign.
# fmt: (mantissa bits, bias, largest finite code, overflow code, NaN code)
FP8_FORMATS = {0: (3, 7, 0x7E, 0x7F, 0x7F), 1: (2, 15, 0x7B, 0x7C, 0x7E)}


def fp8_from_f32_bits(x, fmt, saturate=False):
    """fp8 codes (uint8) of float32 bits ``x`` (uint32), round to nearest even."""
    mbits, bias, max_code, ovf_code, nan_code = FP8_FORMATS[fmt]
    x = np.asarray(x, np.uint32)
    a = x & np.uint32(0x7FFFFFFF)
    sign = (x >> np.uint32(24)) & np.uint32(0x80)
    exp = (a >> np.uint32(23)).astype(np.int64)
    sub = a < np.uint32((128 - bias) << 23)       # the result is subnormal or zero
    v = np.where(sub, (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000),
                 a - np.minimum(a, np.uint32((127 - bias) << 23)))
    # (a shift of 25 leaves 0 of any significand: f32 zeros and subnormals)
    shift = np.where(sub, np.minimum(151 - bias - mbits - exp, 25), 23 - mbits)
    code = _round_shift(v, shift.astype(np.uint32))
    code = np.where(code > max_code, max_code if saturate else ovf_code, code)
    code = np.where(a > np.uint32(0x7F800000), nan_code, code)
    return (code | sign).astype(np.uint8)


def f32_bits_from_fp8(codes, fmt):
    """float32 bits (uint32) of fp8 ``codes`` (uint8): exact."""
    mbits, bias, _, _, _ = FP8_FORMATS[fmt]
    c = np.arange(256, dtype=np.int64)
    mag, neg = c & 0x7F, c >= 0x80
    exp, man = mag >> mbits, mag & ((1 << mbits) - 1)
    # subnormal (exp 0): man * 2**(1 - bias - mbits); normal: (2**mbits + man) * 2**(exp - ...)
    value = np.where(exp == 0, np.ldexp(man.astype(np.float64), 1 - bias - mbits),
                     np.ldexp((man + (1 << mbits)).astype(np.float64), exp - bias - mbits))
    if fmt == 0:
        value = np.where(mag == 0x7F, np.nan, value)
    else:
        value = np.where(exp == 0x1F, np.where(man == 0, np.inf, np.nan), value)
    bits = np.where(neg, -value, value).astype(np.float32).view(np.uint32)
    bits = np.where(np.isnan(value), np.uint32(0x7FC00000) | (neg.astype(np.uint32) << 31), bits)
    return bits.astype(np.uint32)[np.asarray(codes, np.uint8)]
# ------------------------------------------------------- low-precision storage
# fp8 (e4m3fn, e5m2) and int8 storage, defined on float32 values: a float16 or
# bfloat16 input is widened (exactly) first, and a widened output is the
# float32 value converted once more.  The fp8 rounding is the one above (the
# definition of kv_fp8.h, checked against ml_dtypes by the tests).

_FP8_FMT = {dtypes.F8E4M3: 0, dtypes.F8E5M2: 1}   # kind -> kv_fp8.h's fmt


def _f32(bits, kind):
    """float32 values of float storage bits ``bits`` of float ``kind``."""
    return _to_f32_bits(np.asarray(bits), kind).view(np.float32)


def fp8_encode(x, kind, scale=1.0):
    """uint8 fp8 bits of float32 ``x / scale``, saturated: a value past the
    largest finite one (and +-inf) stores +-max; NaN stays NaN."""
    x = np.asarray(x, np.float32)
    scale = np.float32(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        y = x if scale == 1 else x / scale
    return fp8_from_f32_bits(np.ascontiguousarray(y, np.float32).view(np.uint32),
                             _FP8_FMT[kind], saturate=True)


def fp8_decode(b, kind, scale=1.0):
    """float32 ``fp8 * scale`` of uint8 fp8 bits ``b``."""
    v = f32_bits_from_fp8(b, _FP8_FMT[kind]).view(np.float32)
    scale = np.float32(scale)
    return v if scale == 1 else v * scale


def int8_encode(x):
    """``(codes, scales)`` of float32 rows ``x`` (..., dim): per row
    ``scale = max|x| / 127`` (1 for an all-zero row, 2**-149 where that
    quotient underflows to 0), codes
    ``round_half_even(x / scale)`` in -127..127.  A row holding a NaN or an
    infinity stores scale NaN and zeros (it reads back as NaN)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    finite = np.isfinite(x).all(axis=-1)
    amax = np.where(np.isfinite(a), a, np.float32(0)).max(axis=-1, initial=np.float32(0))
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    # max|x| / 127 underflowing to 0 (max|x| below 63.5 * 2**-149): the
    # smallest subnormal, of which every element is an exact multiple
    scale = np.where(scale == 0, np.float32(2.0**-149), scale).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.clip(np.rint(x / scale[..., None]), -127, 127)
    q = np.where(finite[..., None], q, 0).astype(np.int8)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return q, scale


def int8_decode(codes, scales):
    """float32 ``codes * scale`` (scales: one per row of ``codes``)."""
    return np.asarray(codes, np.int8).astype(np.float32) * np.asarray(scales, np.float32)[..., None]


def _encode(src, src_kind, codec):
    """``(elements, row_scales)`` of float input ``src`` (storage bits of
    ``src_kind``, rows along the last axis) stored by ``codec``: storage bits
    of a float kind, fp8 bits, or int8 codes and their per-row scales (None
    but for int8)."""
    bits = _bits_view(src)
    if codec.kind == dtypes.I8:
        return int8_encode(_f32(bits, src_kind))
    if codec.kind in dtypes.FP8_KINDS:
        return fp8_encode(_f32(bits, src_kind), codec.kind, codec.layer_scale), None
    return convert_bits(bits, src_kind, codec.kind), None


def _decode(elements, codec, row_scales, dst_kind):
    """Storage bits of ``dst_kind`` of stored ``elements`` (``codec``'s kind;
    int8: one scale per row in ``row_scales``): widened when ``codec`` is
    low precision and ``dst_kind`` a float kind, else converted (the same
    low-precision kind: the codes, copied)."""
    if codec.lowprec and dst_kind != codec.kind:
        if codec.kind == dtypes.I8:
            vals = int8_decode(elements, row_scales)
        else:
            vals = fp8_decode(elements, codec.kind, codec.layer_scale)
        return convert_bits(vals.view(np.uint32), dtypes.F32, dst_kind)
    return convert_bits(_bits_view(elements), codec.kind, dst_kind)


# ---------------------------------------------------------------- attention
# The float64 reference of paged attention: one sequence and one KV head at
# a time, the context gathered through the block table, the causal window
# spelled out position by position.  Written to be obviously correct, not
# fast; ``Backend.paged_attention`` runs it and every kernel is held to it.

def stored_values(cache, kind=None, scales=None):
    """The stored elements of a cache as float64.

    ``cache`` is float32, float16, ml_dtypes.bfloat16, or uint16 holding
    bfloat16 bits (then ``kind`` must be "bfloat16"); or low precision:
    uint8 fp8 bits with ``kind`` "float8_e4m3fn" / "float8_e5m2" (``scales``
    the layer's float scale, default 1), int8 codes with ``kind="int8"``
    (``scales`` one float32 per row: ``cache.shape[:-1]``).  A low-precision
    value is the float32 ``element * scale`` the pool reads back.
    """
    a = np.asarray(cache)
    if kind in ("float8_e4m3fn", "float8_e5m2"):
        return fp8_decode(a, dtypes.NAME_KIND[kind],
                          1.0 if scales is None else scales).astype(np.float64)
    if kind == "int8":
        return int8_decode(a, scales).astype(np.float64)
    if a.dtype == np.uint16:
        if kind != "bfloat16":
            raise TypeError("a uint16 cache holds bfloat16 bits only when kind='bfloat16'")
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def paged_attention_reference(q, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc=None, scale=None, sliding_window=None,
                              logits_soft_cap=None, kind=None, key_scales=None,
                              value_scales=None, chunk_size=None, alibi_slopes=None,
                              sinks=None):
    """Attention over a paged cache, in float64.

    Parameters
    ----------
    q : array ``(num_query_tokens, num_heads, head_dim)``
    key_cache, value_cache : arrays ``(num_blocks, num_kv_heads, block_size, head_dim)``
        The stored values (float32, float16, bfloat16; uint16 bits with
        ``kind="bfloat16"``; fp8 bits or int8 codes with their ``kind``).
    key_scales, value_scales : optional
        Low precision (see :func:`stored_values`): an fp8 layer's float
        scales, or an int8 layer's scale planes ``(num_blocks, num_kv_heads,
        block_size)``.
    block_tables : integer array ``(num_seqs, max_blocks)``
    seq_lens : integer array ``(num_seqs,)``
        KV length of each sequence, its query tokens included.
    query_start_loc : integer array ``(num_seqs + 1,)``, optional
        Sequence s owns query rows ``query_start_loc[s] .. query_start_loc[s+1]-1``;
        default one query per sequence.
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` positions up to its own.
    logits_soft_cap : float, optional
        Scores become ``c * tanh(score / c)`` before the softmax.
    chunk_size : int, optional
        A query at position ``p`` sees no position before ``(p // chunk_size)
        * chunk_size`` (its chunk's start; with a window too, the later start).
    alibi_slopes : array ``(num_heads,)``, optional
        ``alibi_slopes[h] * (t - p)`` is added to query head ``h``'s score of
        key ``t`` (after the soft cap).
    sinks : array ``(num_heads,)``, optional
        A logit per query head joining each row's softmax denominator:
        ``w_t = exp(x_t) / (sum exp(x_t') + exp(sinks[h]))``.

    Returns
    -------
    float64 array ``(num_query_tokens, num_heads, head_dim)``
    """
    q = stored_values(q, kind if np.asarray(q).dtype == np.uint16 else None)
    k_all = stored_values(key_cache, kind, key_scales)
    v_all = stored_values(value_cache, kind, value_scales)
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_all.shape
    group = num_heads // num_kv_heads
    if query_start_loc is None:
        query_start_loc = np.arange(len(seq_lens) + 1)
    query_start_loc = np.asarray(query_start_loc)
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float64)
    sink = None if sinks is None else np.asarray(sinks, np.float64)
    out = np.zeros((num_tokens, num_heads, head_dim), np.float64)
    for s in range(len(seq_lens)):
        length = int(seq_lens[s])
        first, stop = int(query_start_loc[s]), int(query_start_loc[s + 1])
        m = stop - first
        if m == 0:
            continue
        positions = np.arange(length)
        blocks = block_tables[s, positions // block_size]
        offsets = positions % block_size
        for g in range(num_kv_heads):
            k = k_all[blocks, g, offsets]          # (length, head_dim)
            v = v_all[blocks, g, offsets]
            for j in range(m):
                pos = length - m + j               # this query's position
                visible = positions <= pos
                if sliding_window is not None:
                    visible &= positions > pos - sliding_window
                if chunk_size is not None:
                    visible &= positions >= pos // chunk_size * chunk_size
                heads = slice(g * group, (g + 1) * group)
                scores = q[first + j, heads] @ k[visible].T * scale   # (group, n_visible)
                if logits_soft_cap is not None:
                    scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
                if slopes is not None:
                    scores += slopes[heads, None] * (positions[visible] - pos)[None, :]
                top = scores.max(axis=1, keepdims=True)
                if sink is not None:
                    top = np.maximum(top, sink[heads, None])
                weights = np.exp(scores - top)
                total = weights.sum(axis=1, keepdims=True)
                if sink is not None:
                    total += np.exp(sink[heads, None] - top)
                out[first + j, heads] = weights / total @ v[visible]
    return out


class _AttentionPlan:
    """``Backend.attention_plan``'s plan: owned copies of the checked index
    arrays and the scalars (what ``attention_run`` passes on)."""

    def __init__(self, block_tables, seq_lens, query_start_loc, num_heads, num_kv_heads,
                 head_dim, block_size, num_blocks, kind, scale, sliding_window, soft_cap,
                 chunk_size, num_threads):
        self.block_tables = np.array(block_tables, np.int32, order="C", copy=True)
        self.seq_lens = np.array(seq_lens, np.int64, copy=True)
        self.query_start_loc = np.array(query_start_loc, np.int64, copy=True)
        for a in (self.block_tables, self.seq_lens, self.query_start_loc):
            a.flags.writeable = False
        self.num_tokens = int(self.query_start_loc[-1])
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.num_blocks, self.kind = block_size, num_blocks, kind
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.chunk_size = chunk_size
        self.num_threads = num_threads


class Backend:
    """The data-movement interface, implemented in plain NumPy (host memory).

    ``REFERENCE`` (an instance) is the oracle of the tests; the public
    classes use a device backend (``kvcore.backends.get_backend``).
    """

    name = "reference"
    xp = np

    def normalize_device(self, device):
        return "cpu"

    # -------------------------------------------------------------- arrays
    def asarray(self, x, arg):
        """``x`` as a NumPy array; a GPU array is a TypeError, never a copy.
        (Torch tensors are unwrapped by the caller, ``kvcore._arrays``.)"""
        if isinstance(x, np.ndarray):
            return x
        if is_cuda_array(x):
            raise TypeError(
                f"{arg} is a CUDA array ({type(x).__module__}.{type(x).__name__}) but this "
                "operation runs on the CPU; pass a NumPy array or use device='cuda'")
        if hasattr(x, "__dlpack_device__"):
            try:
                dev_type = x.__dlpack_device__()[0]
            except Exception as e:
                raise TypeError(f"{arg} ({type(x).__name__}) cannot say where its memory "
                                f"lives: {e}") from None
            if dev_type != 1:  # kDLCPU
                raise TypeError(
                    f"{arg} lives on DLPack device type {dev_type}, not the CPU; "
                    "pass a NumPy array or use device='cuda'")
        try:
            return np.asarray(x)
        except Exception as e:  # pragma: no cover - exotic inputs
            raise TypeError(f"{arg} must be an array, got {type(x).__name__}: {e}") from None

    def check_out(self, out, arg):
        """``out`` (an ``out=`` argument, already unwrapped) checked: a
        writeable NumPy array."""
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{arg} must be a NumPy array or a CPU torch tensor, "
                            f"got {type(out).__module__}.{type(out).__name__}")
        if not out.flags.writeable:
            raise ValueError(f"{arg} must be writeable, got a read-only array")
        return out

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def to_host(self, a):
        return a

    def from_host(self, a):
        return a

    def inner_contiguous(self, a):
        """``a`` aligned and with its last axis contiguous (a copy only when
        it is not)."""
        if not a.flags.aligned or (a.ndim and a.strides[-1] != a.itemsize and a.shape[-1] > 1):
            return np.array(a, order="C", copy=True)
        return a

    def apart(self, a, storage):
        """``a``, or a C-contiguous copy of it when its memory may meet
        ``storage``'s: an input that is a view of the storage is read as it
        was when the call began."""
        return a.copy() if self.xp.may_share_memory(a, storage) else a

    def direct_out(self, out, storage):
        """Whether a gather may write ``out`` in place (else a temporary is
        filled and copied into it)."""
        return not self.xp.may_share_memory(out, storage)

    def synchronize(self):
        pass

    # BlockPool.write with slots already on the device (GPU backends only)
    def device_slots(self, slots, n):
        """None: host slots are checked by the pool on the host."""
        return None

    def slot_owner_table(self, num_slots):
        """Scratch a GPU backend needs for ``write_slots_kv`` (None here)."""
        return None

    def row_writer(self, storage, kind, scales=None, layer_scales=None):
        """A C-level writer of a sequence's appended rows into ``storage``
        (a ``kvcore._native._typedefs.RowWriter``), or None: appends then
        go through ``write_positions``.  ``scales``: an int8 pool's scale
        array; ``layer_scales``: an fp8 pool's float32 ``(num_layers, 2)``
        scales (the codecs of every plane at once)."""
        return None

    # ------------------------------------------------------------- kernels
    def convert(self, src, src_kind, dst, dst_kind):
        """``dst[...] = src`` converted; same shape, any strides; ``src`` is
        read as it was before the call even when it overlaps ``dst``."""
        _bits_view(dst)[...] = convert_bits(_bits_view(src), src_kind, dst_kind)

    def convert_fp8(self, src, dst, fmt, narrow, saturate=False):
        """float32 ``src`` -> fp8 codes ``dst`` (uint8) when ``narrow``, else
        fp8 codes ``src`` -> float32 ``dst``; ``fmt`` 0 is e4m3fn, 1 e5m2.
        Same shape, any strides; ``src`` is read as it was before the call."""
        if narrow:
            dst[...] = fp8_from_f32_bits(src.view(np.uint32), fmt, saturate)
        else:
            dst.view(np.uint32)[...] = f32_bits_from_fp8(src.view(np.uint8), fmt)

    # Every data op takes the ``Codec`` of the plane it writes or reads
    # (``kvcore.backends.codec``): float kinds convert, fp8 and int8 encode
    # and decode through float32; a backend dispatches on ``codec.kind``.

    def write_slots(self, cache, src, slots, src_kind, codec):
        """``cache[s // bs, :, s % bs, :] = src[i]`` encoded by ``codec`` for
        every slot ``s = slots[i] >= 0``, in token order (of several tokens
        naming one slot the last one lands); -1 skips a token.

        Float kinds: converted (RNE); fp8: ``fp8(x / codec.layer_scale)``
        saturated; int8: the codes, and each (token, head) row's scale to
        ``codec.scale_plane[s // bs, :, s % bs]``.

        cache: a paged plane ``(num_blocks, heads, block_size, dim)``;
        src: ``(n, heads, dim)``; slots: int64 ``(n,)``."""
        bs = cache.shape[2]
        rows, row_scales = _encode(src, src_kind, codec)
        dst = cache if codec.lowprec else _bits_view(cache)
        for i, s in enumerate(np.asarray(slots).tolist()):
            if s >= 0:
                dst[s // bs, :, s % bs, :] = rows[i]
                if row_scales is not None:
                    codec.scale_plane[s // bs, :, s % bs] = row_scales[i]

    def write_slots_kv(self, k_cache, v_cache, k, v, slots, src_kind, k_codec, v_codec,
                       owner, check):
        """Keys into ``k_cache`` (``k_codec``) and values into ``v_cache``
        (``v_codec``): ``write_slots`` for each.  ``owner`` and ``check``
        matter only for slots in GPU memory (see the CUDA backend)."""
        self.write_slots(k_cache, k, slots, src_kind, k_codec)
        self.write_slots(v_cache, v, slots, src_kind, v_codec)

    def write_positions(self, storage, layer, k, v, block_table, start, src_kind, k_codec,
                        v_codec):
        """Rows ``i`` of ``k`` and ``v`` ``(n, heads, dim)`` to positions
        ``start + i`` of the sequence whose blocks are ``block_table`` (int32),
        in layer ``layer``'s planes of ``storage`` (keys ``2 * layer``,
        values ``2 * layer + 1``, stored by ``k_codec`` / ``v_codec``).  What
        ``PagedKVCache.append`` writes."""
        bs = storage.shape[3]
        pos = start + np.arange(k.shape[0], dtype=np.int64)
        table = np.asarray(self.to_host(block_table), np.int64)
        slots = table[pos // bs] * bs + pos % bs        # host slots: every backend takes them
        self.write_slots(storage[2 * layer], k, slots, src_kind, k_codec)
        self.write_slots(storage[2 * layer + 1], v, slots, src_kind, v_codec)

    def gather(self, cache, block_table, start, end, out, codec, dst_kind):
        """``out[:, t - start, :] = cache[block_table[t // bs], :, t % bs, :]``
        for ``t`` in ``start..end-1``, read through ``codec`` as ``dst_kind``
        (a float kind, or the codec's own kind: the stored codes, raw); out:
        ``(heads, end - start, dim)``.  fp8 reads ``fp8 * layer_scale``, int8
        ``code * scale_plane[block, head, offset]``."""
        bs = cache.shape[2]
        pos = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(block_table, np.int64)[pos // bs]
        rows = cache[blocks, :, pos % bs, :]                      # (n, heads, dim)
        row_scales = None if codec.scale_plane is None else \
            codec.scale_plane[blocks, :, pos % bs]
        _bits_view(out)[...] = _decode(rows, codec, row_scales, dst_kind).transpose(1, 0, 2)

    def gather_batch(self, cache, block_tables, lengths, out, codec, dst_kind):
        """``out[s, :, :lengths[s]]`` = sequence ``s``'s positions (block
        table row ``s``), read as ``gather`` reads them; the padding past
        each length is +0.  out: ``(batch, heads, max_len, dim)``."""
        out[...] = 0
        for s in range(out.shape[0]):
            n = int(lengths[s])
            if n:
                self.gather(cache, block_tables[s], 0, n, out[s, :, :n], codec, dst_kind)

    def copy_blocks(self, storage, src, dst):
        """``storage[:, dst[i]] = storage[:, src[i]]`` for each ``i`` in
        order, every plane (a block is copied whole, every layer, K and V)."""
        for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
            storage[:, d] = storage[:, s]

    def copy_blocks_between(self, src_storage, src, dst_storage, dst):
        """``dst_storage[:, dst[i]] = src_storage[:, src[i]]``: two storages of
        one geometry and dtype (possibly on different devices)."""
        for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
            dst_storage[:, d] = src_storage[:, s]

    def copier_for(self, other):
        """The backend that runs ``copy_blocks_between`` for storages of this
        backend and of backend ``other`` (either direction): one that reaches
        both sides' memory.  A device backend reaches host memory as well, so
        it drives its copies itself; a host backend leaves them to ``other``."""
        return self

    def write_block_bytes(self, arrays, block_ids, payloads, seeds=None, num_threads=1):
        """Write host bytes into whole blocks, and checksum them on the way.

        ``arrays``: storages with the blocks on axis 1 (a pool's storage,
        then its int8 scales), C-contiguous.  ``payloads[j]`` (uint8, the
        caller checked its size) holds ``arrays[0][:, block_ids[j]]``, then
        ``arrays[1][:, block_ids[j]]``, ... as C-ordered bytes; it is written
        into block ``block_ids[j]`` of each.  With ``seeds`` (one int per
        block) returns the XXH3-64 of each payload with its seed (the prefix
        stores' entry checksum), else None.  ``num_threads``: how many CPU
        threads the checksum may use (the bits do not depend on it).
        """
        # the payloads are host bytes on every device: the CPU kernel hashes them
        from .cpu._checksum import xxh3_64

        digests = None if seeds is None else [xxh3_64(p, s) for p, s in zip(payloads, seeds)]
        # (where each array's bytes lie in a payload: the same for every block)
        parts, at = [], 0
        for a in arrays:
            shape = (a.shape[0],) + tuple(a.shape[2:])
            n = a.nbytes // a.shape[1]
            parts.append((a, at, at + n, a.dtype, shape))
            at += n
        for b, p in zip(block_ids, payloads):
            for a, lo, hi, dt, shape in parts:
                a[:, b] = self.from_host(p[lo:hi].view(dt).reshape(shape))
        return digests

    def write_contiguous(self, dst, src, start, src_kind, codec):
        """``dst[b, h, start + t, :] = src[b, h, t, :]`` encoded by ``codec``
        (as ``write_slots``; int8 row scales to ``codec.scale_plane[b, h,
        start + t]``).  dst: ``(batch, heads, max_seq_len, dim)``; src:
        ``(batch, heads, n, dim)``; an int8 scale plane ``(batch, heads,
        max_seq_len)``."""
        n = src.shape[2]
        rows, row_scales = _encode(src, src_kind, codec)
        out = dst if codec.lowprec else _bits_view(dst)
        out[:, :, start:start + n, :] = rows
        if row_scales is not None:
            codec.scale_plane[:, :, start:start + n] = row_scales

    def dequantize(self, src, codec, dst, dst_kind):
        """``dst[...] = src`` read through ``codec`` as ``dst_kind``: any shape
        ``(..., dim)``, the same for both; an int8 ``codec.scale_plane``
        holds one scale per row of ``src`` (shape ``src.shape[:-1]``).  A
        float codec converts; the codec's own low-precision kind copies the
        codes."""
        _bits_view(dst)[...] = _decode(src, codec, codec.scale_plane, dst_kind)

    # ------------------------------------------------------------ attention
    def attention_plan(self, block_tables, seq_lens, query_start_loc, *, num_heads,
                       num_kv_heads, head_dim, block_size, num_blocks, kind, scale,
                       sliding_window, soft_cap, chunk_size=0, num_threads=1):
        """A plan for :meth:`attention_run`: host NumPy arrays in, already
        checked by the public layer (every block id a run can read lies in
        ``0..num_blocks - 1``): ``block_tables`` int32 ``(num_seqs,
        max_blocks)``, ``seq_lens`` int64 ``(num_seqs,)``,
        ``query_start_loc`` int64 ``(num_seqs + 1,)``; ``scale`` float,
        ``sliding_window`` int, ``soft_cap`` float and ``chunk_size`` int
        (0: off).  The plan owns copies of the arrays (a device backend:
        uploaded once)."""
        return _AttentionPlan(block_tables, seq_lens, query_start_loc, num_heads, num_kv_heads,
                              head_dim, block_size, num_blocks, kind, scale, sliding_window,
                              soft_cap, chunk_size, num_threads)

    def check_attention_features(self, chunk_size, alibi_slopes, sinks):
        """Raises ValueError naming a feature these kernels do not compute
        (``chunk_size`` an int, 0 off; ``alibi_slopes`` / ``sinks`` whether
        given); every one is computed here.  The public layer asks before
        anything is planned."""

    def check_attention_tables(self, block_tables, seq_lens, query_start_loc, num_tokens,
                               num_blocks, block_size, sliding_window, chunk_size=0):
        """The index check of an attention call, on host arrays (int32
        ``block_tables``, int64 ``seq_lens`` and ``query_start_loc``).

        Returns ``(status, a, b)``: status None when every argument is fine,
        else the first failure in this order, ``a`` / ``b`` where it is:
        ``"BAD_SEQ_LEN"`` (``seq_lens[a]`` outside ``0..max_blocks *
        block_size``), ``"BAD_FIRST_START"`` (``query_start_loc[0] != 0``),
        ``"DECREASING_START"`` (``query_start_loc[a + 1] <
        query_start_loc[a]``), ``"BAD_LAST_START"`` (``query_start_loc[-1]
        != num_tokens``), ``"SHORT_SEQ"`` (``seq_lens[a]`` below sequence
        ``a``'s query count), ``"BAD_BLOCK_ID"`` (``block_tables[a, b]``
        outside ``0..num_blocks - 1`` and read).  Read: every block a query
        of the sequence can see, from the first query's first visible
        position (0, or the later of its window's and its chunk's starts)
        to ``seq_lens[a] - 1``; a sequence without queries is not read."""
        tables = np.asarray(block_tables)
        lens = np.asarray(seq_lens, np.int64)
        qsl = np.asarray(query_start_loc, np.int64)
        num_seqs, max_blocks = tables.shape
        bad = (lens < 0) | (lens > max_blocks * block_size)
        if bad.any():
            return "BAD_SEQ_LEN", int(np.argmax(bad)), 0
        if qsl[0] != 0:
            return "BAD_FIRST_START", 0, 0
        counts = np.diff(qsl)
        if (counts < 0).any():
            return "DECREASING_START", int(np.argmax(counts < 0)), 0
        if qsl[-1] != num_tokens:
            return "BAD_LAST_START", 0, 0
        if (lens < counts).any():
            return "SHORT_SEQ", int(np.argmax(lens < counts)), 0
        first = np.zeros(num_seqs, np.int64)
        if sliding_window > 0:
            first = np.maximum(lens - counts + 1 - sliding_window, 0)
        if chunk_size > 0:
            first = np.maximum(first, (lens - counts) // chunk_size * chunk_size)
        b = np.arange(max_blocks)
        read = (counts[:, None] > 0) & (b >= (first // block_size)[:, None]) \
            & (b < (-(-lens // block_size))[:, None])
        bad = read & ((tables < 0) | (tables >= num_blocks))
        if bad.any():
            s, blk = divmod(int(np.argmax(bad)), max_blocks)
            return "BAD_BLOCK_ID", s, blk
        return None, 0, 0

    def attention_io_kinds(self, plan):
        """``(q_kinds, out_kinds)``: the element kinds (kvcore.dtypes) in
        which :meth:`attention_run` reads ``q`` and writes ``out`` for
        ``plan``; here float32 only (a backend whose kernels read and write
        float16 / bfloat16 themselves says so, and is handed them as they
        are)."""
        return _F32_IO

    def attention_run(self, plan, q, out, key_cache, value_cache, lowprec=None, *,
                      alibi_slopes=None, sinks=None):
        """``out[...]`` = the planned attention of ``q``.

        ``q`` float32 C-contiguous ``(num_tokens, num_heads, head_dim)``;
        ``out`` the same, written; ``key_cache`` / ``value_cache``
        ``(num_blocks, num_kv_heads, block_size, head_dim)`` in the storage
        dtype; ``lowprec`` None or ``(key_scales, value_scales, k_scale,
        v_scale)`` (int8: the layer's scale planes and 1.0, 1.0; fp8: None,
        None and the layer's scales); ``alibi_slopes`` / ``sinks`` None or
        float32 C-contiguous ``(num_heads,)`` arrays on the backend's
        device (the layer's, finite).  Here: :meth:`paged_attention` with
        the plan's arrays (a backend that overrides only that one runs it)."""
        self.paged_attention(q, out, key_cache, value_cache, plan.kind, plan.block_tables,
                             plan.seq_lens, plan.query_start_loc, plan.scale,
                             plan.sliding_window, plan.soft_cap, lowprec,
                             chunk_size=plan.chunk_size, alibi_slopes=alibi_slopes, sinks=sinks)

    def paged_attention(self, q, out, key_cache, value_cache, kind, block_tables, seq_lens,
                        query_start_loc, scale, sliding_window, soft_cap, lowprec=None, *,
                        chunk_size=0, alibi_slopes=None, sinks=None):
        """``out[...]`` = attention (arguments as :meth:`attention_plan` and
        :meth:`attention_run`); here in float64 (:func:`paged_attention_reference`)
        rounded once to float32."""
        name = dtypes.KIND_NAME[kind]
        key_scales = value_scales = None
        if lowprec is not None:
            key_scales, value_scales, k_scale, v_scale = lowprec
            if key_scales is None:          # fp8: one scale per layer
                key_scales, value_scales = k_scale, v_scale
        out[...] = paged_attention_reference(
            q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale=float(np.float32(scale)), sliding_window=int(sliding_window) or None,
            logits_soft_cap=float(np.float32(soft_cap)) or None, kind=name,
            key_scales=key_scales, value_scales=value_scales, chunk_size=int(chunk_size) or None,
            alibi_slopes=alibi_slopes, sinks=sinks)

    # ------------------------------------------------------------ memory
    def _ptr(self, a):
        """The address of ``a``'s first element."""
        return a.ctypes.data

    def overlaps(self, a, b):
        """Whether the memory spans of ``a`` and ``b`` may meet (a bounds check)."""
        return bool(self.xp.may_share_memory(a, b))


REFERENCE = Backend()
