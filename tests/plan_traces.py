"""Hand-made request traces for the planner tests (the format of shared/traces)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

BLOCK = 512


def write_trace(path: Path, requests: Sequence[Sequence[int]],
                lengths: Sequence[int] | None = None) -> Path:
    """One line per request: ``hash_ids`` as given, every block full unless ``lengths``."""
    with path.open("w", encoding="utf-8") as f:
        for i, ids in enumerate(requests):
            n = lengths[i] if lengths is not None else len(ids) * BLOCK
            f.write(json.dumps({"timestamp": i * 10, "input_length": n, "output_length": 1,
                                "hash_ids": list(ids)}) + "\n")
    return path


def prefix_tree_requests(n: int, seed: int = 0, roots: int = 6,
                         max_len: int = 12) -> list[list[int]]:
    """Requests that share prefixes as conversations do: each extends a random earlier one
    (or starts a new root) by fresh blocks; ids are prefix-closed, as in the shared traces."""
    rng = np.random.default_rng(seed)
    made: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        if made and rng.random() < 0.8:
            base = made[int(rng.integers(0, len(made)))]
            keep = int(rng.integers(1, len(base) + 1))
            prompt = base[:keep]
        elif made and rng.random() < 0.5:
            prompt = made[int(rng.integers(0, min(roots, len(made))))][:1]
        else:
            prompt = []
        for _ in range(int(rng.integers(1, max_len // 2 + 1))):
            if len(prompt) >= max_len:
                break
            prompt = [*prompt, next_id]
            next_id += 1
        made.append(prompt)
    return made
