"""Issue 22 defect 11 and item 7's redaction: which ``KVPOOL_*`` variables are settings,
tokens hidden by ``kvpool config``, TLS settings that cannot be half set, bytes-like keys
and ``lookup(ns, None)`` refused with kvpool's ArgumentError and a true message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvtest import byte_namespace, small_config

from kvpool import KVPool
from kvpool.config import config_from_dict, is_setting_variable, load_config
from kvpool.errors import ArgumentError, ConfigError


def kvpool_config(tmp_path: Path, data: dict[str, Any],
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "kvpool.yaml"
    path.write_text(yaml.safe_dump(data))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "config", "--config", str(path)],
                          capture_output=True, text=True, env={**clean, **(env or {})},
                          timeout=60)


# ---------------------------------------------------------------- environment variables
def test_other_tools_kvpool_variables_are_ignored(tmp_path: Path) -> None:
    """KVPOOL_BIN in a wrapper script's environment stopped kvpool with 'bin: unknown key'."""
    env = {"KVPOOL_BIN": "/opt/kvpool/bin", "KVPOOL_HOME": "/x", "KVPOOL_CACHE_DIR": "/data",
           "KVPOOL_DRAM__CAPACITY": "2GiB"}
    cfg = load_config(environ=env)
    assert cfg.cache_dir == "/data" and cfg.dram.capacity == 2 << 30
    res = kvpool_config(tmp_path, {}, env)
    assert res.returncode == 0, res.stderr
    assert "bin" not in yaml.safe_load(res.stdout)


def test_typos_of_settings_are_still_refused() -> None:
    with pytest.raises(ConfigError, match=r"dramm: unknown key"):
        load_config(environ={"KVPOOL_DRAMM__CAPACITY": "2GiB"})
    with pytest.raises(ConfigError, match=r"ssd\.bogus: unknown key"):
        load_config(environ={"KVPOOL_SSD__BOGUS": "1"})
    with pytest.raises(ConfigError, match=r"cluster\.tls\.enable: unknown key"):
        load_config(environ={"KVPOOL_CLUSTER__TLS__ENABLE": "true"})


@pytest.mark.parametrize(("name", "setting"), [
    ("KVPOOL_CACHE_DIR", True), ("KVPOOL_DRAM__CAPACITY", True), ("KVPOOL_X__Y", True),
    ("KVPOOL_BIN", False), ("KVPOOL_DRAM", False), ("KVPOOL_CONFIG", False),
    ("KVPOOLX_DRAM__CAPACITY", False), ("PATH", False)])
def test_which_variables_are_settings(name: str, setting: bool) -> None:
    assert is_setting_variable(name) is setting


# ---------------------------------------------------------------- redaction
def test_kvpool_config_prints_tokens_redacted(tmp_path: Path) -> None:
    data = {"server": {"auth": [{"token": "tenant-secret-1", "tenants": ["acme"]}],
                       "admin_token": "admin-secret-2",
                       "tls": {"cert_file": "/etc/kvpool/node.pem",
                               "key_file": "/etc/kvpool/node.key"}},
            "cluster": {"token": "client-secret-3",
                        "tls": {"enabled": True, "ca_file": "/etc/kvpool/ca.pem"}}}
    res = kvpool_config(tmp_path, data)
    assert res.returncode == 0, res.stderr
    for secret in ("tenant-secret-1", "admin-secret-2", "client-secret-3"):
        assert secret not in res.stdout
    shown = yaml.safe_load(res.stdout)
    assert shown["server"]["auth"] == [{"token": "***", "tenants": ["acme"]}]
    assert shown["server"]["admin_token"] == "***" and shown["cluster"]["token"] == "***"
    assert shown["server"]["tls"]["key_file"] == "/etc/kvpool/node.key"  # paths are shown
    assert shown["cluster"]["tls"]["ca_file"] == "/etc/kvpool/ca.pem"


def test_unset_tokens_stay_null(tmp_path: Path) -> None:
    shown = yaml.safe_load(kvpool_config(tmp_path, {}).stdout)
    assert shown["cluster"]["token"] is None and shown["server"]["admin_token"] is None


# ---------------------------------------------------------------- TLS settings
@pytest.mark.parametrize(("data", "message"), [
    ({"server": {"tls": {"cert_file": "/c.pem"}}}, "server.tls.cert_file and server.tls.key_file"),
    ({"server": {"tls": {"client_ca_file": "/ca.pem"}}}, "server.tls.client_ca_file: needs"),
    ({"cluster": {"tls": {"ca_file": "/ca.pem"}}}, "cluster.tls.ca_file: set cluster.tls.enabled"),
    ({"cluster": {"tls": {"enabled": True, "key_file": "/k"}}}, "cluster.tls.cert_file and"),
])
def test_half_set_tls_is_refused(data: dict[str, Any], message: str) -> None:
    """A client that names a CA but forgot enabled would talk plain text: refused instead."""
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_dict(data)


# ---------------------------------------------------------------- keys and lookup
@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with KVPool(small_config(tmp_path)) as p:
        yield p


def test_a_bytearray_key_is_refused_naming_its_type(pool: KVPool) -> None:
    """It said 'must be 16 bytes, got 16 bytes'."""
    ns = pool.register_namespace(byte_namespace())
    with pytest.raises(ArgumentError, match=r"keys\[0\] must be a chunk key of type bytes, "
                                            r"got a bytearray of 16 bytes") as err:
        pool.lookup(ns, [bytearray(16)])  # type: ignore[list-item]
    assert "got 16 bytes" not in str(err.value)
    with pytest.raises(ArgumentError, match="got a memoryview of 16 bytes"):
        pool.contains(ns, memoryview(bytes(16)))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="16 bytes, got 3 bytes"):
        pool.contains(ns, b"abc")


@pytest.mark.parametrize("call", ["lookup", "contains_many", "touch", "prefetch"])
def test_none_for_keys_is_an_argument_error(pool: KVPool, call: str) -> None:
    """lookup(ns, None) raised a bare TypeError from len(None)."""
    ns = pool.register_namespace(byte_namespace())
    with pytest.raises(ArgumentError, match=r"keys must be a sequence.*got NoneType"):
        getattr(pool, call)(ns, None)


def test_offload_threshold_is_not_a_kvpool_setting() -> None:
    """docs/vllm.md: it is set in vLLM's kv_connector_extra_config only."""
    with pytest.raises(ConfigError, match=r"pool\.offload_threshold: unknown key"):
        config_from_dict({"pool": {"offload_threshold": 0.8}})
    with pytest.raises(ConfigError, match=r"pool\.offload_threshold: unknown key"):
        load_config(environ={"KVPOOL_POOL__OFFLOAD_THRESHOLD": "0.8"})
    assert load_config(environ={"KVPOOL_OFFLOAD_THRESHOLD": "0.8"})  # not kvpool's: ignored
