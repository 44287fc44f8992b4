"""Entry format version 3 (kvcore/stores/_format.py): the payload checksum
is XXH3-64 (checked against the xxhash package); entries of version 2
(XXH64) filed under their own keys are clean misses (never looked up, no
warning), one met under a version 3 key is 'corrupt'; damaged version 3
entries are misses with one warning; a restore split over threads loads
the same bits as one on a single thread."""
import warnings

import numpy as np
import pytest
import xxhash

import kvcore
from kvcore.stores import _format

try:
    from _stores_support import check_hit, flush_pool, make_pool, run
except ImportError:  # pragma: no cover - run as a package
    from ._stores_support import check_hit, flush_pool, make_pool, run

PROMPT = np.arange(1, 18, dtype=np.int32)        # 4 full blocks of 4
GEO = ("float16", 4, 2, 2, 8, b"")


def entries(store):
    """{key: value} of every entry a HostStore holds (via its public get)."""
    keys = [_format.store_key(_format.fingerprint(*GEO), h)
            for h in kvcore.block_hashes(PROMPT, 4)]
    return dict(zip(keys, store.get(keys)))


def fields(value):
    head = _format.PREFIX_SIZE + 8
    ntok = int.from_bytes(value[104:108], "little")
    return bytes(value[:_format.PREFIX_SIZE]), value[head:head + 4 * ntok], \
        value[head + 4 * ntok:]


def as_version_2(value, monkeypatch):
    """The entry a version 2 kvcore wrote for the same block: version 2, the
    version 2 fingerprint, an XXH64 checksum; and its (version 2) key."""
    with monkeypatch.context() as m:
        m.setattr(_format, "VERSION", 2)
        fp2 = _format.fingerprint(*GEO)
    old = bytearray(value)
    old[4:6] = (2).to_bytes(2, "little")
    old[8:24] = fp2
    prefix, tok, pay = fields(old)
    seed = xxhash.xxh64_intdigest(prefix + bytes(tok))
    old[120:128] = xxhash.xxh64_intdigest(bytes(pay), seed).to_bytes(8, "little")
    return fp2 + bytes(old[24:40]), bytes(old)


def stored(store_cls=kvcore.HostStore):
    store = store_cls(1 << 22)
    pool = make_pool(stores=[store])
    run(pool, PROMPT)
    flush_pool(pool)
    return store, entries(store)


def test_the_checksum_is_xxh3_64_of_the_payload_seeded_by_the_header():
    _, values = stored()
    assert len(values) == 4
    for value in values.values():
        assert int.from_bytes(value[4:6], "little") == 3
        prefix, tok, pay = fields(value)
        seed = xxhash.xxh3_64_intdigest(prefix + bytes(tok))
        assert int.from_bytes(value[120:128], "little") == \
            xxhash.xxh3_64_intdigest(bytes(pay), seed=seed)


def test_version_2_entries_under_their_keys_are_clean_misses(monkeypatch):
    _, values = stored()
    old_store = kvcore.HostStore(1 << 22)
    old_store.put([as_version_2(v, monkeypatch) for v in values.values()])
    pool = make_pool(stores=[old_store])
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no StoreWarning: a clean miss
        check_hit(pool, PROMPT, 0)
    st = pool.stats()["stores"][0]
    assert st["rejected"] == 0 and st["hits"] == 0
    # the pool computed the blocks again and stored them as version 3
    run(pool, PROMPT)
    flush_pool(pool)
    check_hit(pool, PROMPT, 4)


def test_a_version_2_entry_under_a_version_3_key_is_corrupt(monkeypatch):
    store, values = stored()
    key, value = next(iter(values.items()))      # block 0
    _, old = as_version_2(value, monkeypatch)
    store.put([(key, old)])
    assert _format.entry_size(old[:_format.HEAD_PROBE]) is None
    with pytest.raises(_format.Invalid, match="version 2") as e:
        _format.parse(old, _format.fingerprint(*GEO))
    assert e.value.condition == "corrupt"
    pool = make_pool(stores=[store])
    with pytest.warns(kvcore.StoreWarning, match="corrupt") as record:
        check_hit(pool, PROMPT, 0)
    assert len(record) == 1


@pytest.mark.parametrize("where", ["first", "middle", "last", "checksum", "seed"])
def test_a_damaged_version_3_entry_is_a_miss_from_there(where):
    store, values = stored()
    keys = list(values)
    value = bytearray(values[keys[2]])           # block 2
    _, _, pay = fields(value)
    at = {"first": len(value) - len(pay), "middle": len(value) - len(pay) // 2,
          "last": len(value) - 1, "checksum": 123,
          # a token id: the checksum's seed changes, the payload does not
          "seed": _format.PREFIX_SIZE + 8}[where]
    value[at] ^= 0x01
    store.put([(keys[2], bytes(value))])
    pool = make_pool(stores=[store])
    with pytest.warns(kvcore.StoreWarning, match="corrupt|mismatch") as record:
        check_hit(pool, PROMPT, 2)
    assert len(record) == 1


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_threaded_restore_loads_the_same_bits(threads):
    # 16 blocks of 64 KiB: 1 MiB, enough for the batch copy to use threads
    geo = dict(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)
    prompt = np.arange(5, 5 + 16 * 16 + 1, dtype=np.int32)
    before = kvcore.set_num_threads(threads)
    try:
        store = kvcore.HostStore(1 << 26)
        pool = make_pool(num_blocks=24, stores=[store], **geo)
        run(pool, prompt)
        flush_pool(pool)
        check_hit(pool, prompt, 16)
    finally:
        kvcore.set_num_threads(before)


@pytest.mark.parametrize("hmac_key", [None, b"k" * 32])
def test_an_eviction_encodes_its_entries_in_place_as_encode_would(hmac_key):
    """The port exports each evicted block after room for its entry's
    header, and the spill writes the header there: the entry is the same
    bytes as _format.encode's copy; a payload without that room (another
    array) is copied as before."""
    from kvcore._store_port import StorePort
    from kvcore.pool import store_port

    host = kvcore.HostStore(1 << 20, hmac_key=hmac_key)
    pool = make_pool(stores=[host])
    run(pool, np.arange(1, 18, dtype=np.int32))
    port = store_port(pool)
    assert isinstance(port, StorePort)
    spills = pool._stores.tiers.spills
    assert port.headroom == _format.header_size(port.block_size, hmac_key) > 0
    records = port.cached_records()
    assert records
    fp = spills._fp[0]
    for r in records:
        copy = _format.encode(fp, r.hash, r.parent_hash, r.chain_root, r.identity, r.tokens,
                              np.array(r.payload), hmac_key)
        out = spills._in_place(r, hmac_key)
        assert out is not None and len(out) == len(copy)
        assert bytes(_format.encode(fp, r.hash, r.parent_hash, r.chain_root, r.identity,
                                    r.tokens, r.payload, hmac_key, out=out)) == bytes(copy)
        assert bytes(out[-len(r.payload):]) == r.payload.tobytes()
        alone = r._replace(payload=np.array(r.payload))          # no room before it
        assert spills._in_place(alone, hmac_key) is None
    port.headroom = 0                                            # exported without room
    for r in port.cached_records():
        assert spills._in_place(r, hmac_key) is None
    with pytest.raises(ValueError, match="out must be"):
        _format.encode(fp, r.hash, r.parent_hash, r.chain_root, r.identity, r.tokens,
                       r.payload, hmac_key, out=bytearray(3))
