"""The demo's served-model loop: requests, the engines that keep their K/V,
and the continuous-batching scheduler every engine shares.

Each engine is one way of keeping K/V (kvcore's pages, a contiguous cache, no
cache); :func:`serve` runs the same requests through any of them, so the demo
compares like with like.  kvcore's engine (:class:`PagedEngine`) is the loop a
serving engine writes: a request is admitted when ``BlockPool.probe`` says the
pool can hold it to its last token, ``allocate`` returns its prefix hit; each
step calls ``seq.reserve(n)``, builds one slot mapping from
``seq.slot_mapping``, writes each layer once with ``pool.write`` (declared with
``seq.mark_written``), runs one ``AttentionPlan`` per step for every layer,
then ``seq.commit(n)`` and ``seq.append_token``; a finished request ``free()``s.
"""
import time
from collections import deque

import numpy as np

import kvcore
from .model import NumpyContiguousCache


class Request:
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


class RequestState:
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


# ------------------------------------------------------------------ engines
class _Engine:
    """How a loop stores KV; the scheduler in :func:`serve` is shared."""

    label = ""

    def admit(self, req, active):
        """A new RequestState for ``req``, or None if it must wait."""
        return RequestState(req)

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


class PagedEngine(_BatchedEngine):
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
        st = RequestState(req, computed=hit)
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


class ContiguousEngine(_BatchedEngine):
    """The plain NumPy baseline: a float32 NumpyContiguousCache per request,
    preallocated to a common max_seq_len, filled by slice assignment."""

    label = "contiguous NumPy"

    def __init__(self, model, max_seq_len):
        super().__init__(model)
        self.max_seq_len = max_seq_len
        self.live_bytes = 0
        self.peak_bytes = 0

    def admit(self, req, active):
        st = RequestState(req)
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


class KVCacheEngine(_BatchedEngine):
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
        st = RequestState(req)
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


class NoCacheEngine(_Engine):
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
def serve(engine, reqs, chunk, log=None, every=8):
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
