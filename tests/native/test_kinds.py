"""One element-kind table: kvcore/backends/cpu/csrc/kv_kinds.h numbers the
kinds; every twin (Python's kvcore.dtypes, the CUDA kernels' kv_half.cuh, the
attention kernels' kv_attention.h, the CUDA loader) must carry its values."""
import re
from pathlib import Path

import pytest

from kvcore import dtypes
from kvcore.backends.cpu import _convert, _kernels
from kvcore.backends.cuda import _sources

ROOT = Path(__file__).resolve().parents[2]
CPU_CSRC = ROOT / "kvcore" / "backends" / "cpu" / "csrc"
CUDA_KERNELS = ROOT / "kvcore" / "backends" / "cuda" / "kernels"

# the C header, as compiled into the CPU extension (not re-read from text)
C_KINDS = {"F32": _convert.F32, "F16": _convert.F16, "BF16": _convert.BF16,
           **_kernels.LOWPREC_KINDS}


def enum_values(path, prefix):
    """``{name: value}`` of the ``prefix``-named enumerators in a C header."""
    text = path.read_text(encoding="utf-8")
    return {m.group(1): int(m.group(2))
            for m in re.finditer(rf"\b{prefix}(F32|F16|BF16|F8E4M3|F8E5M2|I8)\s*=\s*(\d+)", text)}


def test_the_kinds_are_distinct():
    assert sorted(C_KINDS.values()) == [0, 1, 2, 3, 4, 5]


def test_python_mirrors_the_c_header():
    assert {"F32": dtypes.F32, "F16": dtypes.F16, "BF16": dtypes.BF16,
            "F8E4M3": dtypes.F8E4M3, "F8E5M2": dtypes.F8E5M2, "I8": dtypes.I8} == C_KINDS
    assert set(dtypes.KIND_NAME) == set(C_KINDS.values())
    assert dtypes.KIND_NAME[C_KINDS["BF16"]] == "bfloat16"
    assert dtypes.KIND_NAME[C_KINDS["F8E4M3"]] == "float8_e4m3fn"
    assert dtypes.KIND_NAME[C_KINDS["F8E5M2"]] == "float8_e5m2"
    assert dtypes.KIND_NAME[C_KINDS["I8"]] == "int8"


def test_the_cuda_loader_uses_the_python_table():
    assert (_sources.F32, _sources.F16, _sources.BF16) == (dtypes.F32, dtypes.F16, dtypes.BF16)


@pytest.mark.parametrize("path, prefix", [
    (CPU_CSRC / "kv_kinds.h", "KVH_"),
    (CUDA_KERNELS / "kv_half.cuh", "KV_"),
    (CPU_CSRC / "kv_attention.h", "KVA_"),
], ids=lambda x: x.name if isinstance(x, Path) else x)
def test_every_c_and_cuda_twin_carries_the_same_values(path, prefix):
    if not path.exists():
        pytest.skip("needs the source tree")
    assert enum_values(path, prefix) == C_KINDS, f"{path.name} numbers the kinds differently"
