"""A step's device side for callers that issue each layer's writes and
attention from Python (``kvcore.hf``): what can be fixed is fixed once, so
a layer costs the host its launches and little else, and a decode step can
be captured in a CUDA graph and replayed.

* ``PackedLaunch``: one kernel launch whose argument block (cuLaunchKernel's
  ``kernelParams``: pointers to 8-byte argument slots) is packed once; a
  call rewrites the slots that change (a source address, strides) and
  issues one driver call.
* ``StepLane``: a pool's K/V writes through packed launches, reading rows
  by address (a torch tensor's data pointer and strides: no import, no
  copy), and the device buffers of decode steps.
* ``StepState``: the fixed device buffers of steps of one shape (batch
  rows x q query columns: decode steps, and the short first forward after
  a prefix hit) (slots, sequence lengths, query starts, block tables up to
  a capacity), refilled by one host-to-device copy per step from a pinned
  staging buffer, and the attention plans that read them: their work
  items cover every key up to the capacity (the kernels clip each item to
  the query's own keys, from the lengths they read on the device), so
  neither the items nor any launch argument changes from one step to the
  next.  Everything a layer launches then has the same arguments at every
  step of the state: what a CUDA graph captured at one step replays at
  the next.

Nothing here reads back from the device or allocates device memory per
step or per layer; the one copy per step happens in ``StepState.load``,
before the step's forward.  The caller vouches for what it hands in: slots
and block tables from the pool's own bookkeeping (a sequence's reserved
slots, its block table), K/V rows apart from the pool (``write`` checks
that by address and declines otherwise).
"""
import numpy as np

from ... import dtypes
from . import _sources

__all__ = ["PackedLaunch", "StepLane", "StepState"]


class PackedLaunch:
    """One launch of one kernel with its arguments packed once.

    ``slots`` is an int64 view of the argument block (an int or a device
    address per argument; a float argument would take the low 4 bytes of
    its slot); ``rows, chunks`` are a row/chunk kernel's first two
    arguments (``None`` for a grid kernel)."""

    __slots__ = ("kernel", "grid", "block", "smem", "rows", "chunks", "function", "slots",
                 "_values", "_params", "params_ptr")

    def __init__(self, backend, kernel, grid, block, nargs, rows=None, chunks=None, smem=0):
        self.kernel = kernel               # (file, sk, dk, name)
        self.grid, self.block, self.smem = tuple(grid), tuple(block), int(smem)
        self.rows, self.chunks = rows, chunks
        self._values = np.zeros(max(1, nargs), np.uint64)
        self.slots = self._values.view(np.int64)
        self._params = (self._values.ctypes.data
                        + 8 * np.arange(max(1, nargs), dtype=np.uint64))
        self.params_ptr = self._params.ctypes.data
        self.function = backend.launcher.function_ptr(*kernel)

    def __repr__(self):
        return f"<PackedLaunch {self.kernel[3]} grid={self.grid} block={self.block}>"


def row_launch(backend, file, sk, dk, name, rows, chunks, nargs):
    """A ``PackedLaunch`` of a row/chunk kernel (``launch_shape``), its
    slots 0 and 1 holding ``rows`` and ``chunks``."""
    grid, block = backend.launch_shape(rows, chunks)
    launch = PackedLaunch(backend, (file, sk, dk, name), grid, block, nargs + 2, rows, chunks)
    launch.slots[0], launch.slots[1] = rows, chunks
    return launch


class StepLane:
    """A pool's writes and decode-step buffers for one caller (one cache):
    its launches are packed per call shape and reused, so a lane must not be
    used from two threads at once (a cache is not either).

    Parameters
    ----------
    backend : CudaBackend
    planes : list of (key_plane, value_plane) device arrays per layer
    codecs : list of (key_codec, value_codec) per layer
    owned : device arrays an input must be apart from (the storage, scales)
    """

    def __init__(self, backend, planes, codecs, owned):
        self.backend = backend
        self._planes = planes
        self._codecs = codecs
        k0 = planes[0][0]
        self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = \
            (int(x) for x in k0.shape)
        self._spans = [backend._extent(a) for a in owned if a is not None and a.size]
        # per layer and plane: (cache address, scale-plane address, fp8 scale bits)
        self._plane_args = [
            tuple((backend._ptr(p), None if c.scale_plane is None else
                   backend._ptr(c.scale_plane), backend._scale_bits(c.layer_scale))
                  for p, c in zip(pair, codecs[layer]))
            for layer, pair in enumerate(planes)]
        # planes whose writes the lane cannot pack: fp8 with per-kv-head scales
        self._writable = all(c.head_scales is None for pair in codecs for c in pair)
        self._aligned = all(backend._ptr(p) % 16 == 0 for pair in planes for p in pair) \
            and all(st % 16 == 0 for st in k0.strides[:3])
        # float planes whose rows allow 16-byte runs (8 halves or 4 floats
        # divide head_dim: vector_width is 4 or 8)
        self._vectors = self._aligned and not codecs[0][0].lowprec and self.head_dim % 8 == 0
        self._writes = {}        # (n, src_kind, v) -> (PackedLaunch, slot indices)
        # (plan, layer, q and out dtypes, q and out 16-byte aligned) -> packed
        # launches, or False: that run is not packed
        self._attention = {}
        self._decode = {}        # (batch, q) -> StepState

    # ------------------------------------------------------------ writes
    def write(self, layer, k, v, slots, n):
        """Rows of ``k`` and ``v`` to slots ``slots`` (the address of a
        device int64 array of at least ``n`` entries) of ``layer``: two
        packed launches, no check of the slots (the caller's bookkeeping
        made them).

        ``k``, ``v``: ``(address, token_stride, head_stride, kind)`` of
        ``n`` rows of ``num_kv_heads x head_dim`` elements, strides in
        elements, each row's elements contiguous.  Returns False (nothing
        written) when the lane cannot take them as they are: rows that meet
        the pool's memory, a dtype other than float32/float16/bfloat16, a
        plane it cannot pack; the caller then takes ``BlockPool.write``."""
        if not self._writable or n <= 0 or k[3] != v[3] or k[3] not in _FLOAT_KINDS \
                or n * self.num_kv_heads > _ROW_LIMIT:
            return n == 0
        size = dtypes.ITEMSIZE[k[3]]
        for rows in (k, v):
            if self._meets_pool(rows, n, size):
                return False
        key = (n, k[3], self._width(k, v, n, size))
        entry = self._writes.get(key)
        if entry is None:
            entry = self._writes[key] = self._pack_write(n, k[3], key[2])
        launch, at = entry
        vals = launch.slots
        for (cache, scales, bits), rows in zip(self._plane_args[layer], (k, v)):
            vals[at[0]] = cache
            vals[at[1]] = rows[0]
            vals[at[2]] = slots
            vals[at[3]] = rows[1]
            vals[at[4]] = rows[2]
            if at[5] is not None:        # an int8 plane's scales
                vals[at[5]] = scales
            if at[6] is not None:        # an fp8 plane's scale
                vals[at[6]] = bits
            self.backend.launcher.launch_packed(launch)
        return True

    def _meets_pool(self, rows, n, size):
        lo = rows[0]
        hi = lo + ((n - 1) * abs(rows[1]) + (self.num_kv_heads - 1) * abs(rows[2])
                   + self.head_dim) * size
        for a, b in self._spans:
            if lo < b and a < hi:
                return True
        return False

    def _width(self, k, v, n, size):
        """The vector width of float writes of ``k`` and ``v`` (16-byte
        runs when every address and stride allows it, else 1)."""
        if not self._vectors:
            return 1
        if (k[0] | v[0]) % 16 or (self.num_kv_heads > 1 and (k[2] | v[2]) * size % 16) \
                or (n > 1 and (k[1] | v[1]) * size % 16):
            return 1
        return _sources.vector_width(k[3], self._codecs[0][0].kind)

    def _pack_write(self, n, src_kind, width):
        """The packed launch of ``n`` rows from ``src_kind`` and the slots
        of its per-call arguments (cache, source, slots, token and head
        strides, then an int8 plane's scales and an fp8 plane's scale, or
        None where the plane has none)."""
        be = self.backend
        codec = self._codecs[0][0]
        marks = _Marks()
        file, sk, dk, name, rows, chunks, args = be.write_call(
            self._planes[0][0], marks.src, (marks.tok, marks.head), marks.slots, None, n,
            src_kind, codec, 1 if codec.lowprec else width)
        launch = row_launch(be, file, sk, dk, name, rows, chunks, len(args))
        at = [None] * 7
        for i, a in enumerate(args, start=2):
            if a is self._planes[0][0]:
                at[0] = i
            elif a is codec.scale_plane and a is not None:
                at[5] = i
            elif a is marks.src:
                at[1] = i
            elif a is marks.slots:
                at[2] = i
            elif a is marks.tok:
                at[3] = i
            elif a is marks.head:
                at[4] = i
            elif a is None:
                launch.slots[i] = 0
            else:
                launch.slots[i] = int(a)
        if codec.lowprec and codec.kind != dtypes.I8:
            at[6] = 2 + len(args) - 1       # the fp8 scale's bits: the last argument
        return launch, tuple(at)

    # ------------------------------------------------------------ fixed steps
    def step_state(self, batch, q, capacity):
        """The ``StepState`` of steps of ``batch`` rows x ``q`` query
        columns whose sequences fit ``capacity`` blocks, made (or outgrown:
        remade with twice the blocks) on demand."""
        state = self._decode.get((batch, q))
        if state is None or state.capacity < capacity:
            if state is not None:
                capacity = max(capacity, 2 * state.capacity)
            state = self._decode[(batch, q)] = StepState(self, batch, q, capacity)
        return state

    def planned(self, block_tables, seq_lens, query_start, key, num_heads):
        """A plan of one step's attention (``attention_plan`` of the
        backend over the given host arrays, from the caller's bookkeeping):
        the general path, for steps without a ``StepState``."""
        scale, window, cap = key
        return self.backend.attention_plan(
            block_tables, seq_lens, query_start, num_heads=num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=self.block_size, num_blocks=self.num_blocks,
            kind=self._codecs[0][0].kind, scale=scale, sliding_window=window, soft_cap=cap)

    def attend(self, plan, layer, q, out, reuse=False):
        """Run ``plan`` on ``layer`` for ``q`` into ``out`` (device arrays
        of the plan's shape, C-contiguous, aligned).  ``reuse``: the plan
        runs again and again (a step state's): its launches for the layer
        are collected from ``attention_run`` once and reissued packed,
        with only q's and out's addresses rewritten."""
        be = self.backend
        k_plane, v_plane = self._planes[layer]
        codecs = self._codecs[layer]
        q_ptr, out_ptr = be._ptr(q), be._ptr(out)
        key = (plan, layer, q.dtype, out.dtype, q_ptr % 16 == 0, out_ptr % 16 == 0)
        packs = self._attention.get(key) if reuse else False
        if packs is None:
            # a run that is more than launches (a temporary) is never packed
            packs = self._pack_attention(plan, q, out, k_plane, v_plane, codecs)
            self._attention[key] = packs = False if packs is None else packs
        if packs is False:
            be.attention_run(plan, q, out, k_plane, v_plane, codecs)
        else:
            self.attend_packed(packs, q_ptr, out_ptr)

    def packed(self, plan, layer, q_dtype, out_dtype, q_ptr, out_ptr):
        """The packed launches ``attend(..., reuse=True)`` made for ``plan``
        on ``layer`` with q and out of these (NumPy) dtypes and addresses as
        aligned as these, or None."""
        packs = self._attention.get((plan, layer, q_dtype, out_dtype, q_ptr % 16 == 0,
                                     out_ptr % 16 == 0))
        return None if packs is False else packs

    def attend_packed(self, packs, q_ptr, out_ptr):
        """Reissue ``packed`` launches for the q and out at these addresses."""
        launch_packed = self.backend.launcher.launch_packed
        for launch, q_at, out_at in packs:
            slots = launch.slots
            for i in q_at:
                slots[i] = q_ptr
            for i in out_at:
                slots[i] = out_ptr
            launch_packed(launch)

    def _pack_attention(self, plan, q, out, k_plane, v_plane, codecs):
        """The launches ``attention_run`` makes for these arguments, packed,
        with the slots of q's and out's address in each; None when one of
        them takes an array other than q, out, the planes, their scales and
        the plan's own (a temporary, whose address would not last)."""
        be = self.backend
        lasting = [k_plane, v_plane] + [c.scale_plane for c in codecs
                                        if c.scale_plane is not None]
        lasting += [a for a in (getattr(plan, n, None) for n in type(plan).__slots__)
                    if be._is_device(a)]
        lasting = {id(a) for a in lasting}
        calls = be.launcher.collect_launches(
            lambda: be.attention_run(plan, q, out, k_plane, v_plane, codecs))
        packs = []
        for file, name, grid, block, args, smem in calls:
            launch = PackedLaunch(be, (file, None, None, name), (grid, 1, 1), (block, 1, 1),
                                  len(args), smem=smem)
            q_at, out_at = [], []
            floats = launch.slots.view(np.float32)
            for i, a in enumerate(args):
                if a is q:
                    q_at.append(i)
                elif a is out:
                    out_at.append(i)
                elif a is None:
                    launch.slots[i] = 0
                elif be._is_device(a):
                    if id(a) not in lasting:
                        return None
                    launch.slots[i] = be._ptr(a)
                elif isinstance(a, (float, np.floating)):
                    launch.slots[i] = 0
                    floats[2 * i] = a
                else:
                    launch.slots[i] = int(a)
            packs.append((launch, tuple(q_at), tuple(out_at)))
        return packs


_FLOAT_KINDS = (dtypes.F32, dtypes.F16, dtypes.BF16)
# Rows (tokens x heads) one write launch indexes (backend.py's _ROW_LIMIT).
_ROW_LIMIT = 2**31 - 1


class _Marks:
    """Stand-ins whose identity marks the per-call arguments in an argument
    list (``StepLane._pack_write``)."""

    def __init__(self):
        self.src, self.slots, self.tok, self.head = object(), object(), object(), object()



class StepState:
    """Device buffers of steps of ``batch`` rows x ``q`` query columns
    (decode steps: q = 1; the first forward after a prefix hit: the
    uncached tail, at most a block) whose sequences fit ``capacity``
    blocks, at fixed addresses.

    Layout of the one device buffer (and of its pinned host mirror): slots
    ``int64[batch * q]``, sequence lengths ``int64[batch]``, query starts
    ``int64[batch + 1]`` (0, q, 2q, ...), block tables ``int32[batch,
    capacity]``.  ``load`` refills the host mirror and copies it up in one
    copy.  ``plan(key, heads)`` is the attention plan of such steps: made
    once over lengths of ``capacity`` blocks, it reads the buffers at run
    time, so its launches never change."""

    def __init__(self, lane, batch, q, capacity):
        be = lane.backend
        self.lane, self.batch, self.q, self.capacity = lane, int(batch), int(q), int(capacity)
        b, n, c = self.batch, self.batch * self.q, self.capacity
        at = np.cumsum([0, 8 * n, 8 * b, 8 * (b + 1), 4 * b * c])
        with be._ctx():
            self._device = be.empty((int(at[-1]),), np.uint8)
        self._host = be.launcher.pinned(int(at[-1]))
        self._host[...] = 0
        self._ready = None            # the last copy up (its staging is reused after it)

        def views(buf):
            return (buf[at[0]:at[1]].view(np.int64), buf[at[1]:at[2]].view(np.int64),
                    buf[at[2]:at[3]].view(np.int64),
                    buf[at[3]:at[4]].view(np.int32).reshape(b, c))

        self.slots, self.lens, self.query_start, self.tables = views(self._device)
        self._h_slots, self._h_lens, self._h_qsl, self._h_tables = views(self._host)
        self._h_qsl[...] = np.arange(b + 1) * self.q
        self.slots_ptr = be._ptr(self.slots)
        self._plans = {}

    def load(self, slots, seq_lens, block_tables):
        """This step's slots (``int64[batch * q]``), lengths
        (``int64[batch]``, the queries included) and block tables
        (``[batch, k]``, ``k <= capacity``; entries past a row's blocks are
        never read) into the device buffers: one host-to-device copy on the
        current stream, after the previous one finished reading the
        staging buffer."""
        be = self.lane.backend
        be.launcher.wait_host(self._ready)
        self._h_slots[...] = slots
        self._h_lens[...] = seq_lens
        k = block_tables.shape[1]
        self._h_tables[:, :k] = block_tables
        with be._ctx():
            be.launcher.copy_up(self._device, self._host)
            self._ready = be._record_event()

    def plan(self, key, num_heads):
        """The attention plan of this state's steps for ``key`` = (scale,
        sliding window (0: none), soft cap (0: none)) and ``num_heads``
        query heads: planned once over sequences of ``capacity`` blocks
        (the items cover every key a step can have; the kernels clip them
        to each query's own keys, and apply a sliding window per query),
        reading this state's tables, lengths and query starts."""
        plan = self._plans.get((key, num_heads))
        if plan is None:
            lane, be = self.lane, self.lane.backend
            b, c = self.batch, self.capacity
            scale, window, cap = key
            full = np.full(b, c * lane.block_size, np.int64)
            plan = lane.planned(np.zeros((b, c), np.int32), full,
                                np.arange(b + 1, dtype=np.int64) * self.q, (scale, 0, cap),
                                num_heads)
            plan.tables, plan.lens, plan.qsl = self.tables, self.lens, self.query_start
            plan.sliding_window = int(window)
            # (the plan's launches were packed over the planned tables and
            # window: packed again over this state's)
            plan.launches = be._attention.launches(plan)
            with be._ctx():
                be._fence()          # its uploads are done: a run never waits for them
            plan.ready = None
            self._plans[(key, num_heads)] = plan
        return plan
