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


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang venv's python; builds the venv (a few minutes) if it is missing."""
    subprocess.run(["bash", str(ROOT / "scripts" / "sglang-env.sh")], check=True)
    return SGLANG_VENV / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-home")


@pytest.fixture
def run_check(sglang_python: Path, sglang_home: Path, tmp_path: Path) -> RunCheck:
    """``run_check(name, env=None, **args)``: run one scenario with ``cache_dir`` = a fresh
    directory; returns its JSON result, failing the test with SGLang's stderr on an error."""

    def run(name: str, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("KVPOOL_", "SGLANG_TEST_"))}
        full.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(sglang_home / "hf"),
                     "TORCH_EXTENSIONS_DIR": str(sglang_home / "torch-ext"),
                     "PYTHONWARNINGS": "ignore", **(env or {})})
        args.setdefault("cache_dir", str(tmp_path / "kvpool"))
        proc = subprocess.run([str(sglang_python), str(CHECKS), name, json.dumps(args)],
                              env=full, cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"{name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
        return result

    return run
