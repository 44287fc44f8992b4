"""kv_half.c and kv_fp8.c on their own: every SIMD level the machine
supports gives the scalar path's bits (tests/c/kv_half_check.c,
tests/c/kv_fp8_check.c), natively, and for AArch64's NEON path under
qemu-aarch64 when a cross compiler and qemu are installed
(apt: gcc-aarch64-linux-gnu qemu-user).  The attention plan on its own
(tests/c/kv_attention_plan_check.c): created once, run per layer, the same
bits as kva_paged_attention at every level."""
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    from _helpers import aarch64_tools
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import aarch64_tools

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "kvcore" / "backends" / "cpu" / "csrc"
# each check: its C driver and the sources it links
CHECKS = {
    "kv_half": (ROOT / "tests" / "c" / "kv_half_check.c", ("kv_half.c", "kv_simd.c")),
    "kv_fp8": (ROOT / "tests" / "c" / "kv_fp8_check.c", ("kv_fp8.c", "kv_half.c", "kv_simd.c")),
}

# the attention plan: its driver and the attention kernel's sources
PLAN_CHECK = ROOT / "tests" / "c" / "kv_attention_plan_check.c"

needs_source = pytest.mark.skipif(not (NATIVE / "kv_half.c").exists(),
                                  reason="needs the source tree")


def _attention_sources():
    return (*sorted(p.name for p in NATIVE.glob("kv_att*.c")), "kv_simd.c")


def _build_and_run(cc, check, out, extra=(), runner=(), objects=()):
    """Build a C check and run it.  check: a name of CHECKS, "plan", or the
    path of an attention driver; objects: prebuilt objects standing in for
    the sources of the same name (kv_simd.o for kv_simd.c)."""
    driver, sources = (CHECKS[check] if check in CHECKS else
                       (PLAN_CHECK if check == "plan" else Path(check), _attention_sources()))
    prebuilt = {Path(o).stem + ".c" for o in objects}
    subprocess.run([cc, "-O2", "-pthread", *extra, f"-I{NATIVE}", str(driver),
                    *[str(NATIVE / c) for c in sources if c not in prebuilt], *map(str, objects),
                    "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True)
    return subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)


@needs_source
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.toolchain
def test_native_simd_levels_match_scalar(tmp_path, check):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run(cc, check, tmp_path / "check")
    if run.returncode == 3:
        pytest.skip("this CPU has no SIMD level beyond scalar")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 mismatches" in run.stdout


@pytest.mark.slow
@needs_source
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.toolchain
def test_neon_level_matches_scalar_under_qemu(tmp_path, check):
    cc, qemu = aarch64_tools()
    run = _build_and_run(cc, check, tmp_path / "check_a64", extra=("-static",), runner=(qemu,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "level neon" in run.stdout and "0 mismatches" in run.stdout


@pytest.mark.slow
@needs_source
@pytest.mark.toolchain
def test_prefetching_attention_kernels_give_the_plain_kernels_bits(tmp_path):
    """kva_kernels' scores / pv / widen given the next tile's rows (decode
    items prefetch them among their loads) against the same kernels without
    them, bit for bit, at each native level whose kernels prefetch
    (tests/c/kv_attn_prefetch_check.c)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run(cc, ROOT / "tests" / "c" / "kv_attn_prefetch_check.c",
                         tmp_path / "prefetch_check", extra=(f"-I{ROOT / 'tests' / 'c'}",))
    if run.returncode == 3:
        pytest.skip("this CPU has neither avx2 nor avx512")
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout and "level avx2 checked" in run.stdout, run.stdout


@pytest.mark.slow
@needs_source
@pytest.mark.toolchain
def test_attention_plan_runs_match_one_call_attention(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run(cc, "plan", tmp_path / "plan_check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan level scalar: 60 runs, 0 failures" in run.stdout
    assert "levels, 0 failures" in run.stdout


@pytest.mark.slow
@needs_source
@pytest.mark.toolchain
def test_attention_plan_under_qemu(tmp_path):
    cc, qemu = aarch64_tools()
    run = _build_and_run(cc, "plan", tmp_path / "plan_a64", extra=("-static",), runner=(qemu,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan level neon: 60 runs, 0 failures" in run.stdout
    assert "2 levels, 0 failures" in run.stdout


# ------------------------------------------------- one registry, one KVCORE_SIMD
_CASE = """
import hashlib, json, numpy as np, kvcore
from kvcore.backends import CPU
rng = np.random.default_rng(11)
kc = rng.standard_normal((40, 2, 16, 64)).astype(np.float16)
vc = rng.standard_normal((40, 2, 16, 64)).astype(np.float16)
q = rng.standard_normal((3, 8, 64)).astype(np.float32)
out = np.empty_like(q)
tables = rng.integers(0, 40, (2, 20)).astype(np.int32)
CPU.paged_attention(q, out, kc, vc, 1, tables, np.array([300, 2], np.int64),
                    np.array([0, 1, 3], np.int64), 0.125, 0, 0.0)
print(json.dumps([kvcore.simd_levels(), hashlib.sha256(out.tobytes()).hexdigest()]))
"""


def _run_case(simd=None):
    import json
    import os
    import sys
    env = dict(os.environ)
    env.pop("KVCORE_SIMD", None)
    if simd is not None:
        env["KVCORE_SIMD"] = simd
    # the kvcore this process tests (the source tree's in-place build, or the
    # installed wheel when the suite runs from an sdist)
    import kvcore
    where = str(Path(kvcore.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", _CASE], env=env, capture_output=True, text=True,
                       cwd=where,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_kvcore_simd_scalar_rules_simd_out_of_every_family():
    from kvcore.backends.cpu import _attention
    import kvcore
    levels, digest = _run_case(" Scalar ")
    assert levels == {"conversions": "scalar", "fp8_int8": "scalar", "attention": "scalar"}
    best = _attention.default_simd_level()
    previous = kvcore.set_simd_level("scalar")
    try:
        _, scalar_digest = _run_case("scalar")
        assert digest == scalar_digest
        # the same case at the best level gives other bits where there is one
        # (so the equality above says which kernels ran)
        if best != "scalar":
            best_levels, best_digest = _run_case()
            assert best_levels["attention"] == best and best_digest != digest
    finally:
        kvcore.set_simd_level(previous)


def test_a_cap_without_attention_kernels_runs_the_next_lower_level():
    from kvcore.backends.cpu import _convert
    if "f16c" not in _convert.available_simd_levels():
        pytest.skip("this CPU has no f16c level")
    levels, _ = _run_case("f16c")
    assert levels == {"conversions": "f16c", "fp8_int8": "scalar", "attention": "scalar"}


def test_simd_levels_reports_the_levels_in_use():
    import kvcore
    from kvcore.backends.cpu import _attention, _convert
    assert kvcore.simd_levels() == {"conversions": _convert.get_simd_level(),
                                    "fp8_int8": _convert.fp8_level(),
                                    "attention": _attention.simd_level()}
    previous = kvcore.set_simd_level("scalar")
    try:
        assert kvcore.simd_levels()["attention"] == "scalar"
    finally:
        kvcore.set_simd_level(previous)
