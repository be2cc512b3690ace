"""The embedded pool's Prometheus metrics move by exactly what a scripted workload did:
puts, DRAM and SSD hits, misses, evictions and a corrupt record (read through the text
exposition, as Prometheus reads it)."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config
from metrics_support import delta, metric_names, scrape, scrape_url, value
from test_ssd_corruption import flip_bit, locate

from kvpool.metrics import METRICS, all_metric_names
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.metrics.histogram import LATENCY_BUCKETS
from kvpool.metrics.recorder import LabeledLatency
from kvpool.pool import KVPool
from kvpool.record import HEADER_BLOCK


def _read(pool: KVPool, ns: object, keys: list[bytes]) -> list[bool]:
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    return pool.get_many_into(ns, keys, outs)  # type: ignore[arg-type]


def test_counters_move_by_exactly_the_workload(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)  # DRAM: 16 chunks of 64 KiB; SSD written through
    ns = byte_namespace()  # one token per chunk
    keys = ns.chunk_keys(list(range(40)))
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        before = scrape(pool.metrics)
        for key in keys[:8]:
            assert pool.put(ns, key, payload_for(key))
        assert pool.flush(30)
        s1 = scrape(pool.metrics)
        assert delta(before, s1, "kvpool_written_bytes_total", tier="dram") == 8 * CHUNK
        assert delta(before, s1, "kvpool_written_bytes_total", tier="ssd_staging") == 8 * CHUNK
        assert delta(before, s1, "kvpool_written_bytes_total", tier="ssd") == 8 * CHUNK
        assert value(s1, "kvpool_chunks", tier="dram") == 8
        assert value(s1, "kvpool_chunks", tier="ssd") == 8
        assert value(s1, "kvpool_used_bytes", tier="dram") == 8 * CHUNK
        assert value(s1, "kvpool_capacity_bytes", tier="dram") == 16 * CHUNK
        # each record: one 4 KiB header block + its 64 KiB payload
        assert value(s1, "kvpool_ssd_write_amplification") == pytest.approx(
            (HEADER_BLOCK + CHUNK) / CHUNK)
        assert value(s1, "kvpool_queue_depth", queue="ssd_write_behind") == 0
        assert value(s1, "kvpool_queue_bytes", queue="ssd_write_behind") == 0  # buffers kept
        assert delta(before, s1, "kvpool_op_seconds_count", op="put") == 8

        # 8 DRAM hits and 3 misses in one call; a lookup that finds 8
        unknown = [bytes([i]) * 16 for i in range(3)]
        assert _read(pool, ns, keys[:8] + unknown) == [True] * 8 + [False] * 3
        assert pool.lookup(ns, keys[:10]) == 8
        s2 = scrape(pool.metrics)
        assert delta(s1, s2, "kvpool_hit_chunks_total", tier="dram") == 8
        assert delta(s1, s2, "kvpool_hit_tokens_total", tier="dram") == 8
        assert delta(s1, s2, "kvpool_read_bytes_total", tier="dram") == 8 * CHUNK
        assert delta(s1, s2, "kvpool_miss_chunks_total") == 3
        assert delta(s1, s2, "kvpool_miss_tokens_total") == 3
        assert delta(s1, s2, "kvpool_hit_chunks_total", tier="ssd") == 0
        assert delta(s1, s2, "kvpool_lookups_total") == 1
        assert delta(s1, s2, "kvpool_lookup_hit_chunks_total") == 8
        assert delta(s1, s2, "kvpool_op_seconds_count", op="get") == 1
        assert delta(s1, s2, "kvpool_op_seconds_count", op="lookup") == 1
        # the misses asked every tier: DRAM, the SSD's staging and the SSD once each
        for tier in ("dram", "ssd_staging", "ssd"):
            assert delta(s1, s2, "kvpool_tier_op_seconds_count", tier=tier, op="get") == 1

        # 32 more puts: DRAM holds 16, so 24 of the 40 are evicted (all on SSD already)
        for key in keys[8:]:
            assert pool.put(ns, key, payload_for(key))
        assert pool.flush(30)
        views = pool.pin_many(ns, keys)  # which chunks DRAM still holds (counted as hits)
        off_dram = [k for k, v in zip(keys, views, strict=True) if v is None]
        for v in views:
            if v is not None:
                v.release()
        assert len(off_dram) == 24
        s3 = scrape(pool.metrics)
        assert delta(s2, s3, "kvpool_evictions_total", tier="dram") == 24
        assert delta(s2, s3, "kvpool_hit_chunks_total", tier="dram") == 16
        assert delta(s2, s3, "kvpool_read_bytes_total", tier="dram") == 16 * CHUNK
        # a pin is a get (engines read DRAM so), DRAM's part the pinning
        assert delta(s2, s3, "kvpool_op_seconds_count", op="get") == 1
        assert delta(s2, s3, "kvpool_tier_op_seconds_count", tier="dram", op="get") == 1
        assert delta(s2, s3, "kvpool_demotions_total") == 0  # written through: no demotion
        assert value(s3, "kvpool_chunks", tier="ssd") == 40

        # two evicted chunks: one read from the SSD, one damaged there (a counted miss)
        good, bad = off_dram[:2]
        seg, off, _ = locate(cfg.ssd_path(), bad)
        flip_bit(seg, off + HEADER_BLOCK + 100)
        assert _read(pool, ns, [good, bad]) == [True, False]
        s4 = scrape(pool.metrics)
        assert delta(s3, s4, "kvpool_hit_chunks_total", tier="ssd") == 1
        assert delta(s3, s4, "kvpool_read_bytes_total", tier="ssd") == CHUNK
        assert delta(s3, s4, "kvpool_checksum_failures_total", tier="ssd") == 1
        assert delta(s3, s4, "kvpool_miss_chunks_total") == 1
        assert delta(s3, s4, "kvpool_io_errors_total", tier="ssd") == 0
        assert pool.flush(30)  # the good chunk's promotion
        s5 = scrape(pool.metrics)
        assert delta(s3, s5, "kvpool_promotions_total") == 1
    # a closed pool exports nothing rather than failing the scrape
    assert not any(name.startswith("kvpool_") for name, _ in scrape(pool.metrics))


def test_latency_histogram_buckets_are_cumulative_and_span_10us_to_10s(
        tmp_path: Path) -> None:
    ns = byte_namespace()
    key = ns.chunk_keys([1])[0]
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        for _ in range(5):
            pool.put(ns, key, payload_for(key))
        s = scrape(pool.metrics)
    bounds = [float(b) for b in LATENCY_BUCKETS]
    assert bounds[0] == 1e-5 and bounds[-1] == 10.0
    counts = [value(s, "kvpool_op_seconds_bucket", op="put", le=repr(b)) for b in bounds]
    assert counts == sorted(counts)
    assert value(s, "kvpool_op_seconds_bucket", op="put", le="+Inf") == 5
    assert value(s, "kvpool_op_seconds_count", op="put") == 5
    assert 0 < value(s, "kvpool_op_seconds_sum", op="put") < 5 * 10


def test_metrics_disabled_keeps_counters_and_drops_histograms(tmp_path: Path) -> None:
    ns = byte_namespace()
    key = ns.chunk_keys([1])[0]
    with KVPool(small_config(tmp_path, metrics={"enabled": False})) as pool:
        pool.register_namespace(ns)
        pool.put(ns, key, payload_for(key))
        assert _read(pool, ns, [key]) == [True]
        s = scrape(pool.metrics)
    assert value(s, "kvpool_hit_chunks_total", tier="dram") == 1
    assert "kvpool_op_seconds" not in metric_names(s)
    assert "kvpool_tier_op_seconds" not in metric_names(s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metrics_port_serves_http_and_a_taken_port_fails_the_open(tmp_path: Path) -> None:
    port = _free_port()
    ns = byte_namespace()
    with KVPool(small_config(tmp_path / "a", metrics={"port": port})) as pool:
        assert pool.metrics_url == f"http://127.0.0.1:{port}/metrics"
        pool.register_namespace(ns)
        key = ns.chunk_keys([7])[0]
        pool.put(ns, key, payload_for(key))
        assert _read(pool, ns, [key]) == [True]
        assert value(scrape_url(pool.metrics_url), "kvpool_hit_chunks_total", tier="dram") == 1
        with pytest.raises(OSError):
            KVPool(small_config(tmp_path / "b", metrics={"port": port}))
        # the failed open released its cache directory: the same config opens elsewhere
        with KVPool(small_config(tmp_path / "b")) as other:
            assert other.metrics_url is None
        assert value(scrape_url(pool.metrics_url), "kvpool_hit_chunks_total", tier="dram") == 1
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_engine_collector_exports_tokens_and_ttft() -> None:
    from prometheus_client.registry import CollectorRegistry
    counts = EngineCounts(lookup_hit_tokens=512, lookup_miss_tokens=256,
                          prefill_tokens_saved=512, stored_tokens=256)
    ttft = LabeledLatency()
    ttft.record("hf", 0.02)
    ttft.record("hf", 3.0)
    registry = CollectorRegistry()
    registry.register(EngineCollector("hf", lambda: counts, ttft))
    s = scrape(registry)
    assert value(s, "kvpool_engine_lookup_tokens_total", engine="hf", result="hit") == 512
    assert value(s, "kvpool_engine_lookup_tokens_total", engine="hf", result="miss") == 256
    assert value(s, "kvpool_engine_prefill_tokens_saved_total", engine="hf") == 512
    assert value(s, "kvpool_engine_stored_tokens_total", engine="hf") == 256
    assert value(s, "kvpool_engine_ttft_seconds_bucket", engine="hf", le="0.025") == 1
    assert value(s, "kvpool_engine_ttft_seconds_bucket", engine="hf", le="2.5") == 1
    assert value(s, "kvpool_engine_ttft_seconds_bucket", engine="hf", le="5.0") == 2


def test_catalogue_names_follow_prometheus_conventions() -> None:
    for name, spec in METRICS.items():
        assert name.startswith("kvpool_")
        assert (spec.kind == "counter") == name.endswith("_total"), name
        if spec.kind == "histogram":
            assert name.endswith("_seconds"), name
        assert not {"key", "request", "namespace", "req_id"} & set(spec.labels), name
    assert len(all_metric_names()) == len(METRICS)


def test_docs_list_every_metric() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    missing = [name for name in METRICS if f"`{name}`" not in doc]
    assert not missing, f"docs/operations.md lacks {missing}"


def test_latency_shards_of_many_threads_add_up_exactly() -> None:
    """Each thread records into its own shard; a scrape sums them, including the shards of
    threads that ended (folded in once, never counted twice)."""
    import threading

    from kvpool.metrics.recorder import OpLatency
    latency = OpLatency(["dram", "ssd"])
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(1000):
            latency.record("get", 1e-4, [5e-5, 2e-2])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads[:4]:
        t.join()
    latency.snapshot()  # folds the ended threads' shards while the others still write
    for t in threads[4:]:
        t.join()
    for _ in range(2):  # a second scrape changes nothing
        ops, tiers = latency.snapshot()
        counts, total = ops[("get",)]
        assert sum(counts) == 8000 and total == pytest.approx(8000 * 1e-4)
        assert sum(tiers[("dram", "get")][0]) == 8000
        assert sum(tiers[("ssd", "get")][0]) == 8000
        assert ("dram", "put") not in tiers


def test_latency_recording_switches_at_runtime(tmp_path: Path) -> None:
    ns = byte_namespace()
    key = ns.chunk_keys([1])[0]
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        pool.put(ns, key, payload_for(key))
        pool.record_latency(False)
        assert _read(pool, ns, [key]) == [True]
        s = scrape(pool.metrics)  # what was recorded stays exported; the get was not timed
        assert value(s, "kvpool_op_seconds_count", op="put") == 1
        assert value(s, "kvpool_op_seconds_count", op="get") == 0
        assert value(s, "kvpool_hit_chunks_total", tier="dram") == 1  # counters unaffected
        pool.record_latency(True)
        assert _read(pool, ns, [key]) == [True]
        assert value(scrape(pool.metrics), "kvpool_op_seconds_count", op="get") == 1
