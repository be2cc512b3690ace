"""`kvpool serve` with settings it cannot run with: one line naming the key, exit status 2,
no traceback. The rules about config values alone are the Config's, so an embedded KVPool
gets the same ConfigError."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.config import config_from_dict
from kvpool.errors import ConfigError

SMALL = {"dram": {"capacity": "16MiB", "slab_size": "8MiB"},
         "ssd": {"capacity": "32MiB", "segment_size": "8MiB"}}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(tmp_path: Path, **sections: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    data: dict[str, Any] = {"cache_dir": str(tmp_path / "cache"),
                            "server": {"host": "127.0.0.1", "port": 0}}
    for name, values in {**SMALL, **sections}.items():
        data[name] = {**SMALL.get(name, {}), **values}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, env=env, timeout=60)


CONFIG_CASES = {
    "ssd under 2 segments": ({"ssd": {"capacity": "8MiB"}}, "ssd.capacity"),
    "segment not 4 KiB aligned": ({"ssd": {"segment_size": 1_000_000}}, "ssd.segment_size"),
    "dram under one slab": ({"dram": {"capacity": "4MiB"}}, "dram.capacity"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_tier_geometry_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    sections, key = CONFIG_CASES[case]
    out = serve(tmp_path, **sections)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool serve: ") and key in lines[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):  # embedded: the same rule
        config_from_dict({**SMALL, **sections})


def test_an_ssd_file_too_small_for_two_segments_is_one_line_and_exit_2(tmp_path: Path) -> None:
    region = tmp_path / "region.img"
    region.write_bytes(b"\0" * (12 << 20))  # 1.5 segments of 8 MiB
    out = serve(tmp_path, ssd={"path": str(region)})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "ssd.segment_size" in lines[0] and "Traceback" not in out.stderr


def test_unreachable_etcd_at_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    out = serve(tmp_path, cluster={"etcd": [endpoint]})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith(f"kvpool serve: cluster.etcd={endpoint}: cannot register")
    assert "listening" not in out.stdout


def test_admin_token_without_auth_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"server\.admin_token: needs server\.auth"):
        config_from_dict({"server": {"admin_token": "admin-token-0"}})
    with pytest.raises(ConfigError, match=r"server\.admin_token: must differ"):
        config_from_dict({"server": {"admin_token": "same-token-1",
                                     "auth": [{"token": "same-token-1", "tenants": ["a"]}]}})


def test_a_failed_start_is_one_json_line_with_json_logs(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    out = serve(tmp_path, cluster={"etcd": [endpoint]}, log={"format": "json"})
    assert out.returncode == 2, out.stderr
    docs = [json.loads(line) for line in out.stderr.strip().splitlines()]
    assert [d["event"] for d in docs if d["level"] == "error"] == ["start_failed"]
    assert "cannot register" in docs[-1]["message"]
