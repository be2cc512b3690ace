"""kvpool bench route's pieces without vLLM: the workload, the ratios, the streamed TTFT
through a real kvpool route process-free router in front of fake engines."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kvtest import require_extra

from kvpool.bench.route import Answer, RouteWorkload, mismatch, ratios, requests


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
