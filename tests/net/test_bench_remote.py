"""`kvpool bench remote` at a tiny size: every case runs against a real node, a raw-socket
server and Redis, reads are verified, and every ratio is reported. No timing assertions."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from kvpool.bench.cores import placements
from kvpool.bench.remote import RemotePlan, run_remote_bench

KiB = 1024
TINY = RemotePlan(sizes=(64 * KiB, 256 * KiB), repeats=2, pass_bytes=1 << 20, min_chunks=4,
                  thread_pass_bytes=2 << 20, exists_keys=512, exists_calls=20,
                  small_get_calls=20,
                  headline_size=256 * KiB)


def _positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.redis
def test_tiny_remote_bench_reports_every_ratio() -> None:
    assert shutil.which("redis-server"), "redis-server missing: bash scripts/system-deps.sh"
    result = run_remote_bench(TINY)
    rows = result.pop("_rows")
    data = json.loads(json.dumps(result, default=str))
    for name in ("remote_get_vs_raw_socket", "remote_put_vs_raw_socket", "remote_get_vs_redis",
                 "remote_put_vs_redis", "remote_get_vs_redis_4t", "remote_get_tls_vs_plain",
                 "remote_get_256k_vs_raw_socket"):
        assert _positive(data["ratios"][name]), name
    assert _positive(data["exists_prefix_512_p99_ms"])
    assert _positive(data["remote_get_4k_p50_us"])
    assert data["small_get"]["kvpool"]["calls"] == data["small_get"]["raw"]["calls"] == 20
    assert _positive(data["ratios"]["remote_get_4k_vs_raw_socket"])
    where = data["small_get"]["placements"]  # the headline is the first placement's
    assert list(where) == [p[0] for p in placements()]
    assert data["remote_get_4k_placement"] == data["small_get"]["placement"] == next(iter(where))
    assert data["remote_get_4k_p50_us"] == where[next(iter(where))]["kvpool"]["p50_us"]
    for fig in where.values():
        assert fig["kvpool"]["calls"] == fig["raw"]["calls"] == 20
    tls = data["tls"]  # the same GET case through a TLS node, passes alternating with plain
    assert tls["chunk_bytes"] == TINY.headline_size and tls["threads"] == 1
    assert len(tls["kvpool"]["pass_wall_s"]) == len(tls["reference"]["pass_wall_s"]) == 2
    assert set(data["exists_prefix"]) == {"kvpool", "raw", "redis"}
    ids = {c["id"] for c in data["cases"]}
    for size in TINY.sizes:
        for op in ("get", "put"):
            for t in TINY.threads:
                for ref in ("raw socket", "redis"):
                    assert f"{op}/{size}/{t}t/{ref}" in ids
    assert len(rows) == len(ids)
    assert data["info"]["redis"]
    names = [p[0] for p in placements()]
    for case in data["cases"]:  # a 4-thread pass moves thread_pass_bytes a thread
        threads, size = case["threads"], case["chunk_bytes"]
        assert case["kvpool"]["items_per_pass"] == TINY.ops(size, threads), case["id"]
        # one thread: the headline placement's rows, a GET's other placements beside them
        assert case["placement"] == (names[0] if threads == 1 else "unpinned"), case["id"]
        if threads == 1 and case["case"] == "get" and len(names) > 1:
            assert list(case["placements"]) == names[1:], case["id"]
            assert all(_positive(r) for r in case["placements"].values()), case["id"]
        else:
            assert "placements" not in case, case["id"]


def test_a_pass_of_several_threads_moves_thread_pass_bytes_a_thread() -> None:
    quick = RemotePlan.quick_plan()
    assert quick.ops(2 << 20, 1) == quick.chunks(2 << 20) == 16
    assert quick.ops(2 << 20, 4) == 4 * 16  # 32 MiB a thread, not 4 GETs
    assert quick.ops(16 << 20, 4) == 8  # never fewer than every stored chunk once
    assert RemotePlan().ops(256 * KiB, 4) == 4 * 256


def test_plan_options_pick_sizes_pass_bytes_and_lookups() -> None:
    import argparse

    from kvpool.bench.remote import _plan_from_args, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def plan(*argv: str) -> RemotePlan:
        return _plan_from_args(parser.parse_args(list(argv)))

    assert plan() == RemotePlan()
    steady = plan("--quick", "--sizes", "2MiB", "--pass-bytes", "128MiB", "--repeats", "9",
                  "--exists-calls", "1000")
    assert (steady.sizes, steady.pass_bytes, steady.repeats, steady.exists_calls,
            steady.headline_size, steady.quick) == ((2 << 20,), 128 << 20, 9, 1000, 2 << 20,
                                                    True)
    assert plan("--sizes", "256KiB, 16MiB").headline_size == 256 * KiB  # 2MiB not listed
    for bad in (("--sizes", ""), ("--sizes", "0"), ("--sizes", "lots"), ("--repeats", "0"),
                ("--pass-bytes", "0"), ("--exists-calls", "0")):
        with pytest.raises(ValueError):
            plan(*bad)


def test_remote_steps_time_every_step_of_a_4k_get_on_both_sides() -> None:
    """``python -m kvpool.bench.remote_steps``: its node steps drive the real store and
    connection (a step that no longer matches the code raises), its client steps a real node;
    every step is timed. No timing assertions beyond "it was measured"."""
    from kvpool.bench import remote_steps

    for size in (4096, 256 << 10):  # --node-size: an answer larger than one receive
        steps, whole, cpu = remote_steps.node_steps(50, size)
        assert len(steps) == 11 and all(_positive(us) for us in steps.values())
        assert _positive(whole) and _positive(cpu)
    for placement in placements():
        csteps, kv_p50, raw_p50 = remote_steps.client_steps(50, placement)
        assert len(csteps) == 8 and all(_positive(us) for us in csteps.values())
        assert _positive(kv_p50) and _positive(raw_p50)
