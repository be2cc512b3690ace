"""Scheduler-side planning, lookups and settings of the vLLM connector, without vLLM."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.lookup import LookupClient, LookupServer
from kvpool.integrations.vllm.plan import RequestPlan
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.settings import parse_settings
from kvpool.keys import KVLayout, Namespace


def plan(prompt_len: int = 1000, chunk: int = 256, block: int = 128) -> RequestPlan:
    keys = [(bytes([c]) * 16,) for c in range(prompt_len // chunk)]
    return RequestPlan("r", keys, prompt_len, chunk, block)


TABLE = list(range(100, 120))  # block i of the request lives in engine block 100 + i


def blocks(transfer: object) -> list[tuple[int, ...]]:
    return [c.block_ids for c in transfer.chunks]  # type: ignore[attr-defined]


def test_chunked_prefill_stores_each_chunk_once_in_the_step_that_completes_it() -> None:
    p = plan()
    load, store = p.step(0, 300, TABLE)  # tokens 0..299: chunk 0 complete
    assert load is None and blocks(store) == [(100, 101)]
    load, store = p.step(300, 300, TABLE)  # ..599: chunk 1 complete
    assert blocks(store) == [(102, 103)]
    load, store = p.step(600, 400, TABLE)  # ..999: chunk 2 complete, tail 768..999 is not
    assert blocks(store) == [(104, 105)]
    assert p.step(1000, 1, TABLE) == (None, None)  # decode never stores


def test_load_skips_blocks_vllm_already_has_and_marks_chunks_stored() -> None:
    p = plan()
    p.pending_load_tokens = 768 - 128  # vLLM's prefix cache had block 0; pool has 3 chunks
    load, store = p.step(768, 232, TABLE)
    assert blocks(load) == [(-1, 101), (102, 103), (104, 105)]
    assert store is None  # the 3 full chunks are in the pool already
    assert p.pending_load_tokens == 0


def test_preempted_request_reloads_into_its_new_blocks() -> None:
    p = plan()
    p.pending_load_tokens = 512
    p.step(512, 100, TABLE)
    new_table = list(range(200, 220))  # preempted: blocks freed, resumed with new ones
    p.pending_load_tokens = 512
    load, _ = p.step(512, 488, new_table)
    assert blocks(load) == [(200, 201), (202, 203)]


def test_failed_load_makes_the_recomputed_chunks_stored_again() -> None:
    p = plan()
    p.pending_load_tokens = 768
    p.step(768, 232, TABLE)
    assert not p.load_failed({999})
    assert p.load_failed({103})  # chunk 1 failed
    _, store = p.step(256, 744, TABLE)  # vLLM recomputes from chunk 1
    assert blocks(store) == [(102, 103), (104, 105)]


def scheduler(extra: dict[str, object]) -> tuple[SchedulerSide, LookupServer]:
    """A scheduler side of 256-token chunks over 128-token blocks, one worker that has
    nothing stored (a real lookup server)."""
    sched = SchedulerSide(parse_settings({"chunk_tokens": 256, **extra}, 128))
    server = LookupServer(lambda keys: 0)
    ns = Namespace("m", KVLayout("uint8", 1, 1, 1024, 1, kv_factor=1))
    sched.set_workers([(ns, server.address)])
    return sched, server


def stored_blocks(sched: SchedulerSide, req: str, before: int, n: int) -> list[tuple[int, ...]]:
    """Blocks this step stores for ``req`` (scheduled ``n`` tokens after ``before``)."""
    _, stores = sched.build({req: n}, {req: before}, lambda _: TABLE)
    return [c.block_ids for t in stores for c in t.chunks]


def test_offload_threshold_saves_a_whole_request_or_none_of_it(
        caplog: pytest.LogCaptureFixture) -> None:
    sched, server = scheduler({"offload_threshold": 0.5})
    usage = [0.2]
    sched.bind_usage(lambda: usage[0])
    for req in ("low", "high"):
        request = SimpleNamespace(request_id=req, prompt_token_ids=list(range(1000)))
        assert sched.matched_tokens(request, 0) == 0
        sched.after_alloc(request, 0)
    assert stored_blocks(sched, "low", 0, 300) == []  # 20% in use: vLLM's cache keeps it
    usage[0] = 0.9
    assert stored_blocks(sched, "low", 300, 300) == []  # decided at its first chunk: kept
    assert stored_blocks(sched, "high", 0, 600) == [(100, 101), (102, 103)]
    usage[0] = 0.1
    assert stored_blocks(sched, "high", 600, 400) == [(104, 105)]  # no hole in its prefix
    assert sched.skipped_chunks == 2
    sched.finished("low")
    sched.close()
    server.close()
    # Default 0: every request saved, no block pool needed. A threshold without a bound
    # block pool saves everything too, with one warning.
    for extra in ({}, {"offload_threshold": 0.5}):
        sched, server = scheduler(extra)
        sched.after_alloc(SimpleNamespace(request_id="r", prompt_token_ids=list(range(600))), 0)
        with caplog.at_level(logging.WARNING, logger="kvpool.integrations.vllm"):
            assert stored_blocks(sched, "r", 0, 600) == [(100, 101), (102, 103)]
        sched.close()
        server.close()
    assert sum("bound no block pool" in r.message for r in caplog.records) == 1


def test_lookup_over_the_socket_and_a_dead_worker_is_a_miss() -> None:
    present = {b"a" * 16, b"b" * 16}
    server = LookupServer(lambda keys: next(
        (i for i, k in enumerate(keys) if k not in present), len(keys)))
    # A client in another process would use the socket; force it by hiding the local server.
    from kvpool.integrations.vllm import lookup as mod
    mod._LOCAL.pop(server.address)
    client = LookupClient(server.address, timeout_s=2.0)
    assert client.lookup([b"a" * 16, b"b" * 16, b"c" * 16]) == 2
    assert client.lookup([b"c" * 16, b"a" * 16]) == 0
    server.close()
    client.close()
    assert client.lookup([b"a" * 16]) == 0  # gone: a miss, not an exception
    assert LookupClient("kvpool-vllm-nobody", 0.5).lookup([b"a" * 16]) == 0


def test_settings_validate_chunk_size_and_keys() -> None:
    s = parse_settings({"chunk_tokens": 256,
                        "config": {"dram": {"capacity": "1MiB", "slab_size": "256KiB"}}}, 128)
    assert s.blocks_per_chunk == 2
    assert s.pool_config().dram.capacity == 1 << 20
    assert parse_settings(None, 16).chunk_tokens == 16
    with pytest.raises(ConfigError, match="chunk_tokens"):
        parse_settings({"chunk_tokens": 200}, 128)
    with pytest.raises(ConfigError, match="unknown"):
        parse_settings({"chunk_size": 256}, 128)
    with pytest.raises(ConfigError, match=r"dram\.capacity"):
        parse_settings({"config": {"dram": {"capacity": "lots"}}}, 128)


@pytest.mark.parametrize(("extra", "error"), [
    ({"chunk_tokens": 200}, r"^kv_connector_extra_config\.chunk_tokens: must be a positive "
                            r"multiple of the vLLM block size 128 \(got 200\)$"),
    ({"chunk_tokens": 0}, r"\.chunk_tokens: must be a positive multiple"),
    ({"chunk_tokens": True}, r"\.chunk_tokens: Input should be a valid integer"),
    ({"chunk_tokens": "256"}, r"\.chunk_tokens: Input should be a valid integer"),
    ({"chunk_size": 256}, r"^kv_connector_extra_config\.chunk_size: unknown key$"),
    ({"config": [1]}, r"\.config: must be a mapping of kvpool settings"),
    ({"config_path": "/no/such/kvpool.yaml"}, r"\.config_path: no such file"),
    ({"lookup_timeout_s": 0}, r"\.lookup_timeout_s: Input should be greater than 0"),
    ({"lookup_timeout_s": True}, r"\.lookup_timeout_s: Input should be a valid number"),
    ({"tenant_salt": 5}, r"\.tenant_salt: Input should be a valid string"),
    ({"offload_threshold": 1.5}, r"\.offload_threshold: Input should be less than or equal"),
    ({"offload_threshold": "0.5"}, r"\.offload_threshold: Input should be a valid number"),
])
def test_settings_errors_name_the_key(extra: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_settings(extra, 128)


def test_settings_fields_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "kvpool.yaml").write_text(f"cache_dir: {tmp_path}/cache\n")
    s = parse_settings({"config_path": "~/kvpool.yaml", "model_id": "", "stats_path": "",
                        "tenant_salt": "acme", "lookup_timeout_s": 3}, 16)
    assert (s.chunk_tokens, s.block_size, s.blocks_per_chunk) == (16, 16, 1)
    assert s.config_path == str(tmp_path / "kvpool.yaml")  # ~ expanded
    assert s.pool_config().cache_dir == f"{tmp_path}/cache"
    assert (s.model_id, s.stats_path, s.tenant_salt, s.lookup_timeout_s) == \
        (None, None, "acme", 3.0)
    assert s.config_overrides is None


def test_tensor_parallel_ranks_get_their_own_ssd_dirs(tmp_path: object) -> None:
    s = parse_settings({"config": {"cache_dir": str(tmp_path)}}, 16)
    paths = {s.pool_config(r, 2).ssd_path() for r in range(2)}
    assert len(paths) == 2
