"""CUDA paged-attention kernels (``kernels/attention.cu``).  Internal.

The kernels are compiled by the test suite (``nvcc -arch=sm_90``) but not yet
launched by kvcore: ``paged_attention`` on a CUDA pool raises
NotImplementedError.
"""
from pathlib import Path

from ... import dtypes

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ATTENTION_FILE = KERNEL_DIR / "attention.cu"

# Instantiations (element kind, head_dim) the host side will ask for.
KINDS = (dtypes.F32, dtypes.F16, dtypes.BF16)
HEAD_DIMS = (64, 80, 96, 128, 256)


def attention_names():
    """Name expressions of every kernel instantiation (as NVRTC spells them)."""
    names = [f"kva_attention_split<{kind}, {d}>" for kind in KINDS for d in HEAD_DIMS]
    names += [f"kva_attention_merge<{d}>" for d in HEAD_DIMS]
    return names
