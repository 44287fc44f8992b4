"""The user docs (README.md, docs/*.md) as a user reads them: every runnable
example runs, and nothing points outside the repository."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

pytestmark = pytest.mark.skipif(not (ROOT / "README.md").exists(),
                                reason="needs the source tree or the sdist")

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _examples():
    for path in DOCS:
        for i, m in enumerate(_BLOCK.finditer(path.read_text(encoding="utf-8"))):
            yield pytest.param(path, m.group(1), id=f"{path.name}-{i}")


_NEEDS = re.compile(r"^# needs: ([\w, ]+)$", re.M)


def _require(module):
    """An optional module an example imports: torch through conftest's
    require_torch (a failure, not a skip, under KVCORE_REQUIRE_TORCH=1)."""
    if module == "torch":
        from conftest import require_torch

        return require_torch()
    return pytest.importorskip(module)


@pytest.mark.parametrize("path, code", list(_examples()))
def test_example_runs(path, code, monkeypatch, tmp_path, capsys):
    """Every ```python block runs; one whose first line is ``# needs: torch``
    (an optional dependency) skips only where that module is missing."""
    first = _NEEDS.match(code)
    if first:
        for module in first.group(1).replace(",", " ").split():
            _require(module)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{path.name} example", "exec"), {"__name__": "__doc_example__"})


def test_api_reference_and_changelog_exist():
    assert (ROOT / "docs" / "api.md").exists()
    assert "docs/api.md" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_reference_outside_the_repo(path):
    text = path.read_text(encoding="utf-8")
    # the project's contract documents are not part of a clone
    assert "API.md" not in text, f"{path.name} mentions API.md (use docs/api.md)"
    assert "shared documents" not in text
    assert "/work/" not in text and "../shared" not in text
    for target in _LINK.findall(text):
        if re.match(r"^(https?|mailto):", target) or target.startswith("#"):
            continue
        local = (path.parent / target.split("#")[0]).resolve()
        assert local.is_relative_to(ROOT), f"{path.name} links outside the repo: {target}"
        assert local.exists(), f"{path.name} links to a missing file: {target}"


def test_migration_guide_names_the_engines_it_compares():
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert "seed" not in text.lower(), "say what each engine is, not 'seed'"
