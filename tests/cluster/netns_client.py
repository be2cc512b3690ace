"""A kvpool cluster client in its own network namespace, driven by the test over a pipe.

The test process stays in the host's namespace (it never dials a lab address), so the client
runs as a child: ``ip netns exec <ns> python netns_client.py SPEC``. :class:`NetnsClient` is the
test's side: each :meth:`NetnsClient.call` sends one JSON request line and waits for one JSON
answer line. The child (:func:`main`) holds one :class:`ClusterClient` over one byte namespace
(``SPEC``: the ClusterConfig fields, ``chunk`` bytes and ``salt``) and answers:

- ``live`` -> ``{"live": [ids]}``; ``register`` (``replicas``) -> ``{}``
- ``put`` (``keys``: hex) -> ``{"stored": n}``; ``read`` (``keys``) -> ``{"hits", "wrong"}``
- ``reads_start`` (``keys``, ``watch``: also watch etcd without a grace period) and
  ``reads_stop`` -> the continuous reader's ``reads``, ``misses``, ``wrong``, ``errors``,
  ``min_live``, ``etcd_min`` and the GET latencies ``p50_ms`` / ``p99_ms`` / ``max_ms``
- ``exists`` (``address``, ``keys``) -> ``{"held": [bool]}`` asked of that node directly
- ``etcd_nodes`` -> ``{"nodes": [[id, address, incarnation]]}``; ``stats`` -> the client's

A request that raises answers ``{"error": traceback}``, which :meth:`NetnsClient.call` raises
as AssertionError (with the child's stderr); so does a child that exits or does not answer
within the call's timeout.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class NetnsClient:
    """The test's side. ``prefix``: ``Netlab.exec_prefix(role)``; ``log``: the child's stderr."""

    def __init__(self, prefix: list[str], spec: dict[str, Any], log: Path,
                 env: dict[str, str]) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, str(HERE / "netns_client.py"), json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

    def call(self, op: str, timeout_s: float = 30, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise AssertionError(f"client {op}: child gone ({exc}): {self._tail()}") from exc
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"client {op}: no answer within {timeout_s} s: {self._tail()}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise AssertionError(f"client {op}: {out['error']}\n{self._tail()}")
        return out

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Close the client (it leaves in its own time), then kill the child if it lingers."""
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError):
                self.call("close", timeout_s=15)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Reader:
    """Reads ``keys`` in one batch, over and over, until stopped; counts what it saw."""

    def __init__(self, client: Any, ns: Any, keys: list[bytes], etcd_view: Any) -> None:
        self.client, self.ns, self.keys, self.etcd_view = client, ns, keys, etcd_view
        self.stop = threading.Event()
        self.reads = self.misses = self.wrong = 0
        self.errors: list[str] = []
        self.min_live = self.etcd_min = 1 << 30
        self.latencies: list[float] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import numpy as np
        from kvtest import payload_for

        outs = [np.zeros(self.ns.chunk_bytes, np.uint8) for _ in self.keys]
        want = [payload_for(k, self.ns.chunk_bytes) for k in self.keys]
        while not self.stop.is_set():
            try:
                self.min_live = min(self.min_live, len(self.client.live_nodes()))
                if self.etcd_view is not None:
                    self.etcd_min = min(self.etcd_min, len(self.etcd_view.live_nodes()))
                start = time.perf_counter()
                found = self.client.get_many_into(self.ns, self.keys, outs)
                self.latencies.append(time.perf_counter() - start)
                self.reads += 1
                self.misses += found.count(False)
                self.wrong += sum(1 for o, w, hit in zip(outs, want, found, strict=True)
                                  if hit and not np.array_equal(o, w))
            except Exception:
                self.errors.append(traceback.format_exc())
            time.sleep(0.01)

    def result(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(60)
        lat = sorted(self.latencies) or [0.0]
        return {"reads": self.reads, "misses": self.misses, "wrong": self.wrong,
                "errors": self.errors, "min_live": self.min_live, "etcd_min": self.etcd_min,
                "p50_ms": 1000 * lat[len(lat) // 2],
                "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                "max_ms": 1000 * lat[-1]}


def main() -> None:
    sys.path.insert(0, str(HERE.parent))  # kvtest
    import numpy as np
    from kvtest import byte_namespace, payload_for

    from kvpool.cluster.etcd_membership import EtcdMembership, list_nodes
    from kvpool.config import ClusterConfig
    from kvpool.net.client import ClusterClient
    from kvpool.net.connection import NodeConnection

    spec = json.loads(sys.argv[1])
    cfg = ClusterConfig(**spec["cluster"])
    ns = byte_namespace(spec["chunk"], salt=spec["salt"])
    client = ClusterClient(cfg)
    reader: _Reader | None = None
    watcher: EtcdMembership | None = None

    def keys_of(req: dict[str, Any]) -> list[bytes]:
        return [bytes.fromhex(k) for k in req["keys"]]

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal reader, watcher
        op = req["op"]
        if op == "live":
            return {"live": client.live_nodes()}
        if op == "register":
            client.register_namespace(ns, req.get("replicas"))
            return {}
        if op == "put":
            keys = keys_of(req)
            return {"stored": client.put_many([(k, ns, payload_for(k, ns.chunk_bytes))
                                               for k in keys])}
        if op == "read":
            keys = keys_of(req)
            outs = [np.zeros(ns.chunk_bytes, np.uint8) for _ in keys]
            found = client.get_many_into(ns, keys, outs)
            wrong = sum(1 for k, o, hit in zip(keys, outs, found, strict=True)
                        if hit and not np.array_equal(o, payload_for(k, ns.chunk_bytes)))
            return {"hits": sum(found), "wrong": wrong}
        if op == "reads_start":
            if req.get("watch"):
                watcher = EtcdMembership(cfg.etcd, cfg.name)  # no grace: etcd as it is
            reader = _Reader(client, ns, keys_of(req), watcher)
            return {}
        if op == "reads_stop":
            assert reader is not None, "reads_start first"
            out, reader = reader.result(), None
            if watcher is not None:
                watcher.close()
                watcher = None
            return out
        if op == "exists":
            conn = NodeConnection(req["address"], cfg.token)
            try:
                return {"held": [bool(h) for h in conn.exists(ns, keys_of(req))]}
            finally:
                conn.close()
        if op == "etcd_nodes":
            return {"nodes": [[n.node_id, n.address(), n.incarnation]
                              for n in list_nodes(cfg.etcd, cfg.name)]}
        if op == "stats":
            return json.loads(json.dumps(client.stats(), default=str))
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "close":
            break
        try:
            out = handle(req)
        except Exception:
            out = {"error": traceback.format_exc()}
        print(json.dumps(out), flush=True)
    if reader is not None:
        reader.result()
    client.close()
    print(json.dumps({}), flush=True)


if __name__ == "__main__":
    main()
