"""Large paged writes use non-temporal stores; the bits must be exactly
those of the ordinary path (kvcore.to_float16/to_bfloat16), on every SIMD
level, for rows at any alignment."""
import numpy as np
import pytest

import kvcore

H, D, BS = 8, 128, 16


def _reference(x, dtype):
    if dtype == "float16":
        return kvcore.to_float16(x).view(np.uint16)
    if dtype == "bfloat16":
        return kvcore.to_bfloat16(x)
    return x.view(np.uint32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("path", ["write", "append"])
def test_large_writes_match_small_writes(simd_level, dtype, path):
    rng = np.random.default_rng(0)
    n = 4200  # 4200 * 8 * 128 * 2 bytes = 8.2 MiB per plane: the streamed path
    head_dim = D + 4  # rows not a multiple of 16 elements: aligned head and tail code
    pool = kvcore.BlockPool(2 * n // BS + 2, BS, 1, H, head_dim, dtype=dtype)
    k = rng.standard_normal((n, H, head_dim)).astype(np.float32)
    k[::97] = np.nan
    k[5::89] *= 1e-40  # float32 subnormals
    v = -k
    if path == "write":
        slots = rng.permutation(pool.num_blocks * BS)[:n].astype(np.int64)
        pool.write(0, k, v, slots)
        b, off = slots // BS, slots % BS
        got_k = pool.key_cache(0)[b, :, off]
        got_v = pool.value_cache(0)[b, :, off]
    else:
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(np.zeros(n, np.int32))
        seq.append(0, k, v)
        got_k, got_v = (x.transpose(1, 0, 2) for x in seq.gather(0))
    view = np.uint32 if dtype == "float32" else np.uint16
    assert np.array_equal(np.ascontiguousarray(got_k).view(view), _reference(k, dtype))
    assert np.array_equal(np.ascontiguousarray(got_v).view(view), _reference(v, dtype))
