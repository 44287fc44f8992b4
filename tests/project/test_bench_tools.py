"""The C tools under bench/ that docs/performance.md quotes build and say
what the docs say they say."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    from _helpers import aarch64_tools
except ImportError:  # pragma: no cover - run as a package
    from .._helpers import aarch64_tools

ROOT = Path(__file__).resolve().parents[2]
DOT = ROOT / "bench" / "dot_throughput.c"

pytestmark = pytest.mark.skipif(not DOT.exists(), reason="needs the source tree or the sdist")


def _check_errors(out):
    errors = re.findall(r"float32 q ([\d.e+-]+), bfloat16 q ([\d.e+-]+), "
                        r"q as two bfloat16 \(hi \+ lo\) ([\d.e+-]+)", out)
    assert len(errors) == 2, out  # head_dim 64 and 128
    for f32, bf16, split in (tuple(map(float, e)) for e in errors):
        assert 0 < f32 < 1e-6 and bf16 > 1e-4 and f32 < split < 1e-5, out


def test_dot_throughput_builds_runs_and_measures_the_bfloat16_error(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the build needs one too)"
    exe = tmp_path / "dot_throughput"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", str(DOT), "-o", str(exe), "-lm"], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    _check_errors(out)
    if "1. skipped" not in out:
        products = dict(re.findall(r"^  (\S+) zmm.*?([\d.]+) products per ns$", out, re.M))
        assert set(products) == {"vfmadd231ps", "vdpbf16ps", "vpdpbusd", "vpmaddwd"}, out


def test_dot_throughput_builds_and_runs_on_aarch64(tmp_path):
    """The wheels' aarch64 tests (pyproject.toml: cibuildwheel, under QEMU)
    run the test above with the native cc there: no x86 section, no warning."""
    cc, qemu = aarch64_tools()
    exe = tmp_path / "dot_throughput_a64"
    built = subprocess.run([cc, "-O2", "-Wall", "-Werror", "-static", str(DOT), "-o", str(exe),
                            "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([qemu, str(exe)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert "1. skipped: not x86-64" in out, out
    _check_errors(out)
