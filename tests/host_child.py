"""An engine process attached to a host pool, for tests/test_host_*.py. Run as
``python tests/host_child.py MODE CONFIG.yaml [ARGS...]``; it prints one JSON line per
result (and ``holding`` while it holds pins and reservations, to be SIGKILLed).

Modes: ``save TENANT_SALT SEED N`` (stored count), ``read TENANT_SALT SEED N`` (hits and
whether the bytes are the ones ``save`` wrote), ``psave`` / ``pload`` (the same through the
pool's ``save`` with a fill callback and ``load`` with a scatter callback, then a second
``save`` of the same chunks: all present), ``hold SEED N_PIN N_RESERVE`` (pins the first
N_PIN chunks of SEED, reserves N_RESERVE new ones, half filled, then sleeps), ``load
STOP_FILE`` (puts and reads in a loop, ``started`` once a round hit, until STOP_FILE exists
or 90 s passed; then its errors, slowest call and attaches), ``churn STOP_FILE SECONDS``
(puts 16 chunks whose bytes derive from their keys, four at a time, over 8 DRAM slots) and
``verify STOP_FILE SECONDS`` (reads them in a loop: hits, wrong bytes, direct reads).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from kvtest import payload_for

from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool
from kvpool.keys import KVLayout, Namespace

#: 1 MiB chunks.
LAYOUT = KVLayout("float16", 4, 4, 128, chunk_tokens=128)


def namespace(salt: str = "") -> Namespace:
    return Namespace("host-test", LAYOUT, tenant_salt=salt)


def chunks(ns: Namespace, seed: int, n: int) -> tuple[list[bytes], list[np.ndarray]]:
    base = seed * 1_000_000
    keys = ns.chunk_keys(list(range(base, base + n * ns.chunk_tokens)))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, ns.chunk_bytes, dtype=np.uint8) for _ in keys]


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(mode: str, config_path: str, *args: str) -> int:
    cfg = config_from_dict(yaml.safe_load(Path(config_path).read_text()))
    pool = AttachedPool(cfg)
    if mode in ("psave", "pload"):
        ns = pool.register_namespace(namespace(args[0]))
        keys, datas = chunks(ns, int(args[1]), int(args[2]))
        if mode == "psave":
            ticket = pool.save(ns, keys, lambda i, view: view.__setitem__(
                slice(None), memoryview(datas[i]).cast("B")))
            ticket.wait(30)
            say(stored=ticket.stored, present=ticket.present)
        else:
            outs = [np.zeros_like(d) for d in datas]
            loaded = pool.load(ns, keys, lambda i, view: outs[i].__setitem__(
                slice(None), np.frombuffer(view, np.uint8)))
            again = pool.save(ns, keys, lambda i, view: None)
            say(hits=loaded, same=all(np.array_equal(outs[i], datas[i]) for i in range(loaded)),
                present=again.present)
    elif mode in ("save", "read"):
        ns = pool.register_namespace(namespace(args[0]))
        keys, datas = chunks(ns, int(args[1]), int(args[2]))
        if mode == "save":
            say(stored=pool.put_many(ns, keys, datas))
        else:
            outs = [np.zeros_like(d) for d in datas]
            hits = pool.get_many_into(ns, keys, outs)
            say(hits=sum(hits), same=all(np.array_equal(o, d) for o, d, h in
                                         zip(outs, datas, hits, strict=True) if h))
    elif mode == "hold":
        ns = pool.register_namespace(namespace())
        seed, n_pin, n_reserve = (int(a) for a in args)
        keys, _ = chunks(ns, seed, n_pin)
        views = pool.pin_many(ns, keys)
        new_keys, datas = chunks(ns, seed + 1, n_reserve)
        reservations = pool.reserve_many(ns, new_keys)
        for r, data in zip(reservations, datas, strict=True):
            if not isinstance(r, bool) and r is not None:
                r.view[:len(data) // 2] = data[:len(data) // 2]  # killed mid-fill
        say(holding=True, pinned=sum(v is not None for v in views),
            reserved=sum(not isinstance(r, bool) for r in reservations))
        time.sleep(600)
    elif mode == "saving":  # a save reserved, half filled, never committed: to be killed
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, int(args[0]), int(args[1]))
        batch = pool.begin_save(ns, keys)
        for view, data in zip(batch.views, datas, strict=True):
            if view is not None:
                view[:len(data) // 2] = memoryview(data).cast("B")[:len(data) // 2]
        say(holding=True, reserved=batch.reserved)
        time.sleep(600)
    elif mode == "load":
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 99, 4)
        outs = [np.zeros_like(d) for d in datas]
        deadline = time.monotonic() + 90
        stop = Path(args[0])
        errors, slowest, calls, hits, i = [], 0.0, 0, 0, 0
        while time.monotonic() < deadline and not stop.exists():
            started = time.monotonic()
            try:
                pool.put_many(ns, keys, datas)
                found = pool.get_many_into(ns, keys, outs)
                if hits == 0 and all(found):
                    say(started=True)
                hits += sum(found)
                if not all(np.array_equal(o, d) for o, d, f in
                           zip(outs, datas, found, strict=True) if f):
                    errors.append("wrong bytes")
            except Exception as exc:
                errors.append(repr(exc))
            slowest = max(slowest, time.monotonic() - started)
            calls += 1
            i += 1
            time.sleep(0.02)
        say(errors=errors[:5], slowest_s=slowest, calls=calls, hits=hits,
            attaches=pool.stats()["attached"]["attaches"], attached=pool.attached)
    elif mode in ("churn", "verify"):  # the directory race: tests/test_host_direct.py
        ns = pool.register_namespace(namespace())
        keys = chunks(ns, 77, CHURN_KEYS)[0]
        datas = [payload_for(key, ns.chunk_bytes) for key in keys]
        deadline = time.monotonic() + float(args[1])
        stop = Path(args[0])
        rounds, hits, wrong = 0, 0, 0
        outs = [np.zeros_like(d) for d in datas]
        while time.monotonic() < deadline and not stop.exists():
            if mode == "churn":  # four chunks at a time: each put evicts older ones
                at = (rounds % (CHURN_KEYS // 4)) * 4
                pool.put_many(ns, keys[at:at + 4], datas[at:at + 4])
            else:
                for out in outs:
                    out.fill(0)
                found = pool.get_many_into(ns, keys, outs)
                hits += sum(found)
                wrong += sum(not np.array_equal(o, d) for o, d, f in
                             zip(outs, datas, found, strict=True) if f)
            rounds += 1
        attached = pool.stats()["attached"]
        say(rounds=rounds, hits=hits, wrong=wrong, direct_hits=attached["direct_hits"],
            direct_changed=attached["direct_changed"])
    pool.close()
    return 0


#: The chunks the churn writer cycles through: twice the test host's 8 DRAM slots.
CHURN_KEYS = 16


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
