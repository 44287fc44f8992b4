"""A wheel built here must run on any x86-64: only the run-time dispatched
SIMD functions of kv_half.c may contain instructions beyond the x86-64
baseline (SSE2).  Checked on the built extension modules' machine code."""
import glob
import os
import platform
import re
import shutil

import pytest

try:
    from _helpers import functions_in
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import functions_in

import kvcore._native
import kvcore.backends.cpu

NATIVE = os.path.dirname(kvcore._native.__file__)
CPU = os.path.dirname(kvcore.backends.cpu.__file__)
# the bookkeeping and the conversion/copy kernels (the attention kernels
# have their own dispatch checks)
EXTENSIONS = sorted(glob.glob(os.path.join(NATIVE, "*.so"))
                    + glob.glob(os.path.join(CPU, "_convert*.so"))
                    + glob.glob(os.path.join(CPU, "_kernels*.so")))
# Functions compiled with __attribute__((target(...))); each is only reached
# after __builtin_cpu_supports() agreed.
DISPATCHED = re.compile(r"_(sse41|f16c|avx2)$")
# SSE3/SSSE3/SSE4.x mnemonics a baseline function must not contain.
BEYOND_SSE2 = {
    "pblendvb", "blendvps", "blendvpd", "pblendw", "packusdw", "ptest", "pminsd", "pmaxsd",
    "pminud", "pmaxud", "pmulld", "pshufb", "palignr", "pabsd", "phaddd", "pmovzxwd",
    "pmovzxbw", "pmovsxwd", "roundps", "roundss", "insertps", "pextrd", "pinsrd", "dpps",
    "popcnt", "lzcnt", "tzcnt", "andn", "shlx", "shrx", "sarx", "bzhi", "pdep", "pext",
}

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
    reason="needs x86-64 and objdump")




def _offending(insns):
    for insn in insns:
        op = insn.split()[0]
        if op.startswith("v") or "ymm" in insn or "zmm" in insn or op in BEYOND_SSE2:
            return insn
    return None


@pytest.mark.parametrize("so", EXTENSIONS,
                         ids=os.path.basename)
def test_only_dispatched_functions_use_simd_extensions(so):
    bad = {}
    for fn, insns in functions_in(so).items():
        name = fn.split("@")[0].split(".")[0]
        if DISPATCHED.search(name):
            continue
        hit = _offending(insns)
        if hit:
            bad[fn] = hit
    assert not bad, f"{os.path.basename(so)}: baseline functions use newer instructions: {bad}"


def test_dispatched_functions_are_present():
    so = glob.glob(os.path.join(CPU, "_convert*.so"))
    assert so, "the _convert extension is not built"
    names = {fn.split(".")[0] for fn in functions_in(so[0])}
    for want in ("f32_to_f16_f16c", "f32_to_bf16_avx2", "f32_to_bf16_sse41"):
        assert want in names, f"{want} missing from {os.path.basename(so[0])}"


@pytest.mark.parametrize("so", EXTENSIONS,
                         ids=os.path.basename)
def test_no_avx512_code(so):
    # The AVX-512 conversion path was removed (slower than AVX2 where measured):
    # no function of any extension may use 512-bit registers or mask registers.
    bad = {fn: insn for fn, insns in functions_in(so).items() for insn in insns
           if "zmm" in insn or re.search(r"%k[0-7]\b", insn)}
    assert not bad, f"{os.path.basename(so)}: AVX-512 instructions in {sorted(bad)[:5]}"


def test_checker_flags_simd_code():
    # the check above can fail: it does flag the AVX2 body it exempts
    so = glob.glob(os.path.join(CPU, "_convert*.so"))[0]
    fns = {fn.split(".")[0]: insns for fn, insns in functions_in(so).items()}
    assert _offending(fns["f32_to_bf16_avx2"]) is not None
    assert _offending(fns["f32_to_bf16_sse41"]) is not None
