"""NumPy dtypes matching the C types of ``_typedefs.pxd``."""
import numpy as np

BLOCK_ID_DTYPE = np.dtype(np.int32)
SLOT_DTYPE = np.dtype(np.int64)
TOKEN_DTYPE = np.dtype(np.int32)
HASH_WORD_DTYPE = np.dtype(np.uint64)
HALF_DTYPE = np.dtype(np.uint16)

# (C size, signed) of each typedef, read from the compiler, for the test
# that pins the NumPy twins above to the C types.
C_TYPES = {
    "block_id_t": (sizeof(block_id_t), <block_id_t>-1 < 0),
    "slot_t": (sizeof(slot_t), <slot_t>-1 < 0),
    "token_t": (sizeof(token_t), <token_t>-1 < 0),
    "hash_word_t": (sizeof(hash_word_t), <hash_word_t>-1 < 0),
    "half_t": (sizeof(half_t), <half_t>-1 < 0),
}
NUMPY_TWINS = {
    "block_id_t": BLOCK_ID_DTYPE,
    "slot_t": SLOT_DTYPE,
    "token_t": TOKEN_DTYPE,
    "hash_word_t": HASH_WORD_DTYPE,
    "half_t": HALF_DTYPE,
}


cdef class RowWriter:
    """The writer interface of ``_typedefs.pxd`` (a backend subclasses it);
    this base takes nothing."""

    cdef Py_ssize_t take(self, object k, object v, RowInput* rows) except -2:
        return -1

    cdef int write(self, Py_ssize_t layer, const RowInput* rows, const block_id_t* table,
                   Py_ssize_t start) except -1:
        raise NotImplementedError("RowWriter.write")
