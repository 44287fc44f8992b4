"""kvcore.hf on a CUDA pool without a GPU: the CUDA backend's host emulation
(``test_cuda_host_emulation.py``: the kernels' item functions compiled for
the host, every host <-> device copy recorded) with torch CPU tensors
standing for CUDA memory (``EmulatedTensors``, put where kvcore.hf asks
for the torch side of a CUDA device).  Everything else is the real code:
PagedCache, the step lane's packed launches and decode buffers, the
attention plans, the graph runner's bookkeeping.

What these check that the GPU tests cannot show as directly: a decode
step copies up once and never reads back or allocates on the device; the
launches of one decode step are those of the next, argument for argument,
wherever they point into kvcore's memory (so a CUDA graph captured at one
step is valid at the next); a decode step's fixed plan gives the exact
plan's result; the graph runner's replays give the eager tokens.  A real
capture and replay run in tests/hf/test_hf_cuda.py (GPU only)."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

try:
    from . import test_cuda_host_emulation as emu
    from . import test_hf_cuda as cuda_tests
except ImportError:
    import test_cuda_host_emulation as emu
    import test_hf_cuda as cuda_tests

import kvcore
import kvcore.hf
from kvcore.hf import PagedCache, graphs, torch_bridge

emu_lib = emu.emu_lib
emulated_cuda = emu.emulated_cuda

pytestmark = pytest.mark.toolchain

PAD = cuda_tests.PAD
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64


class EmulatedTensors:
    """torch CPU tensors standing for the emulated device's memory (which is
    host memory): a pool plane is viewed as a tensor, a tensor is handed to
    BlockPool.write as the device array over its memory."""

    def __init__(self, pool):
        self.device = torch.device("cpu")

    def stream(self):
        return contextlib.nullcontext()

    def from_device(self, a):
        return torch.from_numpy(np.asarray(a).view(np.ndarray))

    def holds(self, t):
        return t.device.type == "cpu"

    def on_side_stream(self, fn):
        return fn()

    def input(self, t):
        import ml_dtypes

        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            a = t.numpy()
        return a.view(emu.DevArray)


@pytest.fixture
def hf_cuda(emulated_cuda, monkeypatch):
    """The emulated CUDA backend, with kvcore.hf seeing torch CPU tensors as
    its device's; the backend's device allocations recorded too."""
    monkeypatch.setattr(torch_bridge, "_cuda_tensors", EmulatedTensors)
    be = emulated_cuda
    be.allocations = []
    for name in ("empty", "zeros"):
        make = getattr(emu.HostCupy, name)

        def recorded(shape, dtype, _make=make):
            a = _make(shape, dtype)
            be.allocations.append((a.ctypes.data, a.nbytes))
            return a
        monkeypatch.setattr(emu.HostCupy, name, staticmethod(recorded))
    upload = be._upload

    def recorded_upload(h):
        d = upload(h)
        be.allocations.append((d.ctypes.data, d.nbytes))
        return d
    be._upload = recorded_upload
    return be


def _reset(be):
    for record in (be.launches, be.launch_args, be.uploads, be.downloads, be.allocations):
        del record[:]


@pytest.fixture(scope="module")
def models():
    """Tiny Llamas (head_dim 64, what the CUDA kernels take), float32 and
    bfloat16, eager attention set per test."""
    config = transformers.LlamaConfig(
        vocab_size=cuda_tests.VOCAB, hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=96,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = PAD
        out[dtype] = model
    return out


def _model(models, dtype, attn):
    model = models[dtype]
    model.set_attn_implementation(attn)
    return model


def prompts(lengths=(11, 6)):
    return cuda_tests.prompts("cpu", lengths)


kw = cuda_tests.kw


def cuda_pool(dtype="float32", num_blocks=32, block_size=4, kv_scales=None):
    return kvcore.BlockPool(num_blocks, block_size, LAYERS, KV_HEADS, HEAD_DIM, dtype=dtype,
                            device="cuda", kv_scales=kv_scales)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_an_emulated_cuda_pool_generates_dynamic_cache_tokens(hf_cuda, models, attn):
    """float32 model and pages: DynamicCache's tokens, every K/V written by
    the step lane (two packed launches a layer, no claim/release pass),
    one copy up per forward and nothing read back."""
    model = _model(models, torch.float32, attn)
    ids, mask = prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          **kw(model, transformers.DynamicCache()))
    pool = cuda_pool()
    _reset(hf_cuda)
    with PagedCache(pool) as cache:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             **kw(model, cache))
    assert torch.equal(got, want)
    names = [name for name, *_ in hf_cuda.launches]
    assert sum(n.startswith("kv_write_slots<") for n in names) == 5 * LAYERS * 2
    assert not any(n.startswith(("kv_claim", "kv_release")) for n in names)
    assert hf_cuda.downloads == []
    assert pool.num_used_blocks == 0
    pool.debug.check()


def _decode_steps(model, cache, ids, mask, steps):
    """A prefill and ``steps`` decode forwards by hand; yields before each
    decode forward (the backend's records can be reset there)."""
    out = model(ids, attention_mask=mask, **kw(model, cache))
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        yield
        out = model(token, attention_mask=mask, **kw(model, cache))


def _pointer_args(be, emu_lib, name, args):
    """(position, address) of the pointer arguments of a recorded launch, and
    the other arguments as they were given."""
    pointers, others = [], []
    if all(isinstance(a, int) for a in args):           # a packed launch: by signature
        sig = (emu_lib.attention().signature(name) if name.startswith("kva_")
               else emu_lib.signature(name))
        for k, (code, a) in enumerate(zip(sig, args)):
            # (code: the pointee's size, -2 a void pointer: q / out of a run-time kind)
            (pointers if code > 0 or code == -2 else others).append((k, a))
    else:
        for k, a in enumerate(args):
            if isinstance(a, emu.DevArray):
                pointers.append((k, a.ctypes.data))
            else:
                others.append((k, a))
    return pointers, others


@pytest.mark.parametrize("dtype,pages", [(torch.float32, "float32"),
                                         (torch.bfloat16, "bfloat16")])
def test_a_decode_step_copies_up_once_and_launches_what_the_last_one_did(
        hf_cuda, emu_lib, models, dtype, pages):
    """The capture rules, checked on every decode step after the first of a
    decode state: one copy up (slots, lengths, tables), nothing read back,
    nothing allocated by kvcore on the device; and the same launches as the
    step before, every argument equal except addresses in torch's memory
    (the step's activations, which a CUDA graph's capture fixes)."""
    model = _model(models, dtype, "kvcore")
    ids, mask = prompts()
    pool = cuda_pool(pages, num_blocks=32, block_size=4)
    storage = (pool.storage.ctypes.data, pool.storage.nbytes)
    steps = []
    with PagedCache(pool) as cache:
        for _ in _decode_steps(model, cache, ids, mask, 6):
            if steps:
                steps[-1] = (list(hf_cuda.launch_args), list(hf_cuda.uploads),
                             list(hf_cuda.downloads), list(hf_cuda.allocations))
            steps.append(None)
            _reset(hf_cuda)
        steps[-1] = (list(hf_cuda.launch_args), list(hf_cuda.uploads), list(hf_cuda.downloads),
                     list(hf_cuda.allocations))
    owned = [storage]
    # the first decode step makes the state and its plans (uploads); from the
    # second on nothing but the one copy
    for launches, uploads, downloads, allocations in steps[1:]:
        assert len(uploads) == 1 and downloads == [] and allocations == []
    first = steps[0]
    owned += first[3]
    kinds = [[name for name, _ in s[0]] for s in steps[1:]]
    assert all(k == kinds[0] for k in kinds)
    assert sum(n.startswith("kv_write_slots<") for n in kinds[0]) == 2 * LAYERS
    assert sum(n.startswith("kva_attention_split") for n in kinds[0]) == LAYERS

    def inside(p):
        return any(lo <= p < lo + n for lo, n in owned)

    for a, b in zip(steps[1][0], steps[2][0]):
        pa, oa = _pointer_args(hf_cuda, emu_lib, *a)
        pb, ob = _pointer_args(hf_cuda, emu_lib, *b)
        assert oa == ob, a[0]
        assert [k for k, _ in pa] == [k for k, _ in pb]
        for (k, x), (_, y) in zip(pa, pb):
            if inside(x) or inside(y):
                assert x == y, (a[0], k)


@pytest.mark.parametrize("pages", ["float16", "bfloat16", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("window,cap,q", [(None, None, 1), (5, None, 1), (None, 30.0, 1),
                                          (None, None, 3), (4, None, 3)])
def test_a_step_states_fixed_plan_gives_the_exact_plans_result(hf_cuda, pages, window, cap, q):
    """A step state's plan covers every key up to its capacity and reads
    the step's lengths from the device: over rows shorter than that it gives
    what kvcore.paged_attention gives for the rows' own lengths (sliding
    window and soft cap applied per query; q queries a row, causal)."""
    rng = np.random.default_rng(3)
    scales = [(0.5, 0.25)] * LAYERS if pages.startswith("float8") else None
    pool = cuda_pool(pages, num_blocks=24, block_size=4, kv_scales=scales)
    seqs = [kvcore.PagedKVCache(pool) for _ in range(3)]
    lengths = [9, 1, 14]
    for seq, n in zip(seqs, lengths):
        seq.allocate(list(range(3, 3 + n)))
        seq.reserve(n)
        slots = seq.slot_mapping(0, n)
        for layer in range(LAYERS):
            k = rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32)
            pool.write(layer, hf_cuda.from_host(k), hf_cuda.from_host(v), slots)
            seq.mark_written(layer, n)
        seq.commit(n)
    tables = np.zeros((3, max(len(seq.block_table) for seq in seqs)), np.int32)
    for i, seq in enumerate(seqs):
        t = seq.block_table
        tables[i, :len(t)] = t
    lens = np.array(lengths, np.int64)
    lane = pool._step_lane()
    state = lane.step_state(3, q, 8)              # 32 keys a row: more than any row has
    if q > 1:
        lens = np.maximum(lens, q)
    state.load(np.full(3 * q, -1, np.int64), lens, tables)
    key = kvcore.hf.device.attention_key((0.125, window, cap), HEAD_DIM)
    plan = state.plan(key, 4)
    queries = rng.standard_normal((3 * q, 4, HEAD_DIM)).astype(np.float32)
    qsl = np.arange(4) * q
    for reuse in (False, True, True):    # as it is; packed (made, then reused)
        for layer in range(LAYERS):
            out = hf_cuda.empty((3 * q, 4, HEAD_DIM), np.float32)
            lane.attend(plan, layer, hf_cuda.from_host(queries), out, reuse=reuse)
            want = kvcore.paged_attention(hf_cuda.from_host(queries), pool, layer, tables,
                                          lens, qsl, scale=0.125, sliding_window=window,
                                          logits_soft_cap=cap)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


class StandInGraph:
    """A CUDA graph stand-in: ``replay`` runs the captured step's forward
    again (in capture mode, so kvcore issues only its launches, as a replay
    does) and copies its logits into the captured output's, as a replay
    refills the graph's memory."""

    made = []

    def __init__(self):
        self.run = self.output = None
        StandInGraph.made.append(self)

    def replay(self):
        out = self.run()
        self.output.logits.copy_(out.logits)


def _stand_in_capture(graph, pool_handle, run):
    graph.run = run
    graph.output = run()
    return graph.output


@pytest.fixture
def stand_in_graphs(monkeypatch):
    StandInGraph.made = []
    monkeypatch.setattr(graphs, "_new_graph", StandInGraph)
    monkeypatch.setattr(graphs, "_capture", _stand_in_capture)
    monkeypatch.setattr(graphs, "_graph_pool", lambda: None)
    return StandInGraph


@pytest.mark.parametrize("dtype,pages", [(torch.float32, "float32"),
                                         (torch.bfloat16, "bfloat16")])
def test_generate_with_cuda_graph_replays_give_the_eager_tokens(
        hf_cuda, models, stand_in_graphs, dtype, pages):
    """generate(cuda_graph=True): the first decode step of a batch size runs
    eagerly, the second is captured, the rest replay; the tokens are those
    of generate without graphs; a second call with the same batch size
    replays from its first decode step, each copying up once."""
    model = _model(models, dtype, "kvcore")
    ids, mask = prompts()
    pool = cuda_pool(pages, num_blocks=48)
    want = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=6,
                              do_sample=False)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=6,
                             do_sample=False, cuda_graph=True)
    assert torch.equal(got, want)
    assert len(stand_in_graphs.made) == 1
    assert graphs.counts(pool, model) == (1, 4)    # 5 decode steps: eager, capture, 3 more
    other, other_mask = prompts((9, 12))
    want = kvcore.hf.generate(model, other, pool, attention_mask=other_mask, max_new_tokens=4,
                              do_sample=False)
    _reset(hf_cuda)
    got = kvcore.hf.generate(model, other, pool, attention_mask=other_mask, max_new_tokens=4,
                             do_sample=False, cuda_graph=True)
    assert torch.equal(got, want)
    assert graphs.counts(pool, model) == (1, 7)
    assert hf_cuda.downloads == []
    # the same prompts again: the first forward computes each row's uncached
    # tail (a short step: 3 columns; it ran eagerly in the last call, whose
    # prompts the call before had cached), now captured once and replayed
    for call in range(3):
        got = kvcore.hf.generate(model, other, pool, attention_mask=other_mask,
                                 max_new_tokens=2, do_sample=False, cuda_graph=True)
        assert torch.equal(got, want[:, :other.shape[1] + 2])
    assert graphs.counts(pool, model) == (2, 7 + 3 * 2)
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_beam_search_with_cuda_graphs(hf_cuda, models, stand_in_graphs):
    """Beam search reorders the rows (copy-on-write forks) between steps: a
    replayed step reads the reordered rows' block tables from the buffers
    its step refilled; the tokens are DynamicCache's."""
    model = _model(models, torch.float32, "kvcore")
    ids, mask = prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=2,
                          do_sample=False, **kw(model, transformers.DynamicCache()))
    pool = cuda_pool(num_blocks=64)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=5,
                             num_beams=2, do_sample=False, cuda_graph=True)
    assert torch.equal(got, want)
    assert graphs.counts(pool, model)[1] >= 2
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_the_model_as_its_own_assistant_with_cuda_graphs(hf_cuda, models, stand_in_graphs):
    """generate(assistant_model=model, cuda_graph=True): the assistant's
    forwards (on a DynamicCache of its own) go through the graph runner too
    and run eagerly, never as a step of the PagedCache (the runner keyed
    them as its decode steps: 'position 31, the cache expects 33')."""
    model = _model(models, torch.float32, "kvcore")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (1, 7), generator=g).repeat(1, 4)
    kw_ = dict(assistant_model=model, do_sample=False, max_new_tokens=8)
    pool = cuda_pool(num_blocks=128)
    want = kvcore.hf.generate(model, ids, pool, **kw_)
    for call in range(2):
        assert torch.equal(kvcore.hf.generate(model, ids, pool, cuda_graph=True, **kw_), want)
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_graphs_kept_with_a_pool_do_not_keep_it_alive(hf_cuda, models, stand_in_graphs):
    """The graphs live with their pool (a registry keyed weakly on it): a
    pool dropped after a generate call with graphs is freed, graphs and
    all."""
    import gc
    import weakref

    model = _model(models, torch.float32, "kvcore")
    ids, mask = prompts()
    pool = cuda_pool()
    kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                       do_sample=False, cuda_graph=True)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None


def test_a_failed_graph_step_leaves_the_cache_as_before(hf_cuda, models, stand_in_graphs,
                                                        monkeypatch):
    """A capture that fails rolls its step back: the error reaches the
    caller and every block goes back to the pool."""
    model = _model(models, torch.float32, "kvcore")
    ids, mask = prompts()
    pool = cuda_pool()

    def failing(graph, pool_handle, run):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(graphs, "_capture", failing)
    with pytest.raises(RuntimeError, match="capture failed"):
        kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                           do_sample=False, cuda_graph=True)
    assert pool.num_used_blocks == 0
    pool.debug.check()
    # the set was given back: the next call may use it
    want = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                              do_sample=False)
    monkeypatch.setattr(graphs, "_capture", _stand_in_capture)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                             do_sample=False, cuda_graph=True)
    assert torch.equal(got, want)


def test_cuda_graph_is_refused_by_name_where_it_cannot_run(hf_cuda, models):
    model = _model(models, torch.float32, "kvcore")
    ids, mask = prompts()
    cpu = kvcore.BlockPool(32, 4, LAYERS, KV_HEADS, HEAD_DIM, dtype="float32")
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA pool"):
        kvcore.hf.generate(model, ids, cpu, attention_mask=mask, max_new_tokens=2,
                           cuda_graph=True)
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        kvcore.hf.generate(model, ids, cuda_pool(), attention_mask=mask, max_new_tokens=2,
                           cuda_graph="yes")
    sdpa = _model(models, torch.float32, "sdpa")
    with pytest.raises(ValueError, match="cuda_graph=True needs attn_implementation='kvcore'"):
        kvcore.hf.generate(sdpa, ids, cuda_pool(), attention_mask=mask, max_new_tokens=2,
                           cuda_graph=True)


@pytest.mark.e2e
def test_the_gpu_benchmarks_code_on_the_cpu():
    """bench/bench_hf.py --device cuda's code, dry-run on the CPU with a
    2-layer model (--device cpu --tiny): every number it reports exists and
    the KV bytes compare as blocks against positions (speed never asserted)."""
    from kvcore.cli.benchmarks import hf_gpu

    r = hf_gpu.run(device="cpu", tiny=True, batches=(1, 2), prompt=20, new=3, calls=1,
                   compile=False)
    for b in ("1", "2"):
        row = r["batches"][b]
        assert set(row) == {"dynamic", "kvcore"}      # no graphs nor compile on the CPU
        for m in ("dynamic", "kvcore"):
            assert row[m]["call_s"] > 0 and row[m]["ttft_s"] > 0
            assert row[m]["host_us_per_layer"] > 0
        assert row["kvcore"]["ttft_warm_s"] > 0
        # 22 positions held (the last token's K/V is never computed): 2 blocks of 16
        assert row["kvcore"]["kv_bytes"] * 22 == row["dynamic"]["kv_bytes"] * 32
    text = hf_gpu.report(r)
    assert "| 2 | kvcore |" in text and "| goal (issue 40) |" in text
    assert "pool KV bytes <= 1.05x DynamicCache's" in text
