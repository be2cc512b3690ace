"""KVPoolHiCacheStorage against SGLang's real classes (host pool, backend factory, cache
controller, fault injector), each scenario in the SGLang venv (``sglang_checks.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from host_support import host_config
from node_process import NodeProcess

from kvpool.config import config_from_dict
from kvpool.host.server import HostServer

#: The ``run_check`` fixture of tests/sglang/conftest.py.
RunCheck = Callable[..., dict[str, Any]]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CONTROLLER_LAYOUTS = ("layer_first", "page_first")


@pytest.fixture(scope="module")
def batch(run_checks: Callable[..., list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The fault-free scenarios of this module, run in one SGLang process (one import of
    SGLang, not six: ~10 s each), each on a pool of its own; results by scenario id."""
    scenarios: dict[str, tuple[str, dict[str, Any]]] = {
        **{f"roundtrip-{lay}": ("roundtrip", {"layout": lay}) for lay in LAYOUTS},
        **{f"controller-{lay}": ("controller", {"layout": lay, "rounds": 2, "pages": 20})
           for lay in CONTROLLER_LAYOUTS},
        "threads": ("threads", {"rounds": 30})}
    results = run_checks(list(scenarios.values()))
    return dict(zip(scenarios, results, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_byte_for_byte_through_the_dynamic_factory(
        batch: dict[str, dict[str, Any]], layout: str) -> None:
    r = batch[f"roundtrip-{layout}"]
    assert r["class"] == "KVPoolHiCacheStorage"  # created by SGLang's "dynamic" factory
    assert r["set_v1"] == [True] * 6
    assert r["get_v1"] == [True] * 6
    assert r["v1_bytes_equal"] is True
    # the legacy calls store the same bytes: each path reads what the other wrote
    assert r["legacy_get_equal"] == [True] * 6
    assert r["legacy_set"] is True
    assert r["get_v1_of_legacy"] == [True] * 6
    assert r["v1_of_legacy_equal"] is True
    # a missing key is a miss, never an exception
    assert r["exists_missing"] is False
    assert r["get_missing"] is True
    assert r["get_v1_missing"] == [False]
    # batch_exists: the leading run, cut at the first gap
    assert r["exists_full"] == 6
    assert r["exists_gap"] == 2
    assert r["exists_first_missing"] == 0
    assert r["stats"]["errors"] == 0
    # the pool's engine metrics, in tokens (16-token pages): 12 pages stored, 18 read,
    # lookups of 21 pages of which 8 hit
    m = r["metrics"]
    assert m['kvpool_engine_stored_tokens_total{engine="sglang"}'] == 12 * 16
    assert m['kvpool_engine_prefill_tokens_saved_total{engine="sglang"}'] == 18 * 16
    assert m['kvpool_engine_lookup_tokens_total{engine="sglang",result="hit"}'] == 8 * 16
    assert m['kvpool_engine_lookup_tokens_total{engine="sglang",result="miss"}'] == 13 * 16
    # SGLang's storage metrics: pages per v1 call since the last get_stats
    assert r["io"] == {"type": "StorageMetrics", "prefetch_pgs": [6, 6, 0], "backup_pgs": [6],
                       "again": []}
    # clear drops the namespace's pages; after close every call misses
    assert r["cleared"] is True
    assert r["exists_after_clear"] == 0
    assert r["exists_after_close"] == 0


@pytest.mark.parametrize("layout", CONTROLLER_LAYOUTS)
def test_controller_write_back_then_prefetch_gives_identical_bytes(
        batch: dict[str, dict[str, Any]], layout: str) -> None:
    r = batch[f"controller-{layout}"]
    assert r["backend"] == "KVPoolHiCacheStorage"
    assert r["escaped"] == []
    assert r["hits"] == [20, 20]  # every page written back was prefetched
    assert r["correct_pages"] == 40
    assert r["wrong_pages"] == 0
    assert r["backend_errors"] == 0


def test_fault_injection_failed_pages_miss_and_survivors_are_correct(
        run_check: RunCheck) -> None:
    r = run_check("controller", env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3"},
                  layout="page_first", rounds=20, pages=4)
    assert r["backend"] == "HiCacheStorageFailureInjector"  # SGLang wrapped the backend
    assert r["escaped"] == []
    assert r["backend_errors"] == 0  # the injector's failures never reached the pool as faults
    assert r["wrong_pages"] == 0  # every page that was read is the page written
    assert r["correct_pages"] == sum(r["hits"])
    # at p=0.3 on each of the 4 calls of a round (exists, set, exists, get) about a third
    # of the rounds survive; all 20 failing or all surviving is far under 1 in 1000;
    # an injected failure on a write or a read ends that round's prefix
    assert 0 < sum(r["hits"]) < 20 * 4


def test_three_threads_at_once_read_exactly_what_was_written(
        batch: dict[str, dict[str, Any]]) -> None:
    r = batch["threads"]
    assert r["bad"] == []
    assert r["errors"] == 0
    assert r["get_hit_pages"] == 3 * 30 * 8  # each thread reads back its 8 pages every round
    assert r["dram_evictions"] > 0  # the small DRAM evicted while the threads ran


def test_two_host_pools_share_pages_through_one_node(run_check: RunCheck,
                                                     node: NodeProcess) -> None:
    r = run_check("two_instances", node=node.address)
    assert r["set_a"] == [True] * 5
    assert r["flushed"] is True
    assert r["exists_b"] == 5
    assert r["get_b"] == [True] * 5
    assert r["equal"] is True
    assert r["b_pool"]["remote_hits"] == 5  # instance b read them from the node


def test_two_ranks_and_a_second_instance_attach_to_one_host_pool(
        run_check: RunCheck, tmp_path: Path) -> None:
    data = host_config(tmp_path / "host", dram={"capacity": "16MiB", "slab_size": "8MiB"})
    server = HostServer(config_from_dict(data)).start()
    try:
        r = run_check("attached_ranks", socket=data["host"]["socket"])
    finally:
        server.stop()
    assert r["attached"] == ["AttachedPool", "AttachedPool"]  # host.socket in the config
    for rank in (0, 1):
        assert r[f"set_{rank}"] == [True] * 5
        assert r[f"get_{rank}"] == [True] * 5
        assert r[f"equal_{rank}"] is True  # same page names, each rank its own bytes
    assert r["saved"] == [5, 5]
    # another instance's rank 0 finds rank 0's pages in the host pool
    assert r["exists_other"] == 5
    assert r["get_other"] == [True] * 5
    assert r["other_equal_rank0"] is True
