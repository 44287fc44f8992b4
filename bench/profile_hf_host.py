"""Host time per decode layer of kvcore.hf on a CUDA pool, without a GPU.

A proxy for what a GPU's host pays per layer and step: ``PagedCache.update``
and the kvcore attention of one decode forward, layer by layer, on a
Llama-3.2-1B-shaped layer (32 query / 8 KV heads, head_dim 64, 16 layers,
bfloat16 pages and model dtype), with the CUDA backend of the tests' host
emulation whose kernel launches do nothing (only the host's work is
timed: kvcore's Python, its argument packing, its copies up; no kernel
runs) and torch CPU tensors standing for device memory.  Against it, the
same per layer for DynamicCache is measured on the GPU
(``bench/bench_hf.py --device cuda``'s host rows): torch's CUDA dispatch has
no CPU stand-in (its meta device runs sdpa through Python decompositions).
No launch costs anything here (a real one is about 2-5 us of host time).

    python bench/profile_hf_host.py [--batch 1,16] [--steps 40] [--profile]

Run it with PYTHONPATH at the kvcore tree to measure (its tests/ directory
provides the emulation): before/after comparisons run the same script
against two trees.  --profile prints cProfile's top functions of kvcore's
side.
"""
import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 16, 32, 8, 64
PROMPT = 64


def _emulated_backend(root):
    """The tests' emulated CUDA backend with launches that do nothing,
    installed as device 'cuda' (what tests/cuda/test_cuda_host_emulation.py's
    fixture does)."""
    # the emulation of the tree measured; EmulatedTensors of this script's tree
    # (tests/ and its cuda/ and hf/ folders, each tree's)
    sys.path[:0] = [os.path.join(t, *sub) for t in (os.path.join(root, "tests"),
                                                  os.path.join(_HERE, "..", "tests"))
                    for sub in (("cuda",), ("hf",), ())]
    import test_cuda_host_emulation as emu

    import kvcore.backends.cuda as kc

    class NoLaunches(getattr(emu, "EmulatedLaunches", object)):
        def launch(self, file, sk, dk, name, rows, chunks, args):
            pass

        def launch_grid(self, file, name, grid, block, args, smem=0):
            self._collected(file, name, grid, block, args)   # (what a step lane packs)

        def launch_packed(self, launch):
            pass

        def function_ptr(self, file, sk, dk, name):
            return name

    class NoKernels(emu.EmulatedBackend):
        def __init__(self, lib):
            super().__init__(lib)
            if hasattr(emu, "EmulatedLaunches"):   # a tree whose backend holds its launcher
                self._hold_parts(NoLaunches(self, lib))

        # a tree whose backend inherits its launches (before issue 43)
        def _launch(self, file, sk, dk, name, rows, chunks, args):
            pass

        def _launch_grid(self, file, name, grid, block, args, smem=0):
            collected = getattr(self, "_collected", None)     # (what a step lane packs)
            if collected is not None:
                collected(file, name, grid, block, args)

        def _launch_packed(self, launch):
            pass

        def _function_ptr(self, file, sk, dk, name):
            return name

        def asarray(self, x, arg):
            # host memory stands for device memory (torch CPU tensors arrive
            # as NumPy views): what kvcore's general path imports
            if isinstance(x, np.ndarray) and not isinstance(x, emu.DevArray):
                x = x.view(emu.DevArray)
            return super().asarray(x, arg)

        def check_out(self, out, arg):
            return self.asarray(out, arg)

    be = NoKernels(None)
    kc._cupy, kc._cupy_error, kc._device_count, kc._backends = emu.HOST_CUPY, None, 1, {0: be}
    return emu, be


def _config():
    """The model's config, as transformers hands it to the mask function
    and the attention layer (kvcore.hf reads its attention features)."""
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HEADS * HEAD_DIM,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, intermediate_size=64, vocab_size=128)


class _Module:
    training = False
    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


_CONFIG = [None]


def _forward(cache, attention, q_len, batch, device, dtype, mask_fn=None):
    """One forward's cache and attention calls, layer by layer; the
    seconds spent in them (update + attention, all layers).  Q, K, V as a
    Llama's projections give them: (batch, q, heads, dim) viewed as
    (batch, heads, q, dim)."""
    import torch

    def states(heads):
        return torch.randn(batch, q_len, heads, HEAD_DIM, dtype=dtype,
                           device=device).transpose(1, 2)

    k, v, q = states(KV_HEADS), states(KV_HEADS), states(HEADS)
    if _CONFIG[0] is None:
        _CONFIG[0] = _config()
    if mask_fn is not None:      # what create_causal_mask does once per forward
        kv_length = cache.get_mask_sizes(q_len)[0]
        mask_fn(batch_size=batch, q_length=q_len, kv_length=kv_length, attention_mask=None,
                config=_CONFIG[0])
    module = _Module()
    module.config = _CONFIG[0]
    total = 0.0
    for layer in range(LAYERS):
        kwargs = {}
        t0 = time.perf_counter()
        keys, values = cache.update(k, v, layer, kwargs=kwargs)
        attention(module, q, keys, values, None, scaling=HEAD_DIM ** -0.5, **kwargs)
        total += time.perf_counter() - t0
    return total


def kvcore_layers(root, batch, steps, profile=False):
    import torch
    emu, be = _emulated_backend(root)
    import kvcore
    from kvcore.hf import PagedCache, torch_bridge
    from kvcore.hf.attention import _kvcore_mask, kvcore_attention
    if hasattr(torch_bridge, "_cuda_tensors"):
        from test_hf_cuda_emulation import EmulatedTensors
        torch_bridge._cuda_tensors = EmulatedTensors
    else:       # a tree before the step lane: its torch side imports CuPy itself
        side = torch_bridge._TorchSide

        def init(self, pool):
            self.device, self.cuda = torch.device("cpu"), True
        side.__init__ = init
        side.stream = lambda self: contextlib.nullcontext()
    pool = kvcore.BlockPool(batch * (PROMPT + steps + 16) // 16 + 8, 16, LAYERS, KV_HEADS,
                            HEAD_DIM, dtype="bfloat16", device="cuda")
    cache = PagedCache(pool)
    _forward(cache, kvcore_attention, PROMPT, batch, "cpu", torch.bfloat16, _kvcore_mask)
    times = []
    prof = cProfile.Profile() if profile else None
    for i in range(steps):
        if prof is not None and i == steps // 2:
            prof.enable()
        times.append(_forward(cache, kvcore_attention, 1, batch, "cpu", torch.bfloat16,
                              _kvcore_mask))
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    cache.free()
    per_layer = [t / LAYERS * 1e6 for t in times[2:]]
    return statistics.median(per_layer), min(per_layer), max(per_layer)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--root", default=None, help="the kvcore tree (default: kvcore's parent)")
    a = p.parse_args()
    import kvcore
    root = a.root or os.path.dirname(os.path.dirname(os.path.abspath(kvcore.__file__)))
    print(f"kvcore {kvcore.__file__}")
    print("| batch | kvcore update + attention, host us per decode layer: median [min-max] |")
    print("|---:|---:|")
    for b in (int(x) for x in a.batch.split(",")):
        kv = kvcore_layers(root, b, a.steps, a.profile)
        print(f"| {b} | {kv[0]:.1f} [{kv[1]:.1f}-{kv[2]:.1f}] |")


if __name__ == "__main__":
    main()
