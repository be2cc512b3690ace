"""The node's key catalog: for each chunk it stores, the client's key and its namespace.

A node files a chunk under a scoped key (a hash of namespace id and client key; see
store.py), which cannot be turned back into the client's key. Placement (net/placement.py) and
the PUTs of the protocol work on client keys, so to copy a chunk to the replica that should
hold it (re-replication, drain; server/repair.py) a node must remember, per scoped key, the
client key and the namespace it came with. Every PUT notes them here (one dict probe per
key; a key already noted costs nothing more), and every namespace a PUT used is kept as its
canonical descriptor, so the node can declare it to its peers after a restart, before any
client has declared it again.

Persistence: ``save()`` writes the whole catalog to ``<ssd dir>/repair-catalog`` (written to
a temporary file, then renamed: a crash leaves the old or the new one), which the repair
thread does every few seconds when something changed and once at stop; ``load()`` reads it at
start. Keys PUT after the last save and before a kill -9 are not in it: those chunks are
still served, only not copied by the node itself (a client's read repair still restores the
hot ones). Entries of chunks no tier holds any more (evicted, deleted, dropped for lack of
room) are forgotten by the repair thread at each pass and whenever the catalog doubled since
(``forget``), so it stays about as large as what the node stores (~100 bytes of memory and 32
bytes of file per chunk). Without an SSD there is nothing to persist (a restart loses the data
too).

Failure contract: ``load`` ignores a missing file and logs and ignores a malformed one (an
empty catalog); ``save`` logs an OSError and keeps the old file. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpool.keys import KEY_BYTES, Namespace, canonical_json

log = logging.getLogger("kvpool.serve")

MAGIC = b"KVPOOL-REPAIR-CATALOG 1\n"
FILE_NAME = "repair-catalog"

#: scope(namespace id, client key) -> the key the node files the chunk under.
Scope = Callable[[bytes, bytes], bytes]

#: One entry as the repair thread sees it: (scoped key, namespace id, client key).
Entry = tuple[bytes, bytes, bytes]


class KeyCatalog:
    """Scoped key -> (namespace id, client key), in the order first noted, plus the
    namespaces' descriptors."""

    def __init__(self, path: Path | None, scope: Scope) -> None:
        self.path = path
        self._scope = scope
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[bytes, bytes]] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        #: bumped when new chunks are noted: the repair thread compares it to see new ones
        self.generation = 0
        self._version = 0  # bumped by every change (what save() compares)
        self._saved_version = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def note(self, ns: Namespace, keys: Sequence[bytes], scoped: Sequence[bytes]) -> None:
        """Remember the client ``keys`` of a PUT (``scoped``: the node's keys for them, in
        the same order). Never raises."""
        with self._lock:
            ns_id = ns.id
            if ns_id not in self._namespaces:
                self._namespaces[ns_id] = ns
            else:
                ns_id = self._namespaces[ns_id].id  # one bytes object per namespace
            entries = self._entries
            before = len(entries)
            for key, skey in zip(keys, scoped, strict=True):
                if skey not in entries:
                    entries[skey] = (ns_id, bytes(key))
            if len(entries) != before:
                self.generation += 1
                self._version += 1

    def namespace(self, ns_id: bytes) -> Namespace | None:
        with self._lock:
            return self._namespaces.get(ns_id)

    def entries(self) -> list[Entry]:
        """Every entry, newest first (the most recently stored chunks are copied first)."""
        with self._lock:
            items = list(self._entries.items())
        return [(skey, ns_id, key) for skey, (ns_id, key) in reversed(items)]

    def forget(self, scoped: Sequence[bytes]) -> None:
        """Drop the entries of chunks no tier holds any more."""
        if not scoped:
            return
        with self._lock:
            for skey in scoped:
                self._entries.pop(skey, None)
            self._version += 1

    # ------------------------------------------------------------------ persistence
    def dirty(self) -> bool:
        return self._version != self._saved_version

    def save(self) -> bool:
        """Write the catalog (see the module docstring). False (logged) on an OSError."""
        if self.path is None:
            return False
        with self._lock:
            version = self._version
            namespaces = [ns.canonical() for ns in self._namespaces.values()]
            items = list(self._entries.values())
        header = canonical_json({"namespaces": namespaces}) + b"\n"
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + header)
                f.write(b"".join(ns_id + key for ns_id, key in items))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot save the repair catalog %s: %s", self.path, exc)
            return False
        self._saved_version = version
        return True

    def load(self) -> int:
        """Read the saved catalog (before serving). Returns the entries read."""
        if self.path is None:
            return 0
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("cannot read the repair catalog %s: %s", self.path, exc)
            return 0
        try:
            if not data.startswith(MAGIC):
                raise ValueError("not a repair catalog")
            end = data.index(b"\n", len(MAGIC))
            header = json.loads(data[len(MAGIC):end])
            namespaces = [Namespace.from_canonical(c) for c in header["namespaces"]]
            body = memoryview(data)[end + 1:]
            if len(body) % (2 * KEY_BYTES):
                raise ValueError("truncated entries")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the repair catalog %s: %s", self.path, exc)
            return 0
        with self._lock:
            for ns in namespaces:
                self._namespaces.setdefault(ns.id, ns)
            known = {ns_id: ns.id for ns_id, ns in self._namespaces.items()}
            step, count = 2 * KEY_BYTES, 0
            for off in range(0, len(body), step):
                ns_id = known.get(bytes(body[off:off + KEY_BYTES]))
                if ns_id is None:
                    continue
                key = bytes(body[off + KEY_BYTES:off + step])
                self._entries.setdefault(self._scope(ns_id, key), (ns_id, key))
                count += 1
            self._saved_version = self._version
        return count
