"""The CPU backend: ``Backend``'s interface over the Cython/C kernels of this
folder (``_convert``, ``_kernels``, ``_attention``, ``_checksum``).  The array helpers are
``Backend``'s (NumPy arrays in host memory); every kernel here gives the bits
of ``Backend``'s reference.

Arguments reaching these methods have been validated by the caller: shapes,
kinds, slot and block ranges, index arrays int32/int64, C-contiguous and
aligned.  The kernels themselves release the GIL.
"""
import numpy as np

from ... import dtypes
from ..base import Backend
from . import _attention, _checksum, _convert, _kernels

# What attention_run takes as q and out (attention_io_kinds).
_FLOATS = frozenset({dtypes.F32, dtypes.F16, dtypes.BF16})
_FLOAT_IO = (_FLOATS, _FLOATS)


def _aligned_ids(a):
    """``a`` as a C-contiguous, aligned int32 array (the kernels load ids as int32)."""
    a = np.ascontiguousarray(a, np.int32)
    return a if a.flags.aligned else a.copy()


def _elementwise(src, dst, kernel):
    """``kernel(src, dst)`` for arrays of any alignment that may overlap:
    the kernels load and store typed elements, so a misaligned or
    overlapping ``src`` is read from a copy, and a misaligned ``dst`` is
    filled through an aligned temporary that NumPy then copies into place."""
    if np.may_share_memory(src, dst) or not src.flags.aligned:
        src = src.copy()
    if not dst.flags.aligned:
        tmp = np.empty(dst.shape, dst.dtype)
        kernel(src, tmp)
        dst[...] = tmp
        return
    kernel(src, dst)


class CPUBackend(Backend):
    """NumPy arrays in host memory; Cython/C kernels (GIL released)."""

    name = "cpu"
    # fp8 planes may hold one scale per kv head (Codec.head_scales)
    per_head_fp8_scales = True

    def convert(self, src, src_kind, dst, dst_kind):
        """dst[...] = src converted; same shape, any strides, any alignment,
        overlap allowed (src is read as it was before the call)."""
        _elementwise(src, dst, lambda s, d: _convert.convert_array(s, src_kind, d, dst_kind))

    def convert_fp8(self, src, dst, fmt, narrow, saturate=False):
        """float32 -> fp8 codes (``narrow``) or back; same shape, any strides,
        any alignment, overlap allowed (as ``convert``)."""
        _elementwise(src, dst, lambda s, d: _convert.fp8_array(s, d, fmt, narrow, saturate))

    def apart(self, a, storage):
        """``a``, or a C-contiguous copy of it when its memory span meets
        ``storage``'s (one bounds check, cheaper than NumPy's)."""
        return _kernels.apart(a, storage)

    def overlaps(self, a, b):
        return _kernels.overlaps(a, b)

    @staticmethod
    def _ptr(a):
        return _attention.address(a)

    def direct_out(self, out, storage):
        f = out.flags
        return f.c_contiguous and f.aligned and not _kernels.overlaps(out, storage)

    def write_slots(self, cache, src, slots, src_kind, codec):
        """src is read as it was, also when it is a view of ``cache`` or of
        the codec's scale plane (a caller that writes both planes of a layer
        stages its inputs with ``apart`` against the whole storage first)."""
        src = _kernels.apart(src, cache)
        plane = codec.scale_plane
        if plane is not None:
            src = _kernels.apart(src, plane)
        flags = src.flags
        if not (flags.c_contiguous and flags.aligned):
            src = self.inner_contiguous(src)
        _kernels.write_slots(cache, src, slots, src_kind, codec.kind, codec.layer_scale, plane,
                             codec.head_scales)

    def write_positions(self, storage, layer, k, v, block_table, start, src_kind, k_codec,
                        v_codec):
        """K and V in one kernel call (storage C-contiguous; k, v apart from it)."""
        _kernels.write_positions(storage, layer, self._rows(k), self._rows(v), block_table,
                                 start, src_kind, k_codec.kind, k_codec.layer_scale,
                                 v_codec.layer_scale, k_codec.scale_plane, v_codec.scale_plane,
                                 k_codec.head_scales, v_codec.head_scales)

    @staticmethod
    def _rows(a):
        if not (a.flags.c_contiguous and a.flags.aligned):
            a = np.array(a, order="C", copy=True)
        return a

    def position_writer(self, storage, kind, scale_planes=None, layer_scales=None,
                        head_scales=None):
        """A ``_kernels.PositionWriter``: PagedKVCache.append and kvcore.hf's
        decode writes in one native call each, with write_positions' loop."""
        if isinstance(storage, np.ndarray) and storage.flags.c_contiguous:
            return _kernels.PositionWriter(storage, kind, scale_planes, layer_scales,
                                           head_scales)
        return None

    def gather(self, cache, block_table, start, end, out, codec, dst_kind):
        """out: (heads, end - start, dim), C-contiguous, aligned, apart from
        cache; block_table: int32, C-contiguous, aligned."""
        _kernels.gather(cache, block_table, start, end, out, codec.kind, dst_kind,
                        codec.layer_scale, codec.scale_plane, codec.head_scales)

    def gather_batch(self, cache, block_tables, lengths, out, codec, dst_kind):
        out[...] = 0
        kind, scale, plane, heads = codec.kind, codec.layer_scale, codec.scale_plane, \
            codec.head_scales
        for s in range(out.shape[0]):
            n = int(lengths[s])
            if n:
                # (rows of a head back to back, as gather writes them)
                _kernels.gather(cache, _aligned_ids(block_tables[s]), 0, n,
                                out[s, :, :n] if n < out.shape[2] else out[s], kind, dst_kind,
                                scale, plane, heads)

    def write_contiguous(self, dst, src, start, src_kind, codec):
        # the kernel writes rows of dst back to back: dst must be C-contiguous
        assert dst.flags.c_contiguous, "write_contiguous needs a C-contiguous destination"
        src = _kernels.apart(src, dst)  # e.g. a view of the cache itself
        _kernels.write_contiguous(dst, self.inner_contiguous(src), start, src_kind, codec.kind,
                                  codec.layer_scale, codec.scale_plane, codec.head_scales)

    def dequantize(self, src, codec, dst, dst_kind):
        if not codec.lowprec:
            self.convert(src, codec.kind, dst, dst_kind)
            return
        if dst_kind == codec.kind:      # the codes, raw
            dst[...] = src
            return
        d = src.shape[-1]
        s2 = np.ascontiguousarray(src).reshape(-1, d)
        plane = codec.scale_plane
        sc = None if plane is None else np.ascontiguousarray(plane, np.float32).reshape(-1)
        rs = None
        if codec.head_scales is not None:   # each row's head's scale (heads: axis -3)
            rs = np.ascontiguousarray(np.broadcast_to(
                codec.head_scales[:, None], src.shape[:-1]), np.float32).reshape(-1)
        if dst.flags.c_contiguous and dst.flags.aligned:
            _kernels.dequantize(s2, sc, codec.kind, dst.reshape(-1, d), dst_kind,
                                codec.layer_scale, rs)
        else:
            tmp = np.empty(dst.shape, dst.dtype)
            _kernels.dequantize(s2, sc, codec.kind, tmp.reshape(-1, d), dst_kind,
                                codec.layer_scale, rs)
            dst[...] = tmp

    def copy_blocks(self, storage, src, dst):
        _kernels.copy_blocks(storage, src, dst)

    def copy_blocks_between(self, src_storage, src, dst_storage, dst):
        _kernels.copy_blocks_between(src_storage, src, dst_storage, dst)

    def copier_for(self, other):
        # host code cannot reach a device's memory; a device backend reaches ours
        return other

    def write_block_bytes(self, arrays, block_ids, payloads, seeds=None, num_threads=1):
        """With ``seeds``: every block in one native call, the GIL released,
        the checksums computed while copying, split over ``num_threads``
        (the same bits for any count).  Plane ``p`` of block ``b`` starts at
        byte ``(p * num_blocks + b) * chunk`` of a C-contiguous array."""
        if seeds is None:
            return super().write_block_bytes(arrays, block_ids, payloads)
        parts = []
        for a in arrays:
            planes, num_blocks = a.shape[0], a.shape[1]
            chunk = a.nbytes // (planes * num_blocks)     # one block of one plane
            parts.append((a.reshape(-1).view(np.uint8), [b * chunk for b in block_ids],
                          planes, chunk, num_blocks * chunk))
        return _checksum.copy_xxh3_many(payloads, parts, seeds, num_threads)

    # ------------------------------------------------- attention
    def attention_plan(self, block_tables, seq_lens, query_start_loc, *, num_heads,
                       num_kv_heads, head_dim, block_size, num_blocks, kind, scale,
                       sliding_window, soft_cap, chunk_size=0, num_threads=1):
        """A ``_attention.Plan``: owned copies of the index arrays and the C
        arguments' shape fields (see ``Backend.attention_plan``)."""
        return _attention.Plan(block_tables, seq_lens, query_start_loc, num_heads,
                               num_kv_heads, head_dim, block_size, num_blocks, kind, scale,
                               sliding_window, soft_cap, chunk_size, num_threads)

    def check_attention_tables(self, block_tables, seq_lens, query_start_loc, num_tokens,
                               num_blocks, block_size, sliding_window, chunk_size=0):
        """The index check of an attention call on host arrays (int32
        ``block_tables``, int64 ``seq_lens`` and ``query_start_loc``), in one
        native pass: the one statement of this rule (``kvcore.AttentionPlan``
        checks the tables of every device's plans here).

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
        status, a, b = _attention.check_tables(block_tables, seq_lens, query_start_loc,
                                               num_tokens, num_blocks, block_size,
                                               sliding_window, chunk_size)
        return _attention.STATUS_NAMES.get(status), a, b

    def attention_io_kinds(self, plan):
        """``(q_kinds, out_kinds)``: float32, float16 and bfloat16 (its uint16
        bits) for both; the kernels widen q's rows and narrow out's
        themselves, with kvcore's conversions (the bits of converting the
        whole arrays)."""
        return _FLOAT_IO

    def attention_run(self, plan, q, out, key_cache, value_cache, codecs=None, *,
                      alibi_slopes=None, sinks=None):
        """The C kernel on the plan (GIL released; one run at a time per plan)."""
        plan.run(q, out, key_cache, value_cache, codecs, alibi_slopes=alibi_slopes,
                 sinks=sinks)

    def paged_attention(self, q, out, key_cache, value_cache, kind, block_tables, seq_lens,
                        query_start_loc, scale, sliding_window, soft_cap, codecs=None, *,
                        chunk_size=0, alibi_slopes=None, sinks=None, num_threads=1):
        """``attention_run(attention_plan(...))`` in one call (the public layer
        plans once per step and passes its thread count there)."""
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
        plan = self.attention_plan(block_tables, seq_lens, query_start_loc,
                                   num_heads=q.shape[1], num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, block_size=block_size,
                                   num_blocks=num_blocks, kind=kind, scale=scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   chunk_size=chunk_size, num_threads=num_threads)
        self.attention_run(plan, q, out, key_cache, value_cache, codecs,
                           alibi_slopes=alibi_slopes, sinks=sinks)


CPU = CPUBackend()
