"""benchmarks/policy_ideas.py: the issue-25 ideas docs/plan.md cites keep the policy contract
under the planner's replay, stay under Belady, and the oracle bound is one."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from kvpool.plan.belady import belady
from kvpool.plan.trace import read_trace
from kvpool.policy import EVICTION_POLICIES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "policy_ideas.py"


@pytest.fixture(scope="module")
def ideas() -> ModuleType:
    spec = importlib.util.spec_from_file_location("policy_ideas", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["policy_ideas"] = module
    spec.loader.exec_module(module)
    return module


def conversations(path: Path, requests: int = 400, seed: int = 3) -> Path:
    """A trace of the shared/traces format: a shared first block, then conversations whose
    follow-up turns (probability 0.4) repeat the previous prompt and add 1-3 blocks."""
    rng = random.Random(seed)
    next_id = 1
    open_: list[list[int]] = []
    lines = []
    for i in range(requests):
        prompt = open_.pop(rng.randrange(len(open_))) if open_ and rng.random() < 0.4 else [0]
        added = rng.randint(1, 3) if len(prompt) > 1 else rng.randint(2, 12)
        prompt = prompt + list(range(next_id, next_id + added))
        next_id += added
        open_.append(prompt)
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(prompt) + 7,
                                 "output_length": 50, "hash_ids": [*prompt, next_id]}))
        next_id += 1
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_idea_replays_under_belady_and_the_oracle_beats_lru(
        ideas: ModuleType, tmp_path: Path) -> None:
    trace = read_trace(conversations(tmp_path / "t.jsonl"))
    bound = [belady(trace, int(f * trace.distinct)).resident_hits / trace.references
             for f in ideas.SIZES]
    rates = {}
    for name, make in ideas.IDEAS.items():
        EVICTION_POLICIES[name] = make
        try:
            rates[name] = ideas.hit_rates(trace, name)
        finally:
            del EVICTION_POLICIES[name]
        assert all(0 < r <= b for r, b in zip(rates[name], bound, strict=True)), name
    lru = ideas.hit_rates(trace, "lru")
    EVICTION_POLICIES["oracle"] = lambda: ideas.OracleLRU(Counter(trace.keys.tolist()))
    try:
        oracle = ideas.hit_rates(trace, "oracle")
    finally:
        del EVICTION_POLICIES["oracle"]
    assert all(o >= r for o, r in zip(oracle, lru, strict=True))
    assert oracle[0] > lru[0]  # one-time chunks kept out buy hits at the smallest size


def test_window_tinylfu_admits_a_candidate_only_when_more_frequent_than_mains_victim(
        ideas: ModuleType) -> None:
    policy = ideas.WindowTinyLFU(window=0.01)
    for key in range(100):
        policy.insert(key)
    policy.insert(1000)
    policy.insert(1001)
    # The window (1% of 102 keys) spills 0..99 into main; the candidate 1000, seen once,
    # ties with main's victim 0, seen once: the resident stays, the candidate goes.
    assert policy.evict(lambda _: True) == 1000
    assert 0 in policy
    policy.touch(1001)
    policy.touch(1001)
    policy.insert(1002)
    # 1001, seen three times, is the window's oldest now and beats 0.
    assert policy.evict(lambda _: True) == 0
    assert 1001 in policy and 1002 in policy and len(policy) == 101
