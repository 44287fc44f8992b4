"""GPU attention against the anchor a torch user has, in the same run.

``bench/bench_gpu.py --anchor`` (and the attention part of a full run):
kvcore's paged attention (``kvcore.AttentionPlan.run`` over float16
``(key_cache, value_cache)`` planes, block size 16, shuffled blocks; q and
out float16) beside ``torch.nn.functional.scaled_dot_product_attention``
over a contiguous ``[batch, kv_heads, context, head_dim]`` float16 cache of
the same sizes (``enable_gqa=True``, the flash backend where torch has it),
8 KV heads x 128 dims:

* decode (one query per sequence), batch {1, 64} x context {4096, 32768} x
  query heads per KV head {1, 4, 8}: kvcore's kernels of this version
  ("v3") and of the previous one ("v2", ``KVCORE_CUDA_ATTENTION=v2``: q
  converted to float32 and back), float16 and e4m3fn pages (a pool of the
  same sizes), torch; the fraction of HBM each one reads at (K/V bytes over
  time against 4.8 TB/s, the H200's nominal rate, and against the same
  run's device-to-device copy rate);
* causal prefill of 4096 and 16384 tokens, 32 query / 8 KV heads, float16:
  TFLOP/s (4 x heads x dim per visible (query, key) pair) of kvcore v3, v2
  and torch.

Times are CUDA events around a batch of calls after a warm-up, medians of
the batches; "vs torch" is torch's time over kvcore's (above 1: kvcore is
faster).
"""
import numpy as np

HEADS, DIM, BLOCK_SIZE = 8, 128, 16
DECODE = ((1, 4096), (1, 32768), (64, 4096), (64, 32768))   # (batch, context)
GROUPS = (1, 4, 8)
PREFILL = (4096, 16384)
PREFILL_HEADS = 32
HBM_NOMINAL_GBPS = 4800.0   # the H200's (the rows' "of 4.8 TB/s")


def _torch_sdpa(torch):
    """``(flash, default)``: torch's SDPA with GQA as ``fn(q, k, v, causal)``,
    on the flash backend, and with torch's own choice of backend."""
    F = torch.nn.functional
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:   # an old torch: its default dispatch only
        def plain(q, k, v, causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return plain, plain

    def flash(q, k, v, causal):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def default(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return flash, default


def _fill_normal(cp, a, rng_seed):
    """``a`` (float16) filled with standard normal values, a slice at a time
    (no float32 copy of the whole array)."""
    g = cp.random.default_rng(rng_seed)
    flat = a.reshape(a.shape[0], -1)
    step = max(1, (64 << 20) // max(1, flat.shape[1] * 4))
    for i in range(0, flat.shape[0], step):
        flat[i:i + step] = g.standard_normal(flat[i:i + step].shape, dtype=cp.float32)


def _fill_codes(cp, flat):
    """``flat`` (uint8 rows) filled with random e4m3fn codes other than the
    NaN ones (0x7f / 0xff), a slice at a time."""
    step = max(1, (64 << 20) // flat.shape[1])
    for i in range(0, flat.shape[0], step):
        part = cp.random.randint(0, 256, size=flat[i:i + step].shape, dtype=cp.uint8)
        part[(part & 0x7f) == 0x7f] ^= 1
        flat[i:i + step] = part


def run(be, cp, torch, time_fn, ceiling_gbps):
    """The anchor rows: a list of dicts (see ``report_lines``).
    ``time_fn(fn, calls)`` returns the median seconds per call of ``fn``
    (CUDA events); ``torch`` is None when torch with CUDA is missing."""
    import kvcore

    rows = []
    rng = np.random.default_rng(0)
    dev = be.device
    versions = (3, 2)
    saved = be.attention_version
    tdev = f"cuda:{be.device_id}"
    sdpa = None
    if torch is not None:
        flash, default = _torch_sdpa(torch)
        sdpa = flash

    def torch_time(fn, calls):
        nonlocal sdpa
        try:
            return time_fn(fn, calls), ("flash" if sdpa is flash else "default")
        except RuntimeError:    # no flash kernel for these inputs: torch's own choice
            if sdpa is flash:
                sdpa = default
                try:
                    return time_fn(fn, calls), "default"
                finally:
                    sdpa = flash
            raise

    try:
        for batch, context in DECODE:
            per_seq = context // BLOCK_SIZE
            nblk = batch * per_seq + 1
            shape = (nblk, HEADS, BLOCK_SIZE, DIM)
            k = cp.empty(shape, cp.float16)
            v = cp.empty(shape, cp.float16)
            _fill_normal(cp, k, 1)
            _fill_normal(cp, v, 2)
            pool = kvcore.BlockPool(nblk, BLOCK_SIZE, 1, HEADS, DIM, dtype="float8_e4m3fn",
                                    kv_scales=[(1.0, 1.0)], device=dev)
            _fill_codes(cp, pool.storage.reshape(-1, BLOCK_SIZE * DIM))
            tables = rng.permutation(nblk - 1)[:batch * per_seq].astype(np.int32)
            tables = tables.reshape(batch, per_seq)
            lens = np.full(batch, context, np.int64)
            qsl = np.arange(batch + 1, dtype=np.int64)
            if torch is not None:
                tk = torch.randn((batch, HEADS, context, DIM), dtype=torch.float16, device=tdev)
                tv = torch.randn((batch, HEADS, context, DIM), dtype=torch.float16, device=tdev)
            kv_bytes = 2 * batch * context * HEADS * DIM * 2
            calls = 20 if batch == 1 else 10
            for group in GROUPS:
                heads = HEADS * group
                q = cp.empty((batch, heads, DIM), cp.float16)
                _fill_normal(cp, q, 3)
                out = cp.empty_like(q)
                r = {"op": "decode", "batch": batch, "context": context, "group": group,
                     "kv_bytes": kv_bytes}
                for ver in versions:
                    be.attention_version = ver
                    plan = kvcore.AttentionPlan((k, v), tables, lens, qsl, num_heads=heads)
                    r[f"v{ver}_s"] = time_fn(lambda: plan.run(q, 0, out), calls)
                be.attention_version = 3
                plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=heads)
                r["e4m3_s"] = time_fn(lambda: plan.run(q, 0, out), calls)
                if torch is not None:
                    tq = torch.randn((batch, heads, 1, DIM), dtype=torch.float16, device=tdev)
                    r["torch_s"], r["torch_backend"] = torch_time(
                        lambda: sdpa(tq, tk, tv, False), calls)
                rows.append(r)
            del k, v, pool, plan, q, out
            if torch is not None:
                del tk, tv
                torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()

        for n in PREFILL:
            shape = (n // BLOCK_SIZE, HEADS, BLOCK_SIZE, DIM)
            k = cp.empty(shape, cp.float16)
            v = cp.empty(shape, cp.float16)
            _fill_normal(cp, k, 4)
            _fill_normal(cp, v, 5)
            q = cp.empty((n, PREFILL_HEADS, DIM), cp.float16)
            _fill_normal(cp, q, 6)
            out = cp.empty_like(q)
            table = rng.permutation(n // BLOCK_SIZE).astype(np.int32)[None]
            lens, qsl = np.array([n], np.int64), np.array([0, n], np.int64)
            flops = 4 * PREFILL_HEADS * DIM * n * (n + 1) / 2
            r = {"op": "prefill", "batch": 1, "context": n, "group": PREFILL_HEADS // HEADS,
                 "flops": flops}
            calls = 3 if n > 8192 else 5
            for ver in versions:
                be.attention_version = ver
                plan = kvcore.AttentionPlan((k, v), table, lens, qsl, num_heads=PREFILL_HEADS)
                r[f"v{ver}_s"] = time_fn(lambda: plan.run(q, 0, out), calls)
            if torch is not None:
                tq = torch.randn((1, PREFILL_HEADS, n, DIM), dtype=torch.float16, device=tdev)
                tk = torch.randn((1, HEADS, n, DIM), dtype=torch.float16, device=tdev)
                tv = torch.randn((1, HEADS, n, DIM), dtype=torch.float16, device=tdev)
                r["torch_s"], r["torch_backend"] = torch_time(
                    lambda: sdpa(tq, tk, tv, True), calls)
                del tq, tk, tv
            rows.append(r)
            del k, v, q, out, plan
    finally:
        be.attention_version = saved
    for r in rows:
        r["ceiling_gbps"] = ceiling_gbps
    return rows


def _us(x):
    return f"{x * 1e6:.1f}" if x is not None else "-"


def _ratio(a, b):
    return f"{b / a:.2f}x" if a and b else "-"


def report_lines(rows):
    """Markdown: one line per decode / prefill case."""
    out = ["Attention against torch SDPA (same run; q, out float16; 8 KV heads x 128; "
           "\"vs torch\": torch's time / kvcore's; HBM: K/V bytes read per second over "
           f"{HBM_NOMINAL_GBPS / 1000:.1f} TB/s and over the run's copy rate)", "",
           "| case | group | kvcore v3 us | v2 us | e4m3 v3 us | torch us | v3 vs torch "
           "| v3 vs v2 | e4m3 vs f16 | v3 of HBM | of copy | torch of HBM |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t3, t2, te, tt = (r.get(k) for k in ("v3_s", "v2_s", "e4m3_s", "torch_s"))
        if r["op"] == "decode":
            case = f"decode b{r['batch']} x {r['context'] // 1024}k"
            gbps = r["kv_bytes"] / t3 / 1e9
            hbm = f"{gbps / HBM_NOMINAL_GBPS:.0%}"
            copy = f"{gbps / r['ceiling_gbps']:.0%}"
            thbm = f"{r['kv_bytes'] / tt / 1e9 / HBM_NOMINAL_GBPS:.0%}" if tt else "-"
        else:
            case = f"prefill causal {r['context'] // 1024}k ({r['flops'] / t3 / 1e12:.0f} TF/s" \
                + (f"; torch {r['flops'] / tt / 1e12:.0f})" if tt else ")")
            hbm = copy = thbm = "-"
        out.append(f"| {case} | {r['group']} | {_us(t3)} | {_us(t2)} | {_us(te)} | {_us(tt)} "
                   f"| {_ratio(t3, tt)} | {_ratio(t3, t2)} | {_ratio(te, t3)} | {hbm} | {copy} "
                   f"| {thbm} |")
    backends = sorted({r["torch_backend"] for r in rows if "torch_backend" in r})
    if backends:
        out.append(f"\ntorch SDPA backend asked for: {', '.join(backends)}")
    return out
