"""GPU data movement: kvcore's CUDA kernels against the copy ceiling and torch.

    python bench/bench_gpu.py [--quick] [--json FILE]

Needs CuPy and an NVIDIA GPU (exits with a message otherwise); torch with
CUDA, when importable, is measured beside kvcore.  One run (under three
minutes on an H100/H200, compilation included) measures:

* the ceiling: a device-to-device copy of a 1 GiB buffer (CuPy), in the same
  run, so every other figure can be read as a fraction of it;
* paged write (``CudaBackend.write_slots``, vLLM's reshape_and_cache),
  float32 -> float16 and float16 -> float16, for 1, 64, 4096 and 65536
  tokens x 8 KV heads x 128 dims into random slots of a 131,072-slot pool
  (block size 16), beside torch's index assignment with a cast,
  ``cache[blocks, :, offsets, :] = src.to(torch.float16)``;
* gather of one 4096- and one 65536-token float16 sequence by a random block
  table into (heads, n, dim) (``CudaBackend.gather``), beside torch's
  ``cache.index_select(0, table)`` made head-major.

Storage is laid out as a pool's: (num_layers * 2, num_blocks, heads,
block_size, dim), the per-layer K plane being what the kernels receive.
Times come from CUDA events around a batch of calls after a warm-up;
figures are medians.  GB/s counts the bytes read plus the bytes written
(data, slots and tables), so it compares directly with the copy ceiling,
which also moves each byte twice.

``run(quick=False) -> dict`` measures and ``report(dict) -> str`` formats;
``main`` is this script.
"""
import statistics

import numpy as np

from kvcore.backends.cuda import CudaUnavailableError, get_cuda_backend  # noqa: F401
from kvcore.dtypes import F16, F32

HEADS, DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 128, 16, 8192
WRITE_TOKENS = (1, 64, 4096, 65536)
GATHER_TOKENS = (4096, 65536)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _median_seconds(fn, record, elapsed_ms, repeat, calls):
    """Median seconds per call of ``fn`` over ``repeat`` batches of ``calls``
    calls, each batch timed by a pair of CUDA events."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        start = record()
        for _ in range(calls):
            fn()
        stop = record()
        samples.append(elapsed_ms(start, stop) / 1e3 / calls)
    return statistics.median(samples)


def _calls_for(nbytes):
    # small transfers are launch-bound: batch enough calls to time them
    return 100 if nbytes < (1 << 20) else 10 if nbytes < (64 << 20) else 3


def _copy_seconds(cp, cp_time, nbytes):
    """Seconds for one device-to-device copy of ``nbytes`` (freed after)."""
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    return cp_time(lambda: cp.copyto(b, a), nbytes)


def run(quick=False):
    """Measure; returns a dict (see ``report``).

    Raises CudaUnavailableError without CuPy or a GPU.
    """
    be = get_cuda_backend("cuda")
    cp = be.xp
    torch = _torch_cuda()
    repeat = 7 if quick else 21
    rng = np.random.default_rng(0)

    def cp_record():
        e = cp.cuda.Event()
        e.record()
        return e

    def cp_elapsed(a, b):
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b)

    def cp_time(fn, nbytes):
        return _median_seconds(fn, cp_record, cp_elapsed, repeat, _calls_for(nbytes))

    if torch is not None:
        def t_record():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def t_elapsed(a, b):
            b.synchronize()
            return a.elapsed_time(b)

        def torch_time(fn, nbytes):
            return _median_seconds(fn, t_record, t_elapsed, repeat, _calls_for(nbytes))

    props = cp.cuda.runtime.getDeviceProperties(be.device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    out = {"device": name, "cupy": cp.__version__,
           "torch": torch.__version__ if torch is not None else None,
           "heads": HEADS, "dim": DIM, "block_size": BLOCK_SIZE, "rows": []}

    with cp.cuda.Device(be.device_id):
        # -------------------------------------------------------- ceiling
        n_copy = (256 if quick else 1024) << 20
        ceiling = 2 * n_copy / _copy_seconds(cp, cp_time, n_copy) / 1e9
        out["ceiling_gbps"] = ceiling
        out["ceiling_bytes"] = 2 * n_copy

        def row(op, tokens, nbytes, t_kv, t_torch):
            r = {"op": op, "tokens": tokens, "bytes": nbytes, "kvcore_s": t_kv,
                 "kvcore_gbps": nbytes / t_kv / 1e9,
                 "kvcore_frac": nbytes / t_kv / 1e9 / ceiling}
            if t_torch is not None:
                r.update(torch_s=t_torch, torch_gbps=nbytes / t_torch / 1e9,
                         torch_frac=nbytes / t_torch / 1e9 / ceiling)
            out["rows"].append(r)

        # ---------------------------------------------------- paged write
        # a one-layer pool: plane 0 is K (what write_slots receives)
        storage = cp.zeros((2, NUM_BLOCKS, HEADS, BLOCK_SIZE, DIM), cp.float16)
        key_cache = storage[0]
        t_cache = (torch.zeros((NUM_BLOCKS, HEADS, BLOCK_SIZE, DIM), dtype=torch.float16,
                               device=f"cuda:{be.device_id}") if torch is not None else None)
        all_slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)
        for n in WRITE_TOKENS:
            slots_h = all_slots[:n].astype(np.int64)
            slots = cp.asarray(slots_h)
            src32 = cp.asarray(rng.standard_normal((n, HEADS, DIM), dtype=np.float32))
            src16 = src32.astype(cp.float16)
            if torch is not None:
                tb = torch.as_tensor(slots_h // BLOCK_SIZE, device=t_cache.device)
                to = torch.as_tensor(slots_h % BLOCK_SIZE, device=t_cache.device)
                t32 = torch.as_tensor(cp.asnumpy(src32), device=t_cache.device)
                t16 = t32.to(torch.float16)
            for sk, src, label in ((F32, src32, "write f32->f16"), (F16, src16, "write f16->f16")):
                elems = n * HEADS * DIM
                nbytes = elems * (src.itemsize + 2) + n * 8
                t_kv = cp_time(lambda: be.write_slots(key_cache, src, slots, sk, F16), nbytes)
                t_t = None
                if torch is not None:
                    ts = t32 if sk == F32 else t16

                    def torch_write():
                        t_cache[tb, :, to, :] = ts.to(torch.float16)

                    t_t = torch_time(torch_write, nbytes)
                row(label, n, nbytes, t_kv, t_t)

        # --------------------------------------------------------- gather
        for n in GATHER_TOKENS:
            nblk = n // BLOCK_SIZE
            table_h = rng.permutation(NUM_BLOCKS)[:nblk].astype(np.int32)
            table = cp.asarray(table_h)
            dst = cp.empty((HEADS, n, DIM), cp.float16)
            nbytes = 2 * n * HEADS * DIM * 2 + nblk * 4
            t_kv = cp_time(lambda: be.gather(key_cache, table, 0, n, dst, F16, F16), nbytes)
            t_t = None
            if torch is not None:
                tt = torch.as_tensor(table_h.astype(np.int64), device=t_cache.device)

                def torch_gather():
                    return (t_cache.index_select(0, tt).transpose(0, 1)
                            .reshape(HEADS, n, DIM))

                t_t = torch_time(torch_gather, nbytes)
            row("gather f16", n, nbytes, t_kv, t_t)
        be.synchronize()
    return out


def report(r):
    """A short plain-text table of ``run``'s result."""
    lines = [f"{r['device']}  (CuPy {r['cupy']}, torch {r['torch'] or 'not measured'}); "
             f"{r['heads']} KV heads x {r['dim']} dims, block size {r['block_size']}",
             f"ceiling: device-to-device copy {r['ceiling_gbps']:.0f} GB/s "
             "(bytes read + written)", ""]
    head = (f"{'op':<16}{'tokens':>7}{'MB':>9}{'kvcore us':>11}{'GB/s':>8}{'of ceil':>9}"
            f"{'torch us':>10}{'GB/s':>8}{'of ceil':>9}")
    lines += [head, "-" * len(head)]
    for x in r["rows"]:
        s = (f"{x['op']:<16}{x['tokens']:>7}{x['bytes'] / 1e6:>9.2f}{x['kvcore_s'] * 1e6:>11.1f}"
             f"{x['kvcore_gbps']:>8.0f}{x['kvcore_frac']:>9.0%}")
        if "torch_s" in x:
            s += f"{x['torch_s'] * 1e6:>10.1f}{x['torch_gbps']:>8.0f}{x['torch_frac']:>9.0%}"
        else:
            s += f"{'-':>10}{'-':>8}{'-':>9}"
        lines.append(s)
    return "\n".join(lines)


def rows(r):
    """The lines of ``python -m kvcore bench``'s table: each kernel's GB/s
    against the device-to-device copy ceiling and torch."""
    out = [(f"GPU copy ceiling ({r['device']})", f"{r['ceiling_gbps']:.0f} GB/s", "", "")]
    for x in r["rows"]:
        label = f"GPU {x['op']} {x['tokens']} tok"
        out.append((label, f"{x['kvcore_gbps']:.0f} GB/s", "device-to-device copy",
                    f"{x['kvcore_frac']:.2f} of"))
        if "torch_s" in x:
            out.append(("", "", f"{x['torch_gbps']:.0f} GB/s (torch)",
                        f"{x['torch_s'] / x['kvcore_s']:.1f}x"))
    return out
