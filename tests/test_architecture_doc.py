"""docs/architecture.md stays true: every module and package it names exists in src/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
# `kvpool/...py`, `kvpool/pkg/` and paths relative to kvpool/ such as integrations/hf.py
NAMED = re.compile(r"(?<![\w/.])((?:kvpool/)?(?:[a-z_]+/)*[a-z_]+(?:\.py|/))(?![\w/])")


def named_paths(text: str) -> set[str]:
    """Repository-relative paths: src/kvpool/... for modules, tests/... as written."""
    found = set()
    for match in NAMED.finditer(text):
        path = match.group(1)
        if path in ("src/", "tests/"):
            continue
        if path.startswith("tests/"):
            found.add(path)
        else:
            found.add("src/" + (path if path.startswith("kvpool/") else f"kvpool/{path}"))
    return found


def test_every_module_the_architecture_doc_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 30, sorted(paths)  # the walk names every hop
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_check_would_catch_a_renamed_module() -> None:
    assert "src/kvpool/tiers/nosuch.py" in named_paths("see `kvpool/tiers/nosuch.py` here")
    assert "src/kvpool/ssd/" in named_paths("the engine in kvpool/ssd/ is")
    assert "src/kvpool/integrations/hf.py" in named_paths("(`integrations/hf.py`)")
