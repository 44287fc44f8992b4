"""Every CUDA kernel compiles, in every instantiation kvcore asks for.

Runs wherever ``nvcc`` is on PATH (no GPU needed) and skips cleanly
otherwise; the NVRTC cases run where libnvrtc can be found (the CUDA
toolkit, or the ``nvidia-cuda-nvrtc`` wheel CuPy uses) and compile exactly
what ``CudaBackend`` hands to CuPy's RawModule: the same text, options and
name expressions.
"""
import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from kvcore.backends.cuda import _sources, attention_kernels

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

# The architecture the compile check targets (Hopper: H100/H200).
ARCH = "sm_90"
# -Werror all-warnings: compiler warnings fail the test.  ptxas: register
# spills or local-memory use in these tiny kernels would be a regression.
NVCC_FLAGS = ["-std=c++17", "-Werror", "all-warnings",
              "-Xptxas", "-warn-spills,-warn-lmem-usage,-Werror"]


def _names_by_file():
    out = {}
    for file, _sk, _dk, names in _sources.modules():
        out.setdefault(file, []).extend(names)
    return out


def _harness(file):
    """The text NVRTC compiles for ``file``, plus one host-side reference to
    every name expression (which instantiates it, as NVRTC's name
    expressions do)."""
    refs = "\n".join(f"void *const kv_instance_{i} = (void *)&{name};"
                     for i, name in enumerate(_names_by_file()[file]))
    return _sources.source(file) + "\n\n/* instantiations kvcore uses */\n" + refs + "\n"


def _nvcc(args, cwd):
    r = subprocess.run([NVCC, *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert r.returncode == 0, f"nvcc {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


def test_every_module_name_is_a_kernel_of_its_file():
    for file, _sk, _dk, names in _sources.modules():
        text = (_sources.KERNEL_DIR / file).read_text(encoding="utf-8")
        for name in names:
            kernel = name.split("<")[0]
            assert re.search(rf"__global__ void {kernel}\(", text), (file, name)
    # attention.cu is loaded and compile-tested on its own (attention_kernels)
    others = {attention_kernels.ATTENTION_FILE.name}
    assert set(_sources.FILES) == {p.name for p in _sources.KERNEL_DIR.glob("*.cu")} - others


def test_source_pastes_the_header_once():
    for file in _sources.FILES:
        text = _sources.source(file)
        assert "#include" not in text
        assert text.count("#define KVCORE_KV_HALF_CUH") == 1


@needs_nvcc
@pytest.mark.parametrize("file", _sources.FILES)
def test_nvcc_compiles_file_as_shipped(file, tmp_path):
    """The .cu file itself, with its #include, as a reader would build it."""
    _nvcc([f"-arch={ARCH}", *NVCC_FLAGS, "-c", str(_sources.KERNEL_DIR / file),
           "-o", str(tmp_path / "k.o")], tmp_path)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """file -> PTX of its every-instantiation build (each file compiled once,
    for the target architecture, with -keep to retain the PTX)."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    cache = {}

    def get(file):
        if file not in cache:
            d = tmp_path_factory.mktemp(file.replace(".", "_"))
            src = d / f"all_{file}"
            src.write_text(_harness(file), encoding="utf-8")
            _nvcc([f"-arch={ARCH}", *NVCC_FLAGS, "-keep", "-keep-dir", str(d), "-c", str(src),
                   "-o", str(d / "k.o")], d)
            ptx = sorted(d.glob("*.ptx"))
            assert len(ptx) == 1, ptx
            cache[file] = ptx[0].read_text()
        return cache[file]

    return get


@needs_nvcc
@pytest.mark.parametrize("file", _sources.FILES)
def test_nvcc_compiles_every_instantiation(file, compiled):
    ptx = compiled(file)
    for name in _names_by_file()[file]:
        kernel = name.split("<")[0]
        # mangled: _Z<length of the name><name>, then I<args> for a template
        assert re.search(rf"\.entry\s+_Z{len(kernel)}{kernel}", ptx), name
    assert len(re.findall(r"\.entry\s", ptx)) == len(_names_by_file()[file])


_ENTRY = re.compile(r"\.entry\s+(_Z\d+(kv_[a-z_]+?)ILi(\d+)ELi(\d+)ELi(\d+)EE\w*)")


@needs_nvcc
@pytest.mark.parametrize("file", ["paged.cu", "contiguous.cu"])
def test_vector_path_moves_16_bytes_per_access(file, compiled):
    """In every vector instantiation each data store is one 128-bit
    st.global.v4 and the data loads are ld.global.v4; the scalar
    instantiations move single elements."""
    ptx = compiled(file)
    seen = 0
    for m in _ENTRY.finditer(ptx):
        v = int(m.group(5))
        body = ptx[m.end():ptx.index("\n}", m.end())]
        stores = re.findall(r"st\.global\.\S+", body)
        v4_loads = re.findall(r"ld\.global\.v4\.u32", body)
        assert stores, m.group(1)
        if v > 1:
            assert all(st == "st.global.v4.u32" for st in stores), (m.group(1), stores)
            assert v4_loads, m.group(1)
        else:
            assert not any(".v4" in st for st in stores) and not v4_loads, m.group(1)
        seen += 1
    assert seen == len(_names_by_file()[file])


# ---------------------------------------------------------------- NVRTC

# KVCORE_NVRTC: a libnvrtc.so, or a folder holding one (e.g. the lib folder
# of an nvidia-cuda-nvrtc wheel installed with pip --target), looked at first.
NVRTC_ENV = "KVCORE_NVRTC"
# KVCORE_REQUIRE_NVRTC=1 (set by .ci/run, which installs the wheel): a
# missing libnvrtc fails the NVRTC tests instead of skipping them.
REQUIRE_NVRTC_ENV = "KVCORE_REQUIRE_NVRTC"


def _find_nvrtc():
    candidates = []
    given = os.environ.get(NVRTC_ENV, "")
    if given:
        candidates += (sorted(glob.glob(os.path.join(given, "libnvrtc.so*")))
                       if os.path.isdir(given) else [given])
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for root in filter(None, [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                              "/usr/local/cuda"]):
        candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
    for site in sys.path:  # the nvidia-cuda-nvrtc wheels CuPy loads
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib",
                                                    "libnvrtc.so*")))
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "lib",
                                                    "libnvrtc.so*")))
    for c in candidates:
        if "builtins" in os.path.basename(c) or ".alt." in os.path.basename(c):
            continue
        # libnvrtc dlopens libnvrtc-builtins by name at compile time; from a
        # wheel's directory (not on the loader's path) it is found only if
        # it is loaded already
        for b in sorted(glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*"))):
            if ".alt." not in os.path.basename(b):
                try:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def nvrtc_or_skip(find=_find_nvrtc, environ=os.environ):
    """libnvrtc (ctypes), or a skip where it cannot be found; a failure
    instead where KVCORE_REQUIRE_NVRTC is set (CI installs it, and a
    skipped NVRTC check would look like a passing one)."""
    lib = find()
    if lib is None:
        if environ.get(REQUIRE_NVRTC_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_NVRTC_ENV}=1 but libnvrtc was not found (install the "
                        f"nvidia-cuda-nvrtc wheel, or point {NVRTC_ENV} at libnvrtc.so)",
                        pytrace=False)
        pytest.skip("libnvrtc not found")
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def nvrtc():
    return nvrtc_or_skip()


def test_missing_nvrtc_fails_when_required_and_skips_otherwise():
    with pytest.raises(pytest.fail.Exception, match="KVCORE_REQUIRE_NVRTC=1"):
        nvrtc_or_skip(lambda: None, {REQUIRE_NVRTC_ENV: "1"})
    for env in ({}, {REQUIRE_NVRTC_ENV: "0"}):
        with pytest.raises(pytest.skip.Exception):
            nvrtc_or_skip(lambda: None, env)


def _nvrtc_compile(lib, text, name, options, name_expressions):
    def check(rc, what):
        assert rc == 0, f"{what}: {lib.nvrtcGetErrorString(rc).decode()}"

    prog = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(max(1, size.value))
        lib.nvrtcGetProgramLog(prog, log)
        log = log.value.decode(errors="replace").strip()
        assert rc == 0, f"NVRTC failed on {name} ({' '.join(options)}):\n{log}"
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)),
                  f"nvrtcGetLoweredName({expr})")
            lowered[expr] = out.value.decode()
        return log, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# The GPUs kvcore's CUDA backend is for: A100 (sm_80), L4 / RTX 40 (sm_89),
# H100 / H200 (sm_90).  CuPy compiles for the device it runs on, to a cubin
# (-arch=sm_XX) where NVRTC knows the architecture.
NVRTC_ARCHS = ("sm_80", "sm_89", "sm_90")


def cupy_added_options(arch):
    """What CuPy's RawModule adds to kvcore's options when it compiles for a
    GPU of ``arch`` (cupy/cuda/compiler.py): the target, FTZ, and functions
    without an execution-space annotation treated as device functions.
    ``arch`` "sm_XX" (a cubin, as CuPy asks) or "compute_XX" (PTX: the same
    front end and optimizer, without ptxas)."""
    return (f"-arch={arch}", "-ftz=true", "--device-as-default-execution-space")


_nvrtc_builds = {}


def nvrtc_build(lib, name, text, arch, modules):
    """``{name expression: lowered name}`` of ``text`` (file ``name``) compiled
    by NVRTC for ``arch`` with exactly the options CudaBackend and CuPy pass,
    once per process.  ``modules`` are the name lists of the modules the
    backend compiles from this text: they differ only in their name
    expressions, so one program holding all of them compiles each module's
    instantiations as that module would, in a fraction of the time (the
    attention modules one by one take minutes).  A warning fails."""
    key = (name, arch)
    if key not in _nvrtc_builds:
        names = list(dict.fromkeys(n for names in modules for n in names))
        log, lowered = _nvrtc_compile(lib, text, name,
                                      [*_sources.COMPILE_OPTIONS, *cupy_added_options(arch)],
                                      names)
        assert log == "", f"{name} compiled for {arch} with warnings:\n{log}"
        assert sorted(lowered) == sorted(names)
        assert all(v.startswith("_Z") for v in lowered.values()), lowered
        _nvrtc_builds[key] = lowered
    return _nvrtc_builds[key]


def check_modules_lowered(lowered, modules):
    """Each module's name expressions name distinct kernels of the build."""
    for names in modules:
        assert len({lowered[n] for n in names}) == len(names), names


@pytest.mark.slow
@pytest.mark.parametrize("arch", NVRTC_ARCHS)
@pytest.mark.parametrize("file", _sources.FILES)
def test_nvrtc_compiles_every_module_as_the_backend_does(nvrtc, file, arch):
    """Each (file, kinds) module as CudaBackend asks CuPy for it: the
    pasted text, kvcore's options, CuPy's for the GPU, the module's name
    expressions."""
    modules = [names for f, _sk, _dk, names in _sources.modules() if f == file]
    check_modules_lowered(nvrtc_build(nvrtc, file, _sources.source(file), arch, modules),
                          modules)


def _attention_harness():
    """attention.cu as NVRTC compiles it, with every instantiation referenced."""
    refs = "\n".join(f"void *const kva_instance_{i} = (void *)&{name};"
                     for i, name in enumerate(attention_kernels.attention_names()))
    return attention_kernels.source() + "\n\n/* instantiations kvcore uses */\n" + refs + "\n"


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("file", [*_sources.FILES, attention_kernels.ATTENTION_FILE.name])
def test_no_flush_to_zero_under_cupys_ftz_option(file, tmp_path):
    """CuPy compiles every kernel with -ftz=true.  The data kernels promise
    the CPU's bits, subnormals included (an int8 row of tiny values, an fp8
    write with a tiny scale), and attention reads what they stored (a
    subnormal bf16 / f32 element, an fp8 code times a subnormal scale, an
    int8 code times its 2^-149 row scale) as the CPU does: compiled with
    that option, none of their instructions may carry .ftz (issue 23,
    item 4)."""
    src = tmp_path / f"all_{file}"
    text = _attention_harness() if file == attention_kernels.ATTENTION_FILE.name \
        else _harness(file)
    src.write_text(text, encoding="utf-8")
    _nvcc([f"-arch={ARCH}", *NVCC_FLAGS, "-ftz=true", "-ptx", str(src),
           "-o", str(tmp_path / "k.ptx")], tmp_path)
    ptx = (tmp_path / "k.ptx").read_text()
    flushed = sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx)))
    assert not flushed, f"{file}: {flushed}"
