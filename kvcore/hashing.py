"""Chained block hashes for prefix caching.

Algorithm (also in docs/api.md, "Block hashes"): SipHash-1-3 with 128-bit
output (one compression and three finalization rounds), key = the 16 bytes
``b"kvcore.block.v1\\0"``.

* root = 16 zero bytes when there is no salt, else
  SipHash13_128(key, b"kvcore.salt:" + salt) (a str salt as UTF-8);
* h[i] = SipHash13_128(key, h[i-1] + token ids of block i as 4-byte
  little-endian unsigned integers), with h[-1] = root.

Only full blocks are hashed.  The result depends on nothing but the token ids,
the block size and the salt: not on the process, the machine, the Python
version or ``PYTHONHASHSEED``.
"""
import numpy as np

from ._native import _pool
from ._validate import positive_int, salt_bytes, token_array

_K0, _K1 = _pool.block_key()
SALT_PREFIX = b"kvcore.salt:"


def root_words(salt):
    """(lo, hi) words of the chain root for ``salt`` (bytes or None)."""
    if salt is None:
        return 0, 0
    d = _pool.siphash128(SALT_PREFIX + salt, _K0, _K1)
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def hash_words(tokens, block_size, root, n_blocks=None, out=None):
    """(n_blocks, 2) uint64 chained hashes of the full blocks of int32 ``tokens``."""
    if n_blocks is None:
        n_blocks = len(tokens) // block_size
    if out is None:
        out = np.empty((n_blocks, 2), np.uint64)
    _pool.hash_chain(tokens, n_blocks, block_size, root[0], root[1], out)
    return out


def words_to_bytes(words):
    """Rows of (lo, hi) uint64 words as 16-byte hashes."""
    raw = np.ascontiguousarray(words, dtype="<u8").tobytes()
    return [raw[i:i + 16] for i in range(0, len(raw), 16)]


def block_hashes(token_ids, block_size, salt=None):
    """The chained hash of every full block of ``token_ids``.

    Parameters
    ----------
    token_ids : list of int or 1-D integer array
        Ids in 0..2**31-1.
    block_size : int
    salt : str or bytes, optional
        Sequences with different salts never share blocks.

    Returns
    -------
    list of bytes
        One 16-byte hash per full block, exactly as a ``BlockPool`` computes
        them; the hashes of a prefix are a prefix of the hashes.
    """
    bs = positive_int(block_size, "block_size")
    tokens = token_array(token_ids)
    salt = salt_bytes(salt)
    if bs > tokens.size:      # no full block (and a size past the C range is one)
        return []
    return words_to_bytes(hash_words(tokens, bs, root_words(salt)))


# ------------------------------------------------------------ identity chain
# What a prefix-store entry is verified against (BLAKE2b-256, chained over the
# salt and every token id; "Identity digests" in kvcore/_native/_pool.pyx):
# the pool's bookkeeping computes it once per block with the same function.
identity_root = _pool.identity_root
NO_SALT_IDENTITY = _pool.NO_SALT_IDENTITY


def identity_chain(tokens, block_size, salt, n_blocks):
    """The identity digests (32 bytes each) of the first ``n_blocks`` full
    blocks of int32 ``tokens`` under ``salt`` (bytes or None): one BLAKE2b
    per block, chained, so that two digests are equal only if the whole
    prefixes and salts are (collision resistance of BLAKE2b-256)."""
    raw = _pool.identity_chain(np.ascontiguousarray(tokens, dtype=np.int32), block_size,
                               identity_root(salt), n_blocks)
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]
