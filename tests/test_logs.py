"""Structured logs: the log section, JSON lines carrying event fields, level filtering, and
the events of the SSD engine (a checksum failure of a really damaged record, a segment
eviction)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_ssd_corruption import CHUNK, NS, data, engine_at, fill, flip_bit, key, locate

from kvpool.config import LogConfig, config_from_dict
from kvpool.errors import ConfigError
from kvpool.logs import JsonFormatter, RateLimited, configure_logging
from kvpool.record import HEADER_BLOCK
from kvpool.ssd.engine import SsdEngine


class Captured:
    """What configure_logging wrote, as text and as parsed JSON lines."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [d for d in self.lines() if d["event"] == name]


@pytest.fixture
def logs() -> Iterator[Captured]:
    """Logging configured as a command would, into a buffer; undone afterwards."""
    root = logging.getLogger()
    level = root.level
    cap = Captured()
    handler = configure_logging(LogConfig(format="json", level="info"), cap.stream)
    yield cap
    root.removeHandler(handler)
    root.setLevel(level)


def test_log_section_is_validated() -> None:
    assert config_from_dict({}).log == LogConfig(level="info", format="text")
    assert config_from_dict({"log": {"level": "debug", "format": "json"}}).log.format == "json"
    with pytest.raises(ConfigError, match=r"log\.format: Input should be 'text' or 'json'"):
        config_from_dict({"log": {"format": "xml"}})
    with pytest.raises(ConfigError, match=r"log\.level"):
        config_from_dict({"log": {"level": "loud"}})


def test_json_lines_carry_ts_level_logger_event_message_and_fields(logs: Captured) -> None:
    log = logging.getLogger("kvpool.test")
    log.info("plain %d", 1)
    log.warning("node %s left", "n1", extra={"event": "node_left", "node": "n1",
                                             "where": Path("/x")})
    plain, event = logs.lines()
    assert plain["event"] == "test" and plain["message"] == "plain 1"  # the logger's name
    assert plain["level"] == "info" and plain["logger"] == "kvpool.test"
    assert plain["ts"].endswith("+00:00") and "T" in plain["ts"]
    assert event == {**event, "level": "warning", "event": "node_left", "node": "n1",
                     "message": "node n1 left", "where": "/x"}


def test_level_filtering_and_reconfiguring_replace_the_handler(logs: Captured) -> None:
    log = logging.getLogger("kvpool.test")
    log.debug("hidden at info")
    stream = io.StringIO()
    handler = configure_logging(LogConfig(level="warning", format="text"), stream)
    root = logging.getLogger()
    assert handler in root.handlers and sum(h is handler for h in root.handlers) == 1
    log.info("hidden at warning")
    log.error("shown %s", "once")
    assert logs.stream.getvalue() == ""  # the first handler was replaced, not kept
    [line] = stream.getvalue().splitlines()
    assert line.endswith(" ERROR kvpool.test: shown once")
    root.removeHandler(handler)


def test_rate_limited_counts_what_it_holds_back() -> None:
    say = RateLimited(interval_s=3600)
    assert say.due() == 0
    assert say.due() is None and say.due() is None
    say.interval_s = 0
    assert say.due() == 2


def test_checksum_failure_of_a_damaged_record_is_one_rate_limited_json_line(
        tmp_path: Path, logs: Captured) -> None:
    e = engine_at(tmp_path)
    try:
        fill(e, range(6))
        for i in (2, 4):
            seg, off, _ = locate(tmp_path, key(i))
            flip_bit(seg, off + HEADER_BLOCK + 100)
        out = memoryview(bytearray(CHUNK))
        assert not e.get_into(key(2), out) and not e.get_into(key(4), out)
        assert e.stats()["checksum_failures"] == 2
    finally:
        e.close()
    [line] = logs.events("checksum_failure")  # the second is held back (rate limit)
    seg, off, _ = locate(tmp_path, key(2))  # seg-NNNNN.kvs: one file per segment
    assert line["level"] == "warning" and line["logger"] == "kvpool.ssd"
    assert (line["segment"], line["offset"]) == (int(seg.stem.split("-")[1]), off)
    assert line["key_prefix"] == key(2)[:4].hex() and key(2).hex() not in line["message"]
    assert line["reason"] == "payload checksum mismatch" and line["held_back"] == 0


def test_segment_eviction_is_one_json_line(tmp_path: Path, logs: Captured) -> None:
    e = SsdEngine(tmp_path, 2 << 20, 1 << 20, eviction="fifo")
    try:
        for i in range(40):  # 14 records to a 1 MiB segment: the third segment evicts one
            assert e.put(key(i), NS, data(i))
        evicted = e.stats()["segments_evicted"]
    finally:
        e.close()
    lines = logs.events("segment_evicted")
    assert evicted >= 1 and len(lines) == evicted
    assert lines[0]["records_dropped"] == 14 and lines[0]["copied_forward"] == 0
    assert isinstance(lines[0]["segment"], int)


class _SlowSink:
    """A write-behind sink that blocks until released, so its queue fills."""

    def __init__(self) -> None:
        import threading
        self.go = threading.Event()

    def put_many(self, items: Any) -> int:
        self.go.wait(30)
        return len(list(items))


def test_a_burst_of_dropped_saves_is_one_json_line(logs: Captured) -> None:
    from kvpool.tiers.staging import WriteBehind
    sink = _SlowSink()
    queue = WriteBehind(sink, max_bytes=4 * CHUNK, batch=1, label="ssd")
    try:
        offered = [queue.offer(key(i), NS, data(i)) for i in range(12)]
        dropped = offered.count(False)
        assert dropped >= 6 and queue.stats()["dropped"] == dropped
    finally:
        sink.go.set()
        queue.close()
    [line] = logs.events("dropped_save")  # the rest of the burst is held back
    assert line["level"] == "warning" and line["logger"] == "kvpool.writebehind"
    assert (line["queue"], line["cause"], line["dropped"]) == ("ssd_staging", "full", 1)


def test_an_embedded_pool_configures_logging_only_when_told(tmp_path: Path) -> None:
    from kvtest import small_config

    from kvpool.pool import KVPool
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    with KVPool(small_config(tmp_path / "a")):
        assert root.handlers == before  # the host's logging is left alone
    with KVPool(small_config(tmp_path / "b", log={"configure": True, "format": "json"})):
        ours = [h for h in root.handlers if h not in before]
        assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)
    root.removeHandler(ours[0])
    root.setLevel(level)
