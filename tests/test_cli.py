import os
import subprocess
import sys
from pathlib import Path

import kvpool

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=60)


def test_version() -> None:
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kvpool {kvpool.__version__}"


def test_config_shows_env_override_and_rejects_unknown_keys() -> None:
    res = run("config", env={"KVPOOL_DRAM__CAPACITY": "2GiB"})
    assert res.returncode == 0 and "capacity: 2147483648" in res.stdout
    res = run("config", env={"KVPOOL_DRAM__CAPACITYY": "2GiB"})
    assert res.returncode == 2 and "dram.capacityy: unknown key" in res.stderr

