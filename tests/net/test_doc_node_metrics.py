"""docs/operations.md says which metrics a storage node exports: every metric its tables
list for every process with a KVPool and for storage nodes is on a real node's /metrics, and
the ones it lists for clients of storage nodes only (which nodes used to be said to export:
kvpool_node_up, kvpool_remote_errors_total) are not."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from kvtest import byte_namespace, payload_for
from metrics_support import metric_names, scrape_url
from node_process import NodeProcess

from kvpool.net.connection import NodeConnection

CHUNK = 64 * 1024

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
_ROW = re.compile(r"^\| `(kvpool_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.M)


def documented(heading: str) -> set[str]:
    """The metric rows of the table under the ``####`` heading that starts with
    ``heading``."""
    text = DOC.read_text()
    start = text.index(f"#### {heading}")
    end = text.find("\n#", start + 1)
    return {name for name, _ in _ROW.findall(text[start:end if end > 0 else None])}


def test_the_doc_says_truly_what_a_node_exports(tmp_path: Path) -> None:
    every, nodes = documented("Every process with a KVPool"), documented("Storage nodes only")
    clients = documented("Clients of storage nodes only")
    assert {"kvpool_node_up", "kvpool_remote_errors_total"} <= clients
    assert every and nodes and not clients & (every | nodes)
    # a tenant quota, so the per-tenant quota metrics have a series to export
    with NodeProcess(tmp_path / "n", server={"metrics_port": 0},
                     pool={"tenant_quotas": {"acme": {"dram_bytes": "8MiB"}}}) as node:
        ns = byte_namespace(CHUNK)
        keys = ns.chunk_keys([1, 2])
        conn = NodeConnection(node.address)  # labelled series appear once requests were served
        try:
            assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 2
            conn.get_into(ns, keys, [np.zeros(CHUNK, np.uint8) for _ in keys])
        finally:
            conn.close()
        exported = metric_names(scrape_url(f"http://127.0.0.1:{node.metrics_port}/metrics"))
    assert (every | nodes) - exported == set()
    assert clients & exported == set()
