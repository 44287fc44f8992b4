"""The avx512 attention level (kv_attn_avx512.c).

No machine these kernels were developed on has AVX-512, so they are checked
here under emulation: kv_attn_avx512.c is compiled a second time against
SIMDe's portable AVX-512 (the simde-py package: headers only), with its
target attributes defined away, and kv_simd.c is told the level is there
(-DKVS_TEST_EMULATE).  The C drivers then run the avx512 tables against the
scalar ones and whole attention calls against a float64 reference
(tests/c/kv_attn_avx512_check.c, tests/c/kv_attention_check.c).  On a CPU
with AVX-512 the level also joins every native test of the other levels
(the ``level`` fixtures of test_attention.py and others).
"""
import shutil
import subprocess
from pathlib import Path

import pytest

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

try:
    from test_native_levels import NATIVE, ROOT, _build_and_run, _run_case, needs_source
except ImportError:  # pragma: no cover - run as a package
    from .test_native_levels import NATIVE, ROOT, _build_and_run, _run_case, needs_source

SHIM = ROOT / "tests" / "c" / "kv_simde_shim.h"
DRIVER = ROOT / "tests" / "c" / "kv_attn_avx512_check.c"
ATTENTION_CHECK = ROOT / "tests" / "c" / "kv_attention_check.c"
# what kv_attn_avx512_check.c counts (a change of its cases, or of
# KVA_KEY_TILE: its math checks run every tile width, changes it)
AVX512_CHECKS = 4957


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.fixture(scope="module")
def emulated_objects(tmp_path_factory):
    """kv_attn_avx512.o built against SIMDe, and kv_simd.o that reports the
    avx512 level as there (the test build only)."""
    simde_py = pytest.importorskip("simde_py", reason="needs simde-py (the test extra)")
    cc = _cc()
    out = tmp_path_factory.mktemp("avx512_emulated")
    avx512, simd = out / "kv_attn_avx512.o", out / "kv_simd.o"
    # (no -Werror: SIMDe's headers warn differently under other compilers)
    subprocess.run([cc, "-O2", "-Wall", "-Wno-psabi", "-include", str(SHIM),
                    "-DKVA_AVX512_SIMDE", "-DKVA_AVX512_TARGET=",
                    f"-I{simde_py.get_include()}", f"-I{NATIVE}", "-c",
                    str(NATIVE / "kv_attn_avx512.c"), "-o", str(avx512)],
                   check=True, capture_output=True, text=True)
    subprocess.run([cc, "-O2", "-Wall", "-DKVS_TEST_EMULATE=KVS_AVX512",
                    f"-I{NATIVE}", "-c", str(NATIVE / "kv_simd.c"), "-o", str(simd)],
                   check=True, capture_output=True, text=True)
    return avx512, simd


@pytest.mark.slow
@needs_source
def test_avx512_kernels_match_scalar_and_float64_under_simde(tmp_path, emulated_objects):
    """Every kind; head_dims 8 to 256 with and without a last vector of 8;
    1 to 64 rows (16 and more: the scores over the transposed key tile);
    GQA groups of 1 to 8; ragged lengths, decode splits, window, soft cap;
    chunks, ALiBi, sinks and extreme scales; the math table; the same bits
    for 1, 2 and 5 threads."""
    run = _build_and_run(_cc(), DRIVER, tmp_path / "avx512_check",
                         extra=("-DKVA_AVX512_SIMDE", f"-I{ROOT / 'tests' / 'c'}"),
                         objects=emulated_objects)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"avx512 emulated: {AVX512_CHECKS} checks, 0 failures" in run.stdout, run.stdout


@pytest.mark.slow
@needs_source
def test_avx512_kernels_match_scalar_and_float64_natively(tmp_path):
    """The same driver built from the sources as they ship, on a CPU with
    AVX-512 (skipped without: the emulated run above covers the code)."""
    from kvcore.backends.cpu import _attention
    if "avx512" not in _attention.available_simd_levels():
        pytest.skip("the CPU (or the OS) has no AVX-512")
    run = _build_and_run(_cc(), DRIVER, tmp_path / "avx512_native",
                         extra=(f"-I{ROOT / 'tests' / 'c'}",))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"avx512 native: {AVX512_CHECKS} checks, 0 failures" in run.stdout, run.stdout


@pytest.mark.slow
@needs_source
def test_attention_check_runs_the_emulated_avx512_level(tmp_path, emulated_objects):
    """kv_attention_check.c, the every-level driver, sees the emulated avx512
    level beside the native ones and finds it within 1e-5 of float64."""
    run = _build_and_run(_cc(), ATTENTION_CHECK, tmp_path / "attention_check",
                         objects=emulated_objects)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "level avx512: 90 cases, 0 failures" in run.stdout, run.stdout
    assert "level scalar: 90 cases, 0 failures" in run.stdout


@pytest.mark.slow
@needs_source
def test_attention_plan_at_the_emulated_avx512_level(tmp_path, emulated_objects):
    """kv_attention_plan_check.c: a plan run per layer gives
    kva_paged_attention's bits at the emulated avx512 level too."""
    run = _build_and_run(_cc(), "plan", tmp_path / "plan_check", objects=emulated_objects)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan level avx512: 60 runs, 0 failures" in run.stdout, run.stdout


def test_kvcore_simd_avx512_is_a_cap():
    """KVCORE_SIMD=avx512 is accepted; without AVX-512 the attention falls
    back to the best level the CPU has, and the conversions (which have no
    avx512 kernels) to theirs."""
    from kvcore.backends.cpu import _attention, _convert
    levels, digest = _run_case("avx512")
    _, uncapped = _run_case()
    # (the best level but amx: avx512 caps it)
    assert levels["attention"] == [lvl for lvl in _attention.available_simd_levels()
                                   if lvl != "amx"][-1]
    assert levels["conversions"] == _convert.best_simd_level()
    assert digest == uncapped


def test_a_neon_cap_on_x86_keeps_the_levels_below_avx512():
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86-64 numbering check")
    from kvcore.backends.cpu import _attention
    levels, _ = _run_case("neon")
    # the best level below avx512 (amx, numbered above it, is capped too)
    order = _attention.available_simd_levels()
    below = order[:order.index("avx512")] if "avx512" in order else order
    assert levels["attention"] == below[-1]


def test_avx512_detection_agrees_with_the_kernel_s_cpu_flags():
    """Linux lists the avx512 flags only when the CPU has them and the OS
    enabled their state; the registry (CPUID and XCR0) must agree."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86-64 check")
    try:
        from _simd_levels import cpu_flags
    except ImportError:  # pragma: no cover - run as a package
        from ._simd_levels import cpu_flags
    from kvcore.backends.cpu import _attention
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    has = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert ("avx512" in _attention.available_simd_levels()) == has
