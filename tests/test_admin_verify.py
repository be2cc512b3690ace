"""`kvpool admin verify DIR`: a real SSD directory written by the engine, checked offline by
the real command (a child process): clean, one byte flipped in one record's payload, held
open by a live engine, not an SSD directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtest import byte_namespace, child_env, payload_for

from kvpool.record import BLOCK, HEADER_BLOCK
from kvpool.ssd.engine import SsdEngine

CHUNK = 64 * 1024
SEG = 1 << 20
RECORDS = 30  # 15 records of 68 KiB per 1 MiB segment: two sealed segments, one active
NS = byte_namespace(CHUNK, salt="verify")


def verify(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", "verify", str(path),
                           *extra], capture_output=True, text=True, timeout=120,
                          env=child_env())


def written(tmp_path: Path) -> Path:
    directory = tmp_path / "cache" / "ssd"
    engine = SsdEngine(directory, 4 * SEG, SEG, "durable")
    keys = [i.to_bytes(16, "big") for i in range(1, RECORDS + 1)]
    assert engine.put_many([(k, NS, payload_for(k, CHUNK)) for k in keys]) == RECORDS
    engine.close()
    return directory


def report(path: Path) -> tuple[int, dict[str, Any]]:
    out = verify(path, "--json")
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def test_a_clean_directory_passes_with_every_record_good(tmp_path: Path) -> None:
    directory = written(tmp_path)
    code, doc = report(directory)
    assert code == 0 and doc["clean"]
    assert doc["totals"]["good"] == RECORDS
    assert (doc["totals"]["bad"], doc["totals"]["torn"], doc["totals"]["skipped_blocks"]) == \
        (0, 0, 0)
    used = [s for s in doc["segments"] if s["state"] == "used"]
    assert len(used) == 3
    assert sum(s["summary"] == "ok" for s in used) == 2  # the sealed ones; the active has none
    table = verify(tmp_path / "cache")  # a cache_dir is taken as its ssd/
    assert table.returncode == 0 and "clean" in table.stdout, table.stdout + table.stderr


def test_one_damaged_payload_byte_is_one_bad_record(tmp_path: Path) -> None:
    directory = written(tmp_path)
    _, clean = report(directory)
    oldest = min((s for s in clean["segments"] if s["state"] == "used"),
                 key=lambda s: s["start_seq"])
    # Its first record starts right after the segment header; flip a byte of its payload.
    path = directory / f"seg-{oldest['number']:05d}.kvs"
    at = HEADER_BLOCK + HEADER_BLOCK + 1000
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), at)
    finally:
        os.close(fd)
    code, doc = report(directory)
    assert code == 1 and not doc["clean"]
    assert doc["totals"]["bad"] == 1 and doc["totals"]["good"] == RECORDS - 1
    assert doc["totals"]["torn"] == 0
    damaged = [s for s in doc["segments"] if s["damaged"]]
    assert [s["number"] for s in damaged] == [oldest["number"]]
    assert damaged[0]["bad_records"][0]["offset"] == BLOCK
    assert damaged[0]["bad_records"][0]["problem"] == "bad payload"
    assert damaged[0]["summary"] == "ok"  # the summary still lists the record it holds
    table = verify(directory)
    assert table.returncode == 1 and "DAMAGED" in table.stdout and "1 bad" in table.stdout


def test_a_directory_held_by_a_live_engine_is_refused(tmp_path: Path) -> None:
    directory = written(tmp_path)
    engine = SsdEngine(directory, 4 * SEG, SEG, "durable")
    try:
        out = verify(directory)
    finally:
        engine.close()
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"holds it (pid {os.getpid()})" in out.stderr and "offline" in out.stderr


def test_what_is_no_ssd_directory_is_bad_usage(tmp_path: Path) -> None:
    missing = verify(tmp_path / "nowhere")
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    empty = verify(tmp_path)
    assert empty.returncode == 2 and "no segment file" in empty.stderr
    assert "Traceback" not in missing.stderr + empty.stderr


def test_a_storage_nodes_bad_record_is_named_by_the_clients_chunk_key(tmp_path: Path) -> None:
    """A node files a chunk under xxh3_128(namespace id + chunk key): verify named only that
    internal key, which no client knows. --chunk-key names the record by the client's key."""
    from node_process import NodeProcess

    from kvpool.net.connection import NodeConnection
    node = NodeProcess(tmp_path / "node").start()
    keys = [bytes([i]) * 16 for i in (1, 2)]
    try:
        conn = NodeConnection(node.address)
        assert conn.put(NS, keys, [payload_for(k, CHUNK) for k in keys]) == 2
        conn.close()
    finally:
        assert node.terminate() == 0  # SIGTERM flushes the write-behind queue to SSD
    directory = tmp_path / "node" / "cache" / "ssd"
    _, clean = report(directory)
    used = [s for s in clean["segments"] if s["state"] == "used"]
    assert len(used) == 1 and clean["totals"]["good"] == 2
    path = directory / f"seg-{used[0]['number']:05d}.kvs"
    fd = os.open(path, os.O_RDWR)
    try:  # the first record's payload, right after the segment header and its header block
        at = HEADER_BLOCK + HEADER_BLOCK + 1000
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
    finally:
        os.close(fd)
    out = verify(directory, "--json", "--chunk-key", keys[0].hex(), "--chunk-key",
                 keys[1].hex())
    bad = json.loads(out.stdout)["segments"][used[0]["number"]]["bad_records"]
    assert len(bad) == 1 and bad[0]["namespace"] == NS.id.hex()
    first = bad[0]
    assert first["chunk_key"] in {k.hex() for k in keys} and first["key"] != first["chunk_key"]
    assert "storage node" in first["filed_as"]
    table = " ".join(verify(directory, "--chunk-key", first["chunk_key"]).stdout.split())
    assert f"chunk key {first['chunk_key']}, filed by a storage node" in table, table
    plain = " ".join(verify(directory).stdout.split())  # unwrapped
    assert f"filed key {first['key']}" in plain and "--chunk-key" in plain
    assert verify(directory, "--chunk-key", "abc").returncode == 2
