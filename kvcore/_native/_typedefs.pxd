# The C types behind kvcore's arrays.  Each has a NumPy twin in
# kvcore._native._typedefs (checked by tests/native/test_typedefs.py), so a
# memoryview typed here always matches the array the Python side allocates.
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t

ctypedef int32_t block_id_t    # block ids, ref counts, free-list links: numpy.int32
ctypedef int64_t slot_t        # slot = block_id * block_size + offset: numpy.int64
ctypedef int32_t token_t       # token ids (0 .. 2**31-1): numpy.int32
ctypedef uint64_t hash_word_t  # a block hash is two of these (128 bits): numpy.uint64
ctypedef uint16_t half_t       # raw float16 / bfloat16 bits: numpy.uint16


# The one interface between the bookkeeping and a backend.  A sequence on a
# CPU pool hands the k and v of an append to the writer its pool gave it
# (kvcore.backends.cpu._kernels.PositionWriter) and never touches the bytes
# itself.  Declared here, beside the types both layers share, so that
# kvcore/_native never imports a backend and no backend imports the
# bookkeeping.
# What take() found for write(): the caller's, so that threads sharing a
# pool (and its writer) never see each other's rows.
cdef struct RowInput:
    const char* k
    const char* v
    Py_ssize_t n
    int kind

cdef class RowWriter:
    # n >= 1 when k and v are (n, heads, dim) inputs this writer takes as
    # they are (described in *rows for write), else -1; changes nothing
    cdef Py_ssize_t take(self, object k, object v, RowInput* rows) except -2
    # the rows take() accepted (k and v still alive) to positions start..
    # of the sequence whose blocks are ``table`` (reserved and owned by
    # it), layer ``layer``
    cdef int write(self, Py_ssize_t layer, const RowInput* rows, const block_id_t* table,
                   Py_ssize_t start) except -1
