"""The CUDA attention kernels (kvcore/backends/cuda/kernels/attention.cu)
compile with nvcc for Hopper, in every instantiation kvcore will ask for,
without warnings, register spills or local memory.  Runs where ``nvcc`` is
on PATH (no GPU needed), skips otherwise.  (The kernels are not launched by
kvcore yet: paged_attention on a CUDA pool raises NotImplementedError.)"""
import re
import shutil
import subprocess

import pytest

from kvcore.backends.cuda import attention_kernels as cuda

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
ARCH = "sm_90"
FLAGS = ["-std=c++17", "-Werror", "all-warnings",
         "-Xptxas", "-warn-spills,-warn-lmem-usage,-Werror"]


def test_every_name_is_a_kernel_of_the_file():
    text = cuda.ATTENTION_FILE.read_text(encoding="utf-8")
    for name in cuda.attention_names():
        assert re.search(rf"(?:\n|void ){name.split('<')[0]}\(", text), name
    assert "#include" not in text   # NVRTC compiles it without headers


def _nvcc(args, cwd):
    r = subprocess.run([NVCC, *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert r.returncode == 0, f"nvcc {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


@needs_nvcc
def test_nvcc_compiles_every_instantiation(tmp_path):
    names = cuda.attention_names()
    src = tmp_path / "attention_all.cu"
    src.write_text(cuda.ATTENTION_FILE.read_text(encoding="utf-8")
                   + "\nvoid *kv_instances[] = {\n"
                   + ",\n".join(f"    (void *)&{n}" for n in names) + "\n};\n",
                   encoding="utf-8")
    _nvcc([f"-arch={ARCH}", *FLAGS, "-keep", "-keep-dir", str(tmp_path), "-c", str(src),
           "-o", str(tmp_path / "k.o")], tmp_path)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    entries = re.findall(r"\.entry\s+(\S+?)\(", ptx)
    assert len(entries) == len(names), entries
    for kernel in ("kva_attention_split", "kva_attention_merge"):
        assert sum(kernel in e for e in entries) == sum(n.startswith(kernel) for n in names)


@needs_nvcc
def test_nvcc_compiles_the_file_as_shipped(tmp_path):
    _nvcc([f"-arch={ARCH}", *FLAGS, "-c", str(cuda.ATTENTION_FILE), "-o",
           str(tmp_path / "k.o")], tmp_path)
