"""kvpool bench route's pieces without vLLM: the workload, the ratios, the streamed TTFT
through a real kvpool route process-free router in front of fake engines."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from events_support import Follower
from kvtest import byte_namespace, payload_for, require_extra, wait_for

from kvpool.bench.route import Answer, RouteWorkload, mismatch, ratios, requests
from kvpool.bench.stats import BenchFailure
from kvpool.config import config_from_dict


def test_requests_are_seeded_and_share_each_documents_prefix() -> None:
    load = RouteWorkload(docs=3, questions=2, prefix_len=64, suffix_len=8)
    a, b, c = requests(load, 1), requests(load, 1), requests(load, 2)
    assert a == b and a != c
    assert sorted(d for d, _ in a) == [0, 0, 1, 1, 2, 2]
    for doc in range(3):
        prompts = [p for d, p in a if d == doc]
        assert prompts[0][:64] == prompts[1][:64] and prompts[0] != prompts[1]
        assert all(len(p) == 72 for p in prompts)
    others = {tuple(p[:64]) for d, p in c}
    assert not others & {tuple(p[:64]) for _, p in a}  # another seed, other documents


def test_ratios() -> None:
    r = ratios([1.0, 1.0, 3.0], [2.0, 4.0, 4.0])
    assert r["route_ttft_p50_vs_round_robin"] == pytest.approx(0.25)
    with pytest.raises(ValueError):
        ratios([], [1.0])


def test_ratios_name_the_shared_setup() -> None:
    r = ratios([1.0], [2.0], "route_shared_ttft_p50_vs_round_robin")
    assert r == {"route_shared_ttft_p50_vs_round_robin": 0.5,
                 "route_shared_ttft_p90_vs_round_robin": 0.5}


def test_mismatch_names_what_differs() -> None:
    prompt = [5, 6, 7]
    good = Answer(0.1, "ab", [1, 2], prompt, "engine1")
    assert mismatch(prompt, good, Answer(0.2, "ab", [1, 2], prompt)) == ""
    assert mismatch(prompt, good, Answer(0.2, "ac", [1, 3], prompt)) == "other output tokens"
    assert mismatch(prompt, Answer(0.1, "ab", [1, 2], [5, 6], "e"),
                    Answer(0.2, "ab", [1, 2], prompt)) == "the engine saw another prompt"
    assert mismatch(prompt, Answer(0.1, "ab", [], prompt),
                    Answer(0.2, "ab", [], prompt)) == "no token ids in an answer"
    assert mismatch(prompt, good, Answer(0.2, "abc", [1, 2], prompt)) == \
        "same tokens, other text"


def test_streamed_reads_ttft_text_and_engine_through_the_router() -> None:
    require_extra("aiohttp", "router")
    require_extra("zmq", "router")
    from route_support import FakeEngine

    from kvpool.bench.route import streamed
    from kvpool.route.policy import KvPolicy
    from kvpool.route.proxy import EngineSpec, Router, RouterSettings

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, object] = {}

    async def up() -> None:
        engine = FakeEngine("e0")
        router = Router(RouterSettings([EngineSpec(await engine.start())], KvPolicy()))
        state.update(engine=engine, router=router, port=await router.start())
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(up()),
                                              loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        answer = streamed(int(state["port"]), "m", [1, 2, 3], 4)  # type: ignore[call-overload]
        assert answer.ttft_s > 0 and answer.engine == "engine0"
        assert answer.text == "t0t1t2" and answer.token_ids == [0, 1, 2]
        assert answer.prompt_token_ids == [1, 2, 3]
    finally:
        async def down() -> None:
            await state["router"].close()  # type: ignore[attr-defined]
            await state["engine"].stop()  # type: ignore[attr-defined]
        asyncio.run_coroutine_threadsafe(down(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.parametrize("kind", ["host", "node"])
def test_the_shared_pool_starts_and_engines_configs_open_it(kind: str, tmp_path: Path) -> None:
    """The shared set-up's pool (a kvpool host, or a kvpool serve node) comes up, and the
    connector config each engine gets opens a pool on it: a chunk one engine's pool stores
    is a hit for the other's."""
    from kvpool.bench.route_shared import SharedPool
    from kvpool.host import open_pool

    ns = byte_namespace(64 * 1024)
    key = ns.chunk_keys(list(range(4)))[0]
    stats = [tmp_path / f"stats{i}.json" for i in range(2)]
    with SharedPool(tmp_path, lambda msg: None, kind, "64MiB", "64MiB") as pool:
        assert kind in pool.describe()
        configs = [pool.connector(path)["kv_connector_extra_config"] for path in stats]
        assert configs[0]["config"] != configs[1]["config"]  # each engine its own cache_dir
        for path in stats:  # what each engine's connector writes when it registers
            path.write_text(json.dumps({"counters": {}, "namespace": ns.canonical()}))
        # The routers follow the shared pool's events for the engines' namespace.
        suffix, extra = pool.router_args(stats)
        assert extra[:2] == ("--namespace-id", ns.id.hex())
        if kind == "host":  # both engines attach to it: a host= publisher on each engine
            fields = dict(f.split("=", 1) for f in suffix.lstrip(",").split(","))
            pub, replay = fields["host"], fields["host-replay"]
        else:  # a storage node: the storage tier's publisher
            assert suffix == "" and extra[-2] == "--storage-events"
            pub, replay = extra[-1].split(",replay=")
        follower = Follower({"endpoint": pub, "replay_endpoint": replay})
        pools = [open_pool(config_from_dict(c["config"])) for c in configs]
        try:
            for p in pools:
                p.register_namespace(ns)
            data = payload_for(key, 64 * 1024)
            assert pools[0].put(ns, key, data)
            assert pools[0].flush(30)
            out = np.zeros_like(data)
            wait_for(lambda: pools[1].get_into(ns, key, out), 30,
                     "the other engine's pool finds the chunk")
            assert np.array_equal(out, data)
            wait_for(lambda: follower.leading_run(ns, [key]) == 1, 30,
                     "the shared pool announced the chunk")
        finally:
            follower.close()
            for p in pools:
                p.close()
        stats[1].write_text(json.dumps({"namespace": byte_namespace(4096).canonical()}))
        with pytest.raises(BenchFailure, match="2 namespaces"):
            pool.router_args(stats)
    with pytest.raises(ValueError, match="kind"):
        SharedPool(tmp_path / "x", lambda msg: None, "redis")
