"""What a user downloads: the sdist's contents, the licence, the changelog and
the wheel configuration.  (.ci/run also builds the sdist, installs it into a
fresh venv and runs this suite against it, and lints the wheel workflow.)"""
import fnmatch
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_source = pytest.mark.skipif(not (ROOT / "setup.py").exists(),
                                  reason="needs the source tree or the sdist")


def _pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


@needs_source
def test_sdist_ships_sources_and_no_generated_c(tmp_path):
    # A copy of the tree as it is, Cython's generated .c files included when
    # an in-place build left them: the sdist must leave those out and carry
    # the .pyx they come from.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "wheelhouse", "*.egg-info", "__pycache__", "*.so",
        ".pytest_cache", ".hypothesis"))
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("kvcore-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    # every folder with Cython sources (kvcore/_native, backends/cpu, stores)
    folders = sorted({str(p.parent.relative_to(ROOT)) for p in ROOT.glob("kvcore/**/*.pyx")})
    assert {"kvcore/_native", "kvcore/backends/cpu", "kvcore/stores"} <= set(folders)
    for folder in folders:
        src = ROOT / folder
        for f in [*src.glob("*.pyx"), *src.glob("*.pxd"), *(src / "csrc").iterdir()]:
            assert str(f.relative_to(ROOT)) in names
    for cu in (ROOT / "kvcore" / "backends" / "cuda" / "kernels").iterdir():
        assert f"kvcore/backends/cuda/kernels/{cu.name}" in names
    generated = sorted(n for n in names
                       if n.rsplit("/", 1)[0] in folders
                       and n.endswith((".c", ".cpp", ".html")))
    assert not generated, f"the sdist ships Cython's generated files: {generated}"
    for must in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md",
                 "docs/api.md", "docs/migration.md", "tests/conftest.py",
                 "tests/c/kv_half_check.c", "tests/c/kv_simde_shim.h", "bench/bench_pool.py",
                 "bench/dot_throughput.c", "bench/attention_profile.c"):
        assert must in names, f"the sdist lacks {must}"
    assert not any(n.endswith((".so", ".pyd", ".o")) for n in names)


def test_license_is_the_apache_2_text():
    lic = ROOT / "LICENSE"
    if not lic.exists():
        pytest.skip("LICENSE is not beside the tests (an installed wheel carries it in "
                    "its .dist-info)")
    text = lic.read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 150     # the whole text, not a stub
    assert _pyproject()["project"]["license"] == "Apache-2.0"


def test_changelog_names_both_releases():
    log = ROOT / "CHANGELOG.md"
    if not log.exists():
        pytest.skip("no CHANGELOG.md beside the tests")
    text = log.read_text()
    assert "## [Unreleased]" in text and "## [0.1.0]" in text


def _selected(cfg, ident):
    build = cfg["build"].split()
    skip = cfg.get("skip", "").split()
    return (any(fnmatch.fnmatch(ident, p) for p in build)
            and not any(fnmatch.fnmatch(ident, p) for p in skip))


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs pyproject.toml")
def test_cibuildwheel_builds_cp310_to_cp314_not_free_threaded():
    cfg = _pyproject()["tool"]["cibuildwheel"]
    for arch in ("x86_64", "aarch64"):
        for v in ("310", "311", "312", "313", "314"):
            assert _selected(cfg, f"cp{v}-manylinux_{arch}"), (v, arch)
        assert not _selected(cfg, f"cp314t-manylinux_{arch}")
        assert not _selected(cfg, f"cp314-musllinux_{arch}")
    assert cfg["linux"]["archs"] == ["x86_64", "aarch64"]
    assert "Programming Language :: Python :: 3.14" in _pyproject()["project"]["classifiers"]


@pytest.mark.skipif(not (ROOT / ".github").exists(), reason="needs the source tree")
def test_wheel_workflow_builds_and_uploads():
    wf = (ROOT / ".github" / "workflows" / "wheels.yml").read_text()
    for must in ("pypa/cibuildwheel@", "docker/setup-qemu-action@", "aarch64", "x86_64",
                 "python -m build --sdist", "actions/upload-artifact@", "wheelhouse/*.whl",
                 "dist/*.tar.gz"):
        assert must in wf, must
