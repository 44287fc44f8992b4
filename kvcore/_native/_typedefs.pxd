# The C types behind kvcore's arrays.  Each has a NumPy twin in
# kvcore._native._typedefs (checked by tests/test_typedefs.py), so a
# memoryview typed here always matches the array the Python side allocates.
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t

ctypedef int32_t block_id_t    # block ids, ref counts, free-list links: numpy.int32
ctypedef int64_t slot_t        # slot = block_id * block_size + offset: numpy.int64
ctypedef int32_t token_t       # token ids (0 .. 2**31-1): numpy.int32
ctypedef uint64_t hash_word_t  # a block hash is two of these (128 bits): numpy.uint64
ctypedef uint16_t half_t       # raw float16 / bfloat16 bits: numpy.uint16
