"""Prompts, result helpers and types shared by the vLLM engine tests (a module of its own:
several test folders have a conftest.py, so ``conftest`` is not an importable name)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

EngineRunner = Callable[..., dict[str, Any]]

# Prompts shared by the engine tests: P1 (600 tokens = 4 full 128-token chunks + tail), P2
# (shares P1's first 300 tokens: 2 full chunks), Q (unrelated, 600 tokens).
BLOCK = 128
_rng = random.Random(0)
P1 = [_rng.randrange(300, 4000) for _ in range(600)]
P2 = P1[:300] + [_rng.randrange(300, 4000) for _ in range(200)]
Q = [_rng.randrange(300, 4000) for _ in range(600)]
P1_CHUNKS = (len(P1) - 1) // BLOCK  # 4: never the whole prompt
P2_SHARED_CHUNKS = 300 // BLOCK  # 2


def outputs(result: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    return [(o["token_ids"], o["logprobs"]) for o in result["outputs"]]


def counters(result: dict[str, Any]) -> dict[str, int]:
    c: dict[str, int] = result["connector_stats"]["counters"]
    return c


class EngineProcess:
    """One engine running in the background (``start_engine``); ``result()`` waits for it."""

    def __init__(self, proc: subprocess.Popen[str], out_path: Path, n: int) -> None:
        self.proc, self.out_path, self.n = proc, out_path, n

    def result(self, timeout_s: float = 600) -> dict[str, Any]:
        _, stderr = self.proc.communicate(timeout=timeout_s)
        if self.proc.returncode != 0:
            sys.stderr.write(stderr[-8000:])
            pytest.fail(f"vLLM engine run {self.n} failed (exit {self.proc.returncode}); "
                        "stderr above")
        result: dict[str, Any] = json.loads(self.out_path.read_text())
        return result


EngineStarter = Callable[..., EngineProcess]
