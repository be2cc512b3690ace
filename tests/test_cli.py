import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool.cli import main

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



def test_config_prints_the_capacity_warm_cache_ratio_resolves_to() -> None:
    import yaml

    from kvpool.hostmem import host_memory_total

    res = run("config", env={"KVPOOL_DRAM__WARM_CACHE_RATIO": "0.25"})
    assert res.returncode == 0 and res.stdout.startswith("# dram.capacity resolved from")
    dram = yaml.safe_load(res.stdout)["dram"]
    slab = dram["slab_size"]
    assert dram["capacity"] == int(host_memory_total() * 0.25) // slab * slab
    res = run("config", env={"KVPOOL_DRAM__WARM_CACHE_RATIO": "0.25",
                             "KVPOOL_DRAM__CAPACITY": "1GiB"})
    assert res.returncode == 2 and "set one, not both" in res.stderr


def test_every_command_prints_its_help() -> None:
    """argparse formats help texts with %: a stray one crashes --help (it did for plan)."""
    import argparse
    import contextlib
    import io

    from kvpool.cli import _build_parser

    def commands(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += commands(sub, [*path, name])
        return found

    every = commands(_build_parser(), [])
    assert ["plan"] in every and ["admin", "drain"] in every and ["bench", "sglang"] in every
    for path in every:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
            main([*path, "--help"])
        assert stop.value.code == 0, path
        assert "usage:" in out.getvalue(), path
