"""kvcore.hf on CUDA pools: torch CUDA tensors in and out with no copy
(DLPack), kvcore's kernels on torch's current stream, CuPy allocating from
torch's caching allocator.  GPU only (they skip only without CuPy or a
visible NVIDIA device, see tests/_cuda_env.py); .ci/gpu runs them."""
import os

import pytest

if os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

try:
    from _cuda_env import cuda_backend_or_skip
except ImportError:  # pragma: no cover - run as a package
    from ._cuda_env import cuda_backend_or_skip

import kvcore
import kvcore.hf
from kvcore.hf import PagedCache, pool_for

pytestmark = pytest.mark.cuda

VOCAB, PAD = 96, 0


@pytest.fixture(scope="module")
def device():
    cuda_backend_or_skip()
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees an NVIDIA GPU but torch does not: install a CUDA build of torch "
                    "for these tests", pytrace=False)
    return torch.device("cuda", 0)


def tiny(device, dtype, attn):
    # head_dim 64 (256 / 4 heads): the CUDA attention kernels take 64, 80, 96, 128 or 256
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation(attn)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def prompts(device, lengths=(37, 20, 5, 29)):
    g = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


def kw(model, cache):
    return {kvcore.hf.cache_keyword(model): cache}


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
@pytest.mark.parametrize("dtype,pages", [(torch.float32, "float32"), (torch.float16, "float16"),
                                         (torch.bfloat16, "bfloat16")])
def test_a_cuda_pool_generates_what_dynamic_cache_does(device, attn, dtype, pages):
    model = tiny(device, dtype, attn)
    ids, mask = prompts(device)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          **kw(model, transformers.DynamicCache()))
    pool = pool_for(model.config, 64, dtype=pages, block_size=16, device="cuda")
    assert pool.device == "cuda:0"
    with PagedCache(pool) as cache:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             **kw(model, cache))
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:   # 16-bit models: the same tokens on the first steps at least
        assert torch.equal(got[:, :ids.shape[1] + 2], want[:, :ids.shape[1] + 2])
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_the_kernels_run_on_torchs_current_stream(device):
    """On a side stream of torch's, with no synchronisation: the cache's
    writes and attention are ordered with the model's kernels only if they
    run on that stream."""
    model = tiny(device, torch.float32, "kvcore")
    ids, mask = prompts(device)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          **kw(model, transformers.DynamicCache()))
    pool = pool_for(model.config, 64, dtype="float32", block_size=16, device="cuda")
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side), PagedCache(pool) as cache:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             **kw(model, cache))
    side.synchronize()
    assert torch.equal(got, want)


def test_cupy_allocates_from_torchs_caching_allocator(device):
    import cupy
    kvcore.hf.use_torch_allocator()
    before = torch.cuda.memory_allocated(device)
    with cupy.cuda.Device(0):
        a = cupy.empty(1 << 24, cupy.uint8)
    assert torch.cuda.memory_allocated(device) >= before + (1 << 24)
    del a
    assert torch.cuda.memory_allocated(device) < before + (1 << 24)


# ------------------------------------------------------------ issue 40: the step lane and graphs

@pytest.mark.parametrize("dtype,pages", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_generate_with_cuda_graph_gives_the_eager_tokens(device, dtype, pages):
    """generate(cuda_graph=True) on a real GPU: the first decode step of a
    batch size runs eagerly, the second is captured (torch.cuda.graph), the
    rest replay; the tokens are generate's without graphs; a later call
    replays from its first decode step, and a prompt whose prefix is cached
    has its uncached tail replayed too."""
    from kvcore.hf import graphs

    model = tiny(device, dtype, "kvcore")
    # little padding: a cached prompt's tail (8 columns) has no padding column
    ids, mask = prompts(device, (37, 36, 40, 33))
    pool = pool_for(model.config, 128, dtype=pages, block_size=16, device="cuda")
    salt = "graph-test"
    want = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                              do_sample=False, salt=salt + "eager")
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                             do_sample=False, salt=salt + "graph")
    assert torch.equal(got, want)
    assert graphs.counts(pool, model) == (0, 0)      # (no cuda_graph=True yet)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                             do_sample=False, salt=salt + "first", cuda_graph=True)
    assert torch.equal(got, want)
    assert graphs.counts(pool, model) == (1, 10)     # 11 decode steps: eager, capture, 9 more
    for call in range(3):       # cached prompts: the tail step, eager once, then a graph
        got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                                 do_sample=False, salt=salt + "first", cuda_graph=True)
        assert torch.equal(got, want)
    assert graphs.counts(pool, model) == (2, 10 + 3 * 11 + 2)
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_a_step_states_fixed_plan_on_a_gpu_gives_the_exact_plans_result(device):
    """A step state's plan (splits over its whole capacity, lengths read on
    the device) against paged_attention's exact plan on the same pages:
    the same values to float32 rounding (the splits differ)."""
    import cupy
    import numpy as np

    pool = kvcore.BlockPool(64, 16, 2, 2, 64, dtype="float16", device="cuda")
    rng = np.random.default_rng(5)
    seqs, lengths = [kvcore.PagedKVCache(pool) for _ in range(3)], [200, 1, 37]
    for seq, n in zip(seqs, lengths):
        seq.allocate(list(range(3, 3 + n)))
        seq.reserve(n)
        slots = seq.slot_mapping(0, n)
        for layer in range(2):
            k, v = (cupy.asarray(rng.standard_normal((n, 2, 64)).astype(np.float32))
                    for _ in range(2))
            pool.write(layer, k, v, slots)
            seq.mark_written(layer, n)
        seq.commit(n)
    tables = np.zeros((3, max(len(s.block_table) for s in seqs)), np.int32)
    for i, seq in enumerate(seqs):
        tables[i, :len(seq.block_table)] = seq.block_table
    lens = np.array(lengths, np.int64)
    lane = pool._step_lane()
    state = lane.step_state(3, 1, 32)
    state.load(np.full(3, -1, np.int64), lens, tables)
    plan = state.plan(kvcore.hf.device.attention_key((None, None, None), 64), 4)
    q = cupy.asarray(rng.standard_normal((3, 4, 64)).astype(np.float32))
    for reuse in (False, True, True):
        for layer in range(2):
            out = cupy.empty((3, 4, 64), np.float32)
            lane.attend(plan, layer, q, out, reuse=reuse)
            want = kvcore.paged_attention(q, pool, layer, tables, lens)
            np.testing.assert_allclose(cupy.asnumpy(out), cupy.asnumpy(want), rtol=2e-5,
                                       atol=2e-6)


def test_pool_write_of_torch_tensors_on_torchs_stream_and_on_another(device):
    """A torch CUDA tensor is imported from its fields when torch's current
    stream is CuPy's (no DLPack capsule), through DLPack otherwise (which
    orders the two streams): the same bits either way."""
    import cupy
    import numpy as np

    pool = kvcore.BlockPool(8, 4, 1, 2, 64, dtype="float16", device="cuda")
    k = torch.randn(3, 2, 64, device=device)
    v = torch.randn(3, 2, 64, device=device)
    pool.write(0, k, v, [1, 6, 9])
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        k2, v2 = k * 2, v * 2
        pool.write(0, k2, v2, [13, 14, 15])
    side.synchronize()
    got_k, got_v = pool.gather(0, [0, 1, 2, 3], 0, 16, dtype="float32")
    got_k = cupy.asnumpy(got_k)
    want = k.half().float().cpu().numpy()
    np.testing.assert_array_equal(got_k[:, [1, 6, 9]], want.transpose(1, 0, 2))
    np.testing.assert_array_equal(got_k[:, [13, 14, 15]],
                                  (k2.half().float().cpu().numpy()).transpose(1, 0, 2))
