"""Helpers shared by the tests (not fixtures: plain functions)."""
import re
import shutil
import subprocess

import pytest


def pool_snapshot(pool, cached_tokens=False):
    """Everything observable about a pool: its bookkeeping (the documented
    ``BlockPool.debug_snapshot``), its storage bytes and, with
    ``cached_tokens``, the token ids every cached block is registered with.
    Two snapshots are equal iff nothing observable changed."""
    snap = pool.debug_snapshot()
    snap["num_used_blocks"] = pool.num_used_blocks
    snap["num_cached_blocks"] = pool.num_cached_blocks
    snap["storage"] = pool.storage.tobytes()
    if cached_tokens:
        snap["cached_tokens"] = [pool.debug_cached_block(b)[0].tolist() if cached else None
                                 for b, cached in enumerate(snap["cached"])]
    return snap


def cached_hash_bytes(pool, block_id):
    """The 16-byte hash a cached block is registered with (as block_hashes gives it)."""
    lo, hi = pool.debug_cached_block(block_id)[1]
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


def functions_in(so):
    """{function name: [instruction mnemonics and operands]} of a shared
    object, from ``objdump -d`` (for checks that SIMD code stays behind
    run-time dispatch)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], check=True,
                         capture_output=True, text=True).stdout
    fn, body = None, {}
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            fn = m.group(1)
            body[fn] = []
            continue
        parts = line.split("\t")
        if fn and len(parts) >= 2 and parts[1].strip():
            body[fn].append(parts[1].strip())
    return body


def aarch64_tools():
    """(cross compiler, qemu) for running C checks on AArch64; skips the
    test when either is missing."""
    cc = shutil.which("aarch64-linux-gnu-gcc")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64")
    return cc, qemu


# The attention's kernel levels this build knows on this architecture, and
# what a CPU that cannot run one lacks (a per-level test skips with it).
_ATTENTION_LEVEL_NEEDS = {
    "x86_64": {"avx2": ("avx2", "fma", "f16c"),
               "amx": ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq")},
    "aarch64": {"neon": ("asimd",)},
}


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def attention_level_params(available):
    """pytest params for every attention level of this architecture: the
    ones in ``available`` run, the others skip naming what is missing
    ("CPU lacks amx-bf16", or the kernel's refusal of the tile state)."""
    import platform
    arch = platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")
    flags = _cpu_flags()
    params = []
    for name in ["scalar", *_ATTENTION_LEVEL_NEEDS.get(arch, {})]:
        if name in available:
            params.append(pytest.param(name, id=name))
            continue
        missing = [f for f in _ATTENTION_LEVEL_NEEDS[arch][name] if f not in flags]
        if missing:
            reason = "CPU lacks " + ", ".join(f.replace("_", "-") for f in missing)
        elif name == "amx":
            reason = ("the OS did not grant the AMX tile state "
                      "(XCR0 bits 17-18, or ARCH_REQ_XCOMP_PERM refused)")
        else:
            reason = f"this build has no {name} kernels"
        params.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=reason)))
    return params
