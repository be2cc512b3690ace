"""Workloads of ``kvpool demo``: deterministic token ids and exactly the prefix sharing each
workload promises (chat histories, document prefixes, trace hash blocks)."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvpool.demo import workloads as w

# shared/ lies beside the checkout (here and in CI)
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def train_tokenizer(chat_template: str | None, specials: Sequence[str] = SPECIALS) -> Any:
    """A byte-level BPE trained in-process on part of the reference text (well under a second)."""
    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=list(specials),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text for _, text in w.reference_texts()[:8]], trainer=trainer)
    fast: Any = PreTrainedTokenizerFast  # untyped third-party class
    hf = fast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_tokenizer(CHATML)


@pytest.fixture(scope="module")
def plain_tok() -> Any:
    return train_tokenizer(None, SPECIALS[:1])


def replay_chat(turns: Sequence[w.ChatTurn], reply_len: int = 5) -> list[w.Request]:
    """Replay through ChatStream with a fake model whose reply depends on the prompt."""
    stream = w.ChatStream(turns)
    out: list[w.Request] = []
    for request in stream:
        out.append(request)
        stream.reply(request, [(len(request.prompt) + i) % 97 + 300 for i in range(reply_len)])
    return out


# ------------------------------------------------------------------------------ text source


def test_reference_text_is_clean_and_deterministic() -> None:
    texts = w.reference_texts()
    assert [name for name, _ in texts] == list(w.MODULES)
    for name, text in texts:
        assert text.startswith(f"{name} module"), name
        assert len(text) > 500, name
        assert "\x08" not in text and " at 0x" not in text, name
    w.module_text.cache_clear()
    assert w.reference_texts() == texts


# ------------------------------------------------------------------------------ chat


def test_chat_is_deterministic_and_seeded(tok: Any) -> None:
    a = w.chat_requests(tok, sessions=2, turns=2, system_tokens=300, user_tokens=40)
    b = w.chat_requests(tok, sessions=2, turns=2, system_tokens=300, user_tokens=40)
    assert a == b
    c = w.chat_requests(tok, sessions=2, turns=2, system_tokens=300, user_tokens=40, seed=1)
    assert [t.tokens for t in a] != [t.tokens for t in c]


def test_chat_order_names_and_sizes(tok: Any) -> None:
    turns = w.chat_requests(tok, sessions=3, turns=2, system_tokens=256, user_tokens=32,
                            max_new_tokens=7)
    assert [t.name for t in turns] == ["chat s1 t1", "chat s2 t1", "chat s3 t1",
                                       "chat s1 t2", "chat s2 t2", "chat s3 t2"]
    assert [(t.session, t.turn) for t in turns[:4]] == [("s1", 1), ("s2", 1), ("s3", 1),
                                                         ("s1", 2)]
    assert all(t.max_new_tokens == 7 for t in turns)
    # chatml markup: <|im_start|>system\n + 256 + <|im_end|>\n
    system = turns[0].system_tokens
    assert 256 < system <= 256 + 10
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert turns[0].tokens[0] == im_start
    # Later turns add the user message (32 tokens) plus a little markup.
    assert all(32 < len(t.tokens) <= 32 + 16 for t in turns[3:])


def test_chat_sessions_share_the_system_prompt_only(tok: Any) -> None:
    turns = w.chat_requests(tok, sessions=3, turns=1, system_tokens=400, user_tokens=48)
    system = turns[0].system_tokens
    for other in turns[1:]:
        assert other.tokens[:system] == turns[0].tokens[:system]
        # The user messages differ right after the shared system block and its markup.
        assert common_prefix(other.tokens, turns[0].tokens) < system + 8


def test_chat_prompts_are_strict_prefixes_across_turns(tok: Any) -> None:
    turns = w.chat_requests(tok, sessions=2, turns=3, system_tokens=200, user_tokens=24)
    requests = replay_chat(turns)
    by_session: dict[str, list[w.Request]] = {}
    for r in requests:
        assert r.workload == "chat" and r.continues in ("s1", "s2")
        assert r.continues is not None
        by_session.setdefault(r.continues, []).append(r)
    for session in by_session.values():
        for earlier, later in itertools.pairwise(session):
            assert len(later.prompt) > len(earlier.prompt) + 5
            assert later.prompt[:len(earlier.prompt)] == earlier.prompt
        # The reply (5 tokens) sits right after the earlier prompt.
        first, second = session[0], session[1]
        reply = second.prompt[len(first.prompt):len(first.prompt) + 5]
        assert reply == [(len(first.prompt) + i) % 97 + 300 for i in range(5)]


def test_chat_session_protocol_and_errors(tok: Any) -> None:
    turns = w.chat_requests(tok, sessions=2, turns=2, system_tokens=128, user_tokens=16)
    s1 = w.ChatSession("s1")
    t1, t2 = turns[0], turns[2]
    with pytest.raises(ValueError, match="belongs to session"):
        s1.prompt_for(turns[1])
    with pytest.raises(ValueError, match="out of order"):
        s1.prompt_for(t2)
    with pytest.raises(ValueError, match="without a pending turn"):
        s1.add_reply([1, 2])
    p1 = s1.prompt_for(t1)
    assert s1.prompt_for(t1) == p1 == t1.tokens  # idempotent while pending
    with pytest.raises(ValueError, match="still waits"):
        s1.prompt_for(t2)
    s1.add_reply([400, 401])
    assert s1.turns_done == 1 and s1.history == [*t1.tokens, 400, 401]
    request = s1.request_for(t2)
    assert request == w.Request("chat", "chat s1 t2", [*t1.tokens, 400, 401, *t2.tokens],
                                t2.max_new_tokens, continues="s1")
    stream = w.ChatStream(turns)
    with pytest.raises(ValueError, match="not a request of this chat stream"):
        stream.reply(request, [1])


def test_chat_peek_counts_without_replies(tok: Any) -> None:
    turns = w.chat_requests(tok, sessions=2, turns=2, system_tokens=128, user_tokens=16)
    peeked = w.ChatStream(turns).peek()
    assert [r.name for r in peeked] == [t.name for t in turns]
    assert peeked[2].prompt == turns[0].tokens + turns[2].tokens


def test_chat_plain_template(plain_tok: Any, tok: Any) -> None:
    turns = w.chat_requests(plain_tok, sessions=1, turns=2, system_tokens=100, user_tokens=20)
    assert turns[0].system_tokens == 100
    text = plain_tok.decode(turns[1].tokens)
    assert text.startswith("\n\nUser: ") and text.endswith("\n\nAssistant:")
    forced = w.chat_requests(tok, sessions=1, turns=1, system_tokens=100, user_tokens=20,
                             template="plain")
    assert forced[0].system_tokens == 100
    with pytest.raises(ValueError, match="single"):
        w.chat_requests(plain_tok, sessions=1, turns=1, system_tokens=50, template="chatml")
    with pytest.raises(ValueError, match="sessions"):
        w.chat_requests(tok, sessions=0)


# ------------------------------------------------------------------------------ docqa


def test_docqa_lengths_order_and_prefixes(tok: Any) -> None:
    targets = (1500, 2500, 800)
    reqs = w.docqa_requests(tok, doc_tokens=targets, questions=3, max_new_tokens=9)
    assert [r.name for r in reqs] == [f"doc {d} q{q}" for q in (1, 2, 3) for d in "ABC"]
    assert all(r.workload == "docqa" and r.max_new_tokens == 9 and r.continues is None
               for r in reqs)
    docs = reqs[:3]
    for i, target in enumerate(targets):
        mine = [r for r in reqs if r.name.startswith(f"doc {'ABC'[i]} ")]
        shared = min(common_prefix(mine[0].prompt, m.prompt) for m in mine[1:])
        assert abs(shared - target) <= 0.05 * target
        assert all(m.prompt[:target] == mine[0].prompt[:target] for m in mine)
        # The question adds only a few tokens.
        assert all(target < len(m.prompt) <= target + 40 for m in mine)
    for a in range(3):
        for b in range(a + 1, 3):
            assert common_prefix(docs[a].prompt, docs[b].prompt) < 16
    # Questions on one document differ.
    assert len({tuple(r.prompt) for r in reqs}) == len(reqs)


def test_docqa_is_deterministic(tok: Any) -> None:
    a = w.docqa_requests(tok, doc_tokens=(700, 900))
    assert a == w.docqa_requests(tok, doc_tokens=(700, 900))
    assert a != w.docqa_requests(tok, doc_tokens=(700, 900), seed=3)
    with pytest.raises(ValueError):
        w.docqa_requests(tok, doc_tokens=())
    with pytest.raises(ValueError, match="not enough reference text"):
        w.docqa_requests(tok, doc_tokens=(10_000_000,))


# ------------------------------------------------------------------------------ presets


def test_presets() -> None:
    assert asdict(w.DEFAULT.chat) == {"sessions": 3, "turns": 3, "system_tokens": 1024,
                                      "user_tokens": 64, "max_new_tokens": 24}
    assert asdict(w.DEFAULT.docqa) == {"doc_tokens": (3500, 6000), "questions": 2,
                                       "max_new_tokens": 24}
    assert asdict(w.QUICK.chat) == {"sessions": 2, "turns": 2, "system_tokens": 384,
                                    "user_tokens": 48, "max_new_tokens": 8}
    assert asdict(w.QUICK.docqa) == {"doc_tokens": (2000,), "questions": 2,
                                     "max_new_tokens": 8}


def test_quick_presets_build(tok: Any) -> None:
    turns = w.chat_requests(tok, **asdict(w.QUICK.chat))
    assert len(turns) == 4
    reqs = w.docqa_requests(tok, **asdict(w.QUICK.docqa))
    assert [r.name for r in reqs] == ["doc A q1", "doc A q2"]


class FakeModel:
    class config:  # mimics model.config
        max_position_embeddings = 8192
        vocab_size = 1500


def test_build_streams(tok: Any, tmp_path: Path) -> None:
    args = argparse.Namespace(quick=True, workloads="chat,docqa", trace=None,
                              trace_requests=40, chunk_tokens=None)
    chunk, describe, make = w.build_streams(args, tok, FakeModel())
    assert chunk == w.DEMO_CHUNK_TOKENS and "chat 2 sessions x 2 turns" in describe
    assert "docqa" in describe
    first, second = make(), make()
    assert [s.workload for s in first] == ["chat", "docqa"]
    assert first[0] is not second[0]
    assert isinstance(first[0], w.ChatStream) and isinstance(second[0], w.ChatStream)
    assert replay_chat(first[0].turns) == replay_chat(second[0].turns)
    assert [len(s.peek()) for s in first] == [4, 2]

    trace = tmp_path / "t.jsonl"
    write_trace(trace, [row([1, 2, 3], 1300, 5), row([1, 2, 4], 1400, 20)])
    args = argparse.Namespace(quick=False, workloads="chat", trace=str(trace),
                              trace_requests=10, chunk_tokens=16)
    chunk, describe, make = w.build_streams(args, tok, FakeModel())
    assert chunk == 16 and "2 of 2 requests" in describe and "2 reused" in describe
    (stream,) = make()
    assert [r.name for r in stream] == ["trace #1", "trace #2"]

    with pytest.raises(ValueError, match="unknown workload"):
        w.build_streams(argparse.Namespace(quick=True, workloads="chat,nope", trace=None,
                                           chunk_tokens=None), tok, FakeModel())

    class Short(FakeModel):
        class config:
            max_position_embeddings = 512
            vocab_size = 1500

    with pytest.raises(ValueError, match="positions"):
        w.build_streams(argparse.Namespace(quick=True, workloads="docqa", trace=None,
                                           chunk_tokens=None), tok, Short())


# ------------------------------------------------------------------------------ trace


def row(hash_ids: list[int], input_length: int, output_length: int,
        timestamp: float = 0) -> dict[str, Any]:
    return {"timestamp": timestamp, "input_length": input_length,
            "output_length": output_length, "hash_ids": hash_ids}


def write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_blocks_lengths_and_caps(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "trace.jsonl", [
        row([0, 1, 2], 1300, 3),           # 2 full blocks + 276/512 of a block
        row([0, 1, 5], 1024 + 512, 100),   # 3 full blocks, shares blocks 0 and 1
        row([7], 10, 0),                   # tiny prompt, no output
        row(list(range(10, 30)), 20 * 512, 5),  # 640 scaled tokens > cap
    ])
    reqs, info = w.trace_requests(path, 1000, block_tokens=32, max_prompt_tokens=200,
                                  max_new_tokens=8, special_ids=[300, 301])
    assert [r.name for r in reqs] == ["trace #1", "trace #2", "trace #3", "trace #4"]
    assert [len(r.prompt) for r in reqs] == [32 + 32 + 18, 96, 1, 192]
    assert [r.max_new_tokens for r in reqs] == [3, 8, 1, 5]
    assert all(r.workload == "trace" and r.continues is None for r in reqs)
    a, b = reqs[0].prompt, reqs[1].prompt
    assert a[:64] == b[:64]                         # hash ids 0, 1 shared
    assert common_prefix(a, b) < 64 + 4            # trimmed block 2 vs block 5 differ
    every = [t for r in reqs for t in r.prompt]
    assert min(every) >= 256 and max(every) < 1000 and not {300, 301} & set(every)
    assert info == {
        "trace": "trace.jsonl", "source_block_tokens": 512, "block_tokens": 32,
        "scale": 1 / 16, "max_prompt_tokens": 200, "max_new_tokens": 8, "start": 0,
        "requests": 4, "trace_requests": 4, "capped_requests": 1,
        "unique_blocks": 3 + 1 + 1 + 6, "reused_blocks": 2, "prompt_tokens": 82 + 96 + 1 + 192,
        "seed": 0,
    }


def test_trace_is_deterministic_and_seeded(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row([4, 5], 1024, 1), row([5, 4], 1024, 1)])
    first, _ = w.trace_requests(path, 5000)
    assert first == w.trace_requests(path, 5000)[0]
    # The same id gives the same block wherever it appears.
    assert first[0].prompt[:32] == first[1].prompt[32:]
    assert first[0].prompt[:32] != first[0].prompt[32:]
    other, _ = w.trace_requests(path, 5000, seed=1)
    assert other[0].prompt != first[0].prompt
    # Block size 16: the same ids, shorter blocks.
    small, info = w.trace_requests(path, 5000, block_tokens=16)
    assert len(small[0].prompt) == 32 and info["scale"] == 1 / 32


def test_trace_start_and_max_requests(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row([i], 100, 1, i) for i in range(10)])
    path.write_text(path.read_text().replace("\n", "\n\n", 1))  # a blank line is skipped
    reqs, info = w.trace_requests(path, 5000, max_requests=3, start=2)
    assert [r.name for r in reqs] == ["trace #4", "trace #5", "trace #6"]
    assert info["trace_requests"] == 10 and info["requests"] == 3
    with pytest.raises(ValueError, match="past the last"):
        w.trace_requests(path, 5000, start=10)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "missing field.*output_length"),
    ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}',
     "output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "2"]}',
     "hash_ids"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}',
     "input_length"),
])
def test_trace_malformed_line_names_the_line(tmp_path: Path, bad: str, message: str) -> None:
    good = json.dumps(row([1], 100, 1))
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{bad}\n{good}\n")
    with pytest.raises(ValueError, match=f"bad.jsonl line 3: .*{message}"):
        w.trace_requests(path, 5000, max_requests=1)


def test_trace_argument_errors(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row([1], 100, 1)])
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        w.trace_requests(path, 5000, block_tokens=32, max_prompt_tokens=16)
    with pytest.raises(ValueError, match="no token ids left"):
        w.trace_requests(path, 257)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        w.trace_requests(empty, 5000)


def test_real_trace_loads_and_shares_prefixes() -> None:
    if not REAL_TRACE.exists():
        pytest.skip(f"{REAL_TRACE} is absent (shared/traces is not mounted here)")
    reqs, info = w.trace_requests(REAL_TRACE, 49152, max_requests=130)
    assert info["requests"] == 130 and info["trace_requests"] > 1000
    assert info["reused_blocks"] > 0
    assert all(1 <= len(r.prompt) <= 4096 and 1 <= r.max_new_tokens <= 8 for r in reqs)
    # Some request starts with at least one whole block of an earlier request.
    assert any(common_prefix(a.prompt, b.prompt) >= 32
               for i, b in enumerate(reqs) for a in reqs[:i])
    rows = [json.loads(line) for line in REAL_TRACE.read_text().splitlines()[:130]]
    # Equal hash ids -> equal token blocks, across the whole replay.
    blocks: dict[int, list[int]] = {}
    for r, raw in zip(reqs, rows, strict=True):
        for k, h in enumerate(raw["hash_ids"][:len(r.prompt) // 32]):
            block = r.prompt[32 * k:32 * (k + 1)]
            assert blocks.setdefault(h, block) == block
