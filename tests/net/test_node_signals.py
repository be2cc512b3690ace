"""A real node's lifecycle: SIGTERM with clients connected (one that moved payloads) stops
it cleanly and keeps what it acknowledged; during the stop new PUTs are refused BUSY while reads are
answered and /readyz says 503; SIGHUP reloads the config live; SIGINT during a large DRAM
prefault is one line; a flood of garbage connections is a bounded number of log lines; with
``log.format: json`` every line, stdout's included, is JSON with an event name; and the
metrics port answers /healthz, /readyz, /sd and 404 elsewhere, with process_* and
kvpool_build_info among the metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from kvtest import payload_for, wait_for
from lifecycle_support import CHUNK, NS, bad_lines, http, start_partial_put
from metrics_support import scrape_url, value
from node_process import NodeProcess
from test_node_threads import connected

from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER_BYTES, RemoteError

HANG_S = 60.0  # only a hang detector


def put_some(conn: NodeConnection, n: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    assert conn.put(NS, keys, [payload_for(k, CHUNK) for k in keys]) == n
    return keys


def held(conn: NodeConnection, keys: list[bytes]) -> bool:
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    if conn.get_into(NS, keys, outs) != [True] * len(keys):
        return False
    return all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs,
                                                                       strict=True))


def test_sigterm_with_clients_exits_0_without_errors_and_keeps_acked_puts(
        tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, pool={"ssd_write": "through"}).start()
    try:
        mover, _ = connected(node.address)  # a connection that moved payloads
        idle = NodeConnection(node.address)
        idle.ping()
        writer = NodeConnection(node.address)
        acked = put_some(writer, 8)  # acknowledged once in the write-behind queue
        assert node.terminate(HANG_S) == 0
        text = node.log.read_text()
        assert not bad_lines(text), text
        assert "stopping (SIGTERM)" in text
        for conn in (mover, idle, writer):
            conn.close()
        node.start()
        fresh = NodeConnection(node.address)
        assert held(fresh, acked)
        fresh.close()
    finally:
        node.stop()


def test_during_the_stop_puts_are_busy_reads_answer_and_readyz_is_503(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, server={"shutdown_timeout_s": 6.0, "metrics_port": 0}).start()
    try:
        assert node.metrics_port is not None
        assert http(node.metrics_port, "/readyz") == (200, "ready\n")
        reader = NodeConnection(node.address)
        keys = put_some(reader, 2)
        writer = NodeConnection(node.address)
        writer.declare(NS)
        stuck = start_partial_put(node.address)
        assert node.proc is not None
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping (SIGTERM)" in node.log.read_text(), HANG_S, "the stop")
        code, body = http(node.metrics_port, "/readyz")
        assert code == 503 and "shutting down" in body
        assert http(node.metrics_port, "/healthz")[0] == 200
        with pytest.raises(RemoteError, match=r"BUSY.*shutting down"):
            writer.put(NS, [os.urandom(16)], [payload_for(b"x" * 16, CHUNK)])
        assert held(reader, keys)  # a read is still answered
        assert node.proc.wait(HANG_S) == 0
        assert time.monotonic() - started < 6.0 + 5.0  # the budget, and process exit
        text = node.log.read_text()
        assert "requests still in flight" in text  # the stuck PUT was cut at 3 s
        assert not bad_lines(text), text
        for conn in (reader, writer, stuck):
            conn.close()
    finally:
        node.stop()


def test_sighup_reloads_the_log_level_and_a_limit_live(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, server={"max_connections": 64}, log={"level": "warning"})
    with node:
        first = NodeConnection(node.address)
        first.ping()
        config = yaml.safe_load((tmp_path / "node.yaml").read_text())
        config["server"]["max_connections"] = 1
        config["server"]["max_keys"] = 1000
        config["server"]["port"] = 1  # needs a restart: reported, not applied
        config["log"]["level"] = "info"
        (tmp_path / "node.yaml").write_text(yaml.safe_dump(config))
        assert node.proc is not None
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded" in node.log.read_text(), HANG_S, "the reload")
        assert node.alive()
        [line] = [x for x in node.log.read_text().splitlines() if "config reloaded" in x]
        assert " INFO " in line  # the new level let an info line through
        applied, restart = line.split("applied ")[1].split("; needs a restart: ")
        assert set(applied.split(", ")) == {"log.level", "server.max_connections",
                                            "server.max_keys"}
        assert restart == "server.port"
        first.ping()  # still serving the connection it had
        second = NodeConnection(node.address)
        with pytest.raises(RemoteError, match=r"BUSY.*max_connections=1"):
            second.ping()
        second.close()
        first.close()
        # A file that no longer loads: one line, the node keeps its settings and serves.
        (tmp_path / "node.yaml").write_text("server: {max_connections: -3}\n")
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reload failed" in node.log.read_text(), HANG_S, "the line")
        third = NodeConnection(node.address)
        third.ping()
        third.close()
    assert not bad_lines(node.log.read_text())


def test_sigint_during_a_large_prefault_is_one_line(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, dram={"capacity": "6GiB", "slab_size": "64MiB",
                                       "prefault": "start"})
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(node.config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "serve", "--config",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        def prefaulting() -> bool:  # RSS past 300 MiB: the arena is being populated
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
            return rss > 300 << 10

        wait_for(prefaulting, HANG_S, "the prefault")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [x for x in err.splitlines() if "SIGINT" in x]
    assert len(lines) == 1 and "during start-up" in lines[0], err
    assert "listening" not in out


def test_200_garbage_connections_give_a_bounded_number_of_lines(tmp_path: Path) -> None:
    with NodeProcess(tmp_path) as node:
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", node.port)) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(HEADER_BYTES))
                try:
                    while sock.recv(4096):  # until the node closes it
                        pass
                except OSError:
                    pass
        ok = NodeConnection(node.address)
        ok.ping()
        ok.close()
        stats = NodeConnection(node.address)
        assert stats.stats()["server"]["protocol_errors"] == 200
        stats.close()
    lines = node.log.read_text().splitlines()
    noise = [x for x in lines if "bad frame magic" in x]
    assert 1 <= len(noise) <= 3, lines
    assert len(lines) < 12, lines


def json_doc(line: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(line)
    assert doc.get("event"), line
    return doc


def test_json_logs_every_line_of_stdout_and_stderr_has_an_event(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, log={"format": "json"}, server={"metrics_port": 0}).start()
    assert node.proc is not None and node.proc.stdout is not None
    conn, _ = connected(node.address)
    with socket.create_connection(("127.0.0.1", node.port)) as sock:
        sock.sendall(bytes(HEADER_BYTES))  # a bad frame: a protocol_error line
        sock.recv(1)
    assert node.terminate(HANG_S) == 0
    conn.close()
    out = node.proc.stdout.read()
    stderr = [json_doc(line) for line in node.log.read_text().splitlines()]
    stdout = [json_doc(line) for line in out.splitlines()]
    events = {d["event"] for d in stderr}
    assert {"shutdown", "fd_limit", "protocol_error", "metrics_listening"} <= events, events
    assert [d["event"] for d in stdout] == ["stopped"]  # "listening" was read by start()
    assert stdout[0]["flushed"] is True
    node.start()  # the SSD log read back: an ssd_recovered line with its figures
    assert node.terminate(HANG_S) == 0
    [recovered] = [d for d in map(json_doc, node.log.read_text().splitlines())
                   if d["event"] == "ssd_recovered"]
    assert recovered["records"] == 2


def test_metrics_port_pages(tmp_path: Path) -> None:
    with NodeProcess(tmp_path, server={"metrics_port": 0, "node_id": "paged"}) as node:
        port = node.metrics_port
        assert port is not None
        assert http(port, "/healthz") == (200, "ok\n")
        assert http(port, "/readyz") == (200, "ready\n")
        for other in ("/", "/ready", "/health", "/metricsx", "/sd/x"):
            assert http(port, other)[0] == 404, other
        code, body = http(port, "/sd")
        assert code == 200
        assert json.loads(body) == [{"targets": [f"127.0.0.1:{port}"],
                                     "labels": {"node": "paged", "cluster": "default"}}]
        samples = scrape_url(f"http://127.0.0.1:{port}/metrics")
        from kvpool.metrics.server_collector import VERSION
        assert value(samples, "kvpool_build_info", version=VERSION) == 1
        assert value(samples, "process_resident_memory_bytes") > 0
        assert value(samples, "process_open_fds") > 0


def test_sighup_rotates_tokens_for_new_connections(tmp_path: Path) -> None:
    old = [{"token": "token-old-1234", "tenants": ["acme"]}]
    new = [{"token": "token-new-5678", "tenants": ["acme"]}]
    with NodeProcess(tmp_path, server={"auth": old}) as node:
        before = NodeConnection(node.address, token="token-old-1234")
        before.ping()
        config = yaml.safe_load((tmp_path / "node.yaml").read_text())
        config["server"]["auth"] = new
        (tmp_path / "node.yaml").write_text(yaml.safe_dump(config))
        assert node.proc is not None
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded" in node.log.read_text(), HANG_S, "the reload")
        assert "applied server.auth;" in node.log.read_text()
        with pytest.raises(RemoteError, match="AUTH_FAILED"):
            NodeConnection(node.address, token="token-old-1234")
        after = NodeConnection(node.address, token="token-new-5678")
        after.ping()
        before.ping()  # an open connection keeps the identity it authenticated with
        for conn in (before, after):
            conn.close()
