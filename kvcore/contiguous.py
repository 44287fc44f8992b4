"""Contiguous KV cache: one preallocated buffer per layer, the seeds' layout.

Per layer, K and V have shape ``(batch_size, num_kv_heads, max_seq_len,
head_dim)``; all layers live in one allocation of shape
``(num_layers, 2, batch_size, num_kv_heads, max_seq_len, head_dim)``.
Writes convert to the storage dtype with the round-to-nearest-even kernels of
the device's backend; reads are views.  Positions that were never written
(or were forgotten by ``reset``/``truncate``) can never be read back.
"""

import numpy as np

from . import _arrays, dtypes
from .backends import Codec, get_backend
from .dtypes import KIND_NAME
from ._errors import CacheFullError
from ._planes import (Planes, allocate_storage, check_head_scales_backend, check_layer_scales,
                      kv_scale_pairs)
from ._validate import index_int, kernel_count, num_layers_int, positive_int

__all__ = ["KVCache"]


class KVCache:
    """Contiguous KV cache for one batch of sequences that advance together.

    Every layer holds K and V of shape ``(batch_size, num_kv_heads,
    max_seq_len, head_dim)`` in the storage dtype, allocated once (one buffer
    for all layers) on ``device``.  Writes go through :meth:`update`, reads
    through :meth:`get`.  Each layer tracks how many positions it holds, so a
    forward pass may update the layers one after the other; :attr:`seq_len`
    is the number of positions written in every layer.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, max_seq_len : int
        Geometry, each >= 1.  ``max_seq_len`` is the capacity in positions;
        a write past it raises :class:`kvcore.CacheFullError`.
    batch_size : int, default 1
        Sequences in the batch.  They share positions: position ``t`` of every
        sequence is written by the same :meth:`update`.
    dtype : str or dtype, default "float16"
        Storage dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (aliases
        ``"f32"``, ``"f16"``, ``"bf16"``; ``numpy.float32``, ``numpy.float16``
        and ``ml_dtypes.bfloat16`` too).  bfloat16 is stored, and returned,
        as ``numpy.uint16`` arrays of raw bits.  Low precision, as for
        :class:`kvcore.BlockPool`: ``"float8_e4m3fn"`` / ``"float8_e5m2"``
        (uint8 bits, per-layer or per-head ``kv_scales``) and ``"int8"`` (one float32
        scale per (batch row, kv head, position), see :meth:`get_scales`);
        ``get(..., dtype="float32")`` dequantizes, ``get()`` returns codes.
    device : str, default "cpu"
        ``"cpu"`` (NumPy arrays) or ``"cuda"``/``"cuda:N"`` (CuPy arrays).
    kv_scales : sequence of num_layers (k_scale, v_scale) pairs, optional
        fp8 only: per-layer or per-KV-head scales (default 1.0), as for
        BlockPool.

    Raises
    ------
    TypeError, ValueError
        For a bad geometry, dtype or device, naming the argument.
    MemoryError
        When the buffer cannot be allocated (the message names the
        arguments that size it and its bytes; a ValueError for a size past
        what NumPy asks the allocator for).

    Notes
    -----
    - The buffer is not zero-filled: unwritten positions hold arbitrary
      bytes, which is why :meth:`get` refuses to read them and why
      :meth:`reset` is O(1).  :meth:`key_cache`/:meth:`value_cache` expose
      the raw buffers for kernels that take a length separately.
    - After any exception the cache is exactly as it was before the call.
    - There is no ``len()``: "length" could mean layers or positions; use
      :attr:`seq_len` or :attr:`num_layers`.
    - One thread at a time may drive a cache.

    Examples
    --------
    >>> cache = kvcore.KVCache(num_layers=2, num_kv_heads=4, head_dim=64,
    ...                        max_seq_len=1024, dtype="float16")
    >>> for layer in range(2):                  # the prompt: 7 positions
    ...     cache.update(layer, k_prompt, v_prompt)   # (1, 4, 7, 64) float32
    >>> for layer in range(2):                  # one decode step
    ...     cache.update(layer, k_tok, v_tok)         # (1, 4, 1, 64)
    ...     k, v = cache.get(layer)                   # (1, 4, 8, 64) float16 views
    >>> cache.seq_len
    8
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, max_seq_len,
                 batch_size=1, dtype="float16", device="cpu", kv_scales=None):
        num_layers = num_layers_int(num_layers)
        num_kv_heads = kernel_count(num_kv_heads, "num_kv_heads")
        head_dim = kernel_count(head_dim, "head_dim")
        max_seq_len = positive_int(max_seq_len, "max_seq_len")
        batch_size = positive_int(batch_size, "batch_size")
        kind = dtypes.storage_kind(dtype, "dtype")
        layer_scales, head_scales = check_layer_scales(kv_scales, kind, num_layers, num_kv_heads)
        backend = get_backend(device)
        check_head_scales_backend(head_scales, backend)
        shape = (num_layers, 2, batch_size, num_kv_heads, max_seq_len, head_dim)
        storage = self._allocate(backend, shape, kind)
        scale_planes = backend.zeros(shape[:5], np.float32) if kind == dtypes.I8 else None
        self._init_from(backend, backend.normalize_device(device), kind, storage,
                        [0] * num_layers, scale_planes, layer_scales, head_scales)

    # ------------------------------------------------------------ internals
    @staticmethod
    def _allocate(backend, shape, kind):
        # (zeros: one zero-filled allocation starting on a cache line, as a
        # pool's storage; its attention reads long contiguous runs of rows
        # and measured the same either way)
        names = ("num_layers", None, "batch_size", "num_kv_heads", "max_seq_len", "head_dim")
        return allocate_storage(backend, shape, kind, "the KV cache's buffer",
                                [f"{n}={v}" if n else "2 (K, V)" for n, v in zip(names, shape)])

    def _init_from(self, backend, device, kind, storage, lengths, scale_planes=None,
                   layer_scales=None, head_scales=None):
        self._backend = backend
        self._device = device
        self._kind = kind
        self._storage = storage
        # int8: (num_layers, 2, batch, heads, max_seq_len) float32 scale
        # planes; fp8: the (num_layers, 2) float32 layer scales; else None;
        # and with per-kv-head ones, (num_layers, 2, heads) float32 (else
        # None): the fields of the planes' codecs (kvcore._planes)
        self._scale_planes = scale_planes
        self._layer_scales = layer_scales
        self._head_scales = head_scales
        L, _, B, H, S, D = storage.shape
        self._num_layers, self._batch_size = L, B
        self._num_kv_heads, self._max_seq_len, self._head_dim = H, S, D
        # Per-layer (K, V) views and codecs, made once: update/get are hot paths.
        self._planes = Planes(backend, storage, kind, scale_planes, layer_scales, head_scales,
                              owned=(storage, scale_planes))
        self._lengths = lengths

    def _check_layer(self, layer):
        layer = index_int(layer, "layer")
        if not 0 <= layer < self._num_layers:
            raise IndexError(
                f"layer must be in 0..{self._num_layers - 1} (num_layers={self._num_layers}), "
                f"got {layer}")
        return layer

    def _check_input(self, x, arg, src_dtype, private=False):
        """(array as kernel input, kind, n) for k or v; raises naming ``arg``."""
        x, kind = _arrays.float_input(self._backend, x, arg, src_dtype, private)
        shape = x.shape
        if len(shape) != 4:
            raise ValueError(
                f"{arg} must be 4-D (batch_size, num_kv_heads, n, head_dim) = "
                f"({self._batch_size}, {self._num_kv_heads}, n, {self._head_dim}), "
                f"got shape {tuple(shape)}")
        if (shape[0] != self._batch_size or shape[1] != self._num_kv_heads
                or shape[3] != self._head_dim):
            for axis, name, want in ((0, "batch_size", self._batch_size),
                                     (1, "num_kv_heads", self._num_kv_heads),
                                     (3, "head_dim", self._head_dim)):
                if shape[axis] != want:
                    raise ValueError(
                        f"{arg}.shape[{axis}] must be {name}={want}, got {shape[axis]} "
                        f"({arg} has shape {tuple(shape)}; expected "
                        f"({self._batch_size}, {self._num_kv_heads}, n, {self._head_dim}))")
        return x, kind, shape[2]

    # ---------------------------------------------------------------- writes
    def update(self, layer, k, v, start_pos=None, src_dtype=None):
        """Write ``k`` and ``v`` at positions ``start_pos .. start_pos+n-1`` of ``layer``.

        Parameters
        ----------
        layer : int
            0 <= layer < num_layers (negative indices are not accepted).
        k, v : array
            Shape ``(batch_size, num_kv_heads, n, head_dim)``, the same for
            both; any n (a whole prompt, a chunk, or one token; n == 0 writes
            nothing).  float32, float16, ``ml_dtypes.bfloat16``, or uint16
            holding bfloat16 bits when ``src_dtype="bfloat16"``.  Any strides
            (e.g. a transposed ``(batch, n, heads, dim)`` projection).  The
            two may differ in dtype.  Converted to the storage dtype rounding
            to nearest, ties to even.
        start_pos : int, optional
            First position to write; defaults to the layer's current length
            (append).  A smaller value overwrites those positions in place
            (positions after the written range keep their contents).  It may
            not exceed the layer's length: that would leave unwritten
            positions inside the sequence.
        src_dtype : str, optional
            The element type of ``k`` and ``v`` when their dtype does not say
            it; needed only for uint16 bfloat16 bits.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        TypeError
            A non-integer argument, an unsupported dtype, a uint16 input
            without ``src_dtype="bfloat16"``, an array on the wrong device.
        ValueError
            Wrong shapes, ``start_pos`` negative or past the layer's length.
        kvcore.CacheFullError
            ``start_pos + n > max_seq_len``.

        Notes
        -----
        Everything is checked before anything is written: after an error
        the cache is unchanged.
        """
        # (start_pos converted first, k and v next, the cache read last: a
        # conversion may run the caller's code, which may change the cache
        # or free k's memory: then the call writes copies of k and v)
        (k, v), private, _ = _arrays.private_inputs((k, v), (layer, start_pos, src_dtype),
                                                    names=("k", "v"))
        layer = self._check_layer(layer)
        start_pos = None if start_pos is None else index_int(start_pos, "start_pos")
        k, k_kind, v, v_kind, n = self._check_inputs(k, v, src_dtype, private)
        length = self._lengths[layer]
        start = length if start_pos is None else self._check_start(layer, start_pos, length)
        end = start + n
        if end > self._max_seq_len:
            raise CacheFullError(
                f"cache is full: writing {n} position(s) at start_pos={start} of layer "
                f"{layer} needs {end} positions, max_seq_len is {self._max_seq_len}")
        if n == 0:
            return
        self._write(layer, k, k_kind, v, v_kind, start)
        if end > length:
            self._lengths[layer] = end

    def _check_inputs(self, k, v, src_dtype, private=False):
        """``(k, k_kind, v, v_kind, n)``: both inputs checked, with as many
        positions each (``private``: copies, ``_arrays.float_input``)."""
        k, k_kind, n = self._check_input(k, "k", src_dtype, private)
        v, v_kind, n_v = self._check_input(v, "v", src_dtype, private)
        if n_v != n:
            raise ValueError(
                f"v must have the same number of positions as k: k.shape[2] is {n}, "
                f"v.shape[2] is {n_v}")
        return k, k_kind, v, v_kind, n

    @staticmethod
    def _check_start(layer, start_pos, length):
        """A caller's ``start_pos``: at most the layer's ``length`` (no gap)."""
        start = index_int(start_pos, "start_pos")
        if start < 0:
            raise ValueError(f"start_pos must be >= 0, got {start}")
        if start > length:
            raise ValueError(
                f"start_pos must be <= {length} (the positions written in layer "
                f"{layer}), got {start}: writing there would leave positions "
                f"{length}..{start - 1} unwritten")
        return start

    def _write(self, layer, k, k_kind, v, v_kind, start):
        """Checked ``k`` and ``v`` into ``layer`` from position ``start``."""
        planes = self._planes
        dst_k, dst_v = planes.views[layer]
        k_codec, v_codec = planes.codecs[layer]
        # The kernel copies without staging; an input that is a view of this
        # cache (e.g. from get(), of either plane of any layer) must be read
        # as it was: both are staged before anything is written.
        k = planes.apart(k)
        v = planes.apart(v)
        self._backend.write_contiguous(dst_k, k, start, k_kind, k_codec)
        self._backend.write_contiguous(dst_v, v, start, v_kind, v_codec)

    @property
    def kv_scales(self):
        """fp8 caches: the ``(k_scale, v_scale)`` pair of every layer, each a
        float or a tuple of per-kv-head floats (as :attr:`BlockPool.kv_scales`);
        None otherwise."""
        return kv_scale_pairs(self._layer_scales, self._head_scales)

    def key_scales(self, layer):
        """int8 caches: layer ``layer``'s whole key scale buffer, float32
        ``(batch, heads, max_seq_len)`` (like :meth:`key_cache`); ValueError
        otherwise."""
        return self._scale_plane(layer, 0)

    def value_scales(self, layer):
        """int8 caches: layer ``layer``'s value scales; see :meth:`key_scales`."""
        return self._scale_plane(layer, 1)

    def _scale_plane(self, layer, i):
        layer = self._check_layer(layer)
        if self._scale_planes is None:
            raise ValueError(f"only int8 caches keep per-position scales; this cache's dtype "
                             f"is {self.dtype!r} (fp8: see kv_scales)")
        return self._scale_planes[layer, i]

    def get_scales(self, layer, start=0, end=None):
        """int8 caches: the scales of the codes ``get(layer, start, end)``
        returns, ``(k_scales, v_scales)`` views ``(batch, heads, end -
        start)`` float32 (value = code * scale).  Checked like :meth:`get`."""
        k_sc, v_sc = self._scale_plane(layer, 0), self._scale_plane(layer, 1)
        start, end = self._range(self._check_layer(layer), start, end)
        return k_sc[:, :, start:end], v_sc[:, :, start:end]

    def _range(self, layer, start, end):
        length = self._lengths[layer]
        start = index_int(start, "start")
        end = length if end is None else index_int(end, "end")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if end < start:
            raise ValueError(f"end must be >= start ({start}), got {end}")
        if end > length:
            raise ValueError(
                f"end must be <= {length} (the positions written in layer {layer}), got "
                f"{end}: positions {length}..{end - 1} were never written")
        return start, end

    # ----------------------------------------------------------------- reads
    def get(self, layer, start=0, end=None, dtype=None, out=None):
        """Positions ``start .. end-1`` of ``layer``'s K and V.

        Parameters
        ----------
        layer : int
            0 <= layer < num_layers.
        start : int, default 0
        end : int, optional
            Defaults to the layer's own length (so within a forward pass a
            layer sees its own new positions before later layers are written).
            ``start <= end <= `` the layer's length.
        dtype : str, optional
            Extension: when given (e.g. ``"float32"``), return new arrays
            converted to that dtype (bfloat16 as uint16 bits) instead of
            views, e.g. for NumPy attention in float32.
        out : (k_out, v_out), optional
            Writable arrays of shape ``(batch_size, num_kv_heads, end -
            start, head_dim)`` in the result dtype (``dtype``, else the
            storage dtype; NumPy arrays or torch tensors, ``torch.bfloat16``
            for bfloat16): the positions are copied (converted) into them
            and they are returned, a snapshot rather than views.

        Returns
        -------
        k, v : array
            Shape ``(batch_size, num_kv_heads, end - start, head_dim)``.
            Without ``dtype`` or ``out``: views of the cache in the storage
            dtype (bfloat16 as uint16); they reflect later writes to those
            positions and become meaningless after ``reset``/``truncate``, so
            copy them to keep a snapshot.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        TypeError
            A non-integer bound or an unknown ``dtype`` type.
        ValueError
            ``start < 0``, ``end < start``, or ``end`` past the positions
            written in the layer: kvcore never returns unwritten data.
        """
        out_check = _arrays.out_guard(out, layer, start, end, dtype)
        layer = self._check_layer(layer)
        start, end = self._range(layer, start, end)
        out_kind = None if dtype is None else _arrays.read_kind(dtype, self._kind)
        k_plane, v_plane = self._planes.views[layer]
        k = k_plane[:, :, start:end]
        v = v_plane[:, :, start:end]
        if out_kind is None and out is None:
            return k, v
        return self._read(layer, k, v, start, end, self._kind if out_kind is None else out_kind,
                          out, out_check)

    def _read(self, layer, k, v, start, end, out_kind, out, out_check=None):
        """``get`` into new arrays or the caller's ``out``: views ``k``, ``v``
        of positions ``start .. end - 1`` of ``layer`` read as ``out_kind``
        (``out_check``: ``_arrays.out_guard``'s, run once ``out`` is converted)."""
        backend = self._backend
        dsts = _arrays.out_pair(backend, out, k.shape, out_kind)
        if out_check is not None:
            out_check()
        if out is not None and any(backend.xp.may_share_memory(d, self._storage)
                                   for d, _ in dsts):
            # an out that is a view of this cache: read both before writing either
            k, v = k.copy(), v.copy()
        for src, (dst, _), codec in zip((k, v), dsts, self._planes.codecs[layer]):
            if codec.scale_plane is not None:      # int8: the range's own scales
                codec = Codec(codec.kind, codec.layer_scale, codec.scale_plane[:, :, start:end])
            backend.dequantize(src, codec, dst, out_kind)
        return dsts[0][1], dsts[1][1]

    def attention(self, layer, q, *, scale=None, sliding_window=None, logits_soft_cap=None,
                  out=None, chunk_size=None, alibi_slopes=None, sinks=None):
        """Attention of the layer's last ``n`` positions' queries over the cache.

        ``q`` ``(batch_size, num_heads, n, head_dim)`` are the queries of the
        last ``n`` positions written in ``layer`` (update the layer first);
        causal.  Keywords as :func:`kvcore.paged_attention`.  Returns
        ``(batch_size, num_heads, n, head_dim)`` float32 (or ``out``).
        """
        from .attention import cache_attention

        return cache_attention(self, layer, q, scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, out=out, chunk_size=chunk_size,
                               alibi_slopes=alibi_slopes, sinks=sinks)

    def key_cache(self, layer):
        """The whole K buffer of ``layer``, ``(batch, heads, max_seq_len, dim)``.

        Raw storage for kernels that take the buffer and a length separately
        (e.g. attention with ``cache_seqlens``).  Positions at and past
        :meth:`layer_len` hold arbitrary bytes; writing through this view
        bypasses the cache's bookkeeping.
        """
        return self._planes.views[self._check_layer(layer)][0]

    def value_cache(self, layer):
        """The whole V buffer of ``layer``; see :meth:`key_cache`."""
        return self._planes.views[self._check_layer(layer)][1]

    def layer_len(self, layer):
        """Positions written in ``layer`` (what ``get(layer)`` returns)."""
        return self._lengths[self._check_layer(layer)]

    # ------------------------------------------------------------- lifetime
    def reset(self):
        """Forget every position of every layer, O(1) (nothing is zeroed).

        The buffer is kept for the next sequence; views returned by
        :meth:`get` before the reset see whatever is written next.
        """
        self._lengths = [0] * self._num_layers

    def truncate(self, n):
        """Keep positions ``0 .. n-1`` of every layer and forget the rest.

        Parameters
        ----------
        n : int
            ``0 <= n <= seq_len``.  Every layer's length becomes ``n``, so
            this also rolls back a step that wrote only some layers
            (``truncate(seq_len)``).  Growing a layer is impossible (its
            positions were never written), hence ``n > seq_len`` is an error.

        Raises
        ------
        TypeError
            ``n`` not an int.
        ValueError
            ``n < 0`` or ``n > seq_len``.
        """
        n = index_int(n, "n")
        seq_len = self.seq_len
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > seq_len:
            raise ValueError(
                f"n must be <= seq_len ({seq_len}, the positions written in every layer; "
                f"layer lengths {self._lengths}), got {n}")
        self._lengths = [n] * self._num_layers

    def clone(self):
        """An independent copy: same geometry, dtype, device and contents.

        Only the written positions of each layer are copied.

        Returns
        -------
        KVCache
        """
        return self._copy(self._backend, self._device, lambda a: a)   # (dst is new: no overlap)

    def to(self, device):
        """A copy of this cache on ``device`` ("cpu", "cuda", "cuda:N").

        Same geometry, dtype and contents (only written positions travel);
        always a new cache, even when ``device`` is the current one.  This is
        how a CPU cache moves to the GPU and back.

        Returns
        -------
        KVCache
        """
        backend = get_backend(device)
        return self._copy(backend, backend.normalize_device(device),
                          lambda a: backend.from_host(self._backend.to_host(a)))

    def _copy(self, backend, device, move):
        """A new cache on ``backend``'s ``device`` holding the written
        positions of each layer, each range's data (and int8 scales) brought
        there by ``move``."""
        check_head_scales_backend(self._head_scales, backend)
        dst = self._allocate(backend, self._storage.shape, self._kind)
        planes = self._scale_planes
        scale_planes = None if planes is None else backend.zeros(planes.shape, np.float32)
        for layer, n in enumerate(self._lengths):
            if n:
                dst[layer, :, :, :, :n] = move(self._storage[layer, :, :, :, :n])
                if planes is not None:
                    scale_planes[layer, :, :, :, :n] = move(planes[layer, :, :, :, :n])
        twin = object.__new__(type(self))
        twin._init_from(backend, device, self._kind, dst, list(self._lengths), scale_planes,
                        self._layer_scales, self._head_scales)
        return twin

    # ----------------------------------------------------------- properties
    num_layers = property(lambda self: self._num_layers, doc="Number of layers.")
    num_kv_heads = property(lambda self: self._num_kv_heads, doc="KV heads per layer.")
    head_dim = property(lambda self: self._head_dim, doc="Elements per head per position.")
    max_seq_len = property(lambda self: self._max_seq_len, doc="Capacity in positions.")
    batch_size = property(lambda self: self._batch_size, doc="Sequences in the batch.")

    dtype = property(lambda self: KIND_NAME[self._kind],
                     doc="Canonical storage dtype name: 'float32', 'float16', 'bfloat16', "
                         "'float8_e4m3fn', 'float8_e5m2' or 'int8'.")
    device = property(lambda self: self._device,
                      doc="The device the buffer lives on ('cpu', or the CUDA device).")
    seq_len = property(lambda self: min(self._lengths),
                       doc="Positions written in every layer (the minimum over layers).")
    layer_lengths = property(lambda self: tuple(self._lengths),
                             doc="Positions written in each layer, as a tuple.")

    def memory_report(self):
        """Memory figures, in bytes unless named otherwise.

        Returns
        -------
        dict
            ``allocated_bytes``: the whole buffer (``num_layers *
            bytes_per_layer``); ``used_bytes``: ``seq_len * bytes_per_token``;
            ``bytes_per_token``: what one more position costs (all layers, K
            and V, the whole batch); ``bytes_per_token_per_layer``;
            ``bytes_per_layer`` (allocated, K and V); ``unused_bytes``
            (``allocated_bytes - used_bytes``); ``utilization``
            (``used_bytes / allocated_bytes``); ``seq_len``,
            ``layer_lengths``, ``free_positions`` (positions every layer can
            still append: ``max_seq_len - max(layer_lengths)``); and the
            geometry: ``num_layers``, ``batch_size``, ``num_kv_heads``,
            ``head_dim``, ``max_seq_len``, ``dtype``, ``itemsize``,
            ``device``.  int8 caches count their float32 scales (one per
            batch row, kv head and position, K and V) in every figure.
        """
        itemsize = dtypes.ITEMSIZE[self._kind]
        per_row = self._head_dim * itemsize + (4 if self._kind == dtypes.I8 else 0)
        per_token_layer = 2 * self._batch_size * self._num_kv_heads * per_row
        per_token = per_token_layer * self._num_layers
        per_layer = per_token_layer * self._max_seq_len
        allocated = per_layer * self._num_layers
        seq_len = self.seq_len
        used = seq_len * per_token
        return {
            "allocated_bytes": allocated,
            "used_bytes": used,
            "unused_bytes": allocated - used,
            "utilization": used / allocated,
            "bytes_per_token": per_token,
            "bytes_per_token_per_layer": per_token_layer,
            "bytes_per_layer": per_layer,
            "seq_len": seq_len,
            "layer_lengths": tuple(self._lengths),
            "free_positions": self._max_seq_len - max(self._lengths),
            "num_layers": self._num_layers,
            "batch_size": self._batch_size,
            "num_kv_heads": self._num_kv_heads,
            "head_dim": self._head_dim,
            "max_seq_len": self._max_seq_len,
            "dtype": self.dtype,
            "itemsize": itemsize,
            "device": self._device,
        }

    def __repr__(self):
        return (f"KVCache(num_layers={self._num_layers}, num_kv_heads={self._num_kv_heads}, "
                f"head_dim={self._head_dim}, max_seq_len={self._max_seq_len}, "
                f"batch_size={self._batch_size}, dtype={self.dtype!r}, "
                f"device={self._device!r}, seq_len={self.seq_len})")
