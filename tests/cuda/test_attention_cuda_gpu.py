"""The attention kernels on a real GPU (skipped without CuPy and a visible
GPU, failed when both are there but the backend does not start): the tiled
decode kernel with the device's own split sizing, the tensor-core decode
(issue 41: float16 / bfloat16 / fp8 pages, q and out in the model's dtype,
splits merged by the last block) against the float64 reference within the
float32 paths' 1e-5, the tensor-core prefill kernel (mma.sync, sm_80+)
with the tolerance of docs/gpu.md, and plans replayed with the same bits.
The same kernels run without a GPU in test_attention_cuda_emulation.py."""
import numpy as np
import pytest

from kvcore.backends.cuda import attention_kernels as ak
from kvcore.backends.cuda import get_cuda_backend
from kvcore import dtypes
from kvcore.dtypes import BF16, F16, F8E4M3, F8E5M2, I8

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_cases import FP8_SCALES, _attention_case, cupy_device_under_test, cupy_put as _put
    from ._cuda_env import cuda_backend_or_skip
    from .test_attention_cuda_emulation import (FEATURE_CASES, PREFILL_TOL, TC_IO, _features,
                                                _prefill_case)
except ImportError:
    from _cuda_cases import FP8_SCALES, _attention_case, cupy_device_under_test, cupy_put as _put
    from _cuda_env import cuda_backend_or_skip
    from test_attention_cuda_emulation import (FEATURE_CASES, PREFILL_TOL, TC_IO, _features,
                                               _prefill_case)

# Skips the module only without CuPy or without a GPU (none of the imports
# above needs either); fails it when both are there but the backend does not work.
cuda_backend_or_skip(allow_module_level=True)

import cupy  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture
def dev():
    return cupy_device_under_test(get_cuda_backend("cuda"), 1)


@pytest.mark.parametrize("kind", (F16, F8E4M3, I8), ids=["f16", "e4m3", "i8"])
@pytest.mark.parametrize("group", (1, 4, 8))
def test_tiled_decode_on_the_gpu(dev, kind, group):
    """Long ragged decode rows, split by the device's SM count, merged."""
    rng = np.random.default_rng(kind * 10 + group)
    assert dev.be._sm_count() > 0
    _attention_case(dev, rng, kind, 128, 2 * group, 2, contexts=[3000, 17, 700, 1],
                    queries=[1, 1, 1, 1], block_size=16)


@pytest.mark.parametrize("kind", (F16, BF16), ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_prefill_on_tensor_cores(dev, kind, head_dim):
    if not dev.be._has_mma():
        pytest.fail("kvcore's tensor-core prefill needs sm_80+; this GPU is older")
    rng = np.random.default_rng(kind + head_dim)
    got, want, err = _prefill_case(dev, rng, kind, head_dim, 32, 8, contexts=[700, 300],
                                   queries=[500, 1], block_size=16)
    assert err <= PREFILL_TOL[kind], err
    q_dtype = "float16" if kind == F16 else "bfloat16"
    _, _, err = _prefill_case(dev, rng, kind, head_dim, 32, 8, contexts=[2000], queries=[1500],
                              block_size=16, window=700, cap=30.0, q_dtype=q_dtype,
                              out_dtype=q_dtype)
    assert err <= PREFILL_TOL[kind] + (2.0 ** -8 if kind == BF16 else 2.0 ** -11), err
    row = np.abs(got[-1] - want[-1]).max() / np.abs(want[-1]).max()
    assert row <= 1e-5, row


@pytest.mark.parametrize("q_dtype", ["float32", "float16"])
def test_a_plan_replays_with_the_same_bits(dev, q_dtype):
    """A plan split on this device (float32 q: merge launches; float16 q:
    the tensor-core decode, merged by the last split's ticket) gives the
    same bits run after run, and leaves its tickets at 0."""
    be = dev.be
    rng = np.random.default_rng(2)
    nb, heads, bs, d = 600, 8, 16, 128
    k = _put(rng.standard_normal((nb, heads, bs, d)).astype(np.float16))
    v = _put(rng.standard_normal((nb, heads, bs, d)).astype(np.float16))
    tables = rng.permutation(nb)[:64].astype(np.int32).reshape(1, 64)
    lens = np.full(1, 64 * bs - 3, np.int64)
    qsl = np.arange(2, dtype=np.int64)
    plan = be.attention_plan(tables, lens, qsl, num_heads=32, num_kv_heads=heads, head_dim=d,
                             block_size=bs, num_blocks=nb, kind=F16, scale=d ** -0.5,
                             sliding_window=0, soft_cap=0.0)
    # split on this device: the merge order matters
    assert plan.merge_rows is not None and int(plan.tc_nsplit.max()) > 1
    q = _put(rng.standard_normal((1, 32, d)).astype(q_dtype))
    outs = [cupy.full(q.shape, np.nan, q.dtype) for _ in range(3)]
    for o in outs:
        be.attention_run(plan, q, o, k, v)
    bits = np.uint32 if q_dtype == "float32" else np.uint16
    for o in outs[1:]:
        np.testing.assert_array_equal(cupy.asnumpy(o).view(bits),
                                      cupy.asnumpy(outs[0]).view(bits))
    assert not cupy.asnumpy(plan.counters).any()
    assert ak.split_keys_for(qsl, lens, 32, heads, 0, be._sm_count()) < 64 * bs
    assert dtypes.F16 in be.attention_io_kinds(plan)[0]


@pytest.mark.parametrize("kind", (F16, BF16, F8E4M3, F8E5M2), ids=["f16", "bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("group", (1, 4, 8))
def test_tensor_core_decode_on_the_gpu(dev, kind, group):
    """Long ragged decode rows and a short chunk, split by the device's SM
    count and merged by the last split: q in each dtype the kernel takes
    (e4m3: the hardware pair conversion on sm_89+), out float32 and in q's
    dtype; the float32 paths' 1e-5 against float64."""
    if not dev.be._has_mma():
        pytest.fail("kvcore's tensor-core decode needs sm_80+; this GPU is older")
    for q_dtype in TC_IO[kind]:
        for out_dtype in ("float32", q_dtype):
            rng = np.random.default_rng([kind, group, len(q_dtype), len(out_dtype)])
            names = []
            _attention_case(dev, rng, kind, 128, 4 * group, 4, contexts=[3000, 17, 700, 1],
                            queries=[1, 1, 5, 1], block_size=16, layer_scales=FP8_SCALES,
                            q_dtype=q_dtype, out_dtype=out_dtype,
                            plan_hook=lambda p: names.append(p.tc_items is not None))
            assert names == [True]


@pytest.mark.parametrize("which", FEATURE_CASES)
def test_features_on_the_gpu(dev, which):
    """Issue 39 / 38.3 on the device: chunked attention, ALiBi, sinks and
    extreme scales through the tensor-core decode (float16 q), the float32
    decode (float32 q, e4m3 pages) and the tensor-core prefill, against
    the float64 reference."""
    rng = np.random.default_rng([43, FEATURE_CASES.index(which)])
    feats = _features(rng, 32, which)
    for kind, q_dtype in ((F16, "float16"), (F8E4M3, "float32")):
        _attention_case(dev, rng, kind, 128, 32, 8, contexts=[3000, 17, 700, 1],
                        queries=[1, 1, 5, 1], block_size=16, layer_scales=FP8_SCALES,
                        q_dtype=q_dtype, **feats)
    _, _, err = _prefill_case(dev, rng, F16, 128, 32, 8, contexts=[900], queries=[700],
                              block_size=16, q_dtype="float16", **feats)
    assert err <= PREFILL_TOL[F16], err
