# The byte span of an array's elements: the one bounds check behind the CPU
# kernels' overlap tests (_kernels.overlaps, _attention's plans), as
# numpy.may_share_memory does by default.  Inline, so each module that
# cimports it compiles its own copy (no module of its own).
cimport numpy as cnp


cdef inline bint byte_span(cnp.ndarray a, const char** lo, const char** hi) noexcept:
    """The bytes [lo, hi) that ``a``'s elements may touch (any strides,
    negative ones included); False, and an empty span, for an empty array."""
    cdef const char* l = <const char*>cnp.PyArray_DATA(a)
    cdef const char* h = l
    cdef int i
    cdef cnp.npy_intp n, s
    if cnp.PyArray_SIZE(a) == 0:
        lo[0] = hi[0] = l
        return False
    for i in range(cnp.PyArray_NDIM(a)):
        n = cnp.PyArray_DIM(a, i)
        s = cnp.PyArray_STRIDE(a, i)
        if s > 0:
            h += (n - 1) * s
        else:
            l += (n - 1) * s
    lo[0] = l
    hi[0] = h + cnp.PyArray_ITEMSIZE(a)
    return True
