"""The prefix-store protocol: what a tier below a BlockPool's prefix cache implements.

A store maps keys (32 bytes: a pool's layout fingerprint then a block's
chained hash) to values (bytes: one encoded entry, see ``_format``).  It
knows nothing of pools, hashes or KV: the pool encodes, decodes and
verifies every entry, so a store may keep values anywhere (process memory,
files, Redis, Mooncake, LMCache's backends) as long as it returns the
bytes it was given, or nothing.

Methods (every one may raise; the pool turns an exception into misses and
one warning per condition, never into wrong data):

* ``contains(keys) -> int``: how many of ``keys``, from the first on, the
  store holds (one batched query: the length of the found run).
* ``get(keys) -> list``: the value of each key (bytes-like) or None.
  Marks what it returns as recently used.
* ``get_bounded(keys, max_bytes) -> list`` (optional): ``get``, except
  that a value longer than ``max_bytes`` may come back as ``b""`` (a
  corrupt entry) without being read whole.  The pool calls it with the
  size of its largest valid entry where a store has it, so a value
  planted huge (in Redis, by anyone who may write there) costs the reader
  ``max_bytes``, not the value's size; ``PrefixStore``'s calls ``get``.
  A subclass that overrides ``get`` below the class defining its
  ``get_bounded`` is read through its ``get``.
* ``put(items) -> list``: store ``(key, value)`` pairs (a key already there
  is replaced); returns the ``(key, value)`` pairs the store dropped to stay
  within its capacity, least recently used first, for the next tier (the
  pool verifies them first: a store's bytes are untrusted, e.g. files
  others wrote).  A ``put`` that fails after it already dropped entries
  sets the exception's ``dropped`` attribute to them, so that they still
  reach the next tier.
* ``delete(keys) -> int``: forget these keys; how many were there.
* ``capacity_bytes`` (None: bounded elsewhere, e.g. Redis' maxmemory),
  ``used_bytes()``, ``close()``.

``in_memory`` (class attribute, default False): True for a store whose
methods never wait on a disk or a network (``HostStore``).  The pool puts
its spills into such a store under its lock, right when it evicts; spills
for every other store go through the pool's store worker, off the lock,
queued up to ``max_pending_bytes`` per store (the oldest are dropped past
it, counted as ``spills_dropped`` in the pool's stats).

``namespace`` (bytes) enters the layout fingerprint, so entries of another
namespace are never found; ``hmac_key`` (bytes or None) makes the pool sign
what it stores there and accept only entries whose HMAC holds.

What a pool hands its stores is a :class:`BlockRecord` per cached block it
evicts (or flushes), published on its store port's record queue
(docs/stores.md, "The pool's store port").
"""
import collections

from .._ints import index_int, shown

#: One cached block as the pool publishes it to its stores, self-contained
#: (copied out under the pool's lock; nothing in it refers back to the pool):
#: ``block_id`` (int, where it was), ``hash`` (16 bytes, its chained hash),
#: ``parent_hash`` (16 bytes: the parent block's chained hash, the salt's
#: chain root for block 0), ``chain_root`` (16 bytes: the salt's chain root),
#: ``identity`` (32 bytes: its identity digest, BLAKE2b-256 chained over the
#: salt and every token id up to its end), ``tokens`` (int32 array, its token
#: ids) and ``payload`` (uint8 array: its KV bytes, ``StorePort.export_blocks``).
BlockRecord = collections.namedtuple(
    "BlockRecord", "block_id hash parent_hash chain_root identity tokens payload")


def utf8_text(text, arg):
    """str ``text`` as UTF-8 bytes; ValueError naming ``arg`` for text UTF-8
    cannot encode (a lone surrogate).  The one statement of this rule: the
    pool's side (a salt) calls it too, as the stores import nothing of it."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{arg} must be text UTF-8 can encode, got {text!r:.40} "
                         f"({e.reason} at index {e.start})") from None


def bound_bytes(max_bytes):
    """``get_bounded``'s ``max_bytes`` checked: a positive int (ValueError
    naming it otherwise)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {shown(max_bytes)}")
    return max_bytes


class PrefixStore:
    """Base class of kvcore's prefix stores (and a template for others).

    Subclasses implement ``contains``, ``get``, ``put``, ``delete`` and
    ``used_bytes``; see the module docstring for the contract.
    """

    #: short name used in stats() and warnings
    kind = "store"
    #: seconds a pool leaves the store alone after it timed out or could
    #: not be reached (then tries it again)
    retry_interval = 1.0
    #: whether the methods only touch this process's memory (then the pool
    #: writes spills into it under its lock, not on its store worker)
    in_memory = False
    #: bytes of spills a pool queues for this store before it drops the oldest
    max_pending_bytes = 256 << 20

    def __init__(self, capacity_bytes=None, namespace="", hmac_key=None):
        if capacity_bytes is not None:
            capacity_bytes = index_int(capacity_bytes, "capacity_bytes")
            if capacity_bytes <= 0:
                raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        if isinstance(namespace, str):
            namespace = utf8_text(namespace, "namespace")
        if not isinstance(namespace, (bytes, bytearray)):
            raise TypeError(f"namespace must be str or bytes, got {type(namespace).__name__}")
        self.namespace = bytes(namespace)
        if isinstance(hmac_key, str):
            hmac_key = utf8_text(hmac_key, "hmac_key")
        if hmac_key is not None and (not isinstance(hmac_key, (bytes, bytearray))
                                     or not hmac_key):
            raise TypeError("hmac_key must be None or non-empty bytes/str, got "
                            f"{hmac_key!r:.40}")
        self.hmac_key = None if hmac_key is None else bytes(hmac_key)

    def contains(self, keys):
        raise NotImplementedError

    def get(self, keys):
        raise NotImplementedError

    def get_bounded(self, keys, max_bytes):
        """:meth:`get`, where a value longer than ``max_bytes`` may come
        back as ``b""`` without being read whole (stores that can bound a
        read override this)."""
        return self.get(keys)

    def put(self, items):
        raise NotImplementedError

    def delete(self, keys):
        raise NotImplementedError

    def used_bytes(self):
        raise NotImplementedError

    def close(self):
        """Release what the store holds open (files, connections)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        # (copy.copy, copy.deepcopy and pickle all come here)
        raise TypeError(f"a {type(self).__name__} is not copied or pickled: it holds open "
                        "files, connections or entries in memory; make one per process "
                        "(DiskStore and RedisStore stores of the same path or server and "
                        "namespace share their entries)")


class StoreWarning(UserWarning):
    """A prefix store failed or held an unusable entry; the pool treated it
    as a miss.  Issued once per store and condition ('timeout',
    'unreachable', 'disk full', 'permission denied', 'I/O error', 'corrupt',
    'fingerprint', 'hmac', 'mismatch', 'error')."""
