"""A pure-Python prefix-caching block pool, as a benchmark reference.

This follows the design of vLLM v1's ``BlockPool`` / ``KVCacheManager``
(written from a description of that design, not from its code), so kvcore's
bookkeeping can be timed against the way a well-known pure-Python engine does
the same work:

* every block is a :class:`KVCacheBlock` object with a reference count, an
  optional block hash and links for the free list;
* free blocks live in :class:`FreeKVCacheBlockQueue`, a doubly linked list
  with O(1) ``popleft``, ``append`` and ``remove`` (removal from the middle is
  what a prefix hit on an unreferenced cached block needs);
* the prefix cache is a dict ``block_hash -> {block_id: block}``; a freed
  cached block keeps its hash and stays findable until it is popped for new
  content (lazy eviction), so the least recently released blocks go first;
* block hashes chain: ``sha256(pickle.dumps((parent_hash, tuple(token_ids), extra)))``.

It only manages block ids; no KV data is stored. Hits are trusted on the hash
alone (no token-id verification), as in the design it mirrors.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Iterable, Optional

__all__ = ["KVCacheBlock", "FreeKVCacheBlockQueue", "PyBlockPool", "hash_block_tokens"]


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Iterable[int], extra=None) -> bytes:
    """Chained hash of one full block.

    Parameters
    ----------
    parent_hash : bytes or None
        Hash of the previous block; None for the first block.
    token_ids : iterable of int
        The block's token ids.
    extra : object, optional
        Anything else that must separate caches (a salt, LoRA id, ...).

    Returns
    -------
    bytes
        32-byte SHA-256 digest.
    """
    # Callers pass plain Python ints (allocate converts once), as vLLM's
    # requests hold their token ids in lists.
    payload = (parent_hash, tuple(token_ids), extra)
    return hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class KVCacheBlock:
    """Metadata of one KV block.

    Attributes
    ----------
    block_id : int
    ref_cnt : int
        Number of requests holding the block.
    block_hash : bytes or None
        Set while the block is registered in the prefix cache.
    prev_free_block, next_free_block : KVCacheBlock or None
        Links in the free queue (None when not queued).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, head = next to hand out.

    Sentinel head and tail nodes remove the empty-list special cases from
    every operation.

    Parameters
    ----------
    blocks : list of KVCacheBlock
        Initial content, in hand-out order.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = len(blocks)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; IndexError when empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise IndexError("popleft from an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be queued) in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (handed out last)."""
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self):
        node = self._head.next_free_block
        while node is not self._tail:
            yield node
            node = node.next_free_block


class _Request:
    __slots__ = ("token_ids", "block_hashes", "blocks", "num_computed", "num_cached_blocks", "extra")

    def __init__(self, token_ids: list[int], extra) -> None:
        self.token_ids = token_ids
        self.block_hashes: list[bytes] = []
        self.blocks: list[KVCacheBlock] = []
        self.num_computed = 0
        self.num_cached_blocks = 0
        self.extra = extra


class PyBlockPool:
    """Pure-Python prefix-caching block pool (vLLM v1 style).

    Parameters
    ----------
    num_blocks : int
    block_size : int
        Tokens per block.
    enable_prefix_caching : bool, optional
        When False, nothing is hashed or looked up.

    Notes
    -----
    A request goes through ``allocate`` (prompt), any number of ``commit``
    (and ``append_tokens`` for decoding), then ``free``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks, block_size: expected positive ints, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.requests: dict[object, _Request] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    # ----------------------------------------------------------- properties

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including unheld cached ones)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(d) for d in self.cached_block_hash_to_block.values())

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def block_table(self, req_id) -> list[int]:
        """Block ids of ``req_id`` in position order."""
        return [b.block_id for b in self.requests[req_id].blocks]

    def stats(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "evictions": self.evictions,
        }

    # ----------------------------------------------------------- internals

    def _extend_hashes(self, req: _Request) -> None:
        # Hashes are computed once per full block and kept on the request, so
        # a long decode does not rehash its prefix.
        bs = self.block_size
        hashes = req.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(req.token_ids) // bs):
            extra = req.extra if i == 0 else None
            parent = hash_block_tokens(parent, req.token_ids[i * bs:(i + 1) * bs], extra)
            hashes.append(parent)

    def _get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        entry = self.cached_block_hash_to_block.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        self.evictions += 1

    def _get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_block_queue.num_free_blocks:
            raise MemoryError(f"need {n} free blocks, have {self.free_block_queue.num_free_blocks}")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
            out.append(block)
        return out

    def _touch(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                # An unheld cached block sits in the free queue; a hit takes it out.
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def _cache_full_blocks(self, req: _Request) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed, len(req.token_ids)) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        self._extend_hashes(req)
        for i in range(req.num_cached_blocks, num_full):
            block = req.blocks[i]
            block_hash = req.block_hashes[i]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
        req.num_cached_blocks = num_full

    # ----------------------------------------------------------- public API

    def allocate(self, req_id, token_ids, extra=None) -> int:
        """Take blocks for a new request's prompt.

        Parameters
        ----------
        req_id : hashable
            New request id.
        token_ids : sequence of int
            The prompt.
        extra : object, optional
            Mixed into the first block's hash (a salt); requests with
            different ``extra`` never share blocks.

        Returns
        -------
        int
            Number of leading tokens whose KV is already cached (a multiple of
            ``block_size``, always less than ``len(token_ids)``).

        Raises
        ------
        MemoryError
            Not enough free blocks; nothing is changed.
        """
        if req_id in self.requests:
            raise ValueError(f"req_id: {req_id!r} is already allocated")
        token_ids = token_ids if type(token_ids) is list else [int(t) for t in token_ids]
        n = len(token_ids)
        if n == 0:
            raise ValueError("token_ids: expected a non-empty prompt")
        bs = self.block_size
        req = _Request(token_ids, extra)

        hits: list[KVCacheBlock] = []
        if self.enable_prefix_caching:
            self._extend_hashes(req)
            # Never hit the whole prompt: the last token must be computed to
            # produce logits for the next one.
            max_hit_blocks = (n - 1) // bs
            for block_hash in req.block_hashes[:max_hit_blocks]:
                block = self._get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)

        num_required = -(-n // bs)
        num_new = num_required - len(hits)
        # Hit blocks nobody holds are counted in the free queue but will not
        # be available for new content once touched.
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > self.free_block_queue.num_free_blocks - evictable_hits:
            raise MemoryError(
                f"request {req_id!r} needs {num_new} new blocks, "
                f"{self.free_block_queue.num_free_blocks - evictable_hits} are free")

        self._touch(hits)
        req.blocks = hits + self._get_new_blocks(num_new)
        req.num_computed = len(hits) * bs
        req.num_cached_blocks = len(hits)
        self.requests[req_id] = req
        if self.enable_prefix_caching:
            self.prefix_queries += n
            self.prefix_hits += req.num_computed
        return req.num_computed

    def append_tokens(self, req_id, token_ids) -> None:
        """Add generated tokens to a request and take blocks for them.

        Raises
        ------
        MemoryError
            Not enough free blocks; nothing is changed.
        """
        req = self.requests[req_id]
        new = [int(t) for t in token_ids]
        needed = -(-(len(req.token_ids) + len(new)) // self.block_size) - len(req.blocks)
        if needed > 0:
            req.blocks.extend(self._get_new_blocks(needed))
        req.token_ids.extend(new)

    def commit(self, req_id, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions computed; register newly full blocks.

        Raises
        ------
        ValueError
            If that passes the request's known tokens.
        """
        req = self.requests[req_id]
        if num_tokens < 0 or req.num_computed + num_tokens > len(req.token_ids):
            raise ValueError(
                f"num_tokens: expected 0..{len(req.token_ids) - req.num_computed}, got {num_tokens}")
        req.num_computed += num_tokens
        self._cache_full_blocks(req)

    def free(self, req_id) -> None:
        """Release a request's blocks (no-op for an unknown id).

        Blocks go to the free queue tail first, so when they are later
        evicted the end of a cached prefix goes before its beginning.
        """
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        for block in reversed(req.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (no change) while any block is held."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
