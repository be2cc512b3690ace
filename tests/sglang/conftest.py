"""Fixtures for the SGLang tests: the pinned SGLang venv and a runner for its scenarios.

SGLang is not installed in the test venv: each scenario of ``sglang_checks.py`` runs in a
subprocess with ``.venv-sglang``'s python (created by ``scripts/sglang-env.sh`` if missing),
against SGLang's real host pool, backend factory and cache controller.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
CHECKS = Path(__file__).with_name("sglang_checks.py")

RunCheck = Callable[..., dict[str, Any]]
RunChecks = Callable[[list[tuple[str, dict[str, Any]]]], list[dict[str, Any]]]


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang venv's python; builds the venv (a few minutes) if it is missing."""
    subprocess.run(["bash", str(ROOT / "scripts" / "sglang-env.sh")], check=True)
    return SGLANG_VENV / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-home")


def _run(python: Path, home: Path, cwd: Path, argv: list[str], what: str,
         env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``sglang_checks.py`` with ``argv``; its RESULT lines as JSON, failing the test
    with SGLang's stderr on an error."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVPOOL_", "SGLANG_TEST_"))}
    full.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(home / "hf"),
                 "TORCH_EXTENSIONS_DIR": str(home / "torch-ext"),
                 "PYTHONWARNINGS": "ignore", **(env or {})})
    proc = subprocess.run([str(python), str(CHECKS), *argv], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{what} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return [json.loads(ln.removeprefix("RESULT ")) for ln in lines]


@pytest.fixture
def run_check(sglang_python: Path, sglang_home: Path, tmp_path: Path) -> RunCheck:
    """``run_check(name, env=None, **args)``: run one scenario with ``cache_dir`` = a fresh
    directory; returns its JSON result, failing the test with SGLang's stderr on an error."""

    def run(name: str, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
        args.setdefault("cache_dir", str(tmp_path / "kvpool"))
        return _run(sglang_python, sglang_home, tmp_path, [name, json.dumps(args)], name,
                    env)[-1]

    return run


@pytest.fixture(scope="module")
def run_checks(sglang_python: Path, sglang_home: Path,
               tmp_path_factory: pytest.TempPathFactory) -> RunChecks:
    """``run_checks([(name, args), ...])``: several scenarios in one SGLang process (each
    with a fresh ``cache_dir`` of its own unless given); their results in order."""

    def run(scenarios: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        work = tmp_path_factory.mktemp("sglang-batch")
        batch = [[name, {"cache_dir": str(work / f"kvpool-{i}"), **args}]
                 for i, (name, args) in enumerate(scenarios)]
        results = _run(sglang_python, sglang_home, work, ["batch", json.dumps(batch)],
                       "+".join(name for name, _ in scenarios))
        if len(results) != len(scenarios):
            pytest.fail(f"{len(results)} results for {len(scenarios)} scenarios")
        return results

    return run
