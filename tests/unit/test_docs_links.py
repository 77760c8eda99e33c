"""The README and docs/ stand alone: no link leaves the repository (http(s) only for local
examples such as http://127.0.0.1:8000), no `../` link, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "0.0.0.0")
URL = re.compile(r"https?://([^/\s:)`'\"]+)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_docs_folder_has_the_architecture_the_readme_points_to():
    assert ROOT / "docs" / "architecture.md" in DOCS
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_no_url_leaves_this_machine(path):
    hosts = {m.group(1) for m in URL.finditer(path.read_text())}
    assert hosts - set(LOCAL_HOSTS) == set()


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_relative_links_stay_inside_the_repository_and_resolve(path):
    targets = [t.split("#")[0] for t in MD_LINK.findall(path.read_text()) if not t.startswith("#")]
    assert [t for t in targets if t.startswith("../") or "/../" in t or t.startswith("/")] == []
    assert [t for t in targets if not (path.parent / t).exists()] == []
