"""CPU kernels (C, runtime SIMD dispatch) behind thin Cython wrappers.  Internal,
but for :func:`simd_levels` and :func:`set_simd_level`, which ``kvcore`` exports."""
from ..._ints import shown
from . import _attention, _convert

def simd_levels():
    """The SIMD level each CPU kernel family runs at now.

    Every family takes its levels, the CPU's features and the ``KVCORE_SIMD``
    cap from one registry (``csrc/kv_simd.h``), and runs the best level it has
    kernels for at or under the cap (or the level given to
    :func:`set_simd_level`); a family without kernels of a level runs the next
    lower one (the attention has no ``f16c`` kernels, so ``KVCORE_SIMD=f16c``
    runs it at ``scalar``).

    Returns
    -------
    dict
        ``{"conversions": ..., "fp8_int8": ..., "attention": ...}``: level
        names (``"scalar"``, ``"f16c"``, ``"avx2"``, ``"avx512"``, ``"amx"``,
        ``"neon"``) of the float16/bfloat16 conversions, the fp8/int8
        conversions and the attention kernels.

    Examples
    --------
    >>> import kvcore
    >>> sorted(kvcore.simd_levels())
    ['attention', 'conversions', 'fp8_int8']
    """
    return {"conversions": _convert.get_simd_level(), "fp8_int8": _convert.fp8_level(),
            "attention": _attention.simd_level()}


def set_simd_level(level):
    """Run every CPU kernel family at the best level it has at or under ``level``.

    Process-wide; every level gives the bits of the scalar kernels (up to the
    attention's documented rounding), so this is for benchmarks and debugging.
    The ``KVCORE_SIMD`` cap only sets the level at import; this may name any
    level the CPU supports, ``amx`` included.

    Parameters
    ----------
    level : str
        ``"scalar"``, ``"f16c"``, ``"avx2"``, ``"avx512"``, ``"amx"`` (x86-64) or
        ``"neon"`` (AArch64), one this CPU supports.

    Returns
    -------
    str
        The level in force before (the highest level any family ran at), to
        hand back to ``set_simd_level`` to restore it.

    Raises
    ------
    ValueError
        ``level`` names no level, or one this CPU does not support; nothing
        changed.

    Examples
    --------
    >>> import kvcore
    >>> previous = kvcore.set_simd_level("scalar")
    >>> kvcore.simd_levels()
    {'conversions': 'scalar', 'fp8_int8': 'scalar', 'attention': 'scalar'}
    >>> _ = kvcore.set_simd_level(previous)
    """
    names, supported = _convert.registry_levels()
    if not isinstance(level, str) or level not in supported:
        raise ValueError(f"set_simd_level: level must be one of {supported} (the levels of "
                         f"{names} this CPU supports), got {shown(level)}")
    previous = max((_convert.get_simd_level(), _attention.simd_level()), key=names.index)
    _convert.use_registry_level(names.index(level))
    _attention.use_registry_level(names.index(level))
    return previous
