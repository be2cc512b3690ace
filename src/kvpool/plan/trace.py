"""A request trace (the format of ``shared/traces``) as flat numpy arrays of chunk references.

Each 512-token hash block of a request is one chunk, or ``512 / block_tokens`` chunks with
``block_tokens`` (the key of sub-chunk ``s`` of hash id ``h`` is ``h * (512 / block_tokens) + s``,
so equal ids still give equal chunks). Prompt tokens past the last block (a trace whose
``input_length`` exceeds its blocks) are never cacheable and always prefilled.

Partial chunks: a request whose ``input_length`` is not a multiple of ``block_tokens`` ends in
a chunk holding fewer tokens than a chunk (its last hash id covers ``input_length % 512``
tokens). An engine neither hashes nor stores such a chunk (vLLM and SGLang cache whole blocks
only), so by default (``store_partial=False``) it is left out of the chunk references: its
tokens stay in ``input_tokens`` and are always prefilled, it is never looked up or stored.
``partial_tokens`` keeps, per request, the tokens of the chunk left out (0: none). With
``store_partial=True`` it is kept as a chunk of the tokens it holds, occupying a full chunk of
bytes in a tier (an engine that saves unfull chunks, as LMCache can).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The line-numbered validation of ``kvpool demo --trace``: one parser for the format.
from kvpool.demo.workloads.trace import _read_trace

#: Tokens per hash id in the shared/traces format.
SOURCE_BLOCK = 512


@dataclass(frozen=True)
class Trace:
    """Chunk references in request order; request ``i`` owns ``keys[starts[i]:starts[i+1]]``."""

    name: str
    block_tokens: int
    keys: np.ndarray  # int64 chunk key per reference
    tokens: np.ndarray  # int64 tokens each reference holds (<= block_tokens)
    starts: np.ndarray  # int64, requests + 1 offsets into keys
    input_tokens: np.ndarray  # int64 prompt tokens per request
    timestamps: np.ndarray  # float64 seconds since the first request
    partial_tokens: np.ndarray | None = None  # int64 per request: tokens of a left-out chunk
    output_tokens: np.ndarray | None = None  # int64 per request: generated tokens

    @property
    def requests(self) -> int:
        return int(self.starts.size - 1)

    @property
    def references(self) -> int:
        return int(self.keys.size)

    @property
    def distinct(self) -> int:
        """Distinct chunks: the capacity at which nothing is ever evicted."""
        return int(np.unique(self.keys).size)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last (0 for one request)."""
        if not self.requests:
            return 0.0
        return float(self.timestamps.max() - self.timestamps.min())

    @property
    def partial_chunks(self) -> int:
        """Partial last chunks left out of the references (never stored, always prefilled)."""
        return 0 if self.partial_tokens is None else int(np.count_nonzero(self.partial_tokens))

    def head(self, requests: int) -> Trace:
        """The first ``requests`` requests only."""
        end = int(self.starts[min(requests, self.requests)])
        n = min(requests, self.requests)
        partial = None if self.partial_tokens is None else self.partial_tokens[:n]
        output = None if self.output_tokens is None else self.output_tokens[:n]
        return Trace(self.name, self.block_tokens, self.keys[:end], self.tokens[:end],
                     self.starts[:n + 1], self.input_tokens[:n], self.timestamps[:n], partial,
                     output)


def check_block_tokens(block_tokens: int) -> None:
    """Raises ValueError unless ``block_tokens`` divides the trace's 512-token blocks."""
    if block_tokens < 1 or SOURCE_BLOCK % block_tokens:
        raise ValueError(f"--block-tokens must divide {SOURCE_BLOCK}, got {block_tokens}")


def read_trace(path: Path | str, block_tokens: int = SOURCE_BLOCK,
               store_partial: bool = False) -> Trace:
    """Read and validate a whole trace; a request's partial last chunk is left out unless
    ``store_partial`` (see the module docstring). Raises ValueError naming the file and line
    of the first malformed line (bad JSON, a missing or mistyped field, an empty ``hash_ids``,
    a negative or non-finite timestamp), for an empty trace, or for a ``block_tokens`` that
    does not divide 512; OSError if the file cannot be read."""
    check_block_tokens(block_tokens)
    p = Path(path)
    rows = _read_trace(p)
    split = SOURCE_BLOCK // block_tokens
    keys: list[int] = []
    tokens: list[int] = []
    starts = [0]
    partial: list[int] = []
    for row in rows:
        left = row.input_length
        for h in row.hash_ids:
            block = min(left, SOURCE_BLOCK)
            if block <= 0:
                break  # more ids than the prompt has tokens for: the extra ids are unused
            left -= block
            base = h * split
            for s in range(-(-block // block_tokens)):
                keys.append(base + s)
                tokens.append(min(block_tokens, block - s * block_tokens))
        short = 0
        if not store_partial and len(keys) > starts[-1] and tokens[-1] < block_tokens:
            short = tokens.pop()  # only a request's last chunk can be short
            keys.pop()
        partial.append(short)
        starts.append(len(keys))
    ts = np.asarray([row.timestamp for row in rows], dtype=np.float64) / 1000.0
    return Trace(name=p.name, block_tokens=block_tokens,
                 keys=np.asarray(keys, dtype=np.int64), tokens=np.asarray(tokens, dtype=np.int64),
                 starts=np.asarray(starts, dtype=np.int64),
                 input_tokens=np.asarray([row.input_length for row in rows], dtype=np.int64),
                 timestamps=ts - ts[0], partial_tokens=np.asarray(partial, dtype=np.int64),
                 output_tokens=np.asarray([row.output_length for row in rows], dtype=np.int64))
