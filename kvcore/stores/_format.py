"""The bytes of a prefix-store entry, and their verification.

An entry is one full block of one sequence: its KV (every layer, K and V,
in the pool's storage dtype, the block's bytes as ``BlockPool.export_blocks``
gives them) and what identifies it.  Layout, all integers little-endian::

    offset size
    0      4    magic b"KVST"
    4      2    format version (3)
    6      2    flags: bit 0 = an HMAC follows the checksum
    8      16   layout fingerprint (see :func:`fingerprint`)
    24     16   the block's chained hash (kvcore.block_hashes)
    40     16   the parent's chained hash (the salt's root for block 0)
    56     16   the salt's chain root (16 zero bytes: no salt)
    72     32   the block's identity digest (kvcore.hashing.identity_chain):
                BLAKE2b-256 chained over the salt and every token id of the
                sequence up to the end of this block
    104    4    tokens in the block (= block_size)
    108    4    0 (reserved)
    112    8    payload bytes
    120    8    checksum: XXH3-64 of the payload, seeded with the XXH3-64
                (seed 0) of bytes 0..119 and the token ids
    128    32   HMAC-SHA256 (only with flag bit 0) of bytes 0..127, the token
                ids and the payload, with the store's ``hmac_key``
    ...         token ids (int32), then the payload

An entry is accepted only if every field is consistent, the fingerprint,
hash, parent, salt root, identity digest and token ids equal what the
query expects, the checksum holds and, for a store with an ``hmac_key``,
the HMAC does.  The chained hashes only find an entry (they are the key);
the identity digest decides whether it is the query's block: the pool's
SipHash-1-3 chain is fast but not collision-resistant, so two prefixes
whose chained hashes collide would otherwise share entries.

The checksum guards against damaged bytes only (the identity digest
decides which block an entry is, an HMAC who wrote it): XXH3-64
(kv_xxh3.c, SIMD) runs at memory speed, fused with the copy into the
pool's blocks (``BlockPool.import_blocks``), so restores are bound by the
medium, not by the hash.

Older versions are clean misses, never read: the layout fingerprint names
the version, so their keys differ from this version's and a pool never
looks them up (no warning; they age out of the stores by LRU).  Version 1
had no identity digest; version 2 is this layout with an XXH64 checksum.
An entry of another version met under this version's key anyway (a file
planted or damaged) fails as 'corrupt', and :func:`entry_size` refuses it,
so it never travels to the next tier.
"""
import hashlib
import hmac
import struct

import numpy as np

from ..backends import xxh3_64

MAGIC = b"KVST"
VERSION = 3
FLAG_HMAC = 1
_PREFIX = struct.Struct("<4sHH16s16s16s16s32sIIQ")  # bytes 0..119
_CHECKSUM = struct.Struct("<Q")
PREFIX_SIZE = _PREFIX.size                          # 120
MAC_SIZE = 32
IDENTITY_SIZE = 32
#: bytes of an entry that :func:`entry_size` reads
HEAD_PROBE = PREFIX_SIZE


class Invalid(Exception):
    """An entry that must not be used; ``condition`` names why (the
    warning's condition: 'corrupt', 'fingerprint', 'hmac', 'mismatch')."""

    def __init__(self, condition, detail):
        super().__init__(detail)
        self.condition = condition


def fingerprint(dtype, block_size, num_layers, num_kv_heads, head_dim, namespace,
                kv_scales=None):
    """16 bytes naming a pool's block layout and the store's namespace:
    entries of another model, dtype, block size or namespace never match.
    ``kv_scales``: an fp8 pool's ``(k_scale, v_scale)`` per layer, which give
    its codes their values: a pool with other scales must not read them
    (each a float, or a tuple of per-kv-head floats)."""
    text = (f"kvcore.store.v{VERSION}|dtype={dtype}|block_size={block_size}|"
            f"num_layers={num_layers}|num_kv_heads={num_kv_heads}|head_dim={head_dim}|"
            f"layout=[2*layers][heads][tokens][dim]|")
    if kv_scales is not None:    # the float32 bits, exactly as the pool holds them
        if all(isinstance(s, float) for pair in kv_scales for s in pair):
            text += "kv_scales=" + np.asarray(kv_scales, "<f4").tobytes().hex() + "|"
        else:                    # some per-kv-head: every plane's heads, one repeated
            heads = [[np.broadcast_to(np.asarray(s, "<f4"), (num_kv_heads,)) for s in pair]
                     for pair in kv_scales]
            text += "kv_head_scales=" + np.asarray(heads, "<f4").tobytes().hex() + "|"
    text = (text + "namespace=").encode() + namespace
    return hashlib.blake2b(text, digest_size=16).digest()


def store_key(fp, block_hash):
    """The key a store files an entry under: fingerprint + chained hash (32 bytes)."""
    return fp + block_hash


def entry_size(head):
    """The size in bytes an entry's first :data:`HEAD_PROBE` bytes
    ``head`` promise for the whole entry, or None when they are not the
    start of an entry of this version (too short, another magic or
    version)."""
    if len(head) < PREFIX_SIZE:
        return None
    magic, version, flags, *_, ntok, _reserved, npay = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION:
        return None
    return header_size(ntok, flags & FLAG_HMAC) + npay


def payload_checksum(payload, seed):
    """The checksum of this version: XXH3-64 of the bytes-like ``payload``
    with ``seed`` (what ``BlockPool.import_blocks(..., seeds=)`` computes
    while copying)."""
    return xxh3_64(payload, seed)


def header_seed(prefix, tokens):
    """The seed of an entry's payload checksum: the checksum (seed 0) of its
    first :data:`PREFIX_SIZE` bytes and its token ids."""
    return payload_checksum(bytes(prefix) + bytes(memoryview(tokens).cast("B")), 0)


def _mac(hmac_key, head, tokens, payload):
    m = hmac.new(hmac_key, head, hashlib.sha256)
    m.update(tokens)
    m.update(payload)
    return m.digest()


def header_size(ntok, hmac_key=None):
    """The bytes of an entry of ``ntok`` tokens before its payload (with
    ``hmac_key`` truthy: its MAC too)."""
    return PREFIX_SIZE + 8 + (MAC_SIZE if hmac_key else 0) + 4 * ntok


def encode(fp, block_hash, parent, salt_root, identity, tokens, payload, hmac_key=None,
           out=None):
    """One entry's bytes (a bytearray).  ``identity``: the block's 32-byte
    identity digest (kvcore.hashing.identity_chain); ``tokens``: int32
    array; ``payload``: a C-contiguous array or bytes-like of the block's KV.
    With ``out``, a writable byte buffer that ends with ``payload`` itself
    (:func:`header_size` bytes before it, the same memory): the header is
    written there, the payload left in place, and ``out`` returned."""
    tok = np.ascontiguousarray(tokens, dtype="<i4")
    pay = memoryview(payload).cast("B")
    if len(identity) != IDENTITY_SIZE:
        raise ValueError(f"identity must be {IDENTITY_SIZE} bytes, got {len(identity)}")
    prefix = _PREFIX.pack(MAGIC, VERSION, FLAG_HMAC if hmac_key else 0, fp, block_hash,
                          parent, salt_root, bytes(identity), tok.size, 0, pay.nbytes)
    head = prefix + _CHECKSUM.pack(payload_checksum(pay, header_seed(prefix, tok)))
    if hmac_key:
        head += _mac(hmac_key, head, tok, pay)
    n = len(head) + tok.nbytes
    if out is None:
        out = bytearray(n + pay.nbytes)
        out[n:] = pay
    elif len(out) != n + pay.nbytes:
        raise ValueError(f"out must be the {n} bytes before the payload and the payload, "
                         f"got {len(out)} bytes")
    out[:len(head)] = head
    out[len(head):n] = tok.tobytes()
    return out


def parse(value, fp, hmac_key=None, verify_payload=True):
    """``(block_hash, parent, salt_root, identity, tokens, payload, checksum, seed)``
    of a well-formed entry of layout ``fp`` (tokens and payload are
    memoryviews into ``value``): structure, header, fingerprint and (with
    ``hmac_key``) HMAC checked, and the payload's checksum unless
    ``verify_payload`` is False (the caller then checks ``checksum``
    against :func:`payload_checksum` of the payload with ``seed``, e.g.
    while copying it); raises :class:`Invalid` otherwise."""
    try:
        view = memoryview(value).cast("B")
    except TypeError as e:
        raise Invalid("corrupt", f"not a bytes-like value ({type(value).__name__})") from e
    n = view.nbytes
    if n < PREFIX_SIZE + 8:
        raise Invalid("corrupt", f"truncated entry ({n} bytes)")
    (magic, version, flags, efp, ehash, eparent, esalt, eident, ntok, _reserved,
     npay) = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise Invalid("corrupt", f"not a kvcore store entry (magic {magic!r}, version {version})")
    head = PREFIX_SIZE + 8 + (MAC_SIZE if flags & FLAG_HMAC else 0)
    if n != head + 4 * ntok + npay:
        raise Invalid("corrupt", f"truncated or overlong entry: {n} bytes, its header says "
                                 f"{head + 4 * ntok + npay}")
    tok = view[head:head + 4 * ntok]
    pay = view[head + 4 * ntok:]
    (checksum,) = _CHECKSUM.unpack_from(view, PREFIX_SIZE)
    seed = header_seed(view[:PREFIX_SIZE], tok)
    if verify_payload and payload_checksum(pay, seed) != checksum:
        raise Invalid("corrupt", "checksum mismatch")
    if efp != fp:
        # a damaged fingerprint is corruption, not another layout
        if not verify_payload and payload_checksum(pay, seed) != checksum:
            raise Invalid("corrupt", "checksum mismatch")
        raise Invalid("fingerprint", "the entry's layout fingerprint (dtype, block size, "
                                     "layers, heads, head_dim, namespace) differs from the pool's")
    if hmac_key:
        if not flags & FLAG_HMAC:
            raise Invalid("hmac", "the entry is not signed but the store has an hmac_key")
        want = _mac(hmac_key, view[:PREFIX_SIZE + 8], tok, pay)
        if not hmac.compare_digest(want, view[PREFIX_SIZE + 8:head]):
            raise Invalid("hmac", "HMAC mismatch")
    return ehash, eparent, esalt, eident, tok, pay, checksum, seed


def decode(value, fp, block_hash, parent, salt_root, identity, tokens, payload_size,
           hmac_key=None, verify_payload=True):
    """``(payload, checksum, seed)`` (see :func:`parse`) of a valid entry
    for the block ``block_hash`` with ``parent``, ``salt_root``,
    ``identity`` (the query's identity digest of this block) and
    ``tokens`` (int32 array) of ``payload_size`` bytes; raises
    :class:`Invalid` otherwise."""
    ehash, eparent, esalt, eident, tok, pay, checksum, seed = parse(value, fp, hmac_key,
                                                                    verify_payload)
    expect = memoryview(np.ascontiguousarray(tokens, dtype="<i4")).cast("B")
    if (ehash != block_hash or eparent != parent or esalt != salt_root
            or pay.nbytes != payload_size or tok != expect
            or not hmac.compare_digest(eident, identity)):
        # a damaged header or token id is corruption, not another block
        if not verify_payload and payload_checksum(pay, seed) != checksum:
            raise Invalid("corrupt", "checksum mismatch")
        raise Invalid("mismatch", "the entry's hash, parent, salt, identity digest, token ids "
                                  "or size differ from the query's")
    return pay, checksum, seed
