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
