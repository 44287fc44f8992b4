"""The C tools under bench/ that docs/performance.md quotes build and say
what the docs say they say."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOT = ROOT / "bench" / "dot_throughput.c"

pytestmark = pytest.mark.skipif(not DOT.exists(), reason="needs the source tree or the sdist")


def test_dot_throughput_builds_runs_and_measures_the_bfloat16_error(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the build needs one too)"
    exe = tmp_path / "dot_throughput"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", str(DOT), "-o", str(exe), "-lm"], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    errors = re.findall(r"float32 q ([\d.e+-]+), bfloat16 q ([\d.e+-]+), "
                        r"q as two bfloat16 \(hi \+ lo\) ([\d.e+-]+)", out)
    assert len(errors) == 2, out  # head_dim 64 and 128
    for f32, bf16, split in (tuple(map(float, e)) for e in errors):
        assert 0 < f32 < 1e-6 and bf16 > 1e-4 and f32 < split < 1e-5, out
    if "1. skipped" not in out:
        products = dict(re.findall(r"^  (\S+) zmm.*?([\d.]+) products per ns$", out, re.M))
        assert set(products) == {"vfmadd231ps", "vdpbf16ps", "vpdpbusd", "vpmaddwd"}, out
