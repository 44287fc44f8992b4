"""The SIMD kernel levels the tests parametrize over (not fixtures: plain
functions): every level of this machine's architecture, the ones the CPU
lacks skipped with a reason naming the missing feature."""
import platform

import pytest


# The CPU features each x86-64 kernel level needs (kv_simd.c's detection;
# avx512 also needs the OS to save the zmm state, XCR0; amx the tile state
# too, and Linux's grant of it: ARCH_REQ_XCOMP_PERM).
_X86_LEVEL_FEATURES = {"f16c": ("avx", "f16c", "sse4_1"), "avx2": ("avx2", "fma", "f16c"),
                       "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                  "avx512dq"),
                       "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                               "avx512dq", "amx_tile", "amx_bf16")}


def cpu_flags():
    """The CPU feature flags Linux lists in /proc/cpuinfo (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def simd_level_params(available, levels):
    """pytest params for every kernel level in ``levels`` that this machine's
    architecture has (x86-64 or AArch64): each one ``available`` lacks is
    skipped with a reason naming the missing CPU feature."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    arch = {"scalar"} | (set(_X86_LEVEL_FEATURES) if x86 else {"neon"})
    flags = cpu_flags()
    params = []
    for level in levels:
        if level not in arch:
            continue
        if level in available:
            params.append(level)
            continue
        missing = [f for f in _X86_LEVEL_FEATURES.get(level, (level,)) if f not in flags]
        reason = (f"CPU lacks {', '.join(missing)}" if missing else
                  f"the OS does not enable {level}'s registers (for amx: or refused "
                  f"ARCH_REQ_XCOMP_PERM), or this build has no {level} kernels")
        params.append(pytest.param(level, marks=pytest.mark.skip(reason=reason)))
    return params
