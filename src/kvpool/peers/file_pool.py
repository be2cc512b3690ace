"""The chunk-store interface over a file-per-chunk store: the file-system approach kvpool
replaces, driven by the very same engine integration so the two compare on equal terms."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.buffers import byte_view
from kvpool.errors import ChunkSizeError, UnknownNamespaceError
from kvpool.keys import Namespace
from kvpool.peers.file_per_chunk import FilePerChunkStore
from kvpool.pool import ChunkReservation
from kvpool.saves import Fill, LoadHandle, SaveTicket


class FilePerChunkPool:
    """One FilePerChunkStore directory per namespace; same methods as KVPool that engine
    integrations use (register_namespace, lookup, get_many_into, put, reserve, commit_many,
    save, open_load, flush, stats, close); ``save`` writes each file before it returns.
    No DRAM tier and no checksum: every read goes to the file system."""

    def __init__(self, directory: str | Path, durable: bool = False) -> None:
        self._root = Path(directory)
        self._durable = durable
        self._stores: dict[bytes, FilePerChunkStore] = {}
        self._counters = dict.fromkeys(("hits", "misses", "puts"), 0)

    def register_namespace(self, ns: Namespace) -> Namespace:
        if ns.id not in self._stores:
            self._stores[ns.id] = FilePerChunkStore(self._root / ns.id.hex(), self._durable)
        return ns

    def _store(self, ns: Namespace) -> FilePerChunkStore:
        try:
            return self._stores[ns.id]
        except KeyError:
            raise UnknownNamespaceError(f"namespace {ns.id.hex()} is not registered") from None

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        store = self._store(ns)
        for i, key in enumerate(keys):
            if not store.contains(key):
                return i
        return len(keys)

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]:
        store = self._store(ns)
        found = []
        for key, out in zip(keys, outs, strict=True):
            view = byte_view(out, writable=True)
            if view.nbytes != ns.chunk_bytes:
                raise ChunkSizeError(f"output buffer has {view.nbytes} bytes, chunks "
                                     f"{ns.chunk_bytes}")
            hit = store.get_into(key, view)
            self._counters["hits" if hit else "misses"] += 1
            found.append(hit)
        return found

    def put(self, ns: Namespace, key: bytes, data: Any) -> bool:
        self._counters["puts"] += 1
        return self._store(ns).put(key, data)

    def reserve(self, ns: Namespace, key: bytes, wait: bool = True) -> ChunkReservation:
        """Room to fill in place, as KVPool.reserve; here a scratch buffer, written as one
        file at commit."""
        self._store(ns)
        return ChunkReservation(ns, key, memoryview(bytearray(ns.chunk_bytes)), None,
                                self.commit_many)

    def commit_many(self, reservations: Sequence[ChunkReservation]) -> int:
        return sum(self.put(r.ns, r.key, r.view) for r in reservations if r.take())

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Fill, *,
             defer: bool = False) -> SaveTicket:
        """As KVPool.save, synchronously (``defer`` is accepted and ignored): each chunk is
        filled into a scratch buffer and written as one file."""
        store = self._store(ns)
        present = [store.contains(key) for key in keys]
        ticket = SaveTicket(keys, sum(present))
        stored = 0
        for i, key in enumerate(keys):
            if not present[i]:
                buf = memoryview(bytearray(ns.chunk_bytes))
                fill(i, buf)
                stored += self.put(ns, key, buf)
        ticket.finish(stored)
        return ticket

    def open_load(self, ns: Namespace, keys: Sequence[bytes]) -> LoadHandle:
        """As KVPool.open_load: every chunk read from its file into a scratch buffer."""
        bufs = [bytearray(ns.chunk_bytes) for _ in keys]
        found = self.get_many_into(ns, keys, bufs)
        return LoadHandle([memoryview(b).toreadonly() if hit else None
                           for b, hit in zip(bufs, found, strict=True)], [], [], lambda b: None)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def drop_page_cache(self) -> None:
        for store in self._stores.values():
            store.drop_page_cache()

    def stats(self) -> dict[str, Any]:
        return {"file_per_chunk": dict(self._counters)}

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()
