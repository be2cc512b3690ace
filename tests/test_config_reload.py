"""The SIGHUP reload mechanism (kvpool/server/reload.py): registered keys are written into the
running config in place and their hooks run; guarded changes and unregistered keys are left
for a restart; a failing hook is reported, never raised."""

from __future__ import annotations

from typing import Any

from kvpool.config import config_from_dict
from kvpool.server.reload import LiveSettings, flatten

TOKENS = [{"token": "token-acme-123", "tenants": ["acme"]}]


def test_live_keys_apply_in_place_and_the_rest_need_a_restart() -> None:
    running = config_from_dict({"server": {"max_connections": 10, "auth": TOKENS}})
    server = running.server  # parts of the node hold this object
    new = config_from_dict({"server": {"max_connections": 20, "port": 9000, "auth": [
        {"token": "token-acme-456", "tenants": ["acme"]}]}, "log": {"level": "debug"}})
    seen: list[Any] = []
    live = LiveSettings()
    live.register("server.max_connections")
    live.register("server.auth", seen.append, guard=lambda old, new: bool(old) == bool(new))
    live.register("log.level", lambda _: 1 / 0)  # a broken hook
    live.register("cluster.repair_bytes_per_s")  # a key this Config may not have
    result = live.apply(running, new)
    assert sorted(result.applied) == ["server.auth", "server.max_connections"]
    assert sorted(result.restart_needed) == ["log.level", "server.port"]
    assert running.server is server and server.max_connections == 20
    assert server.port == 7450  # not live: the running value stays
    assert running.log.level == "info"  # its hook failed: the running value is back
    assert server.auth[0].token == "token-acme-456" and seen == [server.auth]


def test_a_guard_keeps_a_change_for_a_restart() -> None:
    running = config_from_dict({"server": {"auth": TOKENS}})
    live = LiveSettings()
    live.register("server.auth", guard=lambda old, new: bool(old) == bool(new))
    result = live.apply(running, config_from_dict({}))  # auth turned off
    assert result.restart_needed == ["server.auth"] and not result.applied
    assert running.server.auth[0].token == "token-acme-123"


def test_flatten_names_every_setting_by_its_dotted_key() -> None:
    flat = flatten(config_from_dict({}))
    assert flat["server.max_connections"] == 1024 and "cache_dir" in flat
    assert "server.shutdown_timeout_s" in flat and "log.format" in flat
