"""The SIMD kernel levels the tests parametrize over: every level of this
machine's architecture, the ones the CPU lacks skipped with a reason naming
the missing feature (plain functions, and a fixture factory for the modules
that run each test at every level of one native module)."""
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


def level_fixture(module):
    """A pytest fixture, to be bound to the name ``simd_level`` in a test
    module, that runs each test using it once per kernel level of
    ``module`` (a native module with ``available_simd_levels`` and
    ``simd_level_names``), set by ``kvcore.set_simd_level``, restoring the
    level after the test whatever happens in it.  Yields the level's name."""
    import kvcore
    @pytest.fixture(params=simd_level_params(module.available_simd_levels(),
                                             module.simd_level_names()))
    def simd_level(request):
        previous = kvcore.set_simd_level(request.param)
        try:
            yield request.param
        finally:
            kvcore.set_simd_level(previous)
    return simd_level
