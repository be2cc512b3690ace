"""ReadRepairer (net/read_repair.py): bounded, copies the caller's bytes at once, sends in the
background, counts what it stored, dropped and failed."""

from __future__ import annotations

import threading

from kvtest import byte_namespace

from kvpool.keys import Namespace
from kvpool.net.read_repair import ReadRepairer

CHUNK = 4096


def test_a_full_queue_drops_and_counts_and_the_callers_buffer_may_be_reused() -> None:
    ns = byte_namespace(CHUNK)
    release = threading.Event()
    sent: list[tuple[str, list[bytes], list[bytes]]] = []

    def send(node: str, ns_: Namespace, keys: list[bytes], datas: list[bytes]) -> int:
        release.wait(10)
        sent.append((node, keys, datas))
        return len(keys)

    r = ReadRepairer(send, 3 * CHUNK)
    buf = bytearray(b"a" * CHUNK)
    offered = [r.offer("n1", ns, i.to_bytes(16, "little"), buf) for i in range(5)]
    buf[:] = b"b" * CHUNK  # the caller reuses its buffer at once
    assert offered == [True, True, True, False, False]
    assert r.counters["read_repair_dropped"] == 2
    release.set()
    assert r.wait_idle(10)
    assert sum(len(k) for _, k, _ in sent) == 3
    assert all(d == b"a" * CHUNK for _, _, datas in sent for d in datas)
    assert r.counters["read_repair_chunks"] == 3
    assert r.counters["read_repair_bytes"] == 3 * CHUNK
    assert r.offer("n1", ns, b"x" * 16, buf)  # room again
    r.close()


def test_failed_sends_are_counted_and_never_raise() -> None:
    ns = byte_namespace(CHUNK)
    calls: list[str] = []

    def send(node: str, ns_: Namespace, keys: list[bytes], datas: list[bytes]) -> int | None:
        calls.append(node)
        if node == "down":
            return None
        raise RuntimeError("bug in a sender")

    r = ReadRepairer(send, 8 * CHUNK, max_age_s=1.5)
    assert r.offer("down", ns, b"k" * 16, bytes(CHUNK))
    assert r.offer("broken", ns, b"j" * 16, bytes(CHUNK))
    assert r.wait_idle(10)  # "down" is tried again until it expires; "broken" once
    assert calls.count("broken") == 1 and calls.count("down") >= 1
    assert r.counters["read_repair_failures"] == 2 and r.counters["read_repair_chunks"] == 0
    r.close()
    assert not r.offer("down", ns, b"k" * 16, bytes(CHUNK))  # closed: dropped


def test_zero_bytes_turns_read_repair_off() -> None:
    assert not ReadRepairer(lambda *a: 0, 0).enabled


def test_a_hint_waits_for_its_node_is_retried_after_a_failure_and_expires() -> None:
    """Hinted writes: nothing is sent while the node is out of placement; a failed send is
    kept and sent once the node answers; what is not sent within max_age_s is dropped."""
    ns = byte_namespace(CHUNK)
    ready = {"n1": False, "n2": True}
    answers = {"n1": [None, 1], "n2": []}  # n1 fails once, then stores
    sent: list[str] = []

    def send(node: str, ns_: Namespace, keys: list[bytes], datas: list[bytes]) -> int | None:
        sent.append(node)
        return answers[node].pop(0) if answers[node] else None

    r = ReadRepairer(send, 8 * CHUNK, ready=lambda node: ready[node], max_age_s=2.5)
    assert r.offer("n1", ns, b"a" * 16, b"x" * CHUNK, hint=True)
    assert r.counters["hints_queued"] == 1
    assert not r.wait_idle(0.6)
    assert sent == []  # n1 is marked down: held, not sent
    ready["n1"] = True
    assert r.wait_idle(5)  # the first send fails, the retry a second later stores it
    assert sent == ["n1", "n1"]
    assert r.counters["read_repair_chunks"] == 1
    assert r.counters["read_repair_failures"] == 0
    ready["n1"] = False
    assert r.offer("n1", ns, b"b" * 16, b"y" * CHUNK, hint=True)
    assert r.wait_idle(5)  # never ready: expired after max_age_s
    assert sent == ["n1", "n1"]
    assert r.counters["read_repair_failures"] == 1
    assert r.pending_bytes() == 0
    r.close()
