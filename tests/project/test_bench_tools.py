"""The C tools under bench/ that docs/performance.md quotes build and say
what the docs say they say."""
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    from _helpers import aarch64_tools
    from _simd_levels import cpu_flags
except ImportError:  # pragma: no cover - run as a package
    from .._helpers import aarch64_tools
    from .._simd_levels import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
DOT = ROOT / "bench" / "dot_throughput.c"

pytestmark = pytest.mark.skipif(not DOT.exists(), reason="needs the source tree or the sdist")


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the build needs one too)"
    return cc


def _check_errors(out):
    errors = re.findall(r"float32 q ([\d.e+-]+), bfloat16 q ([\d.e+-]+), "
                        r"q as two bfloat16 \(hi \+ lo\) ([\d.e+-]+)", out)
    assert len(errors) == 2, out  # head_dim 64 and 128
    for f32, bf16, split in (tuple(map(float, e)) for e in errors):
        assert 0 < f32 < 1e-6 and bf16 > 1e-4 and f32 < split < 1e-5, out


def test_dot_throughput_builds_runs_and_measures_the_bfloat16_error(tmp_path):
    exe = tmp_path / "dot_throughput"
    subprocess.run([_cc(), "-O2", "-Wall", "-Werror", str(DOT), "-o", str(exe), "-lm"],
                   check=True)
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


PROFILE = ROOT / "bench" / "attention_profile.c"
CSRC = ROOT / "kvcore" / "backends" / "cpu" / "csrc"


@pytest.fixture(scope="module")
def profile_exe(tmp_path_factory):
    """bench/attention_profile.c built once for this module's tests."""
    if not PROFILE.exists() or not CSRC.is_dir():
        pytest.skip("needs the source tree")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("its kernels and raw modes time the x86 levels")
    exe = tmp_path_factory.mktemp("attention_profile") / "attention_profile"
    sources = [str(PROFILE), *map(str, sorted(CSRC.glob("kv_att*.c"))), str(CSRC / "kv_simd.c")]
    # (-O1: the timings are not checked, and it builds in 3/4 of -O2's time)
    subprocess.run([_cc(), "-O1", "-pthread", f"-I{CSRC}", *sources, "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    return exe


@pytest.mark.toolchain
def test_attention_profile_times_the_decode_kernels_alone(profile_exe):
    """``attention_profile kernels`` (docs/performance.md, "On an AVX2-only AMD
    EPYC Zen 3"): one line per x86 level the CPU has, the scores and P.V
    kernels' ns per key and multiply-adds per ns; bad arguments exit 2."""
    exe = profile_exe
    has_avx2 = {"avx2", "fma", "f16c"} <= cpu_flags()
    # (float16 at the default 4 rows x 128; int8, whose pages the kernels read as
    # codes, at SmolLM2's 3 x 64)
    for kind, args, macs in (("1", [], 4 * 128), ("5", ["3", "64"], 3 * 64)):
        out = subprocess.run([str(exe), "kernels", kind, *args], check=True,
                             capture_output=True, text=True, timeout=300).stdout
        rows = re.findall(rf"^kernels kind {kind} \((\w+)\), \d+ rows x head_dim \d+, tile of "
                          r"(32|64) keys: scores ([\d.]+) ns/key \(([\d.]+) multiply-adds/ns\), "
                          r"P\.V ([\d.]+) ns/key \(([\d.]+)/ns\); together ([\d.]+) ns per key",
                          out, re.M)
        levels = [r[0] for r in rows]
        assert levels in ([], ["avx2"], ["avx2", "avx512"]), out
        if has_avx2:
            assert levels, out
        for _, _tile, s, s_rate, p, p_rate, both in rows:
            s, s_rate, p, p_rate, both = map(float, (s, s_rate, p, p_rate, both))
            assert s > 0 and p > 0 and abs(s + p - both) < 0.11, out
            # multiply-adds per ns = rows x head_dim per key / ns per key
            assert abs(s_rate - macs / s) <= 0.06 * s_rate, out
            assert abs(p_rate - macs / p) <= 0.06 * p_rate, out
    skipped = subprocess.run([str(exe), "kernels", "3", "9", "64"], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    if has_avx2:       # (e4m3fn decode items of 9 rows widen their tiles first)
        assert re.search(r"^kernels kind 3 \(avx2\), 9 rows: skipped", skipped, re.M), skipped
    bad = subprocess.run([str(exe), "kernels", "9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "kernels [kind 0-5" in bad.stderr


@pytest.mark.toolchain
def test_attention_profile_reads_the_pages_pattern_at_the_best_level(profile_exe):
    """``attention_profile raw`` (docs/performance.md, "On an AVX2-only AMD
    EPYC Zen 3"): the decode's page pattern read by a plain loop, AVX-512
    where the CPU has it, else AVX2 (else a clear refusal); GB/s of the K and
    V chunks read; a head_dim whose 16-position chunk is not whole lines is
    refused."""
    flags = cpu_flags()
    run = subprocess.run([str(profile_exe), "raw", "2", "64", "1024"], capture_output=True,
                         text=True, timeout=120)
    if "avx512f" not in flags and "avx2" not in flags:
        assert run.returncode == 2 and "raw needs AVX-512F or AVX2" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    got = re.search(r"^raw read ctx  1024, 2 kv heads x 2048-byte chunks \((\w+)\): +([\d.]+) GB/s",
                    run.stdout, re.M)
    assert got, run.stdout
    assert got.group(1) == ("avx512" if "avx512f" in flags else "avx2"), run.stdout
    assert float(got.group(2)) > 0, run.stdout
    bad = subprocess.run([str(profile_exe), "raw", "2", "3", "1024"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "head_dim" in bad.stderr
