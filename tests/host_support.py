"""Host pools for tests: a config file per test and ``kvpool host`` as a real process
(kvpool.host.launch), and the engine processes of tests/host_child.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpool.config import Config, config_from_dict
from kvpool.host.launch import HostProcess

CHILD = Path(__file__).with_name("host_child.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def host_config(base: Path, **sections: Any) -> dict[str, Any]:
    """8 MiB of DRAM (8 slots of the 1 MiB test chunks), no SSD, a short request timeout."""
    data: dict[str, Any] = {
        "cache_dir": str(base / "cache"),
        "dram": {"capacity": "8MiB", "slab_size": "8MiB", "put_wait_s": 0.2},
        "ssd": {"enabled": False},
        "host": {"socket": str(base / "host.sock"), "shm_dir": str(base),
                 "request_timeout_s": 3.0, "retry_s": 0.2},
        "metrics": {"enabled": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def write_config(base: Path, data: dict[str, Any], name: str = "host.yaml") -> Path:
    base.mkdir(parents=True, exist_ok=True)
    path = base / name
    path.write_text(yaml.safe_dump(data))
    return path


def engine_config(data: dict[str, Any], **host: Any) -> Config:
    return config_from_dict({**data, "host": {**data["host"], **host}})


def start_host(base: Path, data: dict[str, Any]) -> HostProcess:
    return HostProcess(write_config(base, data), base / "host.log").start()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def child(mode: str, config: Path, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(CHILD), mode, str(config),
                             *map(str, args)], stdout=subprocess.PIPE, text=True, env=_env())


def run_child(mode: str, config: Path, *args: object, timeout_s: float = 120) -> dict[str, Any]:
    proc = child(mode, config, *args)
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result
