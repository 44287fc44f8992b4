"""Prefix-store restore benchmark: python bench/bench_stores.py [--tokens N] [--layers N]
[--repeat N] [--redis-server PATH] [--cluster-only] [--prefetch-only]
[--decode-step-ms MS] [--json FILE]

Restores an N-token prefix (default 2048 tokens of a 32-layer, 8-KV-head,
head_dim-128 float16 model: 128 KiB a token, 256 MiB) into an empty pool
with ``PagedKVCache.allocate`` (lookup, fetch, verify every entry's
identity and checksum, copy into the pool, register) from each store, and
measures in the same run what moving the same bytes costs without kvcore
(and, for the HostStore, what spilling the prefix into it costs):

* HostStore  vs  a plain memcpy (numpy.copyto) of the same number of bytes;
* DiskStore (page cache warm)  vs  numpy.fromfile of the same entry files;
* RedisStore on loopback  vs  one raw redis-py pipelined GET of the same keys;
* RedisStore on a 3-master Redis Cluster on loopback (``RedisStore.cluster``)
  vs  raw redis-py pipelined GETs of the same keys, one pipeline per master,
  the masters in parallel (one thread each, as the store does; the same
  pipelines one master after another are printed beside it);
* prefetch (Redis): how long ``allocate`` waits after ``pool.prefetch`` of
  the prompt was started earlier, while the engine ran decode steps
  (``--decode-step-ms`` of sleep each): allocated one step after the
  prefetch started (it takes what arrived and loads the rest), and
  allocated at the first step at which the prefetch is done (the scheduler
  pattern of docs/stores.md), against the same allocate without prefetch;
* each against recomputing the prefix with the demo model
  (kvcore.cli.model.TinyTransformer.forward_full over the N tokens; its KV
  is smaller, so this says what a hit saves, not a like-for-like speed).

Every time is median [min-max] over --repeat runs; a ratio is baseline
seconds / kvcore seconds (1.0: as fast as the baseline).  Needs redis-py
and redis-server for the Redis rows, and redis-cli for the cluster row
(skipped, and said so, without them).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvcore
from kvcore.cli.model import ModelConfig, TinyTransformer

BLOCK = 16
PREFETCH_STEP = 16      # kvcore.stores._tiers.PREFETCH_STEP: blocks a prefetch holds at once


def _samples(fn, repeat, setup=None):
    out = []
    for i in range(repeat + 1):          # the first is a warm-up
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _fmt(s):
    return f"{statistics.median(s) * 1e3:8.1f} ms [{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}]"


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
    table = seq.block_table
    seq.free()
    written = pool.flush_to_stores()
    assert written == (n - 1) // BLOCK, written
    return pool.storage[:, table[:written]].copy()


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

    out = _samples(evict, repeat, cache_prefix)
    pool.flush_to_stores()
    return out


def _restore_fn(pool, prompt, expect):
    state = {}

    def setup():
        if "seq" in state:
            state.pop("seq").free()
        pool.reset_prefix_cache()

    def restore():
        seq = kvcore.PagedKVCache(pool)
        hit = seq.allocate(prompt)
        state["seq"] = seq
        state["hit"] = hit

    def check():
        setup_hit = state["hit"]
        assert setup_hit == len(prompt) - 1, setup_hit
        got = pool.storage[:, state["seq"].block_table[:expect.shape[1]]]
        assert np.array_equal(got, expect), "restored KV differs"

    return setup, restore, check


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
            t0 = time.perf_counter()
            restore()
            t = time.perf_counter() - t0
            check()
            if h is not None:
                assert h.wait(60)
            if i:
                out.append(t)
                if out is when_ready:
                    steps.append(n)
    setup()
    return {"alone": alone, "one_step": one_step, "when_ready": when_ready,
            "steps": steps, "step_ms": step * 1e3}


def _start_redis(binary, directory):
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", directory],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0", client


def _redis_or_none(redis_server, tmp, prompt, rng, tokens, layers, heads, dim, repeat, res,
                   decode_step_ms):
    """The Redis row (and res["prefetch"]), or None without redis-server or redis-py."""
    binary = redis_server or shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        return None
    if not binary:
        return None
    proc, url, client = _start_redis(binary, tmp)
    try:
        store = kvcore.RedisStore(url, namespace="bench", timeout=30)
        # (spare blocks: an allocate while a prefetch still holds the step it loads)
        pool = _pool(tokens, layers, heads, dim, [store], spare=PREFETCH_STEP + 1)
        expect = _fill(pool, prompt, rng)
        setup, restore, check = _restore_fn(pool, prompt, expect)
        kv = _samples(restore, repeat, setup)
        check()
        setup()
        keys = client.keys(b"kvcore:bench:*")

        def raw():
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            pipe.execute()

        base = _samples(raw, repeat)
        res["prefetch"] = _prefetch_rows(pool, prompt, setup, restore, check,
                                         decode_step_ms / 1e3, repeat)
        pool.close()
        store.close()
        del pool
        return {"kvcore": kv, "baseline": base, "baseline_name": "redis-py pipelined GET"}
    finally:
        proc.kill()
        proc.wait()


def _start_cluster(binary, cli, directory, masters=3):
    """A Redis Cluster of ``masters`` masters on loopback: (procs, ports)."""
    import socket

    import redis

    ports, socks = [], []
    for _ in range(2 * masters):         # a port and a cluster bus port each
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
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
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
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


def _cluster_or_none(redis_server, tmp, prompt, rng, tokens, layers, heads, dim, repeat):
    """The cluster row, or None without redis-server, redis-cli or redis-py."""
    binary = redis_server or shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    try:
        import redis  # noqa: F401
    except ImportError:
        binary = None
    if not binary or not cli:
        return None
    return _cluster_row(binary, cli, os.path.join(tmp, "cluster"), prompt, rng, tokens,
                        layers, heads, dim, repeat)


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
                    setup()
                    t0 = time.perf_counter()
                    fn()
                    if i:
                        out.append(time.perf_counter() - t0)
                    if fn is restore:
                        check()
        setup()
        store.close()
        del pool
        return {"kvcore": kv, "baseline": base,
                "baseline_name": f"pipelined GET per master ({len(ports)}), in parallel",
                "serial": serial, "keys_per_master": [len(o) for o in owned]}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run(tokens=2048, layers=32, heads=8, dim=128, repeat=5, redis_server=None,
        cluster_only=False, prefetch_only=False, decode_step_ms=20.0):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, tokens + 1, dtype=np.int32)
    nbytes = tokens * layers * heads * dim * 2 * 2
    res = {"shape": {"tokens": tokens, "layers": layers, "kv_heads": heads, "head_dim": dim,
                     "dtype": "float16", "bytes": nbytes, "block_size": BLOCK},
           "rows": {}}
    tmp = tempfile.mkdtemp(prefix="kvcore-bench-stores-")
    if cluster_only:
        try:
            res["rows"]["cluster"] = _cluster_or_none(redis_server, tmp, prompt, rng, tokens,
                                                      layers, heads, dim, repeat)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return res
    try:
        if prefetch_only:
            res["rows"]["redis"] = _redis_or_none(redis_server, tmp, prompt, rng, tokens,
                                                  layers, heads, dim, repeat, res,
                                                  decode_step_ms)
            return res
        # --- host
        pool = _pool(tokens, layers, heads, dim, [kvcore.HostStore(2 * nbytes)])
        expect = _fill(pool, prompt, rng)
        setup, restore, check = _restore_fn(pool, prompt, expect)
        kv = _samples(restore, repeat, setup)
        check()
        setup()
        src = np.empty(nbytes, np.uint8)
        src[:] = 1
        dst = np.empty_like(src)
        base = _samples(lambda: np.copyto(dst, src), repeat)
        res["rows"]["host"] = {"kvcore": kv, "baseline": base, "baseline_name": "memcpy"}
        # spill: the cached prefix evicted into the HostStore by a fresh
        # prompt (export, identity digests, encode, checksum, put)
        res["host_spill"] = _spill_samples(pool, prompt, setup, repeat)
        # the same bytes scattered into the pool's blocks by NumPy, nothing
        # checked: what the block layout (a block is 2 * layers pieces, one
        # per plane, num_blocks * piece bytes apart) costs any restore
        ids = np.arange(expect.shape[1])
        parts = [np.ascontiguousarray(expect[:, i]) for i in ids]

        def scatter():
            for i, part in zip(ids, parts):
                pool.storage[:, i] = part

        res["layout_copy"] = _samples(scatter, repeat)
        del pool, src, dst, parts

        # --- disk
        d = os.path.join(tmp, "disk")
        pool = _pool(tokens, layers, heads, dim, [kvcore.DiskStore(d, 2 * nbytes)])
        expect = _fill(pool, prompt, rng)
        setup, restore, check = _restore_fn(pool, prompt, expect)
        kv = _samples(restore, repeat, setup)
        check()
        setup()
        # the allocating thread's share of a spill into a DiskStore (the
        # files are written by the store worker, drained between samples)
        res["disk_spill"] = _spill_samples(pool, prompt, setup, repeat)
        setup()
        files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                       if f.endswith(".kve"))
        base = _samples(lambda: [np.fromfile(f, np.uint8) for f in files], repeat)
        res["rows"]["disk"] = {"kvcore": kv, "baseline": base,
                               "baseline_name": "numpy.fromfile of the entry files"}
        # the same files read into one buffer touched beforehand, as the
        # pool's blocks are (fromfile reads into fresh allocations)
        sizes = [os.path.getsize(f) for f in files]
        buf = np.zeros(sum(sizes), np.uint8)
        starts = np.cumsum([0] + sizes).tolist()

        def readinto():
            for f, a, b in zip(files, starts, starts[1:]):
                with open(f, "rb", buffering=0) as fh:
                    fh.readinto(buf[a:b])

        res["disk_readinto"] = _samples(readinto, repeat)
        del buf
        del pool

        # --- redis
        res["rows"]["redis"] = _redis_or_none(redis_server, tmp, prompt, rng, tokens, layers,
                                              heads, dim, repeat, res, decode_step_ms)

        # --- redis cluster
        res["rows"]["cluster"] = _cluster_or_none(redis_server, tmp, prompt, rng, tokens,
                                                  layers, heads, dim, repeat)

        # --- recompute with the demo model
        model = TinyTransformer(ModelConfig(), seed=0)
        n = min(tokens, model.config.max_position)
        demo_prompt = prompt[:n] % model.config.vocab_size
        res["recompute"] = {"tokens": n, "seconds": _samples(
            lambda: model.forward_full(demo_prompt), max(1, min(repeat, 3)))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def report(res):
    sh = res["shape"]
    lines = [f"restore a {sh['tokens']}-token prefix: {sh['layers']} layers, {sh['kv_heads']} KV "
             f"heads, head_dim {sh['head_dim']}, {sh['dtype']}, blocks of {sh['block_size']}: "
             f"{sh['bytes'] / 2**20:.0f} MiB", "",
             f"{'store':8} {'kvcore restore':30} {'baseline':30} {'ratio':>6}  baseline is",
             "-" * 100]
    for name, row in res["rows"].items():
        if row is None:
            lines.append(f"{name:8} (skipped: needs redis-server and redis-py"
                         f"{', and redis-cli' if name == 'cluster' else ''})")
            continue
        ratio = statistics.median(row["baseline"]) / statistics.median(row["kvcore"])
        lines.append(f"{name:8} {_fmt(row['kvcore']):30} {_fmt(row['baseline']):30} "
                     f"{ratio:5.2f}x  {row['baseline_name']}")
    if res.get("host_spill"):
        lines.append(f"{'':8} (spill of the prefix into the HostStore, evicted by a fresh "
                     f"prompt: {_fmt(res['host_spill']).strip()})")
    if "layout_copy" in res:
        lines.append(f"{'':8} (the same bytes copied into the pool's blocks by NumPy, nothing "
                     f"checked: {_fmt(res['layout_copy']).strip()}; host restore is "
                     f"{statistics.median(res['layout_copy']) / statistics.median(res['rows']['host']['kvcore']):.2f}x that)")
    if res.get("disk_spill"):
        lines.append(f"{'':8} (spill of the prefix into the DiskStore on the allocating thread, "
                     f"the files written by the store worker: "
                     f"{_fmt(res['disk_spill']).strip()})")
    if res.get("disk_readinto") and res["rows"].get("disk"):
        lines.append(f"{'':8} (the entry files read into one pre-touched buffer: "
                     f"{_fmt(res['disk_readinto']).strip()}; disk restore is "
                     f"{statistics.median(res['disk_readinto']) / statistics.median(res['rows']['disk']['kvcore']):.2f}x that)")
    if res["rows"].get("cluster"):
        row = res["rows"]["cluster"]
        lines.append(f"{'':8} (the same per-master pipelines one master after another: "
                     f"{_fmt(row['serial']).strip()}; cluster restore is "
                     f"{statistics.median(row['serial']) / statistics.median(row['kvcore']):.2f}x "
                     f"that; keys per master {row['keys_per_master']})")
    pf = res.get("prefetch")
    if pf:
        alone = statistics.median(pf["alone"])
        lines.append(f"prefetch (Redis; decode step {pf['step_ms']:.0f} ms of sleep): allocate "
                     f"without prefetch {_fmt(pf['alone']).strip()}")
        lines.append(f"{'':8} allocate one step after prefetch() {_fmt(pf['one_step']).strip()}"
                     f" = {statistics.median(pf['one_step']) / alone:.2f}x of that")
        lines.append(f"{'':8} allocate at the first step the prefetch is done "
                     f"{_fmt(pf['when_ready']).strip()} = "
                     f"{statistics.median(pf['when_ready']) / alone:.2f}x of that (after "
                     f"{statistics.median(pf['steps']):.0f} steps [{min(pf['steps'])}-"
                     f"{max(pf['steps'])}])")
    rc = res.get("recompute")
    if rc is None:
        lines.append("ratio = baseline median / kvcore median, one run; times median "
                     "[min-max] of --repeat samples")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"recompute {rc['tokens']} tokens with the demo model (4 layers, 2 KV heads, "
                 f"head_dim 64, float32 math): {_fmt(rc['seconds']).strip()}")
    for name, row in res["rows"].items():
        if row is not None:
            lines.append(f"  restore from {name} is {statistics.median(rc['seconds']) / statistics.median(row['kvcore']):.1f}x "
                         f"faster than that recompute (of a larger KV: {sh['bytes'] / 2**20:.0f} MiB)")
    lines.append("ratio = baseline median / kvcore median, one run; times median [min-max] of "
                 "--repeat samples")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--redis-server", metavar="PATH")
    p.add_argument("--cluster-only", action="store_true",
                   help="run only the Redis Cluster row")
    p.add_argument("--prefetch-only", action="store_true",
                   help="run only the Redis row and the prefetch rows")
    p.add_argument("--decode-step-ms", type=float, default=20.0,
                   help="the decode step the prefetch rows sleep per step (default 20)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    for name in ("tokens", "layers", "kv_heads", "head_dim", "repeat"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if a.tokens % BLOCK:
        p.error(f"--tokens must be a multiple of {BLOCK}")
    if not a.decode_step_ms > 0:
        p.error("--decode-step-ms must be a positive number")
    res = run(a.tokens, a.layers, a.kv_heads, a.head_dim, a.repeat, a.redis_server,
              a.cluster_only, a.prefetch_only, a.decode_step_ms)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
