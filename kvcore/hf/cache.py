"""``PagedCache``: a transformers ``Cache`` whose K/V live in a kvcore pool.

One ``PagedKVCache`` per batch row, written for the whole batch with one
``BlockPool.write`` per layer and step (slot mapping), reordered for beam
search by copy-on-write forks, cropped by ``truncate``.  Each forward's
writes are one :class:`Step` (``step.py``).

Positions: transformers sees a rectangular, left-padded batch of ``length``
columns; row ``i`` keeps its first real token at column ``pad[i]``, and its
sequence position ``p`` is column ``p + pad[i]``.  Pad columns hold no KV
in the pool, so rows with different padding share prefix blocks.
"""
import os
import threading
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._validate import index_int, salt_bytes
from ..backends import simd_levels
from ..paged import PagedKVCache
from ..pool import BlockPool
from . import compiled
from .device import DeviceLane
from .inputs import CACHE_KEYWORDS, _left_pads, _query_length, _truthy
from .handoff import hand_off
from .step import Step
from .torch_bridge import _TorchSide

# storage dtypes that sdpa/eager can read from the pages (an indexed copy);
# the low-precision ones only the kvcore attention reads (it dequantizes)
_TORCH_STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_LOW_PRECISION = ("float8_e4m3fn", "float8_e5m2", "int8")
_PREFILL_CHOICES = ("auto", "kvcore", "sdpa")
# the K/V dtypes a pool is written from (BlockPool.write's: the float ones above)
_KV_DTYPES = frozenset(_TORCH_STORAGE.values())

# create_causal_mask asks the cache for the mask sizes and then calls the mask
# function of the attention implementation, in the same thread: the kvcore
# mask function tells the cache (found here) that this forward's attention
# reads the pages, and hands it the forward's padding mask.
_mask_call = threading.local()


def _layer_number(layer_idx):
    """``layer_idx`` as an int (a Python or NumPy integer, never a bool),
    or None for anything else."""
    try:
        return index_int(layer_idx, "layer_idx")
    except TypeError:
        return None


class _PagedLayer(CacheLayerMixin):
    """One layer's face of a :class:`PagedCache` (transformers iterates
    ``cache.layers``); everything is done by the cache."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx

    @property
    def is_initialized(self):
        return bool(self._cache._seqs)

    @is_initialized.setter
    def is_initialized(self, value):  # set by CacheLayerMixin.__init__; derived here
        pass

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._layer_idx)

    def get_mask_sizes(self, query_length):
        return self._cache._length + _query_length(query_length), 0

    def get_seq_length(self):
        return self._cache._length

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):     # transformers < 5.x's name of get_max_length
        return -1

    # the whole cache acts once (Cache.crop etc. are overridden)
    def crop(self, tokens_to_remove):
        raise NotImplementedError("crop a kvcore PagedCache as a whole: cache.crop(n)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("reorder a kvcore PagedCache as a whole: cache.reorder_cache(idx)")

    def reset(self):
        pass

    def offload(self):
        pass

    def prefetch(self):
        pass


class PagedCache(Cache):
    """A ``transformers`` ``Cache`` whose K/V live in a :class:`kvcore.BlockPool`.

    Parameters
    ----------
    pool : BlockPool
        Shaped for the model (:func:`pool_for`); shared by any number of
        caches.
    salt : str or bytes, optional
        As for :class:`kvcore.PagedKVCache`: caches with different salts
        never share blocks.
    prefill_attention : {"auto", "kvcore", "sdpa"}, default "auto"
        Who computes a layer's attention in a forward that is every row's
        first (no cached position before it, no padding column) and that
        the layer's window, chunk, soft cap, sinks and ALiBi do not change
        (plain causal attention among the new positions, whose K/V the
        forward holds), where the pages hold those K/V exactly (pages of
        the model's dtype, or float32; fp8, int8 and narrower pages always
        take kvcore's): ``"kvcore"`` always kvcore's kernels, ``"sdpa"``
        torch's ``scaled_dot_product_attention`` (what transformers' sdpa
        attention calls), ``"auto"`` torch's where it was measured faster:
        a bfloat16 model on a CPU whose attention runs kvcore's ``amx``
        level (torch's AMX kernels), and a float16 / bfloat16 model on a
        CUDA pool (torch's flash attention).  The K/V go to the pages
        either way; later forwards (decode, prefix hits) read them there.

    Notes
    -----
    Works wherever transformers takes a ``Cache`` (``model.generate(...,
    past_key_values=cache)`` or ``cache=cache``, a forward loop), for one
    batch: left padding, greedy, sampling, beam search (``reorder_cache``
    forks rows copy-on-write), assisted and prompt-lookup decoding
    (``crop`` truncates).  With float32 storage the tokens are identical to
    ``DynamicCache``'s.  transformers never tells a cache the token ids, so
    a cache used on its own fills the pool without adding to its prefix
    cache; :func:`generate` tells it the ids, and then every full block
    (prompt and generated tokens, never padding) enters the prefix cache.
    ``free()`` (or leaving a ``with`` block) gives the rows' blocks back.
    """

    def __init__(self, pool, salt=None, *, prefill_attention="auto"):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
        if not isinstance(prefill_attention, str) or prefill_attention not in _PREFILL_CHOICES:
            raise ValueError(f"prefill_attention must be one of {list(_PREFILL_CHOICES)}, got "
                             f"{prefill_attention!r}")
        if pool.dtype not in _TORCH_STORAGE and pool.dtype not in _LOW_PRECISION:
            raise ValueError(f"pool.dtype must be one of "
                             f"{sorted(_TORCH_STORAGE) + list(_LOW_PRECISION)} for kvcore.hf, "
                             f"got {pool.dtype!r}")
        salt_bytes(salt)                        # (checked now, used by each row)
        self.pool = pool
        self.salt = salt
        self.prefill_attention = prefill_attention
        self._seqs = []                         # one PagedKVCache per batch row
        self._pad = np.zeros(0, np.int64)       # column of each row's position 0
        self._length = 0                        # columns seen by transformers
        self._tokens_known = False              # generate() feeds token ids
        self._may_expand = False                # generate(): the first forward may expand rows
        self._step = None
        self._known_before = None               # row tokens before generate's hook ran
        self._kvcore_forward = False            # this forward's attention reads pages
        self._forward_began_step = False        # and has begun its step (compiled.py)
        self._compiled_id = compiled.identity(self)     # (compiled.py's operators)
        self._captured = False                  # a CUDA graph's capture runs the forward
        self._pending_mask = None               # padding mask of the next forward
        self._attention_state = None            # the model's attention spec (attention.py)
        self._forward_columns = None            # generate's forward: (input columns, model type)
        self._torch = _TorchSide(pool)
        self._writer = pool._writer             # a decode step's K/V: one native call
        # a CUDA pool: slots up once per step, packed launches per layer
        step_lane = pool._step_lane() if self._torch.cuda else None
        self._lane = None if step_lane is None else DeviceLane(step_lane, pool.head_dim,
                                                               self._torch)
        self._num_layers = pool.num_layers
        self._kv_shape = (pool.num_kv_heads, pool.head_dim)
        self._torch_storage = pool.dtype in _TORCH_STORAGE
        # torch views of the pool's storage, per layer: (num_blocks, heads, block, dim)
        bf16 = pool.dtype == "bfloat16"
        self._k_pages = [self._torch.pages(pool.key_cache(i), bf16)
                         for i in range(pool.num_layers)]
        self._v_pages = [self._torch.pages(pool.value_cache(i), bf16)
                         for i in range(pool.num_layers)]
        super().__init__(layers=[_PagedLayer(self, i) for i in range(pool.num_layers)])

    def _prefill_sdpa(self, dtype):
        """Whether a first forward's plain causal layers with queries of
        ``dtype`` go to torch's sdpa (``prefill_attention``): only where
        the pages hold the model's K/V exactly (pages of ``dtype``, or
        float32), so that a prompt read back from the pages later (a prefix
        hit) is attended to as in its first forward."""
        if self.pool.dtype != "float32" and _TORCH_STORAGE.get(self.pool.dtype) != dtype:
            return False
        choice = self.prefill_attention
        if choice != "auto":
            return choice == "sdpa"
        if self._torch.cuda:
            return dtype in (torch.float16, torch.bfloat16)
        return dtype == torch.bfloat16 and simd_levels()["attention"] == "amx"

    # -------------------------------------------------------------- rows
    def _new_row(self, token_ids):
        seq = PagedKVCache(self.pool, salt=self.salt)
        try:
            hit = seq.allocate(token_ids)
        except BaseException:
            seq.free()
            raise
        return seq, hit

    def _begin(self, token_rows, pads):
        """Rows for a batch whose token ids are known (``generate``):
        each row's prompt is looked up in the prefix cache."""
        self._check_empty("_begin")
        seqs = []
        try:
            for tokens in token_rows:
                seqs.append(self._new_row(tokens)[0])
        except BaseException:
            for s in seqs:
                s.free()
            raise
        self._seqs = seqs
        self._pad = np.asarray(pads, np.int64)
        # the columns every row has (padding or cached KV): transformers
        # computes the rest of the batch in its first forward
        self._length = int(min(p + s.num_computed for p, s in zip(self._pad, seqs)))
        self._tokens_known = True
        # transformers expands the prompt rows (beams, num_return_sequences)
        # after generate() set the cache up: its first forward may do that
        self._may_expand = True

    def _check_empty(self, what):
        if self._seqs:
            raise ValueError(f"{what} takes an empty cache; this one holds {len(self._seqs)} rows")

    def _start_rows(self, batch, q):
        """Rows for the first forward of a cache used without generate()."""
        pads = np.zeros(batch, np.int64)
        mask, self._pending_mask = self._pending_mask, None
        if mask is not None:
            if tuple(mask.shape) != (batch, q):
                raise ValueError(f"the first forward's attention_mask must be (batch, columns) "
                                 f"= ({batch}, {q}), got {tuple(mask.shape)}")
            # (a row may be padding throughout: a chunked prefill's first
            # chunk of a row padded further; _later_pads extends it)
            pads = _left_pads(mask, "attention_mask", empty_rows=True)
        seqs = []
        # the ids are not known: a private salt makes sure the placeholder id
        # can never meet another sequence's blocks, and with one known token
        # nothing ever enters the prefix cache
        salt = b"kvcore.hf.untracked:" + os.urandom(16)
        try:
            for _ in range(batch):
                seq = PagedKVCache(self.pool, salt=salt)
                seqs.append(seq)
                seq.allocate([0])
        except BaseException:
            for s in seqs:
                s.free()
            raise
        self._seqs = seqs
        self._pad = pads
        self._length = 0

    def _later_pads(self, q):
        """The padding of a forward after the first, from its attention_mask
        ``(batch, length + q)`` where the kvcore attention got one (a mask
        of another shape is not read): a row holding padding only (a chunked
        prefill's row padded past the first chunk, a row cropped into its
        padding) takes the mask's further padding columns; any other row's
        padding must stay as it is (kvcore's attention reads no mask: a
        padding column among a row's tokens would be attended to), else
        ValueError naming the row.  (On a CUDA pool the mask is read only
        while a row holds padding only: a decode step there never waits to
        read it.)"""
        mask, self._pending_mask = self._pending_mask, None
        if mask is None:
            return
        if tuple(mask.shape) != (len(self._seqs), self._length + q):
            # not this forward's columns (the CUDA graph runner's forwards
            # pass masks of other widths): it says nothing of them
            return
        if self._torch.cuda and not (self._pad == self._length).any():
            return
        pads = _left_pads(mask, "attention_mask", empty_rows=True)
        grown = (self._pad == self._length) & (pads >= self._length)
        bad = (pads != self._pad) & ~grown
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"attention_mask row {i} has {int(pads[i])} padding columns, but the cache holds "
                f"that row after {int(self._pad[i])}: a row's padding may only grow while the row "
                "holds no token (kvcore's attention reads no mask)")
        self._pad = pads

    def _expand_rows(self, batch):
        """Match the rows to a forward of ``batch`` rows.

        Only the first forward of a :func:`generate` call may have more rows
        than the cache (transformers expands the prompts for beams and
        ``num_return_sequences`` after the cache was set up): each row then
        becomes ``batch // rows`` forks.  Any other mismatch is an error: a
        forward of another batch would otherwise be written into rows that
        hold other sequences' KV.
        """
        rows = len(self._seqs)
        if batch != rows:
            if not self._may_expand or rows == 0 or batch % rows:
                raise ValueError(f"the forward has batch size {batch}, but this cache holds "
                                 f"{rows} rows (a new batch needs a new PagedCache)")
            if batch > self.pool.num_blocks:
                raise ValueError(
                    f"the forward has {batch} rows (the {rows} prompts times {batch // rows}, "
                    "for num_beams or num_return_sequences), more than the pool's "
                    f"{self.pool.num_blocks} blocks (each row writes its next token in a block "
                    "of its own)")
            self.batch_repeat_interleave(batch // rows)
        self._may_expand = False

    # -------------------------------------------------------------- hooks
    def _pre_forward(self, module, args, kwargs):
        """Forward pre-hook installed by generate(): learn the token ids of
        the positions this forward computes."""
        for key in CACHE_KEYWORDS:
            other = kwargs.get(key)
            if other is not None and other is not self:
                # another cache's forward (the model as its own assistant
                # model runs on a DynamicCache of its own): not this cache's
                return None
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if kwargs.get("use_cache") is not None and not _truthy(kwargs["use_cache"]):
            # transformers then re-feeds the whole sequence every step: the
            # cache would store it again as new positions
            raise ValueError("a forward with use_cache=False cannot run on a kvcore PagedCache "
                             "(it re-feeds every column, which the cache would store as new "
                             "positions)")
        if not self._tokens_known:
            return None
        if ids is None or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            self._tokens_known = False   # from here on the ids are unknown
            return None
        first = self._may_expand
        self._expand_rows(ids.shape[0])
        q = ids.shape[1]
        if first and self._refeeds_every_column(kwargs, ids):
            # transformers' assisted and prompt-lookup decoding feed the
            # whole prompt in their first forward, whatever the cache holds:
            # the rows give up their prefix hits (nothing was written yet),
            # and the forward computes every column
            for seq in self._seqs:
                seq.truncate(0)
            self._length = 0
        self._check_positions(kwargs.get("position_ids"), q)
        self._forward_columns = (q, getattr(getattr(module, "config", None), "model_type", None))
        # what a failed step restores: the ids each row knew before this
        # forward's are added below
        self._known_before = [seq.num_tokens for seq in self._seqs]
        rows = ids.tolist()
        for i, seq in enumerate(self._seqs):
            first = self._length - int(self._pad[i])   # position of column 0 of this forward
            known = seq.num_tokens
            if known < first:
                self._tokens_known = False
                return None
            if known < first + q:
                seq.extend_tokens(rows[i][known - first:])
        return None

    def _check_columns(self, q):
        """Raise ValueError when generate's forward caches ``q`` columns for
        input_ids of another width (a model that adds positions of its own,
        or re-feeds the whole sequence: the ids recorded for the prefix cache
        would not be the cached positions')."""
        columns, self._forward_columns = self._forward_columns, None
        if columns is not None and columns[0] != q:
            raise ValueError(
                f"kvcore.hf cannot hold a {columns[1]!r} model: its forward caches other "
                f"positions than its input_ids' ({q} for {columns[0]} columns: it adds "
                "positions of its own or feeds the whole sequence again); the prefix cache "
                "would record other tokens than the cached positions'")

    def _refeeds_every_column(self, kwargs, ids):
        """Whether a forward of ``ids`` ``(batch, q)`` on a cache holding
        columns feeds every column from column 0: its ``position_ids``
        ``(batch, q)`` count from each row's first real column, or (without
        them) its ``cache_position`` starts at 0, or (a model whose forward
        takes neither: Bloom, MPT) every row's ids after its padding begin
        with the row's whole prompt (then its candidate tokens).  (A forward
        that continues the cache starts at its column ``length``, past some
        of each row's prompt.)"""
        q = ids.shape[1]
        if self._length == 0 or q <= self._length:
            return False
        position_ids = kwargs.get("position_ids")
        if self._positions_of(position_ids, q):
            return self._position_mismatch(position_ids, q, 0) is None
        position = kwargs.get("cache_position")
        if position is not None:
            return isinstance(position, torch.Tensor) and position.ndim == 1 \
                and position.shape[0] == q and int(position[0]) == 0
        rows = ids.detach().cpu().numpy()
        return all(int(pad) + seq.num_tokens <= q
                   and np.array_equal(rows[i, int(pad):int(pad) + seq.num_tokens], seq.token_ids)
                   for i, (seq, pad) in enumerate(zip(self._seqs, self._pad)))

    def _positions_of(self, position_ids, q):
        """Whether ``position_ids`` are a forward's ``(batch, q)`` tensor."""
        return isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2 \
            and tuple(position_ids.shape) == (len(self._seqs), q)

    def _position_mismatch(self, position_ids, q, length):
        """None when ``position_ids`` (``_positions_of``) continue each row
        after ``length`` columns (padding columns unchecked), else the first
        real column that does not: ``(row, column, got, want)``."""
        want = length + np.arange(q)[None, :] - self._pad[:, None]
        real = want >= 0                      # padding columns have no position to check
        got = position_ids.detach().cpu().numpy()
        if np.array_equal(got[real], want[real]):
            return None
        row = int(np.argmax((real & (got != want)).any(axis=1)))
        col = int(np.argmax(real[row] & (got[row] != want[row])))
        return row, col, int(got[row, col]), int(want[row, col])

    def _check_positions(self, position_ids, q):
        """Raise ValueError unless a forward's ``position_ids`` (when given as
        ``(batch, q)``) continue each row where the cache ends: columns that
        do not follow the cache's length must never be stored as new
        positions (nor their ids recorded for the prefix cache)."""
        if not self._positions_of(position_ids, q):
            return
        bad = self._position_mismatch(position_ids, q, self._length)
        if bad is not None:
            row, col, got, want = bad
            raise ValueError(
                f"the forward's position_ids do not continue the cache: row {row} column {col} "
                f"has position {got}, the cache expects {want} (it holds {self._length} columns)")

    # -------------------------------------------------------------- steps
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write this step's K/V of ``layer_idx`` for the whole batch.

        ``key_states``/``value_states``: ``(batch, num_kv_heads, q, head_dim)``.
        Returns the layer's K/V over every column ``(batch, num_kv_heads,
        length, head_dim)`` in ``key_states.dtype`` read from the pages, or,
        when the model's attention is ``"kvcore"``, the new K/V marked for
        :func:`kvcore_attention`, which reads the pages itself.  Traced by
        ``torch.compile`` in a CPU pool's kvcore forward, the write happens
        in the attention's operator instead (``compiled.py``).
        """
        if torch.compiler.is_compiling() and compiled.traceable(self, layer_idx, kwargs):
            return compiled.traced_update(self, key_states, value_states, layer_idx, kwargs)
        return self.eager_update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable     # (torch.compile runs it as it is: host work)
    def eager_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """:meth:`update` as it runs eagerly (and in the compiled route's
        attention operator, at run time)."""
        before = self._step
        if _layer_number(layer_idx) == 0 and before is not None and before.partial:
            raise ValueError(
                f"the last forward stopped after {before.layers_done} of the model's "
                f"{self._num_layers} layers (an exception in the model, a model that does not "
                "update the cache at every layer, or, in a compiled forward, a layer whose "
                "kvcore attention did not run): cache.crop(cache.get_seq_length()) drops "
                "what it wrote, then the forward can run again")
        # the step this call belongs to: one in progress (this call may
        # commit it before failing), or one it begins
        owned = before if before is not None and not before.complete else None
        try:
            if not self._torch.cuda:
                return self._update(key_states, value_states, layer_idx, kwargs)
            with self._torch.stream():
                return self._update(key_states, value_states, layer_idx, kwargs)
        except BaseException:
            Step.undo_failed(self, before, owned)
            raise

    def _update(self, key_states, value_states, layer_idx, kwargs):
        # (called once per layer and step: what it touches is kept few,
        # since the model's weights have evicted it from the caches)
        pool = self.pool
        if type(layer_idx) is not int or not 0 <= layer_idx < self._num_layers:
            if isinstance(layer_idx, (bool, np.bool_)):
                raise TypeError(f"layer_idx must be an integer, got bool ({layer_idx!r})")
            number = _layer_number(layer_idx)      # (NumPy ints too)
            if number is None or not 0 <= number < self._num_layers:
                raise IndexError(f"layer_idx must be in 0..{pool.num_layers - 1} (the pool's "
                                 f"layers), got {layer_idx!r}")
            layer_idx = number
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise TypeError(f"key_states and value_states must be torch tensors, got "
                            f"{type(key_states).__name__} and {type(value_states).__name__}")
        shape = key_states.shape
        if len(shape) != 4 or shape != value_states.shape:
            raise ValueError("key_states and value_states must both be (batch, num_kv_heads, q, "
                             f"head_dim), got {tuple(key_states.shape)} and "
                             f"{tuple(value_states.shape)}")
        dtype = key_states.dtype
        if dtype not in _KV_DTYPES or value_states.dtype is not dtype \
                or key_states.layout is not torch.strided \
                or value_states.layout is not torch.strided:
            raise TypeError(f"key_states and value_states must be dense float32, float16 or "
                            f"bfloat16 tensors of one dtype, got {dtype} "
                            f"({key_states.layout}) and {value_states.dtype} "
                            f"({value_states.layout})")
        batch, heads, q, dim = shape
        if not batch:
            raise ValueError(f"key_states must hold at least one row (batch, num_kv_heads, q, "
                             f"head_dim), got {tuple(shape)}")
        if heads != self._kv_shape[0] or dim != self._kv_shape[1]:
            raise ValueError(
                f"the model's K/V have {heads} heads of dimension {dim}, the pool "
                f"{pool.num_kv_heads} of dimension {pool.head_dim}: build the pool with "
                "kvcore.hf.pool_for(model.config, ...)")
        if not self._kvcore_forward and not self._torch_storage:
            raise ValueError(f"a {pool.dtype} pool is read by attn_implementation='kvcore' only "
                             "(this forward's attention reads whole K/V tensors): "
                             "model.set_attn_implementation('kvcore')")
        if layer_idx == 0:
            _mask_call.cache = None     # (left by a forward whose mask was sdpa's)
        step = self._step
        if self._captured:
            return self._captured_update(key_states, value_states, layer_idx, kwargs, step)
        if step is None or step.complete:
            if layer_idx != 0:
                raise ValueError(f"a forward must update the cache from layer 0 on, in order; "
                                 f"its first update was for layer {layer_idx}")
            self._check_columns(q)
            step = Step.begin(self, batch, q)
        elif layer_idx != step.layers_done:
            raise ValueError(f"a forward must update the cache at every layer, in order: layer "
                             f"{layer_idx} came after layer {step.layers_done - 1}")
        elif batch != len(self._seqs) or q != step.q:
            raise ValueError(f"layer {layer_idx} got K/V for {batch} rows x {q} columns, this "
                             f"step has {len(self._seqs)} x {step.q}")
        # the K/V as they are, by address: on a CUDA pool through the step
        # lane (any step), on the CPU a decode step's (batch, heads, 1, dim)
        # through the pool's writer (the slots were made and checked once for
        # the step); the rest through pool.write
        lane = self._lane
        if lane is not None:
            done = lane.write(layer_idx, key_states, value_states, step)
        else:
            done = q == 1 and self._writer is not None and self._writer.write_slots(
                layer_idx, key_states, value_states, step.slots)
        if not done:
            # (batch, heads, q, dim) -> (batch * q, heads, dim): for q == 1
            # the same order without a transpose (a view when contiguous)
            if q == 1:
                k_rows = key_states.detach().reshape(batch, heads, dim)
                v_rows = value_states.detach().reshape(batch, heads, dim)
            else:
                k_rows = key_states.detach().transpose(1, 2).reshape(batch * q, heads, dim)
                v_rows = value_states.detach().transpose(1, 2).reshape(batch * q, heads, dim)
            side = self._torch
            pool.write(layer_idx, side.input(k_rows), side.input(v_rows), step.slots)
        step.wrote(self, layer_idx)
        if self._kvcore_forward:
            attn_kwargs = kwargs.get("kwargs")
            if isinstance(attn_kwargs, dict):
                # transformers hands update() the keyword arguments of this
                # layer's attention call (its paged path fills them the same
                # way): the attention gets the cache and the step's tables
                # as arguments, no side channel
                attn_kwargs.update(self.attention_arguments(step, layer_idx))
            # only the new positions, marked: the kvcore attention reads the
            # pages, and anything else computing on them raises (handoff.py);
            # (transformers versions whose attention does not pass kwargs=
            # to Cache.update find the step on the marked key)
            return hand_off(key_states, value_states, self, step, layer_idx, self._model_type)
        index = step.gather_index(self)
        keys = self._k_pages[layer_idx][index]
        values = self._v_pages[layer_idx][index]
        if keys.dtype != key_states.dtype:
            keys = keys.to(key_states.dtype)
            values = values.to(value_states.dtype)
        return keys, values

    @property
    def _model_type(self):
        """The model's type for error messages (once its attention spec is known)."""
        state = self._attention_state
        return state.spec.model_type if state is not None else "the model"

    def attention_arguments(self, step, layer_idx):
        """The keyword arguments that hand the kvcore attention of
        ``layer_idx`` the cache and ``step``'s tables."""
        step.attention_tables(self)
        return dict(cache=self, block_table=step.tables, cu_seq_lens_q=step.query_start,
                    kvcore_step=step, kvcore_layer=layer_idx)

    def _captured_update(self, key_states, value_states, layer_idx, kwargs, step):
        """``update`` inside a CUDA graph's capture of a short step
        (``graphs.py``): the runner began the step and loaded its buffers,
        and commits it after the replay; here only launches are issued."""
        if step is None or step.device is None or not self._kvcore_forward:
            raise RuntimeError("a CUDA graph captures a short step of "
                               "attn_implementation='kvcore' begun by kvcore.hf.generate")
        if not self._lane.write(layer_idx, key_states, value_states, step):
            raise RuntimeError(
                f"layer {layer_idx}'s K/V cannot be written by address (dtype "
                f"{key_states.dtype}, strides {tuple(key_states.stride())}): this step "
                "cannot be captured; generate without cuda_graph=True")
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError("this transformers version does not pass the attention's "
                               "arguments to Cache.update: cuda_graph=True needs it")
        # (the step's tables as the runner left them: no host work in a capture)
        attn_kwargs.update(cache=self, block_table=step.tables, cu_seq_lens_q=step.query_start,
                           kvcore_step=step, kvcore_layer=layer_idx)
        return key_states, value_states

    # -------------------------------------------------------------- queries
    def get_seq_length(self, layer_idx=0):
        return self._length

    def get_mask_sizes(self, query_length, layer_idx=0):
        """``(length + query_length, 0)``: every column is kept.  (Older
        transformers pass the query's ``cache_position`` tensor instead.)"""
        n = _query_length(query_length)          # (checked before the state changes)
        self._kvcore_forward = False
        _mask_call.cache = weakref.ref(self)     # never keeps a dropped cache's blocks
        return self._length + n, 0

    def get_max_length(self, layer_idx=None):
        return -1

    def get_max_cache_shape(self, layer_idx=0):
        return -1

    @property
    def batch_size(self):
        return len(self._seqs) if self._seqs else -1

    is_compileable = property(lambda self: False, doc="transformers' flag: never compiled")
    is_initialized = property(lambda self: bool(self._seqs), doc="Whether rows were begun")
    is_croppable = property(lambda self: True, doc="transformers' flag: crop() works")

    @property
    def rows(self):
        """The :class:`kvcore.PagedKVCache` of each batch row (a list)."""
        return list(self._seqs)

    @property
    def pads(self):
        """Padding columns before each row's first token (numpy int64)."""
        return self._pad.copy()

    # -------------------------------------------------------------- edits
    def crop(self, tokens_to_remove):
        """Forget the last ``-tokens_to_remove`` columns (``crop(0)`` changes
        nothing; a positive value is the length to keep, transformers 4.x's
        form)."""
        n = index_int(tokens_to_remove, "tokens_to_remove")
        keep = self._length + n if n <= 0 else n
        if not 0 <= keep <= self._length:
            raise ValueError(f"tokens_to_remove must leave 0..{self._length} columns (a "
                             f"negative count to drop, or a positive length to keep), got "
                             f"{n}, which would leave {keep}")
        step = self._step
        if step is not None and step.partial:
            step.rollback(self)       # what a forward that failed part-way wrote
        if keep == self._length:
            return
        for i, seq in enumerate(self._seqs):
            seq.truncate(max(0, keep - int(self._pad[i])))
        # a row cropped into its left padding keeps only padding: the
        # columns after keep are whatever the next forward says they are
        self._pad = np.minimum(self._pad, keep)
        self._length = keep
        self._step = None

    def _select_rows(self, index, arg):
        """Rows become ``old[index[r]]`` (copy-on-write forks); ``arg``: the
        caller's name of ``index`` (its errors name it)."""
        with self._torch.stream():
            self._select(index, arg)

    def _select(self, index, arg):
        index = np.asarray(index.detach().cpu() if isinstance(index, torch.Tensor) else index)
        rows = len(self._seqs)
        if index.size and index.dtype.kind not in "iu":
            raise TypeError(f"{arg} must hold integers (row indices), got dtype {index.dtype}")
        if index.ndim != 1:
            raise ValueError(f"{arg} must be 1-D (the old row of each new row), got shape "
                             f"{index.shape}")
        if not index.size and rows:
            raise ValueError(f"{arg} must select at least one of the {rows} rows, got none")
        # (checked before the cast: a uint64 past int64 would wrap to a negative)
        if index.size and (index.min() < 0 or index.max() >= rows):
            held = f"in 0..{rows - 1}" if rows else "none: the cache holds no rows"
            raise IndexError(f"{arg} must be row indices {held}, got {index.tolist()}")
        index = index.astype(np.int64)
        if np.array_equal(index, np.arange(rows)):
            return
        new = self._forks(int(r) for r in index)
        for s in self._seqs:
            s.free()
        self._seqs = new
        self._pad = self._pad[index]
        self._step = None

    def _forks(self, rows):
        """Copy-on-write forks of rows ``rows`` (indices into the rows), in
        order; none left behind if one fails."""
        forks = []
        try:
            for r in rows:
                forks.append(self._seqs[r].fork())
        except BaseException:
            for s in forks:
                s.free()
            raise
        return forks

    def reorder_cache(self, beam_idx):
        """Beam search: row ``r`` becomes old row ``beam_idx[r]`` (forks, copy-on-write)."""
        self._select_rows(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats):
        n = index_int(repeats, "repeats")
        if n < 1:
            raise ValueError(f"repeats must be a positive integer, got {n}")
        rows, blocks = len(self._seqs), self.pool.num_blocks
        if rows * n > blocks:   # (each row writes its next token in a block of its own)
            raise ValueError(f"repeats must be at most {blocks // rows} (the {rows} rows times "
                             f"repeats may not exceed the pool's {blocks} blocks), got {n}")
        if rows:
            self._select_rows(np.repeat(np.arange(rows), n), "repeats")

    def batch_select_indices(self, indices):
        self._select_rows(indices, "indices")

    def reset(self):
        self.free()

    def free(self):
        """Give every row's blocks back to the pool (the cache becomes empty)."""
        for s in self._seqs:
            s.free()
        self._seqs = []
        self._pad = np.zeros(0, np.int64)
        self._length = 0
        self._step = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __deepcopy__(self, memo):
        """``copy.deepcopy(cache)``: a new PagedCache over the same pool
        whose rows are copy-on-write forks of this one's (transformers'
        way to reuse a prompt's cache for several continuations: the copy
        and the original then grow apart without copying a block until
        one writes into a shared one).  The pool is shared, not copied.
        Refused between the layers of a forward."""
        step = self._step
        if step is not None and step.partial:
            raise ValueError(
                f"copy.deepcopy(cache) between a forward's layers ({step.layers_done} of "
                f"{self._num_layers} written): copy it before or after the forward")
        new = PagedCache(self.pool, self.salt, prefill_attention=self.prefill_attention)
        seqs = self._forks(range(len(self._seqs)))
        for fork in seqs:
            # only the ids of computed positions: a copy made inside a
            # forward of kvcore.hf.generate (whose hook has recorded the
            # forward's ids already) would otherwise file other KV under
            # them in the prefix cache
            if fork.num_tokens > fork.num_computed:
                fork.truncate(fork.num_computed)
        new._seqs = seqs
        new._pad = self._pad.copy()
        new._length = self._length
        # (the copy learns no token ids: no generate() hook feeds it; and
        # the model's attention state is made again at its first forward:
        # it holds per-forward records, not to be shared)
        memo[id(self)] = new
        for seq, fork in zip(self._seqs, seqs):
            memo[id(seq)] = fork
        return new

    def __copy__(self):
        raise TypeError("copy.copy(cache) would share the rows' blocks without the pool "
                        "knowing: use copy.deepcopy(cache) (copy-on-write forks of its rows)")

    def __reduce__(self):
        raise TypeError("a kvcore.hf.PagedCache cannot be pickled: its rows live in the "
                        "pool's memory (copy.deepcopy(cache) forks them within the process)")

    def __repr__(self):
        return (f"PagedCache(rows={len(self._seqs)}, length={self._length}, "
                f"pool={self.pool!r})")
