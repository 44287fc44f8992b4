"""CUDA kernels of the backends layer (``kernels/*.cu``).  Internal.

``kernels/attention.cu`` holds paged attention for CUDA pools.  It is
compiled by the test suite (``nvcc -arch=sm_90``) but not yet launched by
kvcore: ``paged_attention`` on a CUDA pool raises NotImplementedError.
"""
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ATTENTION_FILE = KERNEL_DIR / "attention.cu"

# Instantiations (element kind, head_dim) the host side will ask for.
KINDS = (0, 1, 2)              # float32, float16, bfloat16 (kvcore._dtypes numbering)
HEAD_DIMS = (64, 80, 96, 128, 256)


def attention_names():
    """Name expressions of every kernel instantiation (as NVRTC spells them)."""
    names = []
    for kind in KINDS:
        for d in HEAD_DIMS:
            names.append(f"kva_attention_split<{kind}, {d}>")
    names += [f"kva_attention_merge<{d}>" for d in HEAD_DIMS]
    return names
