"""The trace workload: a recorded request trace, scaled down so that a CPU can run it.

A request trace in the format of ``shared/traces`` (JSON lines with ``timestamp``,
``input_length``, ``output_length``, ``hash_ids``), scaled down so that a CPU can run it: every
512-token hash block becomes a deterministic block of ``block_tokens`` random token ids seeded
by its hash id, so equal ids give equal tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from kvpool.demo.workloads.request import Request

__all__ = ["trace_requests"]


@dataclass(frozen=True)
class _TraceRow:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_row(raw: str, line: int, where: str) -> _TraceRow:
    at = f"{where} line {line}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{at}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{at}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise ValueError(f"{at}: missing field(s) {', '.join(missing)}")
    ts, inp, outp, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                          obj["hash_ids"])
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise ValueError(f"{at}: timestamp must be a number, got {ts!r}")
    if not math.isfinite(ts) or ts < 0:
        raise ValueError(f"{at}: timestamp must be a finite number of ms >= 0, got {ts!r}")
    if not _is_int(inp) or inp < 1:
        raise ValueError(f"{at}: input_length must be an integer >= 1, got {inp!r}")
    if not _is_int(outp) or outp < 0:
        raise ValueError(f"{at}: output_length must be an integer >= 0, got {outp!r}")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{at}: hash_ids must be a non-empty list, got {ids!r}")
    bad = next((h for h in ids if not _is_int(h) or h < 0), None)
    if bad is not None:
        raise ValueError(f"{at}: hash_ids must be integers >= 0, got {bad!r}")
    return _TraceRow(line=line, timestamp=float(ts), input_length=inp, output_length=outp,
                     hash_ids=[int(h) for h in ids])


def _read_trace(path: Path) -> list[_TraceRow]:
    """Every request of the trace (blank lines skipped); ValueError names a malformed line."""
    rows: list[_TraceRow] = []
    with path.open(encoding="utf-8") as f:
        for line, raw in enumerate(f, start=1):
            if raw.strip():
                rows.append(_parse_row(raw, line, path.name))
    if not rows:
        raise ValueError(f"{path.name}: the trace holds no requests")
    return rows


def trace_requests(path: Path | str, tokenizer_vocab_size: int, *, block_tokens: int = 32,
                   max_prompt_tokens: int = 4096, max_requests: int = 40,
                   max_new_tokens: int = 8, source_block: int = 512, seed: int = 0,
                   start: int = 0, low_token: int = 256,
                   special_ids: Sequence[int] = ()) -> tuple[list[Request], dict[str, Any]]:
    """Replay requests ``start .. start + max_requests`` of a trace, scaled down.

    Every hash id becomes a block of ``block_tokens`` token ids drawn from
    ``numpy.random.default_rng([seed, hash_id])``, uniformly from ``[low_token,
    tokenizer_vocab_size)`` minus ``special_ids``: equal ids give equal blocks. A prompt is the
    concatenation of its blocks, cut to ``ceil(input_length * block_tokens / source_block)``
    tokens (the last block trimmed in proportion); one longer than ``max_prompt_tokens`` keeps
    only the whole blocks that fit. Output length = ``min(output_length, max_new_tokens)``, at
    least 1. Request names are ``"trace #<line number>"``.

    The whole file is validated: a malformed line raises ValueError naming the file and line.
    Returns (requests, scaling), where scaling describes the replay for printing: source and
    scaled block sizes, scale, caps, request counts, unique blocks, reused blocks (blocks seen
    in an earlier replayed request, i.e. the cache's opportunity) and prompt tokens.
    """
    for label, value in (("tokenizer_vocab_size", tokenizer_vocab_size),
                         ("block_tokens", block_tokens), ("max_requests", max_requests),
                         ("max_new_tokens", max_new_tokens), ("source_block", source_block)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if max_prompt_tokens < block_tokens:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) must hold at least one "
                         f"block of {block_tokens} tokens")
    if start < 0 or low_token < 0:
        raise ValueError("start and low_token must be >= 0")
    specials = np.asarray(sorted(set(special_ids)), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(low_token, tokenizer_vocab_size, dtype=np.int64), specials)
    if allowed.size < 2:
        raise ValueError(f"no token ids left in [{low_token}, {tokenizer_vocab_size}) "
                         "without the special ids")
    trace = Path(path)
    rows = _read_trace(trace)
    chosen = rows[start:start + max_requests]
    if not chosen:
        raise ValueError(f"{trace.name}: start {start} is past the last of {len(rows)} requests")

    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, hash_id])
            blocks[hash_id] = allowed[rng.integers(0, allowed.size, block_tokens)].tolist()
        return blocks[hash_id]

    whole_cap = (max_prompt_tokens // block_tokens) * block_tokens
    requests: list[Request] = []
    seen: set[int] = set()
    reused = capped = prompt_tokens = 0
    for row in chosen:
        length = -(-row.input_length * block_tokens // source_block)
        length = max(1, min(length, len(row.hash_ids) * block_tokens))
        if length > max_prompt_tokens:
            length = whole_cap
            capped += 1
        nblocks = -(-length // block_tokens)
        ids = row.hash_ids[:nblocks]
        prompt = [t for h in ids for t in block(h)][:length]
        reused += sum(1 for h in ids if h in seen)
        seen.update(ids)
        prompt_tokens += len(prompt)
        requests.append(Request(workload="trace", name=f"trace #{row.line}", prompt=prompt,
                                max_new_tokens=max(1, min(row.output_length, max_new_tokens))))
    scaling: dict[str, Any] = {
        "trace": trace.name,
        "source_block_tokens": source_block,
        "block_tokens": block_tokens,
        "scale": block_tokens / source_block,
        "max_prompt_tokens": max_prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "start": start,
        "requests": len(requests),
        "trace_requests": len(rows),
        "capped_requests": capped,
        "unique_blocks": len(seen),
        "reused_blocks": reused,
        "prompt_tokens": prompt_tokens,
        "seed": seed,
    }
    return requests, scaling
