"""bench/bench_gpu.py's tables (kvcore/cli/benchmarks/gpu.py ``report`` and
``rows``) from a made-up result, so a device run cannot fail at its last
step; and the script's one-line refusal without CuPy."""
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.cli.benchmarks import gpu

ROOT = Path(__file__).resolve().parent.parent


def _result(same_bits):
    dec = {"op": "decode", "page": "float16", "batch": 64, "context": 4096, "group": 4,
           "s": 1e-4, "kv_gbps": 3000.0, "frac": 0.75, "tokens_per_s": 6.4e5}
    pre = {"op": "prefill", "page": "float16", "batch": 1, "context": 4096, "group": 4,
           "s": 1e-3, "tflops": 200.0}
    step = {"op": "decode step (graph)", "page": "float16", "batch": 64, "context": 4096,
            "group": 4, "layers": 32, "s": 3e-3, "kv_gbps": 2900.0}
    if same_bits is not None:
        step["same_bits"] = same_bits
    bad = dict(step, error="CUDARuntimeError: capture failed")
    return {"device": "NVIDIA H200", "cupy": "14.2.0", "torch": None, "heads": 8, "dim": 128,
            "block_size": 16, "ceiling_gbps": 4000.0, "rows": [], "torch_bf16_tflops": 700.0,
            "attention": [dec, pre, step, bad]}


@pytest.mark.parametrize("same_bits,word", [(True, "same bits"), (False, "BITS DIFFER"),
                                            (None, "| 2900 | - | 21333 |")])
def test_report_lists_the_attention_rows(same_bits, word):
    text = gpu.report(_result(same_bits))
    assert "| decode | float16 | 64 | 4096 | 4 | 100.0 | 3000 | 75% |" in text
    assert "| 200.00 |" in text
    step = [ln for ln in text.splitlines() if ln.startswith("| decode step (graph)")]
    assert len(step) == 2 and word in step[0] and "failed: CUDARuntimeError" in step[1]
    assert [r[0] for r in gpu.rows(_result(same_bits))][1].startswith("GPU attention decode")


def test_bench_without_cupy_fails_with_one_line():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--quick"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "CuPy" in lines[0], lines
