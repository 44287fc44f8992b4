"""kvcore's exception types."""


class KVCacheError(Exception):
    """Base class of kvcore's own errors."""


class OutOfBlocksError(KVCacheError, MemoryError):
    """The block pool cannot supply the blocks asked for."""


class CacheFullError(KVCacheError, ValueError):
    """A write past ``max_seq_len``."""
