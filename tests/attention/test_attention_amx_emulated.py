"""The amx level of the attention (kv_attn_amx.c: AMX-BF16 tiles for
prefill items) on any CPU, under a tile emulation written from Intel's
published pseudocode (tests/c/amx_tile_emulation.h) with the AVX-512
intrinsics from SIMDe (PyPI ``simde-py``, in the test extra):

- the emulation itself against the pseudocode's facts (even/odd
  accumulators, DAZ, FTZ, round to nearest even, rows x colsb moves);
- the amx level against a double-precision attention within 1e-5 (every
  page kind, head_dims 32-256, GQA, ragged tails, causal, sliding window,
  soft cap, chunked prefill over cached context, 3 threads = 1 thread's
  bits), and that the tiles ran exactly where they should;
- KVCORE_SIMD=amx is a valid cap (the best level under it is used);
- the detection on a made-up CPU/OS: the tile permission requested once,
  a refusal or an old kernel a clean fallback.

This runs the tile code on CPUs without AMX; on a CPU with AMX (first an Intel Xeon,
2026-12-05) the amx level also runs natively in every attention test."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvcore" / "backends" / "cpu" / "csrc"
TESTS_C = ROOT / "tests" / "c"

needs_source = pytest.mark.skipif(not (CSRC / "kv_attention.c").exists(),
                                  reason="needs the source tree")


def _simde_include():
    """SIMDe's include folder: simde-py's (>= 0.8.2), else the system's."""
    try:
        import simde_py
        return simde_py.get_include()
    except ImportError:
        if Path("/usr/include/simde/x86/avx512.h").exists():
            return "/usr/include"
    pytest.skip("needs SIMDe (pip install simde-py, in kvcore's test extra)")


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _build(out, driver, sources=()):
    # -DKVA_AMX_TARGET= : no target attribute (the emulation runs anywhere);
    # -DKVS_TEST_ASSUME_AMX : kv_simd.c reports the amx level supported;
    # -Wno-psabi : SIMDe's 512-bit vector types passed without AVX-512
    cmd = [_cc(), "-O2", "-pthread", "-Wall", "-Werror", "-Wno-psabi",
           "-DKVA_AMX_EMULATION", "-DKVA_AMX_TARGET=", "-DKVS_TEST_ASSUME_AMX",
           f"-I{_simde_include()}", f"-I{TESTS_C}", f"-I{CSRC}", str(driver),
           *[str(s) for s in sources], "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@needs_source
def test_tile_emulation_follows_the_pseudocode(tmp_path):
    exe = _build(tmp_path / "emu", TESTS_C / "amx_tile_emulation_check.c")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "emulation: 0 failures" in run.stdout


def _amx_level_sources(tmp_path):
    """The attention sources of the amx level's driver: the avx512 kernels
    (which the amx level runs for its other items) compiled against SIMDe on
    their own, without -Werror (SIMDe's headers warn differently under other
    compilers), and every other kv_att*.c plus kv_simd.c."""
    avx512 = tmp_path / "kv_attn_avx512.o"
    r = subprocess.run([_cc(), "-O2", "-Wall", "-Wno-psabi", "-include",
                        str(TESTS_C / "kv_simde_shim.h"), "-DKVA_AVX512_SIMDE",
                        "-DKVA_AVX512_TARGET=", f"-I{_simde_include()}", f"-I{CSRC}", "-c",
                        str(CSRC / "kv_attn_avx512.c"), "-o", str(avx512)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return [*sorted(p for p in CSRC.glob("kv_att*.c") if p.name != "kv_attn_avx512.c"),
            CSRC / "kv_simd.c", avx512]


@pytest.mark.slow
@needs_source
def test_amx_level_under_the_tile_emulation(tmp_path):
    import platform
    from kvcore.backends.cpu import _attention
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the amx level exists on x86-64 only")
    if "avx2" not in _attention.available_simd_levels():
        # the level's decode items and float32 pages run the AVX2 kernels natively
        pytest.skip("CPU lacks avx2 (the amx level's other kernels)")
    sources = _amx_level_sources(tmp_path)
    exe = _build(tmp_path / "amx", TESTS_C / "kv_attention_amx_check.c", sources)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("amx: "))
    cases, failures, tdp = line.split()[1], line.split()[3], line.split()[5]
    assert int(cases) > 90 and failures == "0" and int(tdp) > 0, line


@pytest.mark.slow
@needs_source
def test_amx_is_the_default_where_it_is_supported(tmp_path):
    """On a CPU with the amx level (assumed here: -DKVS_TEST_ASSUME_AMX) the
    default is amx (measured faster than avx512 on an Intel Xeon with AMX:
    docs/performance.md); KVCORE_SIMD below it caps it."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the amx level exists on x86-64 only")
    sources = _amx_level_sources(tmp_path)
    exe = _build(tmp_path / "amx_default", TESTS_C / "kv_attention_amx_default_check.c", sources)
    outs = {}
    for value in (None, "", " AMX ", "avx512"):
        env = {k: v for k, v in os.environ.items() if k != "KVCORE_SIMD"}
        if value is not None:
            env["KVCORE_SIMD"] = value
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        outs[value] = run.stdout.split()
    below = outs[None][5].rstrip(",")
    assert outs[None][-1] == "1"                       # amx supported (assumed)
    assert below != "amx"
    assert outs[None][1].rstrip(",") == "amx"         # unset: amx
    assert outs[""][1].rstrip(",") == "amx"           # empty: no cap
    assert outs[" AMX "][1].rstrip(",") == "amx"      # named: amx
    assert outs["avx512"][1].rstrip(",") == below     # a cap under it


def test_kvcore_simd_amx_is_a_valid_cap():
    import kvcore
    from kvcore.backends.cpu import _attention, _convert
    env = dict(os.environ, KVCORE_SIMD=" AMX ")
    where = str(Path(kvcore.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    code = "import json, kvcore; print(json.dumps(kvcore.simd_levels()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=where, timeout=120)
    assert r.returncode == 0, r.stderr
    import json
    levels = json.loads(r.stdout)
    # amx caps nothing below it, and names the amx level: each family runs
    # the best it has here
    assert levels["attention"] == _attention.available_simd_levels()[-1]
    assert levels["conversions"] == _convert.best_simd_level()


@needs_source
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="the amx detection is x86-64 Linux's (CPUID, XGETBV, arch_prctl)")
@pytest.mark.parametrize("scenario, amx, requests", [
    ("granted", 1, 1), ("refused", 0, 1), ("oldkernel", 0, 1), ("noxcr0", 0, 0), ("nobf16", 0, 0)])
def test_amx_detection_asks_the_os_once_and_falls_back(tmp_path, scenario, amx, requests):
    """kv_simd.c on a made-up CPU/OS (tests/c/kv_simd_fake_cpu.h): the tile
    permission is requested once, only when the CPU and XCR0 allow AMX; a
    refusal (EPERM) or an old kernel (EINVAL) leaves amx unsupported; and
    the conversions never run a registry level past their own (avx2)."""
    cc = _cc()
    obj = tmp_path / "kv_simd.o"
    for cmd in ([cc, "-O2", "-Wall", "-Werror", "-include", str(TESTS_C / "kv_simd_fake_cpu.h"),
                 f"-I{CSRC}", "-c", str(CSRC / "kv_simd.c"), "-o", str(obj)],
                [cc, "-O2", "-Wall", "-Werror", f"-I{CSRC}",
                 str(TESTS_C / "kv_simd_amx_detect_check.c"), str(CSRC / "kv_half.c"), str(obj),
                 "-o", str(tmp_path / "detect")]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    run = subprocess.run([str(tmp_path / "detect"), scenario], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    from kvcore.backends.cpu import _convert
    conv = _convert.best_simd_level()   # this CPU's: the fake changes only amx
    assert run.stdout.strip() == (f"{scenario}: amx {amx}, requests {requests}, "
                                  f"conversions {conv}, best {conv}")
