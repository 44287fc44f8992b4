"""KVCORE_DEBUG=1 builds the extensions with bounds checks and a pool that
re-verifies its whole bookkeeping after every operation; it must build and
run a real workload cleanly."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

WORKLOAD = textwrap.dedent("""
    import numpy as np
    import kvcore
    from kvcore._native import _pool
    assert _pool.DEBUG_BUILD, "not a debug build"
    rng = np.random.default_rng(0)
    pool = kvcore.BlockPool(24, 4, 2, 2, 8, dtype="bfloat16")
    prefix = list(range(12))
    seqs = []
    for i in range(6):
        s = kvcore.PagedKVCache(pool, salt=None if i % 3 else "x")
        try:
            s.allocate(prefix + [100 + i] * (i + 1))
        except kvcore.OutOfBlocksError:
            continue
        n = s.num_tokens - s.num_computed
        for layer in range(2):
            s.append(layer, rng.standard_normal((n, 2, 8), np.float32),
                     rng.standard_normal((n, 2, 8), np.float32))
        s.commit(n)
        s.append_token(7)
        seqs.append(s)
    f = seqs[0].fork()
    f.truncate(5)
    f.append(0, np.ones((1, 2, 8), np.float32), np.ones((1, 2, 8), np.float32))
    seqs.append(f)
    for s in seqs:
        s.gather(1)
        s.free()
    # a broken structure is caught by the checking lock
    pool.debug.check()
    print("debug workload ok", pool.stats()["num_cached_blocks"])
""")


def test_debug_build_builds_and_runs(tmp_path):
    if not (ROOT / "setup.py").exists():
        pytest.skip("needs the source tree")
    try:
        import Cython  # noqa: F401
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("needs Cython and setuptools (the test extra installs them)")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kvcore", src / "kvcore",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "_*.c", "__pycache__"))
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    env = dict(os.environ, KVCORE_DEBUG="1")
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src,
                           env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    env["PYTHONPATH"] = str(src)
    run = subprocess.run([sys.executable, "-c", WORKLOAD], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "debug workload ok" in run.stdout
