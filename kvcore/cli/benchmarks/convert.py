"""float32 <-> float16/bfloat16/fp8 conversion: kvcore against its baselines.

    python bench/bench_convert.py [--quick] [--level NAME] [--json FILE]
    python -m kvcore bench

One run measures, on 16 Mi elements (64 MiB of float32; ``--quick``: 4 Mi
elements and fewer repetitions), narrowing and widening in both formats:

* kvcore: ``to_float16``/``to_bfloat16``/``from_float16``/``from_bfloat16``,
  ``to_float8_e4m3fn``/``to_float8_e5m2``/``from_float8_e4m3fn``/``from_float8_e5m2``;
* NumPy's cast for float16 and ml_dtypes' for bfloat16 and the float8
  formats, through ``numpy.copyto(out, x, casting="unsafe")`` (``astype``'s
  cast loop);
* torch's ``Tensor.copy_`` when torch is importable, on one thread
  (``torch.set_num_threads(1)``; kvcore and NumPy are single-threaded too);
* a float32 memcpy (``numpy.copyto``) of the same number of elements, the
  memory-bandwidth yardstick (it moves 8 bytes an element, a conversion 6).

Every implementation writes into the same preallocated output, already
faulted in by the warm-up runs.  The implementations of one op take turns
(one call each per round), so a change of load on a shared machine slows
them alike.  Figures are medians; ratios are
kvcore throughput / baseline throughput (= baseline time / kvcore time), so
above 1 means kvcore is faster.  ``bench/bench_convert.py`` repeats the
whole run (``--repeat``) and prints every figure as median [min-max].

``run(quick=False, level=None) -> dict`` does the measuring and ``report``
formats it, so that ``python -m kvcore bench`` can call them; ``main`` is
this script.
"""
import statistics
import time

import numpy as np

from ._timing import ratio_text

try:
    import ml_dtypes
except ImportError:  # optional: the bf16 baseline is skipped without it
    ml_dtypes = None


def _torch():
    """torch, on one thread, or None."""
    try:
        import torch
    except Exception:  # not installed, or a broken install: no torch baseline
        return None
    torch.set_num_threads(1)
    return torch


def _times_s(fns, repeat, warmup):
    """Seconds per call of each of ``fns`` (a dict), ``repeat`` samples each.
    The calls are interleaved, one of each per round, so that a machine
    whose load changes during the run slows every implementation alike and
    the ratios hold."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


# op name -> (kvcore function name, source format, destination format)
OPS = {
    "f32->f16": ("to_float16", "f32", "f16"),
    "f32->bf16": ("to_bfloat16", "f32", "bf16"),
    "f16->f32": ("from_float16", "f16", "f32"),
    "bf16->f32": ("from_bfloat16", "bf16", "f32"),
    "f32->e4m3fn": ("to_float8_e4m3fn", "f32", "e4m3fn"),
    "f32->e5m2": ("to_float8_e5m2", "f32", "e5m2"),
    "e4m3fn->f32": ("from_float8_e4m3fn", "e4m3fn", "f32"),
    "e5m2->f32": ("from_float8_e5m2", "e5m2", "f32"),
}
FP8 = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}   # format -> dtype name


def run(quick=False, level=None, n=None, repeat=None):
    """Measure every conversion and its baselines.

    Parameters
    ----------
    quick : bool
        4 Mi elements and 5 repetitions instead of 16 Mi and 15.
    level : str, optional
        SIMD level to force (``kvcore.set_simd_level``: the conversions run
        their best path at or under it); the previous one is restored afterwards.  Default: the one in use.
    n, repeat : int, optional
        Override the element count and the number of timed repetitions.

    Returns
    -------
    dict
        ``n``, ``repeat``, ``simd_level``, ``available_levels``, ``torch``
        (version and threads, or None), ``ml_dtypes`` (version or None),
        ``copy_gelem_s`` (the float32 memcpy, median over the ops) and one
        dict per op (``"f32->f16"``, ...) with ``<impl>_gelem_s`` figures
        (``copy`` is the memcpy timed alongside that op) and ``ratio_<impl>``
        = kvcore / impl throughput.
    """
    import kvcore
    from kvcore.backends.cpu import _convert

    n = n or (1 << 22 if quick else 1 << 24)
    repeat = repeat or (5 if quick else 15)
    warmup = 2
    torch = _torch()

    previous = kvcore.set_simd_level(level) if level is not None else None
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(n, dtype=np.float32)   # typical K/V values
        h = x.astype(np.float16)
        b = kvcore.to_bfloat16(x)                       # bf16 bits, uint16
        arrays = {"f32": x, "f16": h, "bf16": b,
                  "e4m3fn": kvcore.to_float8_e4m3fn(x), "e5m2": kvcore.to_float8_e5m2(x)}
        # preallocated outputs shared by every implementation
        outs = {"f32": np.empty(n, np.float32), "f16": np.empty(n, np.float16),
                "bf16": np.empty(n, np.uint16), "e4m3fn": np.empty(n, np.uint8),
                "e5m2": np.empty(n, np.uint8)}
        copy_out = np.empty(n, np.float32)

        def ml_view(a, fmt):
            """bf16 and fp8 bits as ml_dtypes' types for the ml_dtypes baseline."""
            if fmt == "bf16":
                return a.view(ml_dtypes.bfloat16)
            return a.view(getattr(ml_dtypes, FP8[fmt])) if fmt in FP8 else a

        def torch_view(a, fmt):
            t = torch.from_numpy(a.view(np.int16) if fmt == "bf16" else a)
            if fmt == "bf16":
                return t.view(torch.bfloat16)
            return t.view(getattr(torch, FP8[fmt])) if fmt in FP8 else t

        def torch_has(fmt):
            return fmt not in FP8 or hasattr(torch, FP8[fmt])

        res = {
            "n": n, "repeat": repeat, "warmup": warmup,
            "simd_level": _convert.get_simd_level(),
            "available_levels": list(_convert.available_simd_levels()),
            "numpy": np.__version__,
            "ml_dtypes": getattr(ml_dtypes, "__version__", None),
            "torch": None if torch is None else {"version": torch.__version__,
                                                 "threads": torch.get_num_threads()},
        }
        copies = []
        for op, (fname, sf, df) in OPS.items():
            src, dst = arrays[sf], outs[df]
            fn = getattr(kvcore, fname)
            impls = {"kvcore": lambda: fn(src, out=dst)}
            ref = "numpy" if "f16" in (sf, df) else "ml_dtypes"
            if ref == "numpy" or ml_dtypes is not None:
                s_ref, d_ref = ml_view(src, sf), ml_view(dst, df)
                impls[ref] = lambda: np.copyto(d_ref, s_ref, casting="unsafe")
            if torch is not None and torch_has(sf) and torch_has(df):
                s_t, d_t = torch_view(src, sf), torch_view(dst, df)
                impls["torch"] = lambda: d_t.copy_(s_t)
            impls["copy"] = lambda: np.copyto(copy_out, x)
            r = {f"{name}_gelem_s": n / statistics.median(t) / 1e9
                 for name, t in _times_s(impls, repeat, warmup).items()}
            copies.append(r["copy_gelem_s"])
            for name in impls:
                if name != "kvcore":
                    r[f"ratio_{name}"] = r["kvcore_gelem_s"] / r[f"{name}_gelem_s"]
            res[op] = r
        res["copy_gelem_s"] = statistics.median(copies)
        return res
    finally:
        if previous is not None:
            kvcore.set_simd_level(previous)


_LABEL = {"numpy": "NumPy astype (copyto)", "ml_dtypes": "ml_dtypes astype (copyto)",
          "torch": "torch copy_", "copy": "float32 memcpy"}


def report(res):
    """The results of ``run`` as a short table."""
    t = res["torch"]
    head = [
        f"conversion, {res['n']:,} elements ({res['n'] * 4 / 2**20:.0f} MiB float32), "
        f"median of {res['repeat']} runs; SIMD level {res['simd_level']} "
        f"(available: {', '.join(res['available_levels'])})",
        f"NumPy {res['numpy']}, ml_dtypes {res['ml_dtypes'] or 'not installed'}, "
        + (f"torch {t['version']} on {t['threads']} thread(s)" if t else "torch not installed"),
        "ratio = kvcore throughput / baseline throughput (>1: kvcore faster)",
        "",
    ]
    rows = []
    for op in OPS:
        if op not in res:
            continue
        r = res[op]
        rows.append((op, "kvcore", f"{r['kvcore_gelem_s']:.3f}", ""))
        for name in ("numpy", "ml_dtypes", "torch", "copy"):
            if f"ratio_{name}" in r:
                rows.append(("", _LABEL[name], f"{r[name + '_gelem_s']:.3f}",
                             f"{r['ratio_' + name]:.2f}"))
    headers = ("op", "implementation", "Gelem/s", "kvcore/it")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = lambda row: "  ".join(  # noqa: E731
        c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
    line = fmt(headers)
    return "\n".join(head + [line, "-" * len(line)] + [fmt(r).rstrip() for r in rows])


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    names = {"numpy": "NumPy astype", "ml_dtypes": "ml_dtypes astype",
             "torch": "torch copy_, 1 thread", "copy": "float32 memcpy"}
    rows = []
    ops = [k for k, v in r.items() if "->" in k and isinstance(v, dict)]
    if not ops:
        raise KeyError("no conversion in the result")
    for op in ops:
        w = r[op]
        first = True
        for base, label in names.items():
            if f"ratio_{base}" not in w:
                continue
            rows.append((f"convert {op}, {r['n'] * 4 >> 20} MiB f32" if first else "",
                         f"{w['kvcore_gelem_s']:.2f} Gelem/s" if first else "",
                         f"{w[base + '_gelem_s']:.2f} Gelem/s ({label})",
                         ratio_text(w[f"ratio_{base}"])))
            first = False
    return rows
