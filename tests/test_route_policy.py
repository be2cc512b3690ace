"""The routing policies of kvpool.route.policy: what each chooses, and why."""

from __future__ import annotations

import pytest

from kvpool.route.policy import (
    REASON_LOAD,
    REASON_OVERLOAD,
    REASON_PREFIX,
    Candidate,
    KvPolicy,
    LeastLoadedPolicy,
    NoEngineError,
    RandomPolicy,
    RoundRobinPolicy,
    TierWeights,
    make_policy,
)


def test_tier_weights_rank_engine_cache_over_host_over_storage() -> None:
    p = KvPolicy(load_tokens=0)
    cands = [Candidate(0, storage_tokens=4096), Candidate(1, host_tokens=4096),
             Candidate(2, engine_tokens=4096)]
    d = p.choose(cands)
    assert (d.index, d.reason) == (2, REASON_PREFIX)
    assert d.score == 4096
    assert p.choose(cands[:2]).index == 1
    # 0.75 x 4096 = 3072 of host beats 3000 of engine cache.
    assert p.choose([Candidate(0, engine_tokens=3000), Candidate(1, host_tokens=4096)]).index == 1
    w = TierWeights(engine=1.0, host=0.1, storage=0.0)
    assert KvPolicy(w).choose([Candidate(0, engine_tokens=3000),
                               Candidate(1, host_tokens=4096)]).index == 0


def test_load_outweighs_a_short_prefix_but_not_a_long_one() -> None:
    p = KvPolicy(load_tokens=256, prefill_weight=1.0)
    busy_short = [Candidate(0, engine_tokens=512, load=4), Candidate(1, load=0)]
    assert p.choose(busy_short).index == 1
    busy_long = [Candidate(0, engine_tokens=8192, load=4), Candidate(1, load=0)]
    assert p.choose(busy_long).index == 0
    # A queue of prompt tokens to prefill counts token for token.
    queued = [Candidate(0, engine_tokens=8192, pending_tokens=10_000), Candidate(1)]
    assert p.choose(queued).index == 1


def test_overloaded_engine_is_left_out_unless_all_are() -> None:
    p = KvPolicy(load_tokens=0, overload_factor=1.5)
    cands = [Candidate(0, engine_tokens=10**6, load=20), Candidate(1, load=2),
             Candidate(2, load=2)]
    d = p.choose(cands)
    assert d.index in (1, 2) and d.reason == REASON_OVERLOAD
    same = [Candidate(0, engine_tokens=10**6, load=20), Candidate(1, load=20)]
    assert p.choose(same).index == 0


def test_ties_go_to_least_loaded_then_rotate() -> None:
    p = KvPolicy()
    cands = [Candidate(i, storage_tokens=512) for i in range(4)]
    picks = [p.choose(cands) for _ in range(8)]
    assert {d.reason for d in picks} == {REASON_LOAD}
    assert sorted(d.index for d in picks) == [0, 0, 1, 1, 2, 2, 3, 3]
    loaded = [Candidate(0, load=1), Candidate(1, load=0), Candidate(2, load=1)]
    assert {p.choose(loaded).index for _ in range(5)} == {1}


def test_dead_engines_are_skipped_and_none_alive_raises() -> None:
    cands = [Candidate(0, engine_tokens=10**5, alive=False), Candidate(1), Candidate(2)]
    for name in ("kv", "round_robin", "random", "least_loaded"):
        policy = make_policy(name)
        assert {policy.choose(cands).index for _ in range(10)} <= {1, 2}, name
        with pytest.raises(NoEngineError):
            policy.choose([Candidate(0, alive=False)])


def test_round_robin_random_and_least_loaded() -> None:
    rr = RoundRobinPolicy()
    cands = [Candidate(i) for i in range(3)]
    assert [rr.choose(cands).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    a = [RandomPolicy(seed=7).choose(cands).index for _ in range(1)]
    r1, r2 = RandomPolicy(seed=7), RandomPolicy(seed=7)
    assert [r1.choose(cands).index for _ in range(20)] == [r2.choose(cands).index
                                                            for _ in range(20)]
    assert a[0] in (0, 1, 2)
    ll = LeastLoadedPolicy()
    assert ll.choose([Candidate(0, load=3), Candidate(1, load=1), Candidate(2, load=1,
                                                                           pending_tokens=9)]
                     ).index == 1


@pytest.mark.parametrize("kwargs", [{"load_tokens": -1.0}, {"overload_factor": 0.5},
                                    {"prefill_weight": -0.1}])
def test_bad_knobs_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        KvPolicy(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nearest")
    with pytest.raises(ValueError):
        TierWeights(engine=-1.0)
