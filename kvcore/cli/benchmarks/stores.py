"""Prefix-store restores: ``PagedKVCache.allocate`` of an N-token prefix
(default 2048 tokens of a 32-layer, 8-KV-head, head_dim-128 float16 model:
128 KiB a token, 256 MiB; quick mode 512 tokens) into an empty pool from
each store (lookup, fetch, verify every entry's identity and checksum, copy
into the pool, register), against moving the same bytes without kvcore, in
the same run:

* the checksum on its own: XXH3-64 (entry format 3) over the prefix's
  bytes, and the fused copy+XXH3-64 into a pool's block layout, in GB/s
  beside a memcpy (numpy.copyto) of the same bytes;
* HostStore  vs  a memcpy of the same number of bytes;
* DiskStore (page cache warm)  vs  numpy.fromfile of the same entry files;
* DiskStore.put of tokens/4 entries of 16 KiB (a small model's blocks; 512
  by default, 128 in quick mode) into a full store (a trim of as many,
  then the writes, under PATH/.lock), and a lookup of them
  (DiskStore.contains + get), alone and beside a thread busy in Python
  (each call that gives the GIL up may wait a switch interval for it
  back), vs the same files written (open/write/os.replace) or looked up
  (lstat, open/read) by Python beside the same thread;
* RedisStore on loopback  vs  one raw redis-py pipelined GET of the same keys;
  and a lookup of the prefix's entries (RedisStore.contains + get) alone
  and beside a thread busy in Python, vs that GET beside the same thread;
* RedisStore on a 3-master Redis Cluster on loopback (``RedisStore.cluster``)
  vs  raw redis-py pipelined GETs of the same keys, one pipeline per master,
  the masters in parallel (one thread each, as the store does; the same
  pipelines one master after another are printed beside it);
* prefetch (Redis): how long ``allocate`` waits after ``pool.prefetch`` of
  the prompt was started earlier, while the engine ran decode steps
  (``decode_step_ms`` of sleep each): allocated one step after the
  prefetch started (it takes what arrived and loads the rest), and
  allocated at the first step at which the prefetch is done (the scheduler
  pattern of docs/stores.md), against the same allocate without prefetch;
* each against recomputing the prefix with the demo model
  (kvcore.cli.model.TinyTransformer.forward_full; its KV is smaller, so this
  says what a hit saves, not a like-for-like speed).

Every time is median [min-max] of the samples of one run; a ratio is
baseline median / kvcore median (1.0: as fast as the baseline).  The Redis
rows need redis-py and redis-server (the cluster row redis-cli too) and are
skipped, and said so, without them.
"""
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import numpy as np

import kvcore
from kvcore.stores import _format

from ._timing import ratio_text, samples, table

BLOCK = 16
PREFETCH_STEP = 16      # kvcore._pool_stores.PREFETCH_STEP: blocks a prefetch holds at once


def _stat(s):
    return {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}


def _ms(st):
    return (f"{st['median_s'] * 1e3:.1f} ms [{st['min_s'] * 1e3:.1f}-"
            f"{st['max_s'] * 1e3:.1f}]")


def _gbs(nbytes, st):
    # the fastest sample is the max GB/s
    return (f"{nbytes / st['median_s'] / 1e9:.2f} GB/s [{nbytes / st['max_s'] / 1e9:.2f}-"
            f"{nbytes / st['min_s'] / 1e9:.2f}]")


def _pool(tokens, layers, heads, dim, stores, spare=0):
    return kvcore.BlockPool(tokens // BLOCK + 2 + spare, BLOCK, layers, heads, dim,
                            dtype="float16", stores=stores)


def _fill(pool, prompt, rng):
    """Compute (random) KV for the prompt, then write it to the pool's store."""
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(prompt)
    n = len(prompt)
    for layer in range(pool.num_layers):
        k = rng.standard_normal((n, pool.num_kv_heads, pool.head_dim)).astype(np.float16)
        seq.append(layer, k, k)
    seq.commit(n)
    table_ = seq.block_table
    seq.free()
    written = pool.flush_to_stores()
    assert written == (n - 1) // BLOCK, written
    return pool.storage[:, table_[:written]].copy()


def _restore_fn(pool, prompt, expect):
    state = {}

    def setup():
        if "seq" in state:
            state.pop("seq").free()
        pool.reset_prefix_cache()

    def restore():
        seq = kvcore.PagedKVCache(pool)
        state["hit"] = seq.allocate(prompt)
        state["seq"] = seq

    def check():
        assert state["hit"] == len(prompt) - 1, state["hit"]
        got = pool.storage[:, state["seq"].block_table[:expect.shape[1]]]
        assert np.array_equal(got, expect), "restored KV differs"

    return setup, restore, check


def _spill_samples(pool, prompt, setup, repeat):
    """Seconds an allocate of a fresh prompt takes that evicts the cached
    prefix into the pool's stores (what the allocating thread pays)."""
    other = np.arange(10**6, 10**6 + len(prompt), dtype=np.int32)

    def cache_prefix():
        setup()
        pool.flush_to_stores()   # (the previous sample's spill written, off the clock)
        seq = kvcore.PagedKVCache(pool)
        assert seq.allocate(prompt) == len(prompt) - 1    # restored: cached again
        seq.free()

    def evict():
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(other)
        seq.free()

    out = _stat(samples(evict, repeat, warmup=1, before=cache_prefix))
    pool.flush_to_stores()
    return out


def _prefetch_rows(pool, prompt, setup, restore, check, step, repeat):
    """allocate after a prefetch started one decode step earlier, and once
    it is done (polled once per step), against allocate alone (seconds)."""
    one_step, when_ready, steps, alone = [], [], [], []
    for i in range(repeat + 1):          # the first is a warm-up; the three interleaved
        for out in (alone, one_step, when_ready):
            setup()
            h = None if out is alone else pool.prefetch(prompt)
            n = 0
            while h is not None:
                time.sleep(step)         # the engine's decode step
                n += 1
                if out is one_step or h.done():
                    break
            t = samples(restore, repeat=1, warmup=0)
            check()
            if h is not None:
                assert h.wait(60)
            if i:
                out += t
                if out is when_ready:
                    steps.append(n)
    setup()
    return {"alone": _stat(alone), "one_step": _stat(one_step),
            "when_ready": _stat(when_ready), "steps_median": statistics.median(steps),
            "steps_min": min(steps), "steps_max": max(steps), "step_ms": step * 1e3}


def _row(kv, base, name):
    kv, base = _stat(kv), _stat(base)
    return {"kvcore": kv, "baseline": base, "baseline_name": name,
            "ratio": base["median_s"] / kv["median_s"]}


def _wait_ping(client):
    import redis

    for _ in range(500):
        try:
            client.ping()
            return
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)


def _free_ports(n):
    import socket

    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _start_redis(binary, directory):
    import redis

    (port,) = _free_ports(1)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", directory],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    _wait_ping(client)
    return proc, f"redis://127.0.0.1:{port}/0", client


def _start_cluster(binary, cli, directory, masters=3):
    """A Redis Cluster of ``masters`` masters on loopback: (procs, ports)."""
    import redis

    ports = _free_ports(2 * masters)     # a port and a cluster bus port each
    procs = []
    for port, bus in zip(ports[:masters], ports[masters:]):
        d = os.path.join(directory, f"node-{port}")
        os.makedirs(d)
        procs.append(subprocess.Popen(
            [binary, "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--save", "",
             "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
    ports = ports[:masters]
    try:
        for port in ports:
            _wait_ping(redis.Redis(host="127.0.0.1", port=port))
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        for port in ports:
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(500):
                if client.execute_command("CLUSTER INFO")["cluster_state"] == "ok":
                    break
                time.sleep(0.02)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    return procs, ports


def _redis_tools(redis_server, need_cli=False):
    """(redis-server, redis-cli) paths, or None when a Redis row cannot run."""
    binary = redis_server or shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    try:
        import redis  # noqa: F401
    except ImportError:
        return None
    if not binary or (need_cli and not cli):
        return None
    return binary, cli


def _checksum_row(tokens, layers, heads, dim, repeat):
    """The checksum's own speed over the prefix's bytes, beside a memcpy."""
    from ...backends.cpu import _checksum

    blocks = tokens // BLOCK
    chunk = BLOCK * dim * 2                    # one block of one (layer, K/V, head) plane
    planes = 2 * layers * heads
    nbytes = blocks * planes * chunk
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)           # touched, as a pool's blocks are
    payloads = [src[b * planes * chunk:(b + 1) * planes * chunk] for b in range(blocks)]
    parts = [(dst, [b * chunk for b in range(blocks)], planes, chunk, blocks * chunk)]
    seeds = list(range(blocks))
    threads = kvcore.get_num_threads()
    out = {"bytes": nbytes, "threads": threads}
    timed = {
        "memcpy": lambda: np.copyto(dst, src),
        "xxh3": lambda: _checksum.xxh3_64(src),
        "copy_xxh3": lambda: _checksum.copy_xxh3_many(payloads, parts, seeds, threads),
        "copy_xxh3_1": lambda: _checksum.copy_xxh3_many(payloads, parts, seeds, 1),
    }
    # interleaved sample by sample: the load of a shared machine drifts
    got = {k: [] for k in timed}
    for i in range(repeat + 1):
        for k, fn in timed.items():
            s = samples(fn, repeat=1, warmup=0)
            if i:
                got[k] += s
    out.update({k: _stat(v) for k, v in got.items()})
    return out


def _host_rows(res, tokens, layers, heads, dim, nbytes, prompt, rng, repeat):
    pool = _pool(tokens, layers, heads, dim, [kvcore.HostStore(2 * nbytes)])
    expect = _fill(pool, prompt, rng)
    setup, restore, check = _restore_fn(pool, prompt, expect)
    kv = samples(restore, repeat, warmup=1, before=setup)
    check()
    setup()
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    base = samples(lambda: np.copyto(dst, src), repeat, warmup=1)
    res["rows"]["host"] = _row(kv, base, "memcpy")
    # spill: the cached prefix evicted into the HostStore by a fresh prompt
    # (export, identity digests, encode, checksum, put)
    res["host_spill"] = _spill_samples(pool, prompt, setup, repeat)
    # the same bytes scattered into the pool's blocks by NumPy, nothing
    # checked: what the block layout (a block is 2 * layers pieces, one per
    # plane, num_blocks * piece bytes apart) costs any restore
    ids = np.arange(expect.shape[1])
    parts = [np.ascontiguousarray(expect[:, i]) for i in ids]

    def scatter():
        for i, part in zip(ids, parts):
            pool.storage[:, i] = part

    res["layout_copy"] = _stat(samples(scatter, repeat, warmup=1))


def _disk_rows(res, tmp, tokens, layers, heads, dim, nbytes, prompt, rng, repeat):
    d = os.path.join(tmp, "disk")
    pool = _pool(tokens, layers, heads, dim, [kvcore.DiskStore(d, 2 * nbytes)])
    expect = _fill(pool, prompt, rng)
    setup, restore, check = _restore_fn(pool, prompt, expect)
    kv = samples(restore, repeat, warmup=1, before=setup)
    check()
    setup()
    # the allocating thread's share of a spill into a DiskStore (the files
    # are written by the store worker, drained between samples)
    res["disk_spill"] = _spill_samples(pool, prompt, setup, repeat)
    setup()
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                   if f.endswith(".kve"))
    base = samples(lambda: [np.fromfile(f, np.uint8) for f in files], repeat, warmup=1)
    res["rows"]["disk"] = _row(kv, base, "numpy.fromfile of the entry files")
    # the same files read into one buffer touched beforehand, as the pool's
    # blocks are (fromfile reads into fresh allocations)
    sizes = [os.path.getsize(f) for f in files]
    buf = np.zeros(sum(sizes), np.uint8)
    starts = np.cumsum([0] + sizes).tolist()

    def readinto():
        for f, a, b in zip(files, starts, starts[1:]):
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(buf[a:b])

    res["disk_readinto"] = _stat(samples(readinto, repeat, warmup=1))
    res["disk_put"] = _disk_put_rows(tmp, rng, repeat, n=max(16, tokens // 4))


def _disk_entries(rng, n, payload, first):
    fp = _format.fingerprint("float16", BLOCK, 1, 1, payload // (4 * BLOCK), b"")
    out = []
    for i in range(first, first + n):
        h = i.to_bytes(16, "little")
        tok = np.arange(BLOCK, dtype=np.int32) + i
        value = _format.encode(fp, h, bytes(16), bytes(16), bytes(32), tok,
                               rng.integers(0, 255, payload, dtype=np.uint8))
        out.append((_format.store_key(fp, h), bytes(value)))
    return out


def _disk_put_rows(tmp, rng, repeat, n, payload=16384):
    """DiskStore.put of ``n`` entries into a store holding as many others
    (it trims them first), quiet and beside a thread spinning in Python,
    and the same files written by Python beside that thread."""
    entries = _disk_entries(rng, n, payload, 0)
    others = _disk_entries(rng, n, payload, n)
    cap = sum(len(v) for _, v in entries) + 4096
    d = os.path.join(tmp, "disk-put")
    store = kvcore.DiskStore(d, cap)

    def setup():
        store.put(others)            # full of other entries: the put trims them

    def put():
        store.put(entries)

    raw = os.path.join(tmp, "disk-raw")
    os.makedirs(raw, exist_ok=True)

    def python_writes():
        for k, v in entries:
            path = os.path.join(raw, k.hex() + ".kve")
            with open(path + ".tmp", "wb") as f:
                f.write(v)
            os.replace(path + ".tmp", path)

    keys = [k for k, _ in entries]

    def get():                       # a lookup as a pool makes it
        store.contains(keys)
        store.get(keys)

    def python_reads():
        paths = [os.path.join(raw, k.hex() + ".kve") for k in keys]
        for p in paths:
            os.lstat(p)
        for p in paths:
            with open(p, "rb") as f:
                f.read()

    out = {"entries": len(entries), "bytes": sum(len(v) for _, v in entries),
           "quiet": _stat(samples(put, repeat, warmup=1, before=setup))}
    put()
    out["get_quiet"] = _stat(samples(get, repeat, warmup=1))
    with _busy_thread():
        out["busy"] = _stat(samples(put, repeat, warmup=1, before=setup))
        out["python_busy"] = _stat(samples(python_writes, repeat, warmup=1))
        put()
        out["get_busy"] = _stat(samples(get, repeat, warmup=1))
        out["python_get_busy"] = _stat(samples(python_reads, repeat, warmup=1))
    return out


@contextlib.contextmanager
def _busy_thread():
    """A thread spinning in Python for the duration (a model's forward
    between torch calls, a request handler): every call that gives the
    GIL up waits a switch interval to get it back."""
    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            x += 1
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _redis_row(res, binary, tmp, tokens, layers, heads, dim, prompt, rng, repeat,
               decode_step_ms, with_prefetch):
    proc, url, client = _start_redis(binary, tmp)
    try:
        store = kvcore.RedisStore(url, namespace="bench", timeout=30)
        # (spare blocks: an allocate while a prefetch still holds the step it loads)
        pool = _pool(tokens, layers, heads, dim, [store], spare=PREFETCH_STEP + 1)
        expect = _fill(pool, prompt, rng)
        setup, restore, check = _restore_fn(pool, prompt, expect)
        kv = samples(restore, repeat, warmup=1, before=setup)
        check()
        setup()
        keys = client.keys(b"kvcore:bench:*")

        def raw():
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            pipe.execute()

        base = samples(raw, repeat, warmup=1)
        # a lookup as a pool makes it (contains, then get), quiet and beside
        # a busy thread, against the pipelined GET of a client with
        # redis-py's defaults (64 KiB socket reads) beside that thread
        names = [bytes.fromhex(k[len(b"kvcore:bench:"):].decode()) for k in keys]

        def lookup():
            store.contains(names)
            store.get(names)

        res["redis_lookup"] = {"entries": len(keys), "quiet": _stat(samples(lookup, repeat,
                                                                            warmup=1))}
        with _busy_thread():
            res["redis_lookup"]["busy"] = _stat(samples(lookup, repeat, warmup=1))
            res["redis_lookup"]["raw_busy"] = _stat(samples(raw, repeat, warmup=1))
        if with_prefetch:
            res["prefetch"] = _prefetch_rows(pool, prompt, setup, restore, check,
                                             decode_step_ms / 1e3, repeat)
        pool.close()
        store.close()
        return _row(kv, base, "redis-py pipelined GET")
    finally:
        proc.kill()
        proc.wait()


def _cluster_row(binary, cli, directory, prompt, rng, tokens, layers, heads, dim, repeat):
    from concurrent.futures import ThreadPoolExecutor

    import redis

    procs, ports = _start_cluster(binary, cli, directory)
    try:
        store = kvcore.RedisStore.cluster([f"127.0.0.1:{p}" for p in ports],
                                          namespace="bench", timeout=30)
        pool = _pool(tokens, layers, heads, dim, [store])
        expect = _fill(pool, prompt, rng)
        setup, restore, check = _restore_fn(pool, prompt, expect)
        # the same keys, where the cluster keeps them: each master's own
        nodes = [redis.Redis(host="127.0.0.1", port=p) for p in ports]
        owned = [n.keys(b"kvcore:bench:*") for n in nodes]
        assert sum(map(len, owned)) == expect.shape[1]

        def node_get(i):
            pipe = nodes[i].pipeline(transaction=False)
            for k in owned[i]:
                pipe.get(k)
            return pipe.execute()

        # the three interleaved, sample by sample: on a shared machine the
        # load drifts, and must not favour whichever ran last
        kv, base, serial = [], [], []
        with ThreadPoolExecutor(len(nodes)) as ex:
            for i in range(repeat + 1):          # the first is a warm-up
                for out, fn in ((kv, restore),
                                (base, lambda: list(ex.map(node_get, range(len(nodes))))),
                                (serial, lambda: [node_get(j) for j in range(len(nodes))])):
                    s = samples(fn, repeat=1, warmup=0, before=setup)
                    if i:
                        out += s
                    if fn is restore:
                        check()
        setup()
        store.close()
        row = _row(kv, base, f"pipelined GET per master ({len(ports)}), in parallel")
        row["serial"] = _stat(serial)
        row["keys_per_master"] = [len(o) for o in owned]
        return row
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


ROWS = ("checksum", "host", "disk", "redis", "prefetch", "cluster", "recompute")


def run(quick=False, tokens=None, layers=32, heads=8, dim=128, n_samples=None,
        redis_server=None, only=None, decode_step_ms=20.0):
    """One run: a dict of numbers (see the module's docstring), every row
    timed ``n_samples`` times after a warm-up.  ``only``: a subset of
    :data:`ROWS` (default: all; "prefetch" runs the Redis row too)."""
    tokens = tokens or (512 if quick else 2048)
    repeat = n_samples or (3 if quick else 5)
    if tokens % BLOCK:
        raise ValueError(f"tokens must be a multiple of {BLOCK}, got {tokens}")
    only = set(only or ROWS)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, tokens + 1, dtype=np.int32)
    nbytes = tokens * layers * heads * dim * 2 * 2
    res = {"shape": {"tokens": tokens, "layers": layers, "kv_heads": heads, "head_dim": dim,
                     "dtype": "float16", "bytes": nbytes, "block_size": BLOCK},
           "repeat": repeat, "rows": {}}
    if "checksum" in only:
        res["checksum"] = _checksum_row(tokens, layers, heads, dim, repeat)
    tmp = tempfile.mkdtemp(prefix="kvcore-bench-stores-")
    try:
        if "host" in only:
            _host_rows(res, tokens, layers, heads, dim, nbytes, prompt, rng, repeat)
        if "disk" in only:
            _disk_rows(res, tmp, tokens, layers, heads, dim, nbytes, prompt, rng, repeat)
        if only & {"redis", "prefetch"}:
            tools = _redis_tools(redis_server)
            res["rows"]["redis"] = (
                _redis_row(res, tools[0], tmp, tokens, layers, heads, dim, prompt, rng, repeat,
                           decode_step_ms, "prefetch" in only)
                if tools else {"skipped": "needs redis-server and redis-py"})
        if "cluster" in only:
            tools = _redis_tools(redis_server, need_cli=True)
            res["rows"]["cluster"] = (
                _cluster_row(tools[0], tools[1], os.path.join(tmp, "cluster"), prompt, rng,
                             tokens, layers, heads, dim, repeat)
                if tools else {"skipped": "needs redis-server, redis-cli and redis-py"})
        if "recompute" in only:
            from ..model import ModelConfig, TinyTransformer

            model = TinyTransformer(ModelConfig(), seed=0)
            n = min(tokens, model.config.max_position)
            demo_prompt = prompt[:n] % model.config.vocab_size
            # seconds a sample: one (no warm-up) in quick mode
            res["recompute"] = {"tokens": n, "seconds": _stat(samples(
                lambda: model.forward_full(demo_prompt), 1 if quick else min(repeat, 3),
                warmup=0 if quick else 1))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


_GOALS = {"host": 0.8, "disk": 0.8, "redis": 0.9, "cluster": 0.8}


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    sh = r["shape"]
    what = f"{sh['tokens']}-token prefix ({sh['bytes'] / 2**20:.0f} MiB)"
    out = []
    ck = r.get("checksum")
    if ck:
        n = ck["bytes"]
        out.append((f"checksum XXH3-64 of a {what}", _gbs(n, ck["xxh3"]),
                    f"{_gbs(n, ck['memcpy'])} (memcpy)",
                    ratio_text(ck["memcpy"]["median_s"] / ck["xxh3"]["median_s"])))
        out.append((f"copy+XXH3-64 into the pool's blocks ({ck['threads']} threads)",
                    _gbs(n, ck["copy_xxh3"]), f"{_gbs(n, ck['memcpy'])} (memcpy)",
                    ratio_text(ck["memcpy"]["median_s"] / ck["copy_xxh3"]["median_s"])))
    for name, row in r["rows"].items():
        if "skipped" in row:
            out.append((f"restore from {name}", f"skipped: {row['skipped']}", "", ""))
            continue
        out.append((f"restore a {what} from {name}", _ms(row["kvcore"]),
                    f"{_ms(row['baseline'])} ({row['baseline_name']})",
                    f"{row['ratio']:.2f}x"))
    pf = r.get("prefetch")
    if pf:
        out.append((f"allocate one decode step after prefetch (Redis, {what})",
                    _ms(pf["one_step"]), f"{_ms(pf['alone'])} (allocate without prefetch)",
                    f"{pf['alone']['median_s'] / pf['one_step']['median_s']:.2f}x"))
    return out


def report(r):
    sh = r["shape"]
    lines = [f"restore a {sh['tokens']}-token prefix: {sh['layers']} layers, {sh['kv_heads']} KV "
             f"heads, head_dim {sh['head_dim']}, {sh['dtype']}, blocks of {sh['block_size']}: "
             f"{sh['bytes'] / 2**20:.0f} MiB; median [min-max] of {r['repeat']} samples", ""]
    ck = r.get("checksum")
    if ck:
        n = ck["bytes"]
        lines.append(table([
            ("memcpy (numpy.copyto)", _gbs(n, ck["memcpy"]), "1.00x"),
            ("XXH3-64 (format 3), nothing copied", _gbs(n, ck["xxh3"]),
             f"{ck['memcpy']['median_s'] / ck['xxh3']['median_s']:.2f}x"),
            (f"copy+XXH3-64 into the block layout, {ck['threads']} threads",
             _gbs(n, ck["copy_xxh3"]),
             f"{ck['memcpy']['median_s'] / ck['copy_xxh3']['median_s']:.2f}x"),
            ("copy+XXH3-64 into the block layout, 1 thread", _gbs(n, ck["copy_xxh3_1"]),
             f"{ck['memcpy']['median_s'] / ck['copy_xxh3_1']['median_s']:.2f}x"),
        ], ("checksum", "GB/s", "vs memcpy")))
        lines.append("")
    body = []
    for name, row in r["rows"].items():
        if "skipped" in row:
            body.append((name, f"skipped: {row['skipped']}", "", "", ""))
            continue
        goal = _GOALS.get(name)
        body.append((name, _ms(row["kvcore"]), _ms(row["baseline"]), f"{row['ratio']:.2f}x",
                     f">= {goal}x: {'met' if row['ratio'] >= goal else 'not met'}"
                     if goal else ""))
    if body:
        lines.append(table(body, ("store", "kvcore restore", "baseline", "ratio", "goal")))
        for name, row in r["rows"].items():
            if "skipped" not in row:
                lines.append(f"  {name}: baseline is {row['baseline_name']}")
    host = r["rows"].get("host")
    if host and r.get("host_spill"):
        lines.append(f"  (spill of the prefix into the HostStore, evicted by a fresh prompt: "
                     f"{_ms(r['host_spill'])})")
    if host and r.get("layout_copy"):
        lines.append(f"  (the same bytes copied into the pool's blocks by NumPy, nothing "
                     f"checked: {_ms(r['layout_copy'])}; host restore is "
                     f"{r['layout_copy']['median_s'] / host['kvcore']['median_s']:.2f}x that)")
    disk = r["rows"].get("disk")
    if disk and r.get("disk_readinto"):
        lines.append(f"  (the entry files read into one pre-touched buffer: "
                     f"{_ms(r['disk_readinto'])}; disk restore is "
                     f"{r['disk_readinto']['median_s'] / disk['kvcore']['median_s']:.2f}x that)")
    cl = r["rows"].get("cluster")
    if cl and "serial" in cl:
        lines.append(f"  (the same per-master pipelines one master after another: "
                     f"{_ms(cl['serial'])}; cluster restore is "
                     f"{cl['serial']['median_s'] / cl['kvcore']['median_s']:.2f}x that; keys "
                     f"per master {cl['keys_per_master']})")
    dp = r.get("disk_put")
    if dp:
        lines.append(f"  DiskStore.put of {dp['entries']} entries of "
                     f"{dp['bytes'] // dp['entries'] // 1024} KiB into a full store (a trim "
                     f"first): {_ms(dp['quiet'])}; beside a thread busy in Python "
                     f"{_ms(dp['busy'])}, where Python's open/write/os.replace of the same "
                     f"files takes {_ms(dp['python_busy'])} "
                     f"({dp['python_busy']['median_s'] / dp['busy']['median_s']:.1f}x the put)")
        lines.append(f"  DiskStore.contains + get of them: {_ms(dp['get_quiet'])}; beside the "
                     f"busy thread {_ms(dp['get_busy'])}, where Python's lstat, open/read of "
                     f"the same files takes {_ms(dp['python_get_busy'])} "
                     f"({dp['python_get_busy']['median_s'] / dp['get_busy']['median_s']:.1f}x "
                     f"the get)")
    rl = r.get("redis_lookup")
    if rl:
        lines.append(f"  RedisStore.contains + get of the prefix's {rl['entries']} entries: "
                     f"{_ms(rl['quiet'])}; beside a thread busy in Python {_ms(rl['busy'])}, "
                     f"where redis-py's pipelined GET with its default 64 KiB reads takes "
                     f"{_ms(rl['raw_busy'])} "
                     f"({rl['raw_busy']['median_s'] / rl['busy']['median_s']:.1f}x the lookup)")
    if r.get("disk_spill"):
        lines.append(f"  (spill of the prefix into the DiskStore on the allocating thread, the "
                     f"files written by the store worker: {_ms(r['disk_spill'])})")
    pf = r.get("prefetch")
    if pf:
        alone = pf["alone"]["median_s"]
        lines.append(f"prefetch (Redis; decode step {pf['step_ms']:.0f} ms of sleep): allocate "
                     f"without prefetch {_ms(pf['alone'])}")
        lines.append(f"  allocate one step after prefetch() {_ms(pf['one_step'])} = "
                     f"{pf['one_step']['median_s'] / alone:.2f}x of that")
        lines.append(f"  allocate at the first step the prefetch is done "
                     f"{_ms(pf['when_ready'])} = {pf['when_ready']['median_s'] / alone:.2f}x of "
                     f"that (after {pf['steps_median']:.0f} steps [{pf['steps_min']}-"
                     f"{pf['steps_max']}])")
    rc = r.get("recompute")
    if rc:
        lines.append("")
        lines.append(f"recompute {rc['tokens']} tokens with the demo model (4 layers, 2 KV "
                     f"heads, head_dim 64, float32 math): {_ms(rc['seconds'])}")
        for name, row in r["rows"].items():
            if "skipped" not in row:
                lines.append(f"  restore from {name} is "
                             f"{rc['seconds']['median_s'] / row['kvcore']['median_s']:.1f}x "
                             f"faster than that recompute (of a larger KV)")
    lines.append("ratio = baseline median / kvcore median")
    return "\n".join(lines)
