"""The arguments of an attention step, checked: index arrays, the scalars
(scale, soft cap), the per-layer kinds (window, chunk) and the per-head
parameters (ALiBi slopes, sinks).  ``kvcore.attention`` calls these before
any work; each error names the argument, what was expected and what was
given."""
import math

import numpy as np

from . import _arrays
from . import dtypes as _dtypes
from ._validate import index_int
from .backends import backend_of_array, is_cuda_array

# Bounds the C kernels' integer fields hold (int64 positions, int head counts).
MAX_WINDOW = 2**62
MAX_HEADS = 2**16


def int_array(be, x, arg, ndim):
    if isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except ValueError as e:   # ragged nested lists
            raise ValueError(f"{arg} must be a {ndim}-D integer array, got {e}") from None
    else:
        a = _arrays.index_array(be, x, arg)
    if a.ndim != ndim:
        raise ValueError(f"{arg} must be {ndim}-D, got shape {tuple(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{arg} must hold integers, got dtype {a.dtype}")
    return a


def _positive_or_off(value, arg, convert, what):
    """``value`` converted and checked > 0, or 0 (off) for None."""
    if value is None:
        return 0
    v = convert(value, arg)
    if v <= 0:
        raise ValueError(f"{arg} must be {what} or None, got {v}")
    return v


def _is_real(value):
    return isinstance(value, (int, float, np.integer, np.floating)) \
        and not isinstance(value, (bool, np.bool_))


def _finite(value, arg):
    """Real ``value`` as a finite Python float, or ValueError naming ``arg``."""
    try:
        v = float(value)
    except OverflowError:      # an int past the float range
        try:
            digits = str(abs(value))
        except ValueError:     # past sys.get_int_max_str_digits(): no str of it
            raise ValueError(f"{arg} must be finite, got an int of {value.bit_length()} "
                             "bits") from None
        raise ValueError(f"{arg} must be finite, got {value!r:.24}... (an int of "
                         f"{len(digits)} digits)") from None
    if not math.isfinite(v):
        raise ValueError(f"{arg} must be finite, got {v}")
    return v


def _real(value, arg):
    if not _is_real(value):
        raise TypeError(f"{arg} must be a real number or None, got {type(value).__name__} "
                        f"{value!r}")
    return _finite(value, arg)


# The kernels compute in float32: ``scale`` and the soft cap ``c`` become
# C floats, the scores are scaled by ``scale * log2(e)`` (or capped as
# ``c * log2(e) * tanh(s * (1 / c))``).  A value is accepted only when all of
# these are finite, normal float32 numbers, so none of them overflows to inf
# or flushes to 0 (a cap of 0 would read as "no cap").  The kernels keep
# every accepted scale's scores finite (docs/api.md, "Extreme scales").
_LOG2E = np.float32(1.4426950408889634)
_F32_TINY = float(np.finfo(np.float32).tiny)          # 2**-126, the smallest normal
_F32_SCALED_MAX = float(np.float32(np.finfo(np.float32).max) / _LOG2E)


def _float32_real(value, arg, allow_zero):
    """``value`` (already a finite Python float) as the float32 the kernels
    use, checked to be usable there: finite, and 0 or of a magnitude in
    ``[2**-126, FLT_MAX / log2(e)]`` (``allow_zero``: whether 0 is valid)."""
    with np.errstate(over="ignore", under="ignore"):
        f = np.float32(value)
        scaled = f * _LOG2E
        inverse = np.float32(1.0) / f if f != 0 else np.float32(0)
    if value == 0 and allow_zero:
        return 0.0
    if not (np.isfinite(f) and np.isfinite(scaled) and np.isfinite(inverse)
            and abs(float(f)) >= _F32_TINY and abs(float(scaled)) >= _F32_TINY):
        zero = "0 or " if allow_zero else ""
        raise ValueError(f"{arg} must be {zero}a value whose magnitude lies in "
                         f"[{_F32_TINY:.8g}, {_F32_SCALED_MAX:.8g}] (the kernels compute in "
                         f"float32), got {value!r}")
    return float(f)


def _int64(a, arg):
    """1-D integer ``a`` as C-contiguous int64 (uint64 values past the int64
    range are an error here, before they could wrap)."""
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(a > np.iinfo(np.int64).max))
        raise ValueError(f"{arg}[{i}] = {int(a[i])} is out of range")
    return np.ascontiguousarray(a, dtype=np.int64)


def int32_table(t):
    """2-D integer ``t`` as C-contiguous int32; entries outside the int32
    range become -1 (never a block id, so reading one is an error)."""
    if t.dtype == np.int32:
        return np.ascontiguousarray(t)
    if t.size and t.dtype.itemsize >= 4 and (t.min() < -2**31 or t.max() > 2**31 - 1):
        t = np.where((t >= -2**31) & (t <= 2**31 - 1), t, -1)
    return np.ascontiguousarray(t, dtype=np.int32)


def _check_rows(x, rows, arg, what):
    """ValueError when ``x`` is a 1-D array of other than ``rows`` entries,
    read from its ``shape`` (NumPy, torch, CuPy) before any copy."""
    shape = getattr(x, "shape", None)
    if isinstance(shape, tuple) and len(shape) == 1 and shape[0] != rows:
        raise ValueError(f"{arg} must have {what}, got shape {tuple(shape)}")


def step_args(be, num_tokens, head_dim, block_tables, seq_lens, query_start_loc, scale,
              logits_soft_cap):
    """The checked host forms of the index arrays and the scalars:
    ``(tables, lens, qsl, num_tokens, scale, cap)`` (cap 0 when off).
    ``num_tokens`` None: the plan's query count is ``query_start_loc[-1]``
    (one per sequence without it).  Device index arrays are copied down (a
    synchronisation, once per plan)."""
    tables = int_array(be, block_tables, "block_tables", 2)
    num_seqs, max_blocks = tables.shape
    # (an array's rows checked before it is copied: a broadcast view of
    # 2**40 rows beside a short block_tables is a ValueError, not a MemoryError)
    _check_rows(seq_lens, num_seqs, "seq_lens",
                f"one entry per row of block_tables ({num_seqs})")
    _check_rows(query_start_loc, num_seqs + 1, "query_start_loc",
                f"num_seqs + 1 = {num_seqs + 1} entries")
    lens_in = int_array(be, seq_lens, "seq_lens", 1)
    if lens_in.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must have one entry per row of block_tables ({num_seqs}), "
                         f"got shape {tuple(lens_in.shape)}")
    lens = _int64(lens_in, "seq_lens")
    if query_start_loc is None:
        if num_tokens is not None and num_tokens != num_seqs:
            raise ValueError(
                f"without query_start_loc there is one query per sequence: q.shape[0] must be "
                f"num_seqs={num_seqs}, got {num_tokens}")
        qsl = np.arange(num_seqs + 1, dtype=np.int64)
    else:
        qsl_in = int_array(be, query_start_loc, "query_start_loc", 1)
        if qsl_in.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                             f"got shape {tuple(qsl_in.shape)}")
        qsl = _int64(qsl_in, "query_start_loc")
    if num_tokens is None:
        num_tokens = max(0, int(qsl[-1]))

    if scale is None:
        scale_v = 1.0 / math.sqrt(head_dim)
    else:
        scale_v = _float32_real(_real(scale, "scale"), "scale", allow_zero=True)
    cap_v = _positive_or_off(logits_soft_cap, "logits_soft_cap", _real, "positive")   # 0: off
    if cap_v:
        cap_v = _float32_real(cap_v, "logits_soft_cap", allow_zero=False)
    return tables, lens, qsl, num_tokens, scale_v, cap_v


def _one_length(value, arg):
    """A window or chunk length given for every layer: 1..2**62."""
    v = _positive_or_off(value, arg, index_int, "a positive integer")
    if v > MAX_WINDOW:   # the kernels hold it in int64 position arithmetic
        raise ValueError(f"{arg} must be in 1..2**62 or None, got {v}")
    return v


def layer_lengths(value, arg, num_layers):
    """``sliding_window`` / ``chunk_size`` as one int per layer (0: off):
    None, a positive int (every layer), or a sequence of ``num_layers``
    entries, each None, 0 (off) or a positive int (per-layer kinds)."""
    if value is None:
        return (0,) * num_layers
    if isinstance(value, (list, tuple, range)) or \
            (isinstance(value, np.ndarray) and value.ndim == 1):
        entries = list(value)
        if len(entries) != num_layers:
            raise ValueError(f"{arg} must be None, a positive integer or a sequence of "
                             f"num_layers={num_layers} entries (one per layer), got "
                             f"{len(entries)} entries")
        lengths = []
        for i, v in enumerate(entries):
            n = 0 if v is None else index_int(v, f"{arg}[{i}]")
            if not 0 <= n <= MAX_WINDOW:
                raise ValueError(f"{arg}[{i}] must be None, 0 (off) or in 1..2**62, got {n}")
            lengths.append(n)
        return tuple(lengths)
    return (_one_length(value, arg),) * num_layers


def _first_bool(x, at=()):
    """Where the first bool of nested lists/tuples ``x`` is, or None."""
    for i, e in enumerate(x):
        if isinstance(e, (bool, np.bool_)):
            return at + (i,)
        if isinstance(e, (list, tuple)):
            found = _first_bool(e, at + (i,))
            if found is not None:
                return found
    return None


def _entry(x, at):
    for i in at:
        x = x[i]
    return x


#: the largest |alibi_slopes| entry: a slope times log2(e) times any key
#: distance (int64) stays finite in float32 (2^32 * 1.45 * 2^63 < 2^96), so
#: a bias is never +-inf (whose inf - inf in the softmax was NaN); a model's
#: slopes lie in 2^-8 .. 1
ALIBI_SLOPE_LIMIT = 2.0 ** 32


def head_rows(x, arg, num_layers, limit=None):
    """``alibi_slopes`` / ``sinks`` as a float32 ``(num_layers, num_heads)``
    C-contiguous host array (None stays None): a float array (NumPy, torch,
    CuPy; any float dtype) or a sequence of numbers of shape
    ``(num_heads,)`` (every layer) or ``(num_layers, num_heads)``, with
    finite values as float32 (and, given ``limit``, a power of two, none
    past it in magnitude).  A device array is copied down (once per plan)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{arg} must be a float array of shape (num_heads,) or "
                            f"(num_layers, num_heads), got {type(x).__name__}: {e}") from None
        if a.dtype == object:    # ints past int64, None, ...: each a real number or an error
            for at in np.ndindex(a.shape):
                where = f"{arg}[{', '.join(map(str, at))}]"
                if not _is_real(a[at]):
                    raise TypeError(f"{where} must be a real number, got "
                                    f"{type(a[at]).__name__} {a[at]!r:.40}")
                a[at] = _finite(a[at], where)
            a = a.astype(np.float64)
        if a.dtype.kind not in "iuf":
            raise TypeError(f"{arg} must be a float array of shape (num_heads,) or "
                            f"(num_layers, num_heads), got a {type(x).__name__} of {a.dtype}")
        at = _first_bool(x)       # (NumPy reads a bool among numbers as 0 or 1)
        if at is not None:
            where = f"{arg}[{', '.join(map(str, at))}]"
            raise TypeError(f"{where} must be a real number, got bool {_entry(x, at)!r}")
        a = a.astype(np.float64)
    else:
        y, bf16 = _arrays.unwrap(x, arg)
        be = backend_of_array(y)
        a = be.to_host(be.asarray(y, arg)) if is_cuda_array(y) else be.asarray(y, arg)
        if bf16:
            a = (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif _dtypes.float_kind(a.dtype) is None and a.dtype != np.float64:
            raise TypeError(f"{arg} must hold floats (float16 / bfloat16 / float32 / float64), "
                            f"got dtype {a.dtype}")
    if a.ndim not in (1, 2) or a.shape[-1] == 0 or (a.ndim == 2 and a.shape[0] != num_layers):
        raise ValueError(f"{arg} must have shape (num_heads,) or (num_layers={num_layers}, "
                         f"num_heads), got {tuple(a.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        rows = np.array(np.broadcast_to(a, (num_layers, a.shape[-1])), np.float32, order="C")
    def first(bad):      # the index in x of the first True of bad (rows' shape)
        at = np.unravel_index(int(np.argmax(bad)), rows.shape)
        return int(at[1]) if a.ndim == 1 else (int(at[0]), int(at[1]))

    bad = ~np.isfinite(rows)
    if bad.any():
        where = first(bad)
        raise ValueError(f"{arg} must hold finite values (as float32), got {float(a[where])} "
                         f"at index {where}")
    if limit is not None:
        big = np.abs(rows) > limit
        if big.any():
            where = first(big)
            bound = f"2**{int(np.log2(limit))}"
            raise ValueError(f"{arg} must lie in -{bound}..{bound} (a bias slope * distance "
                             f"must stay finite in float32), got {float(a[where])} at index "
                             f"{where}")
    return rows


def raise_table_error(status, a, b, tables, lens, qsl, block_size, num_blocks, num_tokens):
    if status == "BAD_SEQ_LEN":
        cap = tables.shape[1] * block_size
        raise ValueError(f"seq_lens must lie in 0..{cap} (block_tables.shape[1] * block_size "
                         f"= {tables.shape[1]} * {block_size}), got {int(lens[a])} at index {a}")
    if status == "BAD_FIRST_START":
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    if status == "DECREASING_START":
        raise ValueError(f"query_start_loc must be non-decreasing, got {int(qsl[a])} then "
                         f"{int(qsl[a + 1])} at index {a}")
    if status == "BAD_LAST_START":
        raise ValueError(f"query_start_loc[-1] must be q.shape[0]={num_tokens} (the number of "
                         f"query tokens), got {int(qsl[-1])}")
    if status == "SHORT_SEQ":
        raise ValueError(f"seq_lens[{a}] = {int(lens[a])} is less than the "
                         f"{int(qsl[a + 1] - qsl[a])} query tokens of sequence {a}: seq_lens "
                         "counts the queries too")
    if status == "BAD_BLOCK_ID":
        raise IndexError(f"block_tables[{a}, {b}] must be a block id in 0..{num_blocks - 1} "
                         f"(position {b * block_size} of sequence {a} is read), got "
                         f"{int(tables[a, b])}")
    raise AssertionError(f"unknown check status {status}")  # pragma: no cover


def check_tables(be, tables, lens, qsl, num_tokens, num_blocks, block_size, kinds):
    """The index check over every layer kind ``(window, chunk)`` in
    ``kinds``: the blocks a run can read are those of the kind that sees
    the most (per sequence, the smallest first position), so the first
    failure is the same as one check over their union (the checks before
    the block ids do not depend on the kind)."""
    worst = None
    for window, chunk in kinds:
        status, a, b = be.check_attention_tables(tables, lens, qsl, num_tokens, num_blocks,
                                                 block_size, window, chunk)
        if status is None:
            continue
        if status != "BAD_BLOCK_ID":
            return status, a, b
        if worst is None or (a, b) < worst[1:]:
            worst = (status, a, b)
    return worst or (None, 0, 0)
