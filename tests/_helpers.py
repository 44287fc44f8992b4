"""Helpers shared by the tests (not fixtures: plain functions)."""
import contextlib
import copy
import hashlib
import re
import shutil
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

import kvcore

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference_scales(pool, layer):
    """The scale arguments of ``paged_attention_reference`` over ``pool``'s
    layer: int8's per-token scales, fp8's (per layer or per KV head), none
    for float pages."""
    if pool.dtype == "int8":
        return dict(key_scales=pool.key_scales(layer), value_scales=pool.value_scales(layer))
    if pool.dtype.startswith("float8"):
        k_scale, v_scale = pool.kv_scales[layer]
        return dict(key_scales=k_scale, value_scales=v_scale)
    return {}


def pool_snapshot(pool, cached_tokens=False):
    """Everything observable about a pool: its bookkeeping (the documented
    ``BlockPool.debug_snapshot``), its storage bytes and, with
    ``cached_tokens``, the token ids every cached block is registered with.
    Two snapshots are equal iff nothing observable changed."""
    snap = pool.debug.snapshot()
    snap["num_used_blocks"] = pool.num_used_blocks
    snap["num_cached_blocks"] = pool.num_cached_blocks
    snap["storage"] = pool.storage.tobytes()
    if cached_tokens:
        snap["cached_tokens"] = [pool.debug.cached_block(b)[0].tolist() if cached else None
                                 for b, cached in enumerate(snap["cached"])]
    return snap


def storage_bits(x, storage):
    """The storage bits kvcore must produce for host input ``x`` in a cache
    of dtype ``storage``: widen exactly, then round to nearest even with
    kvcore's own conversions (a bfloat16 input is bfloat16 bits as
    ml_dtypes or uint16)."""
    if x.dtype == np.float16:
        if storage == "float16":
            return x
        wide = kvcore.from_float16(x)
    elif x.dtype in (np.uint16, BF16):
        if storage == "bfloat16":
            return x.view(np.uint16)
        wide = kvcore.from_bfloat16(x)
    else:
        wide = x
    if storage == "float32":
        return wide
    if storage == "float16":
        return kvcore.to_float16(wide)
    return kvcore.to_bfloat16(wide)


def snapshot_without_stores(pool):
    """``pool.debug.snapshot()`` less its stores' statistics: what must
    equal the snapshot of a like pool without stores that ran the same."""
    snap = pool.debug.snapshot()
    snap["stats"].pop("stores")
    return snap


def cached_hash_bytes(pool, block_id):
    """The 16-byte hash a cached block is registered with (as block_hashes gives it)."""
    lo, hi = pool.debug.cached_block(block_id)[1]
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


def write_kv(seq, data, start, batched, after_append=None):
    """Write ``data``, ``(layers, 2, heads, n, dim)``, as the KV of
    positions ``start..start+n-1`` of ``seq`` in every layer, not
    committed: ``batched``, reserve then one ``pool.write`` at the slots
    and ``mark_written`` per layer; else one ``seq.append`` per layer,
    each followed by ``after_append(layer)`` when given."""
    n = data.shape[3]
    if batched:
        seq.reserve(n)
        slots = seq.slot_mapping(start, start + n)
        for layer in range(data.shape[0]):
            seq.pool.write(layer, data[layer, 0].transpose(1, 0, 2),
                           data[layer, 1].transpose(1, 0, 2), slots)
            seq.mark_written(layer, n)
    else:
        for layer in range(data.shape[0]):
            seq.append(layer, data[layer, 0].transpose(1, 0, 2),
                       data[layer, 1].transpose(1, 0, 2))
            if after_append is not None:
                after_append(layer)


@contextlib.contextmanager
def simd_level(level):
    """Run the block with every CPU kernel family at ``level``
    (``kvcore.set_simd_level``), then restore the level before."""
    previous = kvcore.set_simd_level(level)
    try:
        yield level
    finally:
        kvcore.set_simd_level(previous)


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


def run_script_phases(script, phases):
    """Run the Python file ``script`` once per phase (its one argument) in
    a fresh interpreter with warnings as errors; each run must exit 0 and
    print ``ok PHASE``."""
    for phase in phases:
        r = subprocess.run([sys.executable, "-W", "error", str(script), phase],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and f"ok {phase}" in r.stdout, r.stderr


def run_in_threads(work, n):
    """Call ``work()`` in ``n`` threads at once and wait for them all; the
    first exception any of them raised fails the test."""
    errors = []

    def guarded():
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def aarch64_tools():
    """(cross compiler, qemu) for running C checks on AArch64; skips the
    test when either is missing."""
    cc = shutil.which("aarch64-linux-gnu-gcc")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64")
    return cc, qemu


class PrefixKV:
    """K/V as a function of (salt, prefix): what a model would compute for
    the last position of ``prefix``, so that any block's expected contents
    are known from its tokens alone (the oracle of the model-based tests).

    ``half_exact``: multiples of 1/8 in [-128, 128) (exact in float16 and
    float32), else finer float32 values."""

    def __init__(self, layers, heads, dim, half_exact=False):
        self.shape = (layers, 2, heads, dim)
        self.half_exact = half_exact
        self._memo = {}

    def value(self, salt, prefix):
        """``(layers, 2, heads, dim)`` float32 K/V of the last position of ``prefix``."""
        key = (salt, tuple(prefix))
        v = self._memo.get(key)
        if v is None:
            n = int(np.prod(self.shape))
            if self.half_exact:
                d = hashlib.blake2b(repr(key).encode(), digest_size=2 * n)
                u = np.frombuffer(d.digest(), np.uint16)
                v = (u % 2048).astype(np.float32) / np.float32(8) - np.float32(128)
            else:
                d = hashlib.blake2b(repr(key).encode(), digest_size=4 * n)
                u = np.frombuffer(d.digest(), np.uint32)
                v = (u % 200003).astype(np.float32) / np.float32(1024) - np.float32(97)
            v = self._memo[key] = v.reshape(self.shape)
        return v

    def expected(self, salt, tokens, start, end):
        """``(layers, 2, heads, end - start, dim)`` of positions start..end-1."""
        if end <= start:
            layers, two, heads, dim = self.shape
            return np.zeros((layers, two, heads, 0, dim), np.float32)
        return np.stack([self.value(salt, tokens[:p + 1]) for p in range(start, end)], axis=3)


_GGUF_MODELS = {}


def gguf_causal_lm(torch, transformers, path):
    """``(model, tokenizer)`` of the GGUF file ``path`` through transformers,
    the model in float32 and eval mode.  The file is read once per process
    (about two minutes for SmolLM2 on a small machine); each call gets its
    own deep copy of the model, so no test sees another's changes to it."""
    key = str(path)
    if key not in _GGUF_MODELS:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32)
        model.eval()
        _GGUF_MODELS[key] = (model, tokenizer)
    model, tokenizer = _GGUF_MODELS[key]
    return copy.deepcopy(model), tokenizer


def bad_out_cases(tokens, heads=8, head_dim=64):
    """The checks every attention entry point makes of ``out`` for q of
    ``(tokens, heads, head_dim)``: ``(change, exception, message)`` rows."""
    return [
        (dict(out=np.zeros((tokens, heads, head_dim - 1), np.float32)), ValueError,
         rf"out must have shape \({tokens}, {heads}, {head_dim}\)"),
        (dict(out=np.zeros((tokens, heads, head_dim), np.float64)), TypeError,
         r"out must be float32"),
        (dict(out="read-only"), ValueError, r"out must be writeable"),
    ]
