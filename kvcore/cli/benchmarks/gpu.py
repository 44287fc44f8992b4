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
  ``cache.index_select(0, table)`` made head-major;
* attention against torch SDPA in the same run (``gpu_attention.py``):
  decode at batch {1, 64} x context {4096, 32768} x query heads per KV head
  {1, 4, 8} and causal prefill of 4096 and 16384 tokens (32 query / 8 KV
  heads), float16 q and out, kvcore's kernels of this version and the
  previous one (``KVCORE_CUDA_ATTENTION=v2``), float16 and e4m3fn pages,
  each beside torch's SDPA over a contiguous cache of the same sizes, with
  the fraction of HBM read;
* a 32-layer decode step (write + attention, float16 q and out) replayed
  from a CUDA graph, with whether a replay kept the bits;
* torch's bf16 8192^3 matrix product (the tensor-core rate of the same
  machine).

``--anchor`` measures only the copy ceiling and the attention against torch
(under two minutes on an H200, compilation included).

The whole run, quick or not, takes well under the 8 minutes ``.ci/gpu``
allows it on an H200 (compilation included).

Storage is laid out as a pool's: (num_layers * 2, num_blocks, heads,
block_size, dim), the per-layer K plane being what the kernels receive.
Times come from CUDA events around a batch of calls after a warm-up;
figures are medians.  GB/s counts the bytes read plus the bytes written
(data, slots and tables), so it compares directly with the copy ceiling,
which also moves each byte twice.

``run(quick=False) -> dict`` measures and ``report(dict) -> str`` formats;
``main`` is this script.
"""

import numpy as np

from kvcore.backends import codec_of
from kvcore.backends.cuda import CudaUnavailableError, get_cuda_backend  # noqa: F401
from kvcore.dtypes import F16, F32

from . import gpu_attention
from ._timing import median_time

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
    return median_time(fn, repeat=repeat, number=calls, warmup=3,
                       clock=(record, lambda start: elapsed_ms(start, record()) / 1e3))


def _calls_for(nbytes):
    # small transfers are launch-bound: batch enough calls to time them
    return 100 if nbytes < (1 << 20) else 10 if nbytes < (64 << 20) else 3


def _copy_seconds(cp, cp_time, nbytes):
    """Seconds for one device-to-device copy of ``nbytes`` (freed after)."""
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    return cp_time(lambda: cp.copyto(b, a), nbytes)


def run(quick=False, attention=True, anchor=False):
    """Measure; returns a dict (see ``report``); ``attention=False`` leaves
    out the attention rows; ``anchor=True`` measures only the copy ceiling
    and the attention against torch.

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

        def time_fn(fn, calls):
            return _median_seconds(fn, cp_record, cp_elapsed, repeat, calls)

        if anchor:
            out["anchor"] = gpu_attention.run(be, cp, torch, time_fn, ceiling)
            be.synchronize()
            return out

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
                t_kv = cp_time(lambda: be.write_slots(key_cache, src, slots, sk, codec_of(F16)),
                               nbytes)
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
            t_kv = cp_time(lambda: be.gather(key_cache, table, 0, n, dst, codec_of(F16), F16),
                           nbytes)
            t_t = None
            if torch is not None:
                tt = torch.as_tensor(table_h.astype(np.int64), device=t_cache.device)

                def torch_gather():
                    return (t_cache.index_select(0, tt).transpose(0, 1)
                            .reshape(HEADS, n, DIM))

                t_t = torch_time(torch_gather, nbytes)
            row("gather f16", n, nbytes, t_kv, t_t)
        del storage, key_cache, t_cache
        if attention:
            out["anchor"] = gpu_attention.run(be, cp, torch, time_fn, ceiling)
            out["attention"] = [_captured_step(be, cp, cp_time, rng)]
            if torch is not None:
                n = 4096 if quick else 8192
                a = torch.randn((n, n), dtype=torch.bfloat16, device=f"cuda:{be.device_id}")
                t = torch_time(lambda: a @ a, 1 << 30)
                out["torch_bf16_tflops"] = 2 * n ** 3 / t / 1e12
        be.synchronize()
    return out


def _captured_step(be, cp, cp_time, rng, layers=32, batch=64, context=4096, group=4):
    """One decode step (``layers`` x (``pool.write`` of one token per
    sequence, ``check=False``, + ``attention_run`` with float16 q and out))
    captured in a CUDA graph; the row times a replay (or says why the
    capture failed)."""
    import kvcore

    per_seq = context // BLOCK_SIZE
    nblk = batch * per_seq + 1
    pool = kvcore.BlockPool(nblk, BLOCK_SIZE, layers, HEADS, DIM, dtype="float16",
                            device=be.device)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, context, np.int64)
    qsl = np.arange(batch + 1, dtype=np.int64)
    heads = HEADS * group
    plan = be.attention_plan(tables, lens, qsl, num_heads=heads, num_kv_heads=HEADS,
                             head_dim=DIM, block_size=BLOCK_SIZE, num_blocks=nblk, kind=F16,
                             scale=DIM ** -0.5, sliding_window=0, soft_cap=0.0)
    row = {"op": "decode step (graph)", "page": "float16", "batch": batch, "context": context,
           "group": group, "layers": layers}
    cp.cuda.runtime.deviceSynchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            q = cp.asarray(rng.standard_normal((layers, batch, heads, DIM), dtype=np.float32)
                           .astype(np.float16))
            k = cp.asarray(rng.standard_normal((layers, batch, HEADS, DIM), dtype=np.float32))
            slots = cp.asarray(tables[:, -1].astype(np.int64) * BLOCK_SIZE + BLOCK_SIZE - 1)
            outs = cp.empty_like(q)

            def step():
                for layer in range(layers):
                    pool.write(layer, k[layer], k[layer], slots, check=False)
                    be.attention_run(plan, q[layer], outs[layer], pool.storage[2 * layer],
                                     pool.storage[2 * layer + 1])

            step()
            stream.synchronize()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
            eager = outs.copy()   # the step run eagerly (its last call, captured after)
            kv_bytes = layers * 2 * batch * context * HEADS * DIM * 2
            row["s"] = cp_time(lambda: graph.launch(stream=stream), kv_bytes)
            row["kv_gbps"] = kv_bytes / row["s"] / 1e9
            # every replay writes the same bits as the eager step (a fixed merge order)
            outs.fill(cp.nan)
            graph.launch(stream=stream)
            row["same_bits"] = bool((outs.view(cp.uint16) == eager.view(cp.uint16)).all())
    except Exception as e:  # noqa: BLE001 - reported in the table, not raised
        row["error"] = f"{type(e).__name__}: {e}"[:160]
    stream.synchronize()
    return row


def report(r):
    """Markdown tables of ``run``'s result (to paste into a note)."""
    lines = [f"{r['device']} (CuPy {r['cupy']}, torch {r['torch'] or 'not measured'}); "
             f"{r['heads']} KV heads x {r['dim']} dims, block size {r['block_size']}; "
             f"ceiling: device-to-device copy {r['ceiling_gbps']:.0f} GB/s "
             "(bytes read + written)", "",
             "| op | tokens | MB | kvcore us | GB/s | of ceiling | torch us | GB/s | of ceiling |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["rows"]:
        s = (f"| {x['op']} | {x['tokens']} | {x['bytes'] / 1e6:.2f} | {x['kvcore_s'] * 1e6:.1f} "
             f"| {x['kvcore_gbps']:.0f} | {x['kvcore_frac']:.0%} |")
        if "torch_s" in x:
            s += f" {x['torch_s'] * 1e6:.1f} | {x['torch_gbps']:.0f} | {x['torch_frac']:.0%} |"
        else:
            s += " - | - | - |"
        lines.append(s)
    att = r.get("attention")
    if att:
        lines += ["", "Attention (one layer; decode: one query per sequence; GB/s of K/V read)",
                  "", "| op | pages | batch | context | group | us | K/V GB/s | of ceiling "
                  "| tokens/s | TFLOP/s |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in att:
            if "error" in x:
                lines.append(f"| {x['op']} | {x['page']} | {x['batch']} | {x['context']} "
                             f"| {x['group']} | failed: {x['error']} | | | | |")
                continue
            if x["op"] == "decode":
                tail = f"{x['kv_gbps']:.0f} | {x['frac']:.0%} | {x['tokens_per_s']:.0f} | - |"
            elif x["op"] == "prefill":
                tail = f"- | - | - | {x['tflops']:.2f} |"
            else:   # the captured step: all its layers, and whether a replay kept the bits
                bits = {True: "same bits", False: "BITS DIFFER"}.get(x.get("same_bits"), "-")
                tail = f"{x['kv_gbps']:.0f} | {bits} | {x['batch'] / x['s']:.0f} | - |"
            lines.append(f"| {x['op']} | {x['page']} | {x['batch']} | {x['context']} "
                         f"| {x['group']} | {x['s'] * 1e6:.1f} | " + tail)
        if r.get("torch_bf16_tflops"):
            lines.append(f"\ntorch bf16 matrix product: {r['torch_bf16_tflops']:.0f} TFLOP/s")
    if r.get("anchor"):
        lines += [""] + gpu_attention.report_lines(r["anchor"])
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
    for x in r.get("anchor") or ():
        if x["op"] != "decode":
            continue   # the decode grid here; prefill and the graph row in report()
        label = f"GPU attention decode f16 b{x['batch']} ctx{x['context']} g{x['group']}"
        gbps = x["kv_bytes"] / x["v3_s"] / 1e9
        out.append((label, f"{gbps:.0f} GB/s K/V", "device-to-device copy",
                    f"{gbps / r['ceiling_gbps']:.2f} of"))
        if x.get("torch_s"):
            out.append(("", "", "torch SDPA", f"{x['torch_s'] / x['v3_s']:.2f}x"))
    return out
