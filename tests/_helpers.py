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
