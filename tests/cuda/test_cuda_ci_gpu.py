"""``.ci/gpu`` (the project's GPU check) where it cannot run: one clear line.

Run without a GPU, as CI and most sessions are, the script must stop
before building anything, with exactly one line saying why and a non-zero
exit status, so that a missing GPU never passes for a passed check.  The
GPU is hidden with ``CUDA_VISIBLE_DEVICES=""`` (the driver then reports no
device), so this runs the same on a machine that has one.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "gpu"

pytestmark = [pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
              pytest.mark.skipif(not (ROOT / ".ci").is_dir(),
                                 reason="needs the source tree (.ci/ is not in the sdist)")]


def _run(tmp_path, **env):
    full = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"),
            "CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=120)


def test_the_script_is_executable_for_the_smoke_script():
    # ../shared/tools/gpu_smoke.sh hands over only to an executable .ci/gpu
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK)


def test_without_a_gpu_it_fails_with_one_clear_line(tmp_path):
    r = _run(tmp_path)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2, (r.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("ci/gpu: FAIL: no NVIDIA GPU here (")
    assert "this check needs one" in lines[0]
    assert not (tmp_path / "out").exists()   # stopped before building or writing anything


def test_a_missing_python_is_one_clear_line(tmp_path):
    r = _run(tmp_path, PY=str(tmp_path / "no-such-python"))
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, lines)
    assert "no-such-python not found (set PY)" in lines[0]


def test_bench_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    """bench/gpu_check.sh (the attention GPU check of issue 41) stops before
    building, with one line and exit status 2, where no GPU is visible."""
    full = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"),
            "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=tmp_path, env=full,
                       capture_output=True, text=True, timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, lines)
    assert lines[0].startswith("gpu_check: FAIL: no usable NVIDIA GPU here")
    assert not (tmp_path / "out" / "build.log").exists()   # stopped before the build
