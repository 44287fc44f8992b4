"""How a plane's elements are stored: the one argument every data op takes.

A paged plane (one layer's keys or values of a pool) or a contiguous plane
(one layer's keys or values of a ``KVCache``) holds elements of one storage
kind.  Float kinds (float32, float16, bfloat16) need nothing else; fp8
planes are read as ``fp8 * layer_scale``; int8 planes keep one float32
scale per (token, kv head) row in a *scale plane* beside the codes.  A
``Codec`` says all three, so a backend op takes one of it instead of a twin
method family per kind: the backend dispatches on ``codec.kind`` inside.

The public classes make their codecs once (``kvcore._planes``), so a data
op's call costs no construction.
"""
from dataclasses import dataclass

from .. import dtypes

__all__ = ["Codec", "codec_of"]


@dataclass(frozen=True, eq=False, slots=True)
class Codec:
    """The storage format of one plane.

    Parameters
    ----------
    kind : int
        The element kind (``kvcore.dtypes.F32 .. I8``).
    layer_scale : float, default 1.0
        fp8 only: stored ``fp8(x / layer_scale)``, read ``fp8 * layer_scale``.
    scale_plane : array or None
        int8 only: the plane's float32 scales, one per row of ``head_dim``
        elements (a paged plane: ``(num_blocks, heads, block_size)``; a
        contiguous one: ``(batch, heads, max_seq_len)``), C-contiguous.
    head_scales : array or None
        fp8 only, one scale per kv head: float32 ``(heads,)``,
        C-contiguous; head ``h`` (axis -3 of a plane, paged or contiguous)
        is stored ``fp8(x / head_scales[h])`` and ``layer_scale`` is unused.
    """

    kind: int
    layer_scale: float = 1.0
    scale_plane: object = None
    head_scales: object = None

    @property
    def lowprec(self):
        """Whether the elements are fp8 or int8 codes (reads widen them)."""
        return self.kind in dtypes.LOWPREC_KINDS


_FLOAT = {k: Codec(k) for k in (dtypes.F32, dtypes.F16, dtypes.BF16)}


def codec_of(kind):
    """The codec of ``kind`` without scales (shared for float kinds): a float
    plane's, or fp8 codes read with scale 1."""
    c = _FLOAT.get(kind)
    return Codec(kind) if c is None else c
