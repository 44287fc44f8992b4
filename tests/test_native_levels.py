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

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "kvcore" / "backends" / "cpu" / "csrc"
# each check: its C driver and the sources it links
CHECKS = {
    "kv_half": (ROOT / "tests" / "c" / "kv_half_check.c", ("kv_half.c",)),
    "kv_fp8": (ROOT / "tests" / "c" / "kv_fp8_check.c", ("kv_fp8.c", "kv_half.c")),
}

# the attention plan: its driver and the attention kernel's sources
PLAN_CHECK = ROOT / "tests" / "c" / "kv_attention_plan_check.c"

needs_source = pytest.mark.skipif(not (NATIVE / "kv_half.c").exists(),
                                  reason="needs the source tree")


def _attention_sources():
    return tuple(sorted(p.name for p in NATIVE.glob("kv_att*.c")))


def _build_and_run(cc, check, out, extra=(), runner=()):
    driver, sources = CHECKS[check] if check in CHECKS else (PLAN_CHECK, _attention_sources())
    subprocess.run([cc, "-O2", "-pthread", *extra, f"-I{NATIVE}", str(driver),
                    *[str(NATIVE / c) for c in sources], "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True)
    return subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)


@needs_source
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_native_simd_levels_match_scalar(tmp_path, check):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run(cc, check, tmp_path / "check")
    if run.returncode == 3:
        pytest.skip("this CPU has no SIMD level beyond scalar")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 mismatches" in run.stdout


@needs_source
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_neon_level_matches_scalar_under_qemu(tmp_path, check):
    cc, qemu = aarch64_tools()
    run = _build_and_run(cc, check, tmp_path / "check_a64", extra=("-static",), runner=(qemu,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "level neon" in run.stdout and "0 mismatches" in run.stdout


@needs_source
def test_attention_plan_runs_match_one_call_attention(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run(cc, "plan", tmp_path / "plan_check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan level scalar: 60 runs, 0 failures" in run.stdout
    assert "levels, 0 failures" in run.stdout


@needs_source
def test_attention_plan_under_qemu(tmp_path):
    cc, qemu = aarch64_tools()
    run = _build_and_run(cc, "plan", tmp_path / "plan_a64", extra=("-static",), runner=(qemu,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan level neon: 60 runs, 0 failures" in run.stdout
    assert "2 levels, 0 failures" in run.stdout
