"""Thin wrapper over kv_attention.c: paged attention on the CPU.

``kvcore/attention.py`` validated the shapes, dtypes and aliasing of every
argument (q, out, the caches, the scale planes, the ALiBi slopes and
sinks).  The index arguments are checked by ``check_tables`` (the
backend's ``check_attention_tables``): every block id a run can read in
0..num_blocks-1, positions in range, seq_lens >= the query counts (the
caller turns its status into an error).  This module only unpacks arrays
into the C argument struct and runs the kernel without the GIL.  The
kernel returns a status; Python raises.  ``Plan`` holds a C plan (kva_plan)
for ``kvcore.AttentionPlan``; its ``run_layer`` fast path checks a run's q,
layer and out here, but never raises for them: anything it does not take
returns NotImplemented and ``kvcore/attention.py`` checks and reports it.
"""
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.limits cimport INT_MAX
from kvcore.backends.cpu._convert cimport KVH_BF16, KVH_F16, KVH_F32, convert_n, kind_itemsize
from kvcore.backends.cpu._span cimport byte_span
from kvcore.backends.cpu._kernels import tensor_meta
from kvcore.backends.base import owned_index_arrays
from kvcore.dtypes import FP8_KINDS

import numpy as np

cnp.import_array()

# Status codes of the argument check (kvcore/attention.py turns them into errors).
cdef enum:
    CHECK_OK = 0
    BAD_SEQ_LEN = 1        # seq_lens[a] outside 0..max_blocks * block_size
    BAD_FIRST_START = 2    # query_start_loc[0] != 0
    DECREASING_START = 3   # query_start_loc[a + 1] < query_start_loc[a]
    BAD_LAST_START = 4     # query_start_loc[-1] != num_tokens
    SHORT_SEQ = 5          # seq_lens[a] < the query count of sequence a
    BAD_BLOCK_ID = 6       # block_tables[a, b] is read and outside 0..num_blocks - 1
STATUS_NAMES = {BAD_SEQ_LEN: "BAD_SEQ_LEN", BAD_FIRST_START: "BAD_FIRST_START",
                DECREASING_START: "DECREASING_START", BAD_LAST_START: "BAD_LAST_START",
                SHORT_SEQ: "SHORT_SEQ", BAD_BLOCK_ID: "BAD_BLOCK_ID"}


cdef extern from "kv_attention.h" nogil:
    enum:
        KVA_OK
        KVA_ENOMEM
        KVA_NUM_LEVELS
    ctypedef struct kva_args:
        const float *q
        float *out
        const char *key_cache
        const char *value_cache
        int kind
        Py_ssize_t block_stride
        Py_ssize_t head_stride
        Py_ssize_t row_stride
        int64_t block_size
        int num_heads
        int num_kv_heads
        int head_dim
        const int32_t *block_tables
        Py_ssize_t block_table_stride
        const int64_t *seq_lens
        const int64_t *query_start_loc
        int64_t num_seqs
        float scale
        int64_t sliding_window
        float soft_cap
        int num_threads
        const float *key_scales
        const float *value_scales
        float k_scale
        float v_scale
        const float *k_head_scales
        const float *v_head_scales
        int64_t chunk_size
        const float *alibi_slopes
        const float *sinks
        int q_kind
        int out_kind
        int (*convert)(int, const void *, int, void *, Py_ssize_t) noexcept nogil
    int kva_best_level()
    int kva_default_level()
    int kva_level_supported(int level)
    int kva_current_level()
    int kva_set_level(int level)
    int kva_level_at_most(int registry)
    const char *kva_level_name(int level)
    int kva_exp2_neg(int level, const float *x, float *y, Py_ssize_t n)
    int kva_softcap(int level, const float *x, float *y, Py_ssize_t n, float a, float b)
    ctypedef struct kva_plan:
        pass
    kva_plan *kva_plan_create(const kva_args *args, int *status)
    int kva_plan_run(const kva_plan *plan, const kva_args *args)
    void kva_plan_free(kva_plan *plan)
    int64_t kva_plan_num_items(const kva_plan *plan)
    int kva_plan_num_threads(const kva_plan *plan)


cdef const float* _float_row(object x, Py_ssize_t n, str what) except? NULL:
    """A float32 (n,) C-contiguous array's data (an fp8 plane's per-kv-head
    scales, a layer's ALiBi slopes or sinks); NULL for None."""
    cdef cnp.ndarray s
    if x is None:
        return NULL
    s = <cnp.ndarray?>x
    if cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(s) \
            or not cnp.PyArray_ISALIGNED(s) or not cnp.PyArray_ISNOTSWAPPED(s) or s.ndim != 1 \
            or s.shape[0] != n:
        raise ValueError(f"internal: {what} must be C-contiguous float32 of shape ({n},)")
    return <const float*>cnp.PyArray_DATA(s)


cdef const float* _scale_plane(object scales, cnp.ndarray cache, str what) except? NULL:
    """An int8 cache's scale plane (num_blocks, num_kv_heads, block_size),
    C-contiguous float32, checked against the cache; NULL for None."""
    cdef cnp.ndarray s
    if scales is None:
        return NULL
    s = <cnp.ndarray>scales
    want = (cache.shape[0], cache.shape[1], cache.shape[2])
    if cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(s) \
            or not cnp.PyArray_ISALIGNED(s) or not cnp.PyArray_ISNOTSWAPPED(s) or s.ndim != 3 \
            or (s.shape[0], s.shape[1], s.shape[2]) != want:
        raise ValueError(f"internal: {what} must be C-contiguous float32 of shape {want}")
    return <const float*>cnp.PyArray_DATA(s)


cdef int _codec_args(kva_args *a, object codecs, cnp.ndarray cache, int kind,
                     Py_ssize_t num_kv_heads) except -1:
    """Set ``a``'s scale fields from the planes' ``(key_codec, value_codec)``:
    an int8 plane's scale plane, an fp8 plane's layer scale or per-kv-head
    scales (which then win)."""
    key_codec, value_codec = codecs
    if key_codec.kind != kind or value_codec.kind != kind:
        raise ValueError(f"internal: codecs of kinds {key_codec.kind}, {value_codec.kind} for "
                         f"a plan of kind {kind}")
    a.key_scales = _scale_plane(key_codec.scale_plane, cache, "the key scale_plane")
    a.value_scales = _scale_plane(value_codec.scale_plane, cache, "the value scale_plane")
    a.k_scale = <float>key_codec.layer_scale
    a.v_scale = <float>value_codec.layer_scale
    a.k_head_scales = _float_row(key_codec.head_scales, num_kv_heads, "head_scales")
    a.v_head_scales = _float_row(value_codec.head_scales, num_kv_heads, "head_scales")
    return 0


def simd_level():
    """Name of the kernel level in use."""
    return kva_level_name(kva_current_level()).decode()


def default_simd_level():
    """Name of the level used unless one is set: the best this CPU supports
    under KVCORE_SIMD."""
    return kva_level_name(kva_default_level()).decode()


def simd_level_names():
    """Names of every kernel level of the registry this build knows (the
    CPU may lack some)."""
    return [kva_level_name(l).decode() for l in range(KVA_NUM_LEVELS)]


def available_simd_levels():
    """Names of the kernel levels this CPU can run, lowest first."""
    return [kva_level_name(l).decode() for l in range(KVA_NUM_LEVELS) if kva_level_supported(l)]


def use_registry_level(int level):
    """Run the attention at its best level at or under registry level
    ``level`` (kv_simd.h's numbering)."""
    kva_set_level(kva_level_at_most(level))


def _level_index(name):
    for l in range(KVA_NUM_LEVELS):
        if kva_level_name(l).decode() == name:
            if not kva_level_supported(l):
                raise ValueError(f"SIMD level {name!r} is not supported by this CPU")
            return l
    raise ValueError(f"unknown SIMD level {name!r}")


def exp2_neg(const float[::1] x, float[::1] y, level):
    """y = 2**x for x <= 0, as the kernels of ``level`` compute it (tests)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError("x and y must have the same length")
    cdef int l = _level_index(level)
    if x.shape[0]:
        kva_exp2_neg(l, &x[0], &y[0], x.shape[0])


def softcap(const float[::1] x, float[::1] y, float a, float b, level):
    """y = b * tanh(a * x), as the kernels of ``level`` compute it (tests)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError("x and y must have the same length")
    cdef int l = _level_index(level)
    if x.shape[0]:
        kva_softcap(l, &x[0], &y[0], x.shape[0], a, b)




def check_tables(const int32_t[:, ::1] block_tables, const int64_t[::1] seq_lens,
                 const int64_t[::1] query_start_loc, int64_t num_tokens, int64_t num_blocks,
                 int64_t block_size, int64_t sliding_window, int64_t chunk_size):
    """See _check_tables."""
    cdef Py_ssize_t a = 0, b = 0
    cdef int status = _check_tables(block_tables, seq_lens, query_start_loc, num_tokens,
                                    num_blocks, block_size, sliding_window, chunk_size, &a, &b)
    return status, a, b


cdef int _check_tables(const int32_t[:, ::1] block_tables, const int64_t[::1] seq_lens,
                       const int64_t[::1] query_start_loc, int64_t num_tokens,
                       int64_t num_blocks, int64_t block_size, int64_t sliding_window,
                       int64_t chunk_size, Py_ssize_t *ea, Py_ssize_t *eb) noexcept nogil:
    """One pass over the integer arguments of paged_attention, in the order
    the errors are reported.  Returns ``(status, a, b)``; status 0 is fine.

    Every block-table entry the kernel can read is checked: those from the
    first position any query of the sequence can see (that of the first
    query, at position p = seq_len - n: 0, or the later of its window's and
    its chunk's starts) to the last position.  A sequence without queries
    is not read."""
    cdef Py_ssize_t S = seq_lens.shape[0], B = block_tables.shape[1], s, b
    cdef int64_t cap = B * block_size, n, first, end_blk
    cdef int32_t blk
    for s in range(S):
        if seq_lens[s] < 0 or seq_lens[s] > cap:
            ea[0] = s
            return BAD_SEQ_LEN
    if query_start_loc[0] != 0:
        return BAD_FIRST_START
    for s in range(S):
        if query_start_loc[s + 1] < query_start_loc[s]:
            ea[0] = s
            return DECREASING_START
    if query_start_loc[S] != num_tokens:
        return BAD_LAST_START
    for s in range(S):
        if seq_lens[s] < query_start_loc[s + 1] - query_start_loc[s]:
            ea[0] = s
            return SHORT_SEQ
    for s in range(S):
        n = query_start_loc[s + 1] - query_start_loc[s]
        if n == 0:
            continue
        # (the kernel's key range: kv_attn_internal.h kva_key_lo)
        first = 0
        if sliding_window > 0:
            first = seq_lens[s] - n + 1 - sliding_window
            if first < 0:
                first = 0
        if chunk_size > 0 and (seq_lens[s] - n) // chunk_size * chunk_size > first:
            first = (seq_lens[s] - n) // chunk_size * chunk_size
        end_blk = (seq_lens[s] + block_size - 1) // block_size
        for b in range(first // block_size, end_blk):
            blk = block_tables[s, b]
            if blk < 0 or blk >= num_blocks:
                ea[0] = s
                eb[0] = b
                return BAD_BLOCK_ID
    return CHECK_OK


# ------------------------------------------------------------------ plan / run
cdef inline bint _dims_are(cnp.ndarray a, int nd, Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t d2,
                          Py_ssize_t d3=0) noexcept:
    cdef Py_ssize_t want[4]
    want[0], want[1], want[2], want[3] = d0, d1, d2, d3
    if cnp.PyArray_NDIM(a) != nd:
        return False
    for i in range(nd):
        if cnp.PyArray_DIM(a, i) != want[i]:
            return False
    return True


cdef inline bint _layer_stride(cnp.ndarray first, cnp.ndarray last, Py_ssize_t steps,
                               Py_ssize_t *stride) noexcept:
    cdef Py_ssize_t d = <const char *>cnp.PyArray_DATA(last) - <const char *>cnp.PyArray_DATA(first)
    if d % steps:
        return False
    stride[0] = d // steps
    return True


cdef bint _one_buffer(cnp.ndarray first, cnp.ndarray last):
    """Whether ``first`` and ``last`` are views of one NumPy array whose
    memory holds both (so every plane between them, at a whole number of
    layer strides, lies in that memory too)."""
    cdef object root_a = first, root_b = last
    while isinstance(root_a.base, np.ndarray):
        root_a = root_a.base
    while isinstance(root_b.base, np.ndarray):
        root_b = root_b.base
    if root_a is not root_b:
        return False
    cdef const char *rlo
    cdef const char *rhi
    cdef const char *lo
    cdef const char *hi
    byte_span(<cnp.ndarray>root_a, &rlo, &rhi)
    for a in (first, last):
        byte_span(<cnp.ndarray>a, &lo, &hi)
        if lo < rlo or hi > rhi:
            return False
    return True


def address(cnp.ndarray a):
    """The address of ``a``'s first element (cheaper than ``a.ctypes.data``)."""
    return <size_t>cnp.PyArray_DATA(a)


def first_moved(tuple held):
    """The index of the first ``(array, address, nbytes)`` of ``held``
    whose array no longer has that address and size (it was resized in
    place: ``ndarray.resize(..., refcheck=False)``), else -1."""
    cdef Py_ssize_t i
    cdef tuple entry
    cdef cnp.ndarray a
    for i in range(len(held)):
        entry = <tuple>held[i]
        a = <cnp.ndarray>entry[0]
        if <size_t>cnp.PyArray_DATA(a) != <size_t>entry[1] \
                or cnp.PyArray_NBYTES(a) != <Py_ssize_t>entry[2]:
            return i
    return -1


cdef class Plan


cdef class _Guard:
    """The one-run-at-a-time flag of a plan, shared by the plans of one
    ``kvcore.AttentionPlan`` (one per layer kind: ``Plan.share_guard``)."""
    cdef bint busy


cdef inline bint _plane_ok(Plan p, cnp.ndarray c) noexcept:
    cdef Py_ssize_t item = 4 if p.kind == 0 else 1 if p.kind >= 3 else 2
    return cnp.PyArray_NDIM(c) == 4 and cnp.PyArray_DIM(c, 0) >= p.num_blocks \
        and cnp.PyArray_DIM(c, 1) == p.num_kv_heads and cnp.PyArray_DIM(c, 2) == p.block_size \
        and cnp.PyArray_DIM(c, 3) == p.head_dim and cnp.PyArray_ITEMSIZE(c) == item \
        and cnp.PyArray_STRIDE(c, 3) == item


cdef inline bint _same_geometry(Plan a, Plan b) noexcept:
    """Whether plans a and b run on the same q, out and planes."""
    return a.num_tokens == b.num_tokens and a.num_heads == b.num_heads \
        and a.num_kv_heads == b.num_kv_heads and a.head_dim == b.head_dim \
        and a.block_size == b.block_size and a.num_blocks == b.num_blocks and a.kind == b.kind


cdef const float* _layer_rows(object x, Py_ssize_t num_layers, Py_ssize_t num_heads,
                              str what) except? NULL:
    """Bound ALiBi slopes or sinks: float32 (num_layers, num_heads),
    C-contiguous; NULL for None."""
    cdef cnp.ndarray s
    if x is None:
        return NULL
    s = <cnp.ndarray?>x
    if cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(s) \
            or not cnp.PyArray_ISALIGNED(s) or not cnp.PyArray_ISNOTSWAPPED(s) \
            or not _dims_are(s, 2, num_layers, num_heads, 0):
        raise ValueError(f"internal: {what} must be C-contiguous float32 (num_layers, num_heads)")
    return <const float*>cnp.PyArray_DATA(s)


cdef inline bint _planes_match(Plan p, cnp.ndarray k, cnp.ndarray v) noexcept:
    """k and v: (num_blocks or more, num_kv_heads, block_size, head_dim) of
    the plan's storage kind, rows contiguous, the same strides."""
    if not (_plane_ok(p, k) and _plane_ok(p, v)):
        return False
    for i in range(4):
        if cnp.PyArray_STRIDE(k, i) != cnp.PyArray_STRIDE(v, i):
            return False
    return True


def _scale_rows(codecs, Py_ssize_t num_kv_heads):
    """fp8 planes' scales as the bound runs read them: ``(layer_scales,
    None)`` float32 ``(num_layers, 2)``, or where some plane has per-kv-head
    scales ``(None, head_scales)`` float32 ``(num_layers, 2, num_kv_heads)``
    (a plane of one scale repeated); ``(None, None)`` for other kinds."""
    if codecs[0][0].kind not in FP8_KINDS:
        return None, None
    if all(c.head_scales is None for pair in codecs for c in pair):
        return np.array([[c.layer_scale for c in pair] for pair in codecs], np.float32), None
    return None, np.ascontiguousarray(
        [[np.full(num_kv_heads, c.layer_scale, np.float32) if c.head_scales is None
          else c.head_scales for c in pair] for pair in codecs], np.float32)


cdef class Plan:
    """The CPU backend's attention plan: owned, checked copies of the index
    arguments and the shape/scalar fields of the C arguments, for one
    geometry (num_heads, num_kv_heads, head_dim, block_size, num_blocks).

    ``run`` (the backend's ``attention_run``) takes already-checked arrays;
    ``bind`` + ``run_layer`` are ``kvcore.AttentionPlan.run``'s fast path:
    the layers' planes are bound once (base pointers and a layer stride),
    and a call with a float32 C-contiguous ``q`` and ``out`` (or None) is
    checked and run here, with no Python-level work; anything else returns
    NotImplemented and the caller takes the general path.

    A step whose layers differ in window or chunk (one Plan per kind)
    binds them all to one Plan: ``bind(layer_plans=...)`` runs each layer
    on its kind's Plan, with its row of the bound ALiBi slopes and sinks.

    One run at a time: a run that finds another in progress on the same
    plan (or on one sharing its guard) raises RuntimeError (the work
    buffers belong to the plan).
    """
    cdef kva_args args
    cdef kva_plan *plan
    cdef readonly object block_tables, seq_lens, query_start_loc
    cdef readonly Py_ssize_t num_tokens, num_heads, num_kv_heads, head_dim
    cdef readonly int64_t block_size, num_blocks
    cdef readonly int kind, num_threads
    cdef readonly double scale, soft_cap
    cdef readonly int64_t sliding_window, chunk_size
    cdef _Guard guard
    # the bound layers (bind)
    cdef bint bound
    cdef Py_ssize_t num_layers
    cdef const char *key_base
    cdef const char *value_base
    cdef Py_ssize_t key_layer_stride, value_layer_stride
    cdef const char *key_scale_plane_base
    cdef const char *value_scale_plane_base
    cdef Py_ssize_t key_scale_plane_stride, value_scale_plane_stride
    cdef object layer_scales          # float32 (num_layers, 2) C-contiguous, or None
    cdef const float *layer_scales_ptr
    cdef object head_scales           # float32 (num_layers, 2, num_kv_heads), or None
    cdef const float *head_scales_ptr
    cdef const char *owned_lo[8]
    cdef const char *owned_hi[8]
    cdef int num_owned
    cdef tuple layer_plans            # the Plan of each layer (None: this one), or None
    cdef const float *alibi_ptr       # float32 (num_layers, num_heads), or NULL
    cdef const float *sinks_ptr       # float32 (num_layers, num_heads), or NULL
    cdef object keep                  # references to everything bound

    def __cinit__(self, block_tables, seq_lens, query_start_loc, Py_ssize_t num_heads,
                  Py_ssize_t num_kv_heads, Py_ssize_t head_dim, int64_t block_size,
                  int64_t num_blocks, int kind, double scale, int64_t sliding_window,
                  double soft_cap, int64_t chunk_size, int num_threads):
        self.guard = _Guard()
        # the kernels' counts are C ints: a larger one must not wrap (a
        # head_dim of 2**32 + 8 would run as 8)
        for arg, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                           ("head_dim", head_dim)):
            if not 0 < count <= INT_MAX:
                raise ValueError(f"{arg} must be in 1..{INT_MAX} (the attention kernels take "
                                 f"a C int), got {count}")
        # owned copies (the caller may change or drop its arrays afterwards)
        cdef cnp.ndarray t, l, s
        t, l, s = owned_index_arrays(block_tables, seq_lens, query_start_loc)
        if t.ndim != 2 or l.ndim != 1 or s.ndim != 1 or l.shape[0] != t.shape[0] \
                or s.shape[0] != t.shape[0] + 1:
            raise ValueError("internal: plan index arrays of the wrong shapes")
        self.block_tables, self.seq_lens, self.query_start_loc = t, l, s
        self.num_tokens = <Py_ssize_t>(<const int64_t *>cnp.PyArray_DATA(s))[s.shape[0] - 1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.num_blocks, self.kind = block_size, num_blocks, kind
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.chunk_size = chunk_size
        self.num_threads = num_threads
        cdef kva_args *a = &self.args
        a.kind = kind
        a.block_size = block_size
        a.num_heads = <int>num_heads
        a.num_kv_heads = <int>num_kv_heads
        a.head_dim = <int>head_dim
        a.block_tables = <const int32_t *>cnp.PyArray_DATA(t) if t.size else NULL
        a.block_table_stride = t.shape[1]
        a.seq_lens = <const int64_t *>cnp.PyArray_DATA(l) if l.size else NULL
        a.query_start_loc = <const int64_t *>cnp.PyArray_DATA(s)
        a.num_seqs = l.shape[0]
        a.scale = <float>scale
        a.sliding_window = sliding_window
        a.soft_cap = <float>soft_cap
        a.num_threads = num_threads
        a.key_scales = NULL
        a.value_scales = NULL
        a.k_scale = 1.0
        a.v_scale = 1.0
        a.k_head_scales = NULL
        a.v_head_scales = NULL
        a.chunk_size = chunk_size
        a.alibi_slopes = NULL
        a.sinks = NULL
        cdef int status = KVA_OK
        with nogil:
            self.plan = kva_plan_create(a, &status)
        if self.plan == NULL:
            if status == KVA_ENOMEM:
                raise MemoryError("attention plan could not allocate its work buffers")
            raise RuntimeError(f"kv_attention rejected the plan (status {status})")

    def __dealloc__(self):
        kva_plan_free(self.plan)

    @property
    def num_items(self):
        """Work items of a run."""
        return kva_plan_num_items(self.plan)

    @property
    def num_threads_used(self):
        """Threads a run uses (at most the planned num_threads)."""
        return kva_plan_num_threads(self.plan)

    def share_guard(self, Plan other):
        """Runs of this plan and of ``other`` take turns (one at a time
        between them): the plans of one step, one per layer kind."""
        self.guard = other.guard

    cdef int _go(self, kva_args *a, int q_kind=KVH_F32, int out_kind=KVH_F32) except -1:
        """Runs the kernel on ``a`` (the plan's fields plus the data fields),
        one run at a time.  ``q_kind`` / ``out_kind`` float16 or bfloat16:
        ``a.q`` / ``a.out`` point at such elements, which the kernels read
        and write themselves, a row at a time through kvcore's conversions
        (the bits of converting the whole arrays before and after)."""
        cdef int status
        cdef _Guard guard = self.guard
        if guard.busy:
            raise RuntimeError("this AttentionPlan is already running (one run at a time per "
                               "plan: use one plan per thread)")
        guard.busy = True
        try:
            a.q_kind = q_kind
            a.out_kind = out_kind
            a.convert = convert_n
            with nogil:
                status = kva_plan_run(self.plan, a)
        finally:
            guard.busy = False
        if status == KVA_ENOMEM:
            raise MemoryError("paged_attention could not allocate its work buffers")
        if status != KVA_OK:
            raise RuntimeError(f"kv_attention rejected its arguments (status {status})")
        return 0

    def run(self, cnp.ndarray q, cnp.ndarray out, cnp.ndarray key_cache,
            cnp.ndarray value_cache, codecs=None, *, alibi_slopes=None, sinks=None):
        """out[...] = attention of q (C-contiguous, the plan's shape: float32,
        float16, or bfloat16 as its uint16 bits; the kernels widen and narrow
        16-bit rows themselves) over key_cache / value_cache ((num_blocks,
        num_kv_heads, block_size, head_dim), rows contiguous, the same
        strides), checked by the caller.  ``codecs``: the planes'
        ``(key_codec, value_codec)`` (kvcore.backends.Codec, of the plan's
        kind), or None for unscaled planes.  ``alibi_slopes`` / ``sinks``:
        float32 ``(num_heads,)`` or None."""
        cdef int kinds[2]
        for i, x in enumerate((q, out)):
            t = cnp.PyArray_TYPE(x)
            kinds[i] = KVH_F32 if t == cnp.NPY_FLOAT32 else KVH_F16 if t == cnp.NPY_FLOAT16 \
                else KVH_BF16 if t == cnp.NPY_UINT16 else -1
            if kinds[i] < 0 or not cnp.PyArray_IS_C_CONTIGUOUS(x) \
                    or not cnp.PyArray_ISALIGNED(x) or not cnp.PyArray_ISNOTSWAPPED(x) \
                    or not _dims_are(x, 3, self.num_tokens, self.num_heads, self.head_dim):
                raise ValueError("internal: q and out must be C-contiguous float32, float16 "
                                 "or bfloat16 bits (uint16) "
                                 f"{(self.num_tokens, self.num_heads, self.head_dim)}")
        if not _planes_match(self, key_cache, value_cache):
            raise ValueError("internal: the caches do not match the plan")
        cdef kva_args a = self.args
        a.q = <const float *>cnp.PyArray_DATA(q) if self.num_tokens else NULL
        a.out = <float *>cnp.PyArray_DATA(out) if self.num_tokens else NULL
        a.key_cache = <const char *>cnp.PyArray_DATA(key_cache)
        a.value_cache = <const char *>cnp.PyArray_DATA(value_cache)
        a.block_stride = key_cache.strides[0]
        a.head_stride = key_cache.strides[1]
        a.row_stride = key_cache.strides[2]
        if codecs is not None:
            _codec_args(&a, codecs, key_cache, self.kind, self.num_kv_heads)
        elif self.kind == 5:      # (kvcore.dtypes.I8)
            raise ValueError("internal: int8 planes need their codecs (the scale planes)")
        a.alibi_slopes = _float_row(alibi_slopes, self.num_heads, "alibi_slopes")
        a.sinks = _float_row(sinks, self.num_heads, "sinks")
        self._go(&a, kinds[0], kinds[1])

    def bind(self, cnp.ndarray key0, cnp.ndarray value0, cnp.ndarray key_last,
             cnp.ndarray value_last, Py_ssize_t num_layers, codecs=None, owned=(),
             layer_plans=None, alibi=None, sinks=None):
        """Binds the layers ``run_layer`` reads: the planes of layer 0 and of
        the last layer (``num_layers - 1``); layer ``l``'s planes lie ``l``
        layer strides past layer 0's (the stride measured here; a layout
        where it is not a whole number of bytes per layer is not bound).
        ``codecs``: None (unscaled planes), or every layer's ``(key_codec,
        value_codec)`` (int8: the scale planes of layers 0 and last lie a
        layer stride apart too; fp8: each plane's layer scale, or its
        per-kv-head scales).  ``owned``: up to 8
        arrays an ``out`` must not overlap.  ``layer_plans``: None (every
        layer runs this plan), or the Plan of each layer (one per layer
        kind, each of this plan's geometry and guard).  ``alibi`` /
        ``sinks``: None or float32 ``(num_layers, num_heads)``, C-contiguous
        (each layer's row).  Returns ``run_layer``, or None when the layers
        cannot be bound."""
        cdef Py_ssize_t key_layer_stride, value_layer_stride
        cdef Py_ssize_t steps = num_layers - 1 if num_layers > 1 else 1
        # int8: the scale planes of layers 0 and last; fp8: every plane's scales
        k_plane0 = v_plane0 = k_plane_last = v_plane_last = None
        layer_scales = head_scales = None
        if codecs is not None:
            if len(codecs) != num_layers:
                raise ValueError("internal: codecs must hold one pair per layer")
            k_plane0, v_plane0 = codecs[0][0].scale_plane, codecs[0][1].scale_plane
            k_plane_last = codecs[num_layers - 1][0].scale_plane
            v_plane_last = codecs[num_layers - 1][1].scale_plane
            layer_scales, head_scales = _scale_rows(codecs, self.num_kv_heads)
        if num_layers < 1 or not (_one_buffer(key0, key_last) and _one_buffer(value0, value_last)):
            return None
        if k_plane0 is not None and not (_one_buffer(k_plane0, k_plane_last)
                                         and _one_buffer(v_plane0, v_plane_last)):
            return None
        if not _layer_stride(key0, key_last, steps, &key_layer_stride) \
                or not _layer_stride(value0, value_last, steps, &value_layer_stride):
            return None
        cdef Py_ssize_t key_scale_plane_stride = 0, value_scale_plane_stride = 0
        if k_plane0 is not None:
            if not _layer_stride(k_plane0, k_plane_last, steps, &key_scale_plane_stride) \
                    or not _layer_stride(v_plane0, v_plane_last, steps,
                                         &value_scale_plane_stride):
                return None
        if len(owned) > 8:
            raise ValueError("internal: at most 8 owned arrays")
        if not (_planes_match(self, key0, value0) and _planes_match(self, key_last, value_last)):
            raise ValueError("internal: the bound planes do not match the plan")
        for o in (key_last, value_last):
            if cnp.PyArray_STRIDE(<cnp.ndarray>o, 0) != cnp.PyArray_STRIDE(key0, 0) \
                    or cnp.PyArray_STRIDE(<cnp.ndarray>o, 1) != cnp.PyArray_STRIDE(key0, 1) \
                    or cnp.PyArray_STRIDE(<cnp.ndarray>o, 2) != cnp.PyArray_STRIDE(key0, 2):
                raise ValueError("internal: every layer's planes must have one layout")
        _scale_plane(k_plane_last, key0, "the key scale_plane")
        _scale_plane(v_plane_last, key0, "the value scale_plane")
        self.args.key_cache = <const char *>cnp.PyArray_DATA(key0)
        self.args.value_cache = <const char *>cnp.PyArray_DATA(value0)
        self.args.block_stride = key0.strides[0]
        self.args.head_stride = key0.strides[1]
        self.args.row_stride = key0.strides[2]
        self.key_base = <const char *>cnp.PyArray_DATA(key0)
        self.value_base = <const char *>cnp.PyArray_DATA(value0)
        self.key_layer_stride, self.value_layer_stride = key_layer_stride, value_layer_stride
        self.num_layers = num_layers
        self.key_scale_plane_base = <const char *>_scale_plane(k_plane0, key0,
                                                               "the key scale_plane")
        self.value_scale_plane_base = <const char *>_scale_plane(v_plane0, key0,
                                                                 "the value scale_plane")
        self.key_scale_plane_stride = key_scale_plane_stride
        self.value_scale_plane_stride = value_scale_plane_stride
        cdef cnp.ndarray ls
        self.layer_scales_ptr = NULL
        if layer_scales is not None:
            ls = <cnp.ndarray>layer_scales
            if cnp.PyArray_TYPE(ls) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(ls) \
                    or not _dims_are(ls, 2, num_layers, 2, 0):
                raise ValueError("internal: layer_scales must be float32 (num_layers, 2)")
            self.layer_scales_ptr = <const float *>cnp.PyArray_DATA(ls)
        self.head_scales_ptr = NULL
        if head_scales is not None:
            ls = <cnp.ndarray>head_scales
            if cnp.PyArray_TYPE(ls) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(ls) \
                    or not cnp.PyArray_ISALIGNED(ls) \
                    or not _dims_are(ls, 3, num_layers, 2, self.num_kv_heads):
                raise ValueError("internal: head_scales must be float32 "
                                 "(num_layers, 2, num_kv_heads)")
            self.head_scales_ptr = <const float *>cnp.PyArray_DATA(ls)
        self.layer_plans = None
        if layer_plans is not None:
            plans = tuple(layer_plans)
            if len(plans) != num_layers:
                raise ValueError("internal: layer_plans must hold one Plan per layer")
            for p in plans:
                if not _same_geometry(self, <Plan?>p) or (<Plan>p).guard is not self.guard:
                    raise ValueError("internal: layer_plans must share this plan's geometry "
                                     "and guard")
            # (this plan as None: it does not hold itself)
            self.layer_plans = tuple(None if p is self else p for p in plans)
        self.alibi_ptr = _layer_rows(alibi, num_layers, self.num_heads, "alibi")
        self.sinks_ptr = _layer_rows(sinks, num_layers, self.num_heads, "sinks")
        self.num_owned = 0
        cdef const char *lo
        cdef const char *hi
        for o in owned:
            if byte_span(<cnp.ndarray?>o, &lo, &hi):
                self.owned_lo[self.num_owned] = lo
                self.owned_hi[self.num_owned] = hi
                self.num_owned += 1
        self.keep = (key0, value0, key_last, value_last, k_plane0, v_plane0,
                     k_plane_last, v_plane_last, layer_scales, head_scales,
                     tuple(owned), alibi, sinks)
        self.bound = True
        return self.run_layer

    cdef int _rows(self, object x, bint out, const char **p, const char **end) except -2:
        """The element kind of ``x`` when run_layer takes it as it is, as
        (num_tokens, num_heads, head_dim) rows from ``*p`` to ``*end``: a
        native float32 NumPy array (C-contiguous, aligned; an ``out``
        writable), or a CPU torch tensor (``tensor_meta``) of float32,
        float16 or bfloat16, aligned, an ``out`` one that does not require
        grad (the general path refuses those); -1 for anything else."""
        cdef cnp.ndarray a
        cdef int kind
        if type(x) is np.ndarray:
            a = <cnp.ndarray>x
            # (a byte-swapped float32 has the float32 type number too)
            if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(a) != 3 \
                    or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a) \
                    or not cnp.PyArray_ISNOTSWAPPED(a) \
                    or (out and not cnp.PyArray_ISWRITEABLE(a)) \
                    or cnp.PyArray_DIM(a, 0) != self.num_tokens \
                    or cnp.PyArray_DIM(a, 1) != self.num_heads \
                    or cnp.PyArray_DIM(a, 2) != self.head_dim:
                return -1
            p[0] = <const char *>cnp.PyArray_DATA(a)
            end[0] = p[0] + cnp.PyArray_NBYTES(a)
            return KVH_F32
        meta = tensor_meta(x)
        if meta is None:
            return -1
        ptr, typenum, shape = meta
        if typenum == cnp.NPY_FLOAT32:
            kind = KVH_F32
        elif typenum == cnp.NPY_FLOAT16:
            kind = KVH_F16
        elif typenum == cnp.NPY_UINT16:      # tensor_meta: torch.bfloat16's bits
            kind = KVH_BF16
        else:
            return -1
        if len(shape) != 3 or shape[0] != self.num_tokens or shape[1] != self.num_heads \
                or shape[2] != self.head_dim or (<uintptr_t>ptr) % kind_itemsize(kind) \
                or (out and x.requires_grad):
            return -1
        p[0] = <const char *><uintptr_t>ptr
        end[0] = p[0] + self.num_tokens * self.num_heads * self.head_dim * kind_itemsize(kind)
        return kind

    def run_layer(self, q, layer, out=None):
        """``kvcore.AttentionPlan.run``'s fast path (see the class notes):
        the result, or NotImplemented when the general path must decide.
        Takes float32 NumPy arrays and CPU torch tensors of float32, float16
        or bfloat16 (16-bit ones read and written by the kernels a row at a
        time with kvcore's conversions: the general path's bits)."""
        cdef const char *qlo
        cdef const char *qhi
        cdef const char *olo
        cdef const char *ohi
        cdef int q_kind, out_kind = KVH_F32
        cdef cnp.ndarray oa = None
        cdef int i
        if not self.bound or type(layer) is not int:
            return NotImplemented
        q_kind = self._rows(q, False, &qlo, &qhi)
        if q_kind < 0:
            return NotImplemented
        cdef Py_ssize_t l
        try:
            l = layer
        except OverflowError:
            return NotImplemented
        if l < 0 or l >= self.num_layers:
            return NotImplemented
        cdef cnp.npy_intp dims[3]
        if out is None:
            dims[0], dims[1], dims[2] = self.num_tokens, self.num_heads, self.head_dim
            oa = cnp.PyArray_EMPTY(3, dims, cnp.NPY_FLOAT32, 0)
            olo = <const char *>cnp.PyArray_DATA(oa)
        else:
            out_kind = self._rows(out, True, &olo, &ohi)
            if out_kind < 0:
                return NotImplemented
            if olo < ohi:
                if qlo < qhi and olo < qhi and qlo < ohi:
                    return NotImplemented
                for i in range(self.num_owned):
                    if olo < self.owned_hi[i] and self.owned_lo[i] < ohi:
                        return NotImplemented
        # the layer's kind's plan (its C plan; the same q, out and planes)
        cdef Plan target = self
        if self.layer_plans is not None:
            entry = self.layer_plans[l]
            if entry is not None:
                target = <Plan>entry
        cdef kva_args a = target.args
        a.block_stride = self.args.block_stride      # (the bound planes' layout)
        a.head_stride = self.args.head_stride
        a.row_stride = self.args.row_stride
        if self.alibi_ptr != NULL:
            a.alibi_slopes = self.alibi_ptr + l * self.num_heads
        if self.sinks_ptr != NULL:
            a.sinks = self.sinks_ptr + l * self.num_heads
        if self.num_tokens:
            a.q = <const float *>qlo
            a.out = <float *>olo
        a.key_cache = self.key_base + l * self.key_layer_stride
        a.value_cache = self.value_base + l * self.value_layer_stride
        if self.key_scale_plane_base != NULL:
            a.key_scales = <const float *>(self.key_scale_plane_base
                                           + l * self.key_scale_plane_stride)
            a.value_scales = <const float *>(self.value_scale_plane_base
                                             + l * self.value_scale_plane_stride)
        if self.layer_scales_ptr != NULL:
            a.k_scale = self.layer_scales_ptr[2 * l]
            a.v_scale = self.layer_scales_ptr[2 * l + 1]
        if self.head_scales_ptr != NULL:
            a.k_head_scales = self.head_scales_ptr + 2 * l * self.num_kv_heads
            a.v_head_scales = self.head_scales_ptr + (2 * l + 1) * self.num_kv_heads
        target._go(&a, q_kind, out_kind)
        return oa if out is None else out
