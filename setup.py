"""Build kvcore's native modules.

KVCORE_DEBUG=1 builds with bounds and initialisation checks on, -O0 -g, and
the internal invariant checks of the pool (KVCORE_DEBUG macro) compiled in.
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KVCORE_DEBUG", "") not in ("", "0")

# Directives are set here once, not per file.
directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "nonecheck": False,  # True forbids attribute access without the GIL
    "cdivision": True,
    "embedsignature": True,
    "freethreading_compatible": False,
}

macros = [("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")]
if DEBUG:
    macros.append(("KVCORE_DEBUG", "1"))
    # -O0 -g: step through kernels in gdb; no -march anywhere (see below).
    extra = ["-O0", "-g"]
else:
    # -O3 only.  Never -march=native: wheels must run on any x86-64/aarch64;
    # SIMD lives behind run-time dispatch in kv_half.c.
    extra = ["-O3"]
if sys.platform == "win32":
    extra = []

NATIVE = "kvcore/_native"
CSRC = f"{NATIVE}/csrc"  # hand-written C (the .c files next to the .pyx are generated)


def ext(name, *c_sources):
    return Extension(
        f"kvcore._native.{name}",
        [f"{NATIVE}/{name}.pyx", *[f"{CSRC}/{c}" for c in c_sources]],
        include_dirs=[numpy.get_include(), NATIVE, CSRC],
        define_macros=macros,
        extra_compile_args=extra,
    )


extensions = [
    ext("_typedefs"),
    ext("_convert", "kv_half.c"),
    ext("_kernels"),
    ext("_pool", "kv_hash.c"),
    ext("_seq"),
]

# Attention over the pages (kvcore/backends/cpu): C kernels with run-time
# SIMD dispatch; pthreads for the worker pool.
CPU_BACKEND = "kvcore/backends/cpu"
extensions.append(Extension(
    "kvcore.backends.cpu._attention",
    [f"{CPU_BACKEND}/_attention.pyx", f"{CPU_BACKEND}/csrc/kv_attention.c"],
    include_dirs=[numpy.get_include(), f"{CPU_BACKEND}/csrc"],
    define_macros=macros,
    extra_compile_args=extra + ([] if sys.platform == "win32" else ["-pthread"]),
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
))

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        include_path=["."],
    ),
)
