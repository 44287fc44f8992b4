"""The CUDA attention kernels (kvcore/backends/cuda/kernels/attention.cu)
compile with nvcc for Hopper, in every instantiation kvcore will ask for,
without warnings, register spills or local memory.  Runs where ``nvcc`` is
on PATH (no GPU needed), skips otherwise.  The host plan of a call
(``attention_kernels.plan``) is checked here too; the kernels themselves run
in test_cuda_host_emulation.py (host emulation) and test_cuda_backend.py (a GPU)."""
import re
import subprocess

import numpy as np
import pytest

from kvcore.backends.cuda import attention_kernels as cuda

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

try:  # tests/ as a package or as a plain directory on sys.path
    from .test_cuda_kernels_compile import (  # noqa: F401
        ARCH, NVCC, NVCC_FLAGS as FLAGS, _nvcc, check_modules_lowered, needs_nvcc,
        nvrtc, nvrtc_build)
except ImportError:
    from test_cuda_kernels_compile import (  # noqa: F401
        ARCH, NVCC, NVCC_FLAGS as FLAGS, _nvcc, check_modules_lowered, needs_nvcc,
        nvrtc, nvrtc_build)


def test_every_name_is_a_kernel_of_the_file():
    text = cuda.source()
    for name in cuda.attention_names():
        assert re.search(rf"(?:\n|void ){name.split('<')[0]}\(", text), name
    # NVRTC compiles it without system headers: its only includes are the
    # kernel headers beside it, pasted in by the loader (_sources.source)
    includes = re.findall(r'^\s*#\s*include\s*(\S+)',
                          cuda.ATTENTION_FILE.read_text(encoding="utf-8"), re.M)
    assert includes == ['"kv_attn.cuh"', '"kv_attn_decode.cuh"', '"kv_attn_prefill.cuh"'], \
        includes
    assert "#include" not in cuda.source()
    assert "kv_fp8_to_f32_one" in cuda.source()   # the shared fp8 rule, not a copy


def test_host_constants_match_the_file():
    text = cuda.source()
    assert re.search(rf"#define KVA_HEADS {cuda.CHUNK_HEADS}\n", text)
    assert re.search(rf"#define KVA_WARPS {cuda.WARPS}\n", text)
    assert re.search(rf"#define KVA_TILE_BYTES {cuda.TILE_BYTES} ", text)
    assert re.search(r"#define KVA_ROWS 8 ", text) and cuda.THREADS == 8 * 16
    for name, value in (("WARPS", cuda.TC_WARPS), ("KEYS", cuda.TC_KEYS),
                        ("ROWS", cuda.TC_ROWS), ("MAX_SPLITS", cuda.TC_MAX_SPLITS)):
        assert re.search(rf"#define KVT_{name} {value}\b", text), name
    assert cuda.TC_THREADS == 32 * cuda.TC_WARPS
    assert "static constexpr int STAGES = ROW <= 128 ? 3 : 2;" in text
    assert [cuda.tc_stages(k, 128) for k in (cuda.dtypes.F16, cuda.dtypes.F8E4M3)] == [2, 3]


def test_tensor_core_plan_covers_each_pair_and_visible_key_once():
    """Every (query row, query head) of the planned sequences gets each
    visible key in exactly one item of its kv head, splits consecutive and
    in order; items hold at most TC_ROWS pairs of one sequence."""
    nq = np.array([1, 5, 0, 3, 1])
    lens = np.array([300, 40, 9, 3, 1000])
    qsl = np.concatenate([[0], np.cumsum(nq)])
    for H, KVH, window in ((20, 2, 0), (32, 8, 7), (12, 1, 100), (4, 4, 0)):
        G = H // KVH
        items, nsplit = cuda.tc_plan(qsl, lens, H, KVH, window, split_keys=64,
                                     seqs=np.array([True, True, True, True, False]))
        seen = {}
        for k, (it, ns) in enumerate(zip(items.tolist(), nsplit.tolist())):
            s, g, p0, npairs, k0, k1, sp, _ = it
            assert 0 < npairs <= cuda.TC_ROWS and p0 % cuda.TC_ROWS == 0 and 0 < k1 - k0 <= 64
            assert items[k - sp][6] == 0 and (items[k - sp:k + 1, 4] < k0 + 1).all()
            for p in range(p0, p0 + npairs):
                row, h = qsl[s] + p // G, g * G + p % G
                seen.setdefault((row, h), []).append((k0, k1, ns))
        assert set(seen) == {(r, h) for r in range(int(qsl[4])) for h in range(H)}
        for (row, h), ranges in seen.items():
            s = int(np.searchsorted(qsl, row, side="right") - 1)
            pos = lens[s] - nq[s] + row - qsl[s]
            lo = max(0, pos + 1 - window) if window else 0
            assert ranges[0][0] <= lo and ranges[-1][1] >= pos + 1
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(ns == len(ranges) for _, _, ns in ranges)
    # sized from the device: batch 1 x 32k, 8 kv heads, fills 132 SMs
    items, nsplit = cuda.tc_plan([0, 1], [32768], 32, 8, 0, num_sms=132)
    assert cuda.TC_BLOCKS_PER_SM * 132 * 0.9 <= len(items) <= cuda.TC_BLOCKS_PER_SM * 132 + 8
    # batch 64: enough units, no split
    items, nsplit = cuda.tc_plan(np.arange(65), np.full(64, 4096), 32, 8, 0, num_sms=132)
    assert len(items) == 64 * 8 and (nsplit == 1).all()
    # never more than TC_MAX_SPLITS splits of a unit
    items, nsplit = cuda.tc_plan([0, 1], [10 ** 6], 8, 8, 0, split_keys=64)
    assert nsplit.max() <= cuda.TC_MAX_SPLITS and (items[:, 5] - items[:, 4]).sum() == 8 * 10 ** 6


def test_split_keys_are_sized_from_the_multiprocessors():
    """Few long rows on many multiprocessors: split to about
    BLOCKS_PER_SM blocks per multiprocessor; enough rows: not split; never
    below MIN_SPLIT_KEYS, always whole tiles."""
    one = cuda.split_keys_for([0, 1], [32768], 32, 8, 0, 132)   # batch 1, 32k, group 4
    items, _, _ = cuda.plan([0, 1], [32768], 32, 8, 0, num_sms=132)
    assert one % cuda.SPLIT_ALIGN == 0 and one < 32768
    assert cuda.BLOCKS_PER_SM * 132 // 2 <= len(items) <= 2 * cuda.BLOCKS_PER_SM * 132
    qsl = np.arange(65)
    many = cuda.split_keys_for(qsl, np.full(64, 4096), 32, 8, 0, 132)  # batch 64: 512 units
    assert many == 4096
    assert cuda.split_keys_for([0, 1], [100], 32, 8, 0, 132) == cuda.MIN_SPLIT_KEYS
    # a sliding window bounds what a row sees, hence its splits
    assert cuda.split_keys_for([0, 1], [32768], 32, 8, 1024, 132) == cuda.MIN_SPLIT_KEYS
    # without a count: the fixed SPLIT_KEYS
    items, nsplit, _ = cuda.plan([0, 1], [1000], 8, 8, 0)
    assert int(nsplit[0]) == -(-1000 // cuda.SPLIT_KEYS)


def test_udiv_magic_numbers():
    """The tiled kernel's 32-bit division by block_size (KvaDiv: a
    multiply-high by a magic number): the same arithmetic in Python over
    divisors and dividends at the edges."""
    def init(d):
        lg = 0
        while lg < 32 and (1 << lg) < d:
            lg += 1
        return ((1 << 32) * ((1 << lg) - d)) // d + 1, lg

    rng = np.random.default_rng(0)
    divisors = [1, 2, 3, 5, 7, 16, 33, 100, 255, 256, 257, 65535, 2 ** 20 + 1, 2 ** 30,
                2 ** 31 - 1, 2 ** 31] + [int(x) for x in rng.integers(1, 2 ** 31, 50)]
    for d in divisors:
        m, lg = init(d)
        assert 0 < m < 2 ** 32
        ns = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2 ** 32 - 1, 2 ** 31, 2 ** 31 - 1]
        ns += [int(x) for x in rng.integers(0, 2 ** 32, 200)]
        for n in ns:
            if 0 <= n < 2 ** 32:
                assert (((m * n) >> 32) + n) >> lg == n // d, (d, n)


@pytest.mark.parametrize("window", [0, 7, 100])
def test_plan_covers_each_rows_visible_keys_once(window):
    """Every (query row, query head) gets each visible key in exactly one
    item, splits in order; merge rows list exactly the (row, chunk)s of
    more than one split."""
    nq = np.array([1, 5, 0, 3])
    lens = np.array([300, 40, 9, 3])
    qsl = np.concatenate([[0], np.cumsum(nq)])
    H, KVH = 20, 2        # groups of 10: a chunk of 8 heads and one of 2
    items, nsplit, merge = cuda.plan(qsl, lens, H, KVH, window, split_keys=16)
    seen = {}
    for it, ns in zip(items, nsplit):
        s, row, g, h0, nh, k0, k1 = (int(x) for x in it)
        assert 0 < nh <= cuda.CHUNK_HEADS and g * (H // KVH) <= h0 < (g + 1) * (H // KVH)
        for h in range(h0, h0 + nh):
            seen.setdefault((row, h), []).append((k0, k1, int(ns)))
    assert len(seen) == int(qsl[-1]) * H
    for (row, h), ranges in seen.items():
        s = int(np.searchsorted(qsl, row, side="right") - 1)
        pos = lens[s] - nq[s] + row - qsl[s]
        lo = max(0, pos + 1 - window) if window else 0
        assert ranges[0][0] == lo and ranges[-1][1] == pos + 1
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(ns == len(ranges) for _, _, ns in ranges)
    multi = {(int(r), int(h0)) for r, h0, _, _ in merge}
    assert multi == {(it[1], it[3]) for it, ns in zip(items, nsplit) if ns > 1}
    for r, h0, nh, first in merge:
        assert items[first][1] == r and items[first][3] == h0 and items[first][4] == nh


@pytest.mark.slow
@needs_nvcc
def test_nvcc_compiles_every_instantiation(tmp_path):
    names = cuda.attention_names()
    src = tmp_path / "attention_all.cu"
    src.write_text(cuda.source()
                   + "\nvoid *kv_instances[] = {\n"
                   + ",\n".join(f"    (void *)&{n}" for n in names) + "\n};\n",
                   encoding="utf-8")
    _nvcc([f"-arch={ARCH}", *FLAGS, "-keep", "-keep-dir", str(tmp_path), "-c", str(src),
           "-o", str(tmp_path / "k.o")], tmp_path)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    entries = re.findall(r"\.entry\s+(\S+?)\(", ptx)
    assert len(entries) == len(names), entries
    for kernel in ("kva_attention_split", "kva_attention_split_scalar", "kva_attention_prefill",
                   "kva_attention_merge", "kva_decode_tc", "kva_prefill_tc"):
        mangled = f"{len(kernel)}{kernel}I"   # the name's Itanium mangling, then its template
        assert sum(mangled in e for e in entries) == sum(n.startswith(kernel + "<")
                                                         for n in names), kernel


@pytest.mark.slow
@needs_nvcc
def test_tiled_and_prefill_kernel_resources_on_sm_90(tmp_path):
    """ptxas -v for every tiled, prefill and tensor-core decode
    instantiation: no spills, no stack, at most 40 KB of static shared
    memory (static: under 48 KB); the tiled kernel at most 128 registers (4
    blocks of 128 threads per SM, BLOCKS_PER_SM), the prefill one at most
    168 (3 blocks per SM), the tensor-core decode at most 255 (2 blocks per
    SM, TC_BLOCKS_PER_SM, its __launch_bounds__) and the FlashAttention-2
    prefill at most 255.  Measured (nvcc 13.0, sm_90): tiled 48-80
    registers, 19.3-35.3 KB; prefill 115-164 registers, 8.3-16.3 KB;
    tensor-core decode 158-254 registers, no static shared memory (the
    dynamic amounts: attention_kernels.tc_smem); FlashAttention-2 prefill
    226-255 registers (attention_kernels.prefill_tc_smem)."""
    names = [cuda.split_name(k, d) for k in cuda.KINDS for d in cuda.HEAD_DIMS]
    names += [cuda.prefill_name(k, d) for k in cuda.PREFILL_KINDS
              for d in cuda.PREFILL_HEAD_DIMS]
    names += [cuda.tc_name(k, d, mt) for k in cuda.TC_KINDS for mt in cuda.tc_mma_kinds(k)
              for d in cuda.TC_HEAD_DIMS]
    names += [cuda.prefill_tc_name(k, d) for k in cuda.PREFILL_KINDS
              for d in cuda.PREFILL_TC_HEAD_DIMS]
    src = tmp_path / "attention_tiled.cu"
    src.write_text(cuda.source() + "\nvoid *kv_instances[] = {\n"
                   + ",\n".join(f"    (void *)&{n}" for n in names) + "\n};\n",
                   encoding="utf-8")
    r = subprocess.run([NVCC, f"-arch={ARCH}", "-std=c++17", "-Xptxas", "-v", "-c", str(src),
                        "-o", str(tmp_path / "k.o")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    used = re.findall(r"Compiling entry function '(\S+)'[^\n]*\n[^\n]*Function properties[^\n]*"
                      r"\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                      r"spill loads\n[^\n]*Used (\d+) registers[^\n]*?(?:(\d+) bytes smem|\n)",
                      r.stderr)
    assert len(used) == len(names), r.stderr[-2000:]
    for entry, stack, st, ld, regs, smem in used:
        assert (int(stack), int(st), int(ld)) == (0, 0, 0), entry
        most = 255 if "decode_tc" in entry or "prefill_tc" in entry else \
            168 if "prefill" in entry else 128
        assert int(regs) <= most and int(smem or 0) <= 40 * 1024, (entry, regs, smem)
    for kind in cuda.TC_KINDS:   # 2 blocks per SM fit in an sm_90's 228 KB
        for d in cuda.TC_HEAD_DIMS:
            assert 2 * (cuda.tc_smem(kind, d) + 1024) <= 228 * 1024
    for d in cuda.PREFILL_TC_HEAD_DIMS:   # and of the prefill
        assert 2 * (cuda.prefill_tc_smem(d) + 1024) <= 228 * 1024


@needs_nvcc
def test_nvcc_compiles_the_file_as_shipped(tmp_path):
    _nvcc([f"-arch={ARCH}", *FLAGS, "-c", str(cuda.ATTENTION_FILE), "-o",
           str(tmp_path / "k.o")], tmp_path)


# attention.cu's only architecture branches are at sm_80 (cp.async,
# ldmatrix, mma, the float -> half pair conversion) and sm_89 (the fp8 pair
# conversions): sm_80, sm_89 and sm_90 compile every side of each.  PTX, not
# a cubin: ptxas over these kernels takes minutes, and the nvcc tests above
# already run it for sm_90 (no spills, registers bounded); the front end and
# optimizer are NVRTC's.
ATTENTION_NVRTC_TARGETS = ("compute_80", "compute_89", "compute_90")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ATTENTION_NVRTC_TARGETS)
def test_nvrtc_compiles_every_attention_module_as_the_backend_does(nvrtc, arch):
    """Each attention module (one page kind's split kernels, or the merge
    kernels) as CudaBackend asks CuPy for it: the pasted source, kvcore's
    options and those CuPy adds for the GPU (FTZ included)."""
    modules = [names for _key, names in cuda.modules()]
    check_modules_lowered(nvrtc_build(nvrtc, cuda.ATTENTION_FILE.name, cuda.source(), arch,
                                      modules), modules)
