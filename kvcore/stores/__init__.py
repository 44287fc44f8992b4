"""Prefix stores: where a BlockPool keeps the cached blocks it evicts
(process memory, files, Redis), to hit them again later, after a restart,
or from another process or machine.  See docs/stores.md."""
from ._worker import Prefetch
from .base import BlockRecord, PrefixStore, StoreWarning
from .disk import DiskStore
from .host import HostStore
from .redis_store import RedisStore

__all__ = ["PrefixStore", "StoreWarning", "HostStore", "DiskStore", "RedisStore", "Prefetch",
           "BlockRecord"]
