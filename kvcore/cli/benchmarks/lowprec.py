"""Low-precision pools (fp8 e4m3fn / e5m2, int8 with per-token scales)
against float16 storage, in one run, one thread:

- paged write: ``BlockPool.write`` of float32 K/V (n tokens scattered over
  the pool's blocks) into each storage dtype, in Gelem/s (K and V elements);
  the ratio is the float16 write's time / this dtype's time (goal >= 0.9x);
- bytes per token at head_dim 128 (all layers, K and V, int8 scales
  included): fp8 is half of float16, int8 (128 + 4) / 256 of it;
- decode attention: ``paged_attention`` of one query token per sequence over
  each storage dtype, ``set_num_threads(1)``, in GB/s of KV read (the stored
  bytes of every visible position, int8 scales included), and the ratio of
  this dtype's GB/s to float16's (goal >= 1).

Figures are medians of repeated calls.
"""
import numpy as np

import kvcore

from ._timing import median_time, table

DTYPES = ("float16", "float8_e4m3fn", "float8_e5m2", "int8")
HEADS, DIM, BS = 8, 128, 16
Q_HEADS = 32
SEQS, CTX = 8, 2048


def _write(dtype, tokens, repeat, rng):
    pool = kvcore.BlockPool(tokens // BS * 2, BS, 1, HEADS, DIM, dtype=dtype)
    k = rng.standard_normal((tokens, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((tokens, HEADS, DIM)).astype(np.float32)
    slots = rng.permutation(pool.num_blocks * BS)[:tokens].astype(np.int64)
    t = median_time(lambda: pool.write(0, k, v, slots), repeat=repeat)
    return 2 * k.size / t / 1e9, t


def _decode(dtype, ctx, repeat, rng):
    nblk = ctx // BS
    pool = kvcore.BlockPool(nblk * SEQS, BS, 1, HEADS, DIM, dtype=dtype)
    k = rng.standard_normal((nblk * SEQS * BS, HEADS, DIM)).astype(np.float32)
    pool.write(0, k, k, np.arange(k.shape[0]))
    tables = rng.permutation(nblk * SEQS).astype(np.int32).reshape(SEQS, nblk)
    lens = np.full(SEQS, ctx, np.int64)
    q = rng.standard_normal((SEQS, Q_HEADS, DIM)).astype(np.float32)
    t = median_time(lambda: kvcore.paged_attention(q, pool, 0, tables, lens), repeat=repeat)
    per_pos = pool.bytes_per_token          # one layer: K and V, scales included
    return SEQS * ctx * per_pos / t / 1e9, t


def run(quick=False):
    rng = np.random.default_rng(7)
    tokens = 1024 if quick else 4096
    repeat = 5 if quick else 15
    ctx = 512 if quick else CTX
    previous = kvcore.set_num_threads(1)   # (the setting before: restored after)
    try:
        write = {d: _write(d, tokens, repeat, rng) for d in DTYPES}
        decode = {d: _decode(d, ctx, repeat, rng) for d in DTYPES}
    finally:
        kvcore.set_num_threads(previous)
    bpt = {d: kvcore.BlockPool(1, BS, 1, HEADS, DIM, dtype=d).bytes_per_token for d in DTYPES}
    return {
        "tokens": tokens, "ctx": ctx,
        "write_gelem_s": {d: w[0] for d, w in write.items()},
        "write_ratio_vs_f16": {d: write["float16"][1] / w[1] for d, w in write.items()},
        "bytes_per_token": bpt,
        "bytes_ratio_vs_f16": {d: bpt[d] / bpt["float16"] for d in DTYPES},
        "decode_gb_s": {d: x[0] for d, x in decode.items()},
        "decode_ratio_vs_f16": {d: x[0] / decode["float16"][0] for d, x in decode.items()},
        "decode_time_ratio_vs_f16": {d: decode["float16"][1] / x[1] for d, x in decode.items()},
    }


def report(r):
    rows = [(d, f"{r['write_gelem_s'][d]:.2f}", f"{r['write_ratio_vs_f16'][d]:.2f}x",
             str(r["bytes_per_token"][d]), f"{r['bytes_ratio_vs_f16'][d]:.3f}",
             f"{r['decode_gb_s'][d]:.2f}", f"{r['decode_ratio_vs_f16'][d]:.2f}x",
             f"{r['decode_time_ratio_vs_f16'][d]:.2f}x")
            for d in DTYPES]
    return table(rows, (
        "storage",
        f"paged write f32->dtype, {r['tokens']} tok (Gelem/s)", "vs f16 write",
        f"bytes/token (h{HEADS} d{DIM})", "vs f16",
        f"decode attn {SEQS}x{r['ctx']} (GB/s KV)", "GB/s vs f16", "speed vs f16"))


def rows(r):
    """The lines of ``python -m kvcore bench``'s table: for each low-precision
    storage dtype, its paged write, bytes per token and decode against float16
    pages in the same run."""
    out = []
    for d in DTYPES:
        if d == "float16":
            continue
        out += [
            (f"{d}: paged write f32->{d}, {r['tokens']} tok",
             f"{r['write_gelem_s'][d]:.2f} Gelem/s",
             f"{r['write_gelem_s']['float16']:.2f} Gelem/s (float16 pages)",
             f"{r['write_ratio_vs_f16'][d]:.2f}x"),
            (f"{d}: bytes per token (h{HEADS} d{DIM})", str(r["bytes_per_token"][d]),
             f"{r['bytes_per_token']['float16']} (float16 pages)",
             f"{r['bytes_ratio_vs_f16'][d]:.3f} of"),
            (f"{d}: decode {SEQS}x{r['ctx']}, GB/s of KV", f"{r['decode_gb_s'][d]:.2f} GB/s",
             f"{r['decode_gb_s']['float16']:.2f} GB/s (float16 pages)",
             f"{r['decode_ratio_vs_f16'][d]:.2f}x"),
            (f"{d}: decode {SEQS}x{r['ctx']}, time per step", "", "float16 pages",
             f"{r['decode_time_ratio_vs_f16'][d]:.2f}x"),
        ]
    return out
