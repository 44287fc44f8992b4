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
the same bits; ``tests/pool/test_backends.py`` checks each one against this class,
operation by operation.  A new kernel gets its reference here first.

Element kinds are ``kvcore.dtypes.F32 / F16 / BF16``; a bfloat16 array is
held as its uint16 bits.  Layouts:

* a paged plane (one layer's keys or values): ``(num_blocks, heads,
  block_size, dim)``; a pool's storage stacks ``2 * num_layers`` planes;
* tokens in: ``(n, heads, dim)``; a gather's output: ``(heads, n, dim)``;
* a contiguous cache: ``(batch, heads, max_seq_len, dim)``.
"""
import math
import operator
import weakref

import numpy as np

from .. import dtypes
from .elements import (bits_view, convert_bits, decode, encode, f32_bits_from_fp8,
                       fp8_decode, fp8_encode, fp8_from_f32_bits, int8_decode, int8_encode)
from .reference_attention import paged_attention_reference, stored_values

__all__ = ["Backend", "REFERENCE", "is_cuda_array", "paged_attention_reference",
           "stored_values", "convert_bits", "fp8_from_f32_bits", "f32_bits_from_fp8",
           "fp8_encode", "fp8_decode", "int8_encode", "int8_decode"]

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


# The arrays owned_index_arrays made: id -> weak reference (a plain dict of
# plain references: a WeakValueDictionary's callbacks cost more than the
# copies).  Taken as they are, so a step's index arrays are copied once, by
# AttentionPlan, however many backend plans (one per layer kind) hold them.
# An entry whose array died is dropped by _forget_dead_owned; until then it
# matches nothing (its reference gives None), and an entry lost to a race
# between threads only costs a copy.
_OWNED_INDEX = {}
_OWNED_PURGE_AT = 1024


def _forget_dead_owned():
    global _OWNED_PURGE_AT
    for key, ref in list(_OWNED_INDEX.items()):
        if ref() is None and _OWNED_INDEX.get(key) is ref:
            _OWNED_INDEX.pop(key, None)
    _OWNED_PURGE_AT = max(1024, 2 * len(_OWNED_INDEX))


def owned_index_arrays(block_tables, seq_lens, query_start_loc):
    """The plan's own read-only copies of a step's index arrays: C-contiguous
    int32 ``block_tables``, int64 ``seq_lens`` and ``query_start_loc``.

    A caller changing its arrays afterwards (or meanwhile, on another thread)
    changes nothing a plan checked or runs on.  The one statement of this
    rule: ``kvcore.AttentionPlan``, the reference plan and the CPU plan
    (``_attention.Plan``) all hold what this returns; arrays it returned
    before are taken as they are."""
    out = []
    for a, dtype in ((block_tables, np.int32), (seq_lens, np.int64),
                     (query_start_loc, np.int64)):
        ref = _OWNED_INDEX.get(id(a))
        if ref is None or ref() is not a:
            a = np.array(a, dtype, order="C", copy=True)
            a.flags.writeable = False
            _OWNED_INDEX[id(a)] = weakref.ref(a)
        out.append(a)
    if len(_OWNED_INDEX) > _OWNED_PURGE_AT:
        _forget_dead_owned()
    return tuple(out)


class _AttentionPlan:
    """``Backend.attention_plan``'s plan: owned copies of the checked index
    arrays and the scalars (what ``attention_run`` passes on)."""

    def __init__(self, block_tables, seq_lens, query_start_loc, num_heads, num_kv_heads,
                 head_dim, block_size, num_blocks, kind, scale, sliding_window, soft_cap,
                 chunk_size, num_threads):
        self.block_tables, self.seq_lens, self.query_start_loc = owned_index_arrays(
            block_tables, seq_lens, query_start_loc)
        self.num_tokens = int(self.query_start_loc[-1])
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.num_blocks, self.kind = block_size, num_blocks, kind
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.chunk_size = chunk_size
        self.num_threads = num_threads


#: where :meth:`Backend.zeros` starts host memory: a cache line, and a huge
#: page for allocations of four huge pages or more
LINE_ALIGN, HUGE_ALIGN = 64, 2 << 20


def _aligned_zeros(shape, dtype):
    """``np.zeros(shape, dtype)`` with its data starting on a line (a huge
    page from 4 of them up): one allocation of the bytes plus the slack,
    sliced."""
    dtype = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dims = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must not have negative dimensions, got {dims}")
    nbytes = math.prod(dims) * dtype.itemsize
    align = HUGE_ALIGN if nbytes >= 4 * HUGE_ALIGN else LINE_ALIGN
    try:
        raw = np.zeros(nbytes + align, np.uint8)
    except (MemoryError, ValueError) as e:
        kind = MemoryError if isinstance(e, MemoryError) else ValueError
        raise kind(f"cannot allocate {nbytes} bytes for an array of shape {dims} and "
                   f"dtype {dtype}: {e}") from None
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(dims)


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
        """Zero-filled host memory whose data starts on a cache line (on a
        2 MiB boundary from 8 MiB up): the kernels' vector loads of a page
        row then never straddle two lines (``np.zeros`` starts 16 bytes into
        a page) and large pools can sit in huge pages.  Still one lazily
        zeroed ``calloc``: untouched pages cost no memory."""
        return _aligned_zeros(shape, dtype)

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

    def position_writer(self, storage, kind, scale_planes=None, layer_scales=None,
                        head_scales=None):
        """A pool's one native writer into ``storage`` (a
        ``kvcore._native._typedefs.RowWriter`` with ``write_slots``: a
        sequence's appends, a decode step's rows by slots), or None: both
        then go through ``write_positions`` / ``write_slots_kv``.  The
        fields of every plane's codec at once: ``scale_planes`` an int8
        pool's, ``layer_scales`` an fp8 pool's float32 ``(num_layers, 2)``,
        ``head_scales`` float32 ``(num_layers, 2, num_kv_heads)`` or None."""
        return None

    # ------------------------------------------------------------- kernels
    def convert(self, src, src_kind, dst, dst_kind):
        """``dst[...] = src`` converted; same shape, any strides; ``src`` is
        read as it was before the call even when it overlaps ``dst``."""
        bits_view(dst)[...] = convert_bits(bits_view(src), src_kind, dst_kind)

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
        rows, row_scales = encode(src, src_kind, codec)
        dst = cache if codec.lowprec else bits_view(cache)
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
        bits_view(out)[...] = decode(rows, codec, row_scales, dst_kind).transpose(1, 0, 2)

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
        rows, row_scales = encode(src, src_kind, codec)
        out = dst if codec.lowprec else bits_view(dst)
        out[:, :, start:start + n, :] = rows
        if row_scales is not None:
            codec.scale_plane[:, :, start:start + n] = row_scales

    def dequantize(self, src, codec, dst, dst_kind):
        """``dst[...] = src`` read through ``codec`` as ``dst_kind``: any shape
        ``(..., dim)``, the same for both; an int8 ``codec.scale_plane``
        holds one scale per row of ``src`` (shape ``src.shape[:-1]``).  A
        float codec converts; the codec's own low-precision kind copies the
        codes."""
        bits_view(dst)[...] = decode(src, codec, codec.scale_plane, dst_kind)

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

    def attention_io_kinds(self, plan):
        """``(q_kinds, out_kinds)``: the element kinds (kvcore.dtypes) in
        which :meth:`attention_run` reads ``q`` and writes ``out`` for
        ``plan``; here float32 only (a backend whose kernels read and write
        float16 / bfloat16 themselves says so, and is handed them as they
        are)."""
        return _F32_IO

    def attention_run(self, plan, q, out, key_cache, value_cache, codecs=None, *,
                      alibi_slopes=None, sinks=None):
        """``out[...]`` = the planned attention of ``q``.

        ``q`` float32 C-contiguous ``(num_tokens, num_heads, head_dim)``;
        ``out`` the same, written; ``key_cache`` / ``value_cache``
        ``(num_blocks, num_kv_heads, block_size, head_dim)`` in the storage
        dtype; ``codecs`` the planes' ``(key_codec, value_codec)`` (the
        layer's :class:`Codec` pair, of the plan's kind: an int8 layer's
        scale planes, an fp8 layer's scales), or None for unscaled planes;
        ``alibi_slopes`` / ``sinks`` None or
        float32 C-contiguous ``(num_heads,)`` arrays on the backend's
        device (the layer's, finite).  Here: :meth:`paged_attention` with
        the plan's arrays (a backend that overrides only that one runs it)."""
        self.paged_attention(q, out, key_cache, value_cache, plan.kind, plan.block_tables,
                             plan.seq_lens, plan.query_start_loc, plan.scale,
                             plan.sliding_window, plan.soft_cap, codecs,
                             chunk_size=plan.chunk_size, alibi_slopes=alibi_slopes, sinks=sinks)

    def paged_attention(self, q, out, key_cache, value_cache, kind, block_tables, seq_lens,
                        query_start_loc, scale, sliding_window, soft_cap, codecs=None, *,
                        chunk_size=0, alibi_slopes=None, sinks=None):
        """``out[...]`` = attention (arguments as :meth:`attention_plan` and
        :meth:`attention_run`); here in float64 (:func:`paged_attention_reference`)
        rounded once to float32."""
        name = dtypes.KIND_NAME[kind]
        key_scales = value_scales = None
        if codecs is not None:
            key_scales, value_scales = (_reference_scales(c, kind) for c in codecs)
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


def _reference_scales(codec, kind):
    """What :func:`paged_attention_reference` reads a plane of ``codec``
    with: its scale plane (int8), per-kv-head scales or layer scale (fp8)."""
    if codec.kind != kind:
        raise ValueError(f"codecs must be of the pages' kind {dtypes.KIND_NAME[kind]}, got "
                         f"{dtypes.KIND_NAME.get(codec.kind, codec.kind)}")
    if codec.scale_plane is not None:
        return codec.scale_plane
    return codec.head_scales if codec.head_scales is not None else codec.layer_scale


REFERENCE = Backend()
