"""CPU kernels (C, runtime SIMD dispatch) behind thin Cython wrappers.  Internal,
but for :func:`simd_levels`, which ``kvcore`` exports."""
from . import _attention, _convert


def simd_levels():
    """The SIMD level each CPU kernel family runs at now.

    Every family takes its levels, the CPU's features and the ``KVCORE_SIMD``
    cap from one registry (``csrc/kv_simd.h``), and runs the best level it has
    kernels for at or under the cap; a family without kernels of a level runs
    the next lower one (the attention has no ``f16c`` kernels, so
    ``KVCORE_SIMD=f16c`` runs it at ``scalar``).

    Returns
    -------
    dict
        ``{"conversions": ..., "fp8_int8": ..., "attention": ...}``: level
        names (``"scalar"``, ``"f16c"``, ``"avx2"``, ``"avx512"``, ``"neon"``, or
        ``"amx"`` for the attention only) of the float16/bfloat16 conversions, the
        fp8/int8 conversions and the attention kernels.

    Examples
    --------
    >>> import kvcore
    >>> sorted(kvcore.simd_levels())
    ['attention', 'conversions', 'fp8_int8']
    """
    return {"conversions": _convert.get_simd_level(), "fp8_int8": _convert.fp8_level(),
            "attention": _attention.simd_level()}
