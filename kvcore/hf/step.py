"""One forward's K/V in a :class:`PagedCache`: the one place a step is begun,
committed and rolled back.

A step begins at the forward's first ``update`` (layer 0): it makes or
expands the cache's rows, records what each row had, reserves the positions
the forward computes and maps their slots.  Each layer's ``update`` writes
through the step; the last layer's commits it (the cache's length grows).
Any kvcore error inside the forward rolls it back (:meth:`Step.undo_failed`,
the one rule the cache and the attention function both apply): every row is
as before the forward and what the step reserved goes back to the pool.
"""
import numpy as np
import torch

from .._errors import OutOfBlocksError


class Step:
    """One forward's bookkeeping, shared by every layer of the step.

    Methods take the cache they act on (a step never holds its cache: a
    dropped cache must not be kept alive by its last step).
    """

    __slots__ = ("q", "start", "num_layers", "counts", "slots", "tables", "seq_lens",
                 "query_start", "query_rows", "_gather", "layers_done", "plans", "written",
                 "before", "pads", "made_rows", "device", "device_slots")

    # -------------------------------------------------------------- begin
    @classmethod
    def begin(cls, cache, batch, q):
        """Begin the step of a forward of ``batch`` rows x ``q`` columns and
        make it ``cache``'s: rows made (first forward) or expanded (beams),
        positions reserved and slots mapped.  On an error nothing is begun
        (rows it made are freed, reservations given back)."""
        made_rows = not cache._seqs
        if made_rows:
            cache._start_rows(batch, q)
        else:
            cache._expand_rows(batch)
        pads = cache._pad
        if not made_rows:
            cache._later_pads(q)
        step = cls()
        step.pads = pads
        step.start = cache._length
        step.num_layers = cache._num_layers
        step.layers_done = 0
        step.made_rows = made_rows
        # what rollback restores: each row's computed positions and the
        # tokens it knew before this forward (generate's hook adds its ids)
        known = cache._known_before
        cache._known_before = None
        if known is None or len(known) != len(cache._seqs):
            known = [seq.num_tokens for seq in cache._seqs]
        step.before = [(seq.num_computed, k) for seq, k in zip(cache._seqs, known)]
        cache._step = step
        cache._forward_began_step = True
        try:
            step._reserve(cache, q)
            if cache._lane is not None:
                # a CUDA pool: the step's slots (a decode step's tables) go
                # up now, once, before any layer
                cache._lane.begin(step, cache)
        except BaseException:
            step.rollback(cache)
            raise
        return step

    def _reserve(self, cache, q):
        """Reserve the step's positions in every row and map their slots."""
        cache._pending_mask = None
        seqs = cache._seqs
        rows = len(seqs)
        counts = np.empty(rows, np.int64)
        first = self.start - cache._pad
        for i, seq in enumerate(seqs):
            lo = max(int(first[i]), 0)
            nc = seq.num_computed
            if nc < lo:
                raise ValueError(f"row {i} has {nc} computed positions but this forward starts "
                                 f"at its position {lo}: the cache is out of step")
            counts[i] = max(0, int(first[i]) + q - nc)
        # all rows or none, under the pool's (reentrant) lock: a row that
        # ran out of blocks after the rows before it had reserved would
        # leave them their copy-on-write copies (a truncate keeps a copied
        # block) and the cached blocks their reservations evicted
        pool = cache.pool
        with pool._lock:
            _check_room(pool, seqs, counts)
            for i, seq in enumerate(seqs):
                seq.reserve(int(counts[i]))
        slots = np.full((rows, q), -1, np.int64)
        for i, seq in enumerate(seqs):
            n = int(counts[i])
            if n:
                end = int(first[i]) + q
                slots[i, q - n:] = seq.slot_mapping(end - n, end)
        self.q = q
        self.counts = counts
        self.slots = slots.reshape(-1)
        self.tables = None
        self.query_rows = None
        self._gather = None
        self.written = [(seq, int(n)) for seq, n in zip(seqs, counts) if n]
        self.plans = {}          # (scale, window, soft cap) -> AttentionPlan of this step
        self.device = self.device_slots = None   # a CUDA pool's (DeviceLane.begin)

    # -------------------------------------------------------------- layers
    @property
    def complete(self):
        """Every layer of the step is written (and the step committed)."""
        return self.layers_done == self.num_layers

    @property
    def partial(self):
        """Some layers written, not all: a forward that stopped part-way."""
        return 0 < self.layers_done < self.num_layers

    def wrote(self, cache, layer_idx):
        """Layer ``layer_idx``'s K/V are in the pages; the last layer's commits the step."""
        for seq, n in self.written:
            seq.mark_written(layer_idx, n)
        self.layers_done += 1
        if self.layers_done == self.num_layers:
            self.commit(cache)

    def wrote_all(self, cache):
        """Every layer's K/V are in the pages (a replayed CUDA graph wrote
        them): the step is committed."""
        for layer in range(self.layers_done, self.num_layers):
            self.wrote(cache, layer)

    # -------------------------------------------------------------- end
    def commit(self, cache):
        """The step's positions become the rows' computed ones; the cache's
        length grows by the step's columns."""
        for i, seq in enumerate(cache._seqs):
            seq.commit(int(self.counts[i]))
        cache._length = self.start + self.q

    def rollback(self, cache):
        """Undo the step, committed or not (its forward failed): each row goes
        back to the positions it had computed and the tokens it knew when the
        step began (what the step reserved and wrote is given back); rows the
        step made are freed.  Nothing unless it is ``cache``'s step; never raises."""
        if cache._step is not self:
            return
        cache._step = None
        if self.made_rows:
            cache.free()
            return
        for seq, (computed, known) in zip(cache._seqs, self.before):
            ids = seq.token_ids[computed:known].copy()
            seq.truncate(computed)
            if ids.size:
                seq.extend_tokens(ids)
        cache._length = self.start
        cache._pad = self.pads

    @staticmethod
    def undo_failed(cache, before, owned):
        """An exception inside a forward: roll back the step that forward owns.

        ``before`` is ``cache``'s step when the failing call began; ``owned``
        the step the call belongs to (the one in progress when it began, or
        the attention function's), or None.  The cache's step is rolled back
        when it is ``owned`` or was begun by the failing call; a step that a
        finished forward completed stays (``crop`` removes its columns).
        """
        step = cache._step
        if step is not None and (step is owned or step is not before):
            step.rollback(cache)

    # -------------------------------------------------------------- reads
    def attention_tables(self, cache):
        """Block tables, KV lengths and query rows of the step, for its AttentionPlan."""
        if self.tables is None:
            seqs = cache._seqs
            block_size = cache.pool.block_size
            ends = self.start + self.q - cache._pad
            need = (ends + block_size - 1) // block_size
            tables = np.zeros((len(seqs), max(1, int(need.max()))), np.int32)
            for i, seq in enumerate(seqs):
                tables[i, :need[i]] = seq.block_table[:need[i]]
            # pad columns are no queries of the row
            m = np.minimum(self.q, np.maximum(ends, 0))
            self.tables = tables
            self.seq_lens = np.maximum(ends, 0)
            self.query_start = np.zeros(len(seqs) + 1, np.int64)
            np.cumsum(m, out=self.query_start[1:])
            if int(m.sum()) == len(seqs) * self.q:
                self.query_rows = None
            else:
                col = np.arange(self.q)
                keep = col[None, :] >= (self.q - m)[:, None]
                self.query_rows = cache._torch.tensor(np.flatnonzero(keep.reshape(-1)))
        return self

    def gather_index(self, cache):
        """Index tensors that read every column of every row from the pages."""
        if self._gather is None:
            bs = cache.pool.block_size
            total = self.start + self.q
            pos = np.arange(total)[None, :] - cache._pad[:, None]
            pos = np.maximum(pos, 0)       # pad columns read the row's position 0 (masked)
            need = int(pos.max()) // bs + 1 if pos.size else 0    # (a forward of no columns)
            tables = np.zeros((len(cache._seqs), need), np.int64)
            for i, seq in enumerate(cache._seqs):
                t = seq.block_table
                k = min(need, t.shape[0])
                tables[i, :k] = t[:k]
            blocks = np.take_along_axis(tables, pos // bs, axis=1)
            self._gather = (
                cache._torch.tensor(blocks)[:, None, :],
                torch.arange(cache.pool.num_kv_heads, device=cache._torch.device)[None, :, None],
                cache._torch.tensor(pos % bs)[:, None, :])
        return self._gather


def _check_room(pool, seqs, counts):
    """Raise OutOfBlocksError, changing nothing, unless reserving
    ``counts[i]`` positions in each row ``seqs[i]``, in order, finds the
    blocks every row needs: new blocks past its table, and a copy of each
    block it would write that is shared or cached (``PagedKVCache.reserve``'s
    rule; a copy releases the original, which a later row holding it may
    then own alone, and a cached one nobody holds any more is free again).
    The caller holds the pool's lock."""
    bs = pool.block_size
    start = pool.num_free_blocks
    rows = [(seq, seq.num_computed, int(n)) for seq, n in zip(seqs, counts) if n]
    if sum(-(-(nc + n) // bs) - nc // bs for _, nc, n in rows) <= start:
        return          # (the usual step: room even if every block were new)
    free = start
    refs = {}
    total = copies = 0
    short = False
    for seq, nc, n in rows:
        table = seq.block_table
        end = -(-(nc + n) // bs)
        cow = []
        for b in table[nc // bs:min(end, table.shape[0])].tolist():
            if b not in refs:
                refs[b] = pool.ref_count(b)
            if refs[b] != 1 or pool.is_cached(b):
                cow.append(b)
        need = max(0, end - table.shape[0]) + len(cow)
        total += need
        copies += len(cow)
        short = short or need > free
        free -= need
        for b in cow:
            refs[b] -= 1
            if refs[b] == 0:
                free += 1
    if short:
        raise OutOfBlocksError(
            f"this forward needs {total} more blocks for its {len(seqs)} rows ({copies} "
            f"copy-on-write), {start} of {pool.num_blocks} are free")
