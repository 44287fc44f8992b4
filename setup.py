"""Build kvcore's native modules.

KVCORE_DEBUG=1 builds with bounds and initialisation checks on, -O0 -g, and
the internal invariant checks of the pool (KVCORE_DEBUG macro) compiled in.

KVCORE_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
(-fsanitize=address,undefined, any UB report aborts), into build/sanitize so
that the objects of a normal build are never reused.  Python itself is not
instrumented: run with LD_PRELOAD=$(gcc -print-file-name=libasan.so) and
ASAN_OPTIONS=detect_leaks=0 (.ci/sanitize does all of this).
"""
import os
import sys

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("KVCORE_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("KVCORE_SANITIZE", "") not in ("", "0")

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
    # SIMD lives behind run-time dispatch (kv_simd.h).
    extra = ["-O3"]
link_extra = []
if SANITIZE:
    if sys.platform == "win32":
        sys.exit("KVCORE_SANITIZE=1 needs GCC or Clang")
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
           "-fno-omit-frame-pointer", "-g"]
    extra = [f for f in extra if not f.startswith("-O")] + ["-O1"] + san
    link_extra = san
if sys.platform == "win32":
    extra = []

# One extension per .pyx.  Each layer is a folder (docs/architecture.md):
# kvcore/_native holds the bookkeeping, kvcore/backends/cpu the data-movement
# kernels; hand-written C lives in each folder's csrc/ (the .c files next to
# the .pyx are generated).
NATIVE = "kvcore/_native"
CPU_BACKEND = "kvcore/backends/cpu"
# _typedefs.pxd (block ids, slots, halves) is shared by both folders
STORES = "kvcore/stores"
INCLUDE = [numpy.get_include(), NATIVE, f"{NATIVE}/csrc", CPU_BACKEND, f"{CPU_BACKEND}/csrc",
           f"{STORES}/csrc"]


def ext(folder, name, *c_sources, compile_args=(), link_args=()):
    return Extension(
        f"{folder.replace('/', '.')}.{name}",
        [f"{folder}/{name}.pyx", *[f"{folder}/csrc/{c}" for c in c_sources]],
        include_dirs=INCLUDE,
        define_macros=macros,
        extra_compile_args=extra + list(compile_args),
        extra_link_args=link_extra + list(link_args),
    )


# Attention over the pages: C kernels with run-time SIMD dispatch, one file
# per role (kv_attn_internal.h lists them); pthreads for the worker pool.
PTHREAD = [] if sys.platform == "win32" else ["-pthread"]
ATTENTION_C = ["kv_attention.c", "kv_attn_schedule.c", "kv_attn_tile.c", "kv_attn_threads.c",
               "kv_attn_scalar.c", "kv_attn_avx2.c", "kv_attn_avx512.c", "kv_attn_neon.c",
               "kv_attn_amx.c"]
# kv_simd.c, the one SIMD registry (levels, CPU detection, the KVCORE_SIMD
# cap), is linked into every module with dispatched kernels.
extensions = [
    ext(NATIVE, "_typedefs"),
    ext(NATIVE, "_pool", "kv_hash.c"),
    ext(NATIVE, "_seq"),
    ext(CPU_BACKEND, "_convert", "kv_half.c", "kv_fp8.c", "kv_simd.c"),
    ext(CPU_BACKEND, "_kernels"),
    ext(CPU_BACKEND, "_checksum", "kv_xxh3.c", "kv_xxh3_avx2.c", "kv_xxh3_neon.c",
        "kv_xxh3_many.c", "kv_simd.c", compile_args=PTHREAD, link_args=PTHREAD),
    ext(CPU_BACKEND, "_attention", *ATTENTION_C, "kv_simd.c", compile_args=PTHREAD, link_args=PTHREAD),
    # a DiskStore's directory listing, one call without the GIL (POSIX)
    ext(STORES, "_fs", "kv_fs.c"),
]


class cythonize_then_build_ext(build_ext):
    """Cythonize the .pyx sources when the extensions are built, not before.

    The extensions list .pyx files, so `sdist` ships the Cython sources (and
    never Cython's generated C, which MANIFEST.in also excludes); every build
    (wheel, editable, from an sdist) generates the C from them here.
    """

    def run(self):
        from Cython.Build import cythonize

        generated = cythonize(
            self.extensions,
            compiler_directives=directives,
            include_path=["."],
            nthreads=self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else 0,
        )
        # Keep the Extension objects setuptools has finalized; only their
        # sources change (.pyx -> the generated .c).
        by_name = {e.name: e for e in generated}
        for e in self.extensions:
            e.sources = by_name[e.name].sources
        super().run()


setup(
    # a sanitizer build never shares objects with a normal one
    options={"build": {"build_base": "build/sanitize"}} if SANITIZE else {},
    ext_modules=extensions,
    cmdclass={"build_ext": cythonize_then_build_ext},
)
