"""bench/bench_gpu.py's tables (kvcore/cli/benchmarks/gpu.py ``report`` and
``rows``) from a made-up result, so a device run cannot fail at its last
step; and the script's one-line refusal without CuPy."""
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.cli.benchmarks import gpu

ROOT = Path(__file__).resolve().parents[2]


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
    anchor = [{"op": "decode", "batch": 64, "context": 32768, "group": 8, "kv_bytes": 8.6e9,
               "v3_s": 2e-3, "v2_s": 8e-3, "e4m3_s": 1.25e-3, "torch_s": 1.9e-3,
               "torch_backend": "flash", "ceiling_gbps": 4000.0},
              {"op": "decode", "batch": 1, "context": 4096, "group": 1, "kv_bytes": 1.6e7,
               "v3_s": 3e-5, "v2_s": 3e-4, "e4m3_s": 3e-5, "ceiling_gbps": 4000.0},
              {"op": "prefill", "batch": 1, "context": 4096, "group": 4, "flops": 1.1e12,
               "v3_s": 1e-3, "v2_s": 3.4e-3, "torch_s": 2.7e-4, "torch_backend": "flash",
               "ceiling_gbps": 4000.0}]
    return {"device": "NVIDIA H200", "cupy": "14.2.0", "torch": None, "heads": 8, "dim": 128,
            "block_size": 16, "ceiling_gbps": 4000.0, "rows": [], "torch_bf16_tflops": 700.0,
            "attention": [dec, pre, step, bad], "anchor": anchor}


@pytest.mark.parametrize("same_bits,word", [(True, "same bits"), (False, "BITS DIFFER"),
                                            (None, "| 2900 | - | 21333 |")])
def test_report_lists_the_attention_rows(same_bits, word):
    text = gpu.report(_result(same_bits))
    assert "| decode | float16 | 64 | 4096 | 4 | 100.0 | 3000 | 75% |" in text
    assert "| 200.00 |" in text
    step = [ln for ln in text.splitlines() if ln.startswith("| decode step (graph)")]
    assert len(step) == 2 and word in step[0] and "failed: CUDARuntimeError" in step[1]
    labels = [r[0] for r in gpu.rows(_result(same_bits))]
    assert labels[1] == "GPU attention decode f16 b64 ctx32768 g8" and labels[2] == ""
    # the anchor table: kvcore v3 / v2 / e4m3 beside torch, ratios and HBM fractions
    assert "| decode b64 x 32k | 8 | 2000.0 | 8000.0 | 1250.0 | 1900.0 | 0.95x | 4.00x " \
        "| 1.60x | 90% | 108% | 94% |" in text
    assert "| decode b1 x 4k | 1 | 30.0 | 300.0 | 30.0 | - | - | 10.00x | 1.00x |" in text
    assert "| prefill causal 4k (1100 TF/s; torch 4074) | 4 | 1000.0 | 3400.0 | - | 270.0 " \
        "| 0.27x | 3.40x | - | - | - | - |" in text
    assert "torch SDPA backend asked for: flash" in text


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
