"""The C typedefs of ``_typedefs.pxd`` against their NumPy twins.

Kernels take typed memoryviews of these C types while the Python side
allocates arrays of the NumPy twins; a mismatch in size or signedness would
make Cython refuse the buffer at best and misread it at worst.
"""
import numpy as np
import pytest

from kvcore._native import _typedefs


def test_every_typedef_has_a_numpy_twin():
    assert set(_typedefs.C_TYPES) == set(_typedefs.NUMPY_TWINS)
    assert _typedefs.C_TYPES  # not vacuous


@pytest.mark.parametrize("name", sorted(_typedefs.C_TYPES))
def test_c_type_matches_numpy_twin(name):
    size, signed = _typedefs.C_TYPES[name]
    twin = np.dtype(_typedefs.NUMPY_TWINS[name])
    assert twin.kind in "iu", f"{name}: twin {twin} is not an integer dtype"
    assert twin.isnative, f"{name}: twin {twin} is not in native byte order"
    assert size == twin.itemsize, f"{name}: C size {size}, NumPy {twin} has {twin.itemsize}"
    assert bool(signed) == (twin.kind == "i"), (
        f"{name}: C type is {'signed' if signed else 'unsigned'}, NumPy twin is {twin}")


def test_named_dtypes_are_the_twins():
    twins = _typedefs.NUMPY_TWINS
    assert twins["block_id_t"] == _typedefs.BLOCK_ID_DTYPE
    assert twins["slot_t"] == _typedefs.SLOT_DTYPE
    assert twins["token_t"] == _typedefs.TOKEN_DTYPE
    assert twins["hash_word_t"] == _typedefs.HASH_WORD_DTYPE
    assert twins["half_t"] == _typedefs.HALF_DTYPE


def test_half_t_holds_float16_and_bfloat16_bits():
    # half_t memoryviews are fed float16 arrays and bf16 bits (uint16) alike
    half = _typedefs.NUMPY_TWINS["half_t"]
    assert half == np.uint16
    assert half.itemsize == np.dtype(np.float16).itemsize
