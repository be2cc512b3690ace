"""The query API on a node's (and a host pool's) metrics port (docs/routing.md): ``POST
/query`` (a prompt's token ids) and ``POST /query_by_hash`` (its chained chunk keys) answer
how many leading tokens of the prompt each tier of this node holds, in the Mooncake
conductor indexer's shape (tenant -> node -> figures). With ``"scope": "cluster"`` the node
asks every node of its etcd membership in parallel; a node that is expected but not live,
or that does not answer within ``query.timeout_s``, is reported ``"status": "dead"``, never
as an error. A host pool answers from the pool of the request's tenant.

Failure contract: a malformed body, an unknown or ambiguous namespace, an unknown tenant is
a 400 with ``{"error": ...}``; a closed pool is a 503. Probing costs in-memory index lookups
only (no IO): the answer is what the tiers' indexes say now; the one exception is a host
pool's cluster tier (REMOTE), whose storage nodes are asked (a node fault: not held).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpool.cluster.membership import NodeInfo
from kvpool.errors import PoolClosedError
from kvpool.events.sink import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE
from kvpool.keys import KEY_BYTES, Namespace, chunk_keys
from kvpool.metrics.http import Page, RequestHandler
from kvpool.pool import KVPool
from kvpool.tiers.base import Tier, leading_run
from kvpool.tiers.remote import RemoteTier

#: Which medium each tier label is (metrics/catalogue.py TIERS).
MEDIUM_OF = {"dram": MEDIUM_CPU, "ssd_staging": MEDIUM_DISK, "ssd": MEDIUM_DISK,
             "cluster_staging": MEDIUM_REMOTE, "remote": MEDIUM_REMOTE}
SCOPES = ("local", "cluster")
MAX_KEYS = 1 << 20


class QueryError(ValueError):
    """The request cannot be answered as asked (a 400)."""


@dataclass(frozen=True)
class Query:
    namespace_id: bytes
    chunk_tokens: int
    keys: list[bytes]
    scope: str
    tenant: str


def _namespace(req: dict[str, Any], known: Sequence[Namespace]) -> tuple[bytes, int | None]:
    """The namespace id asked for and its chunk tokens where known."""
    block = req.get("block_size")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool)
                              or block <= 0):
        raise QueryError("block_size must be a positive integer")
    if "namespace_id" in req:
        try:
            ns_id = bytes.fromhex(str(req["namespace_id"]))
        except ValueError:
            raise QueryError("namespace_id must be hex") from None
        if len(ns_id) != KEY_BYTES:
            raise QueryError(f"namespace_id must be {KEY_BYTES} bytes of hex")
        mine = next((ns for ns in known if ns.id == ns_id), None)
        return ns_id, block if block is not None else (mine.chunk_tokens if mine else None)
    if "namespace" in req:
        try:
            ns = Namespace.from_canonical(req["namespace"])
        except (ValueError, TypeError) as exc:
            raise QueryError(f"namespace: {exc}") from None
        return ns.id, ns.chunk_tokens
    model = req.get("model")
    if not isinstance(model, str):
        raise QueryError("give namespace_id, namespace or model")
    salt = req.get("cache_salt")
    found = [ns for ns in known if ns.model == model
             and (block is None or ns.chunk_tokens == block)
             and (salt is None or ns.tenant_salt == salt)]
    if len(found) != 1:
        which = ", ".join(f"{ns.id.hex()} ({ns.model}@{ns.revision}, tp_rank "
                          f"{ns.layout.tp_rank}, chunk_tokens {ns.chunk_tokens})"
                          for ns in found)
        raise QueryError(f"model {model!r} matches {len(found)} namespaces this node knows"
                         f"{': ' + which if which else ''}; give namespace_id")
    return found[0].id, found[0].chunk_tokens


def load_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object. Raises QueryError when it is not one."""
    try:
        req = json.loads(body or b"{}")
    except ValueError as exc:
        raise QueryError(f"body is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise QueryError("body must be a JSON object")
    return req


def tenant_of(req: dict[str, Any]) -> str:
    """The request's ``tenant_id`` (``default`` when absent): the answer's top-level key."""
    return str(req.get("tenant_id") or "default")


def parse(path: str, body: bytes, known: Sequence[Namespace]) -> Query:
    """The query of a request body. Raises QueryError naming what is wrong."""
    return parse_request(path, load_body(body), known)


def parse_request(path: str, req: dict[str, Any], known: Sequence[Namespace]) -> Query:
    """The query of a decoded request body (``load_body``). Raises QueryError."""
    ns_id, block = _namespace(req, known)
    scope = req.get("scope", "local")
    if scope not in SCOPES:
        raise QueryError(f"scope must be one of {SCOPES}")
    tenant = tenant_of(req)
    if path == "/query":
        tokens = req.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) > MAX_KEYS:
            raise QueryError("token_ids must be a list of token ids")
        if block is None:
            raise QueryError("block_size is needed with a namespace_id this node does not know")
        try:
            keys = chunk_keys(ns_id, tokens, block)
        except (ValueError, TypeError, OverflowError) as exc:
            raise QueryError(f"token_ids: {exc}") from None
    else:
        hashes = next((req[k] for k in ("seq_hashes", "block_hash", "chunk_keys") if k in req),
                      None)
        if not isinstance(hashes, list) or len(hashes) > MAX_KEYS:
            raise QueryError("seq_hashes must be a list of hex chunk keys")
        try:
            keys = [bytes.fromhex(h) for h in hashes]
        except (ValueError, TypeError):
            raise QueryError("seq_hashes must be hex strings") from None
        if any(len(k) != KEY_BYTES for k in keys):
            raise QueryError(f"every chunk key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex)")
    return Query(ns_id, block or 0, keys, scope, tenant)


#: How a pool files a prompt's chunk keys: (namespace id, chunk keys) -> the keys its tiers
#: hold them under (a storage node scopes them by namespace: server/store.py).
Filing = Callable[[bytes, Sequence[bytes]], list[bytes]]


def _held(pool: KVPool, tier: Tier, keys: list[bytes], ns_id: bytes) -> list[bool]:
    """Which of ``keys`` ``tier`` holds. The cluster tier (a host or embedded pool's storage
    nodes) keeps no index here: the nodes are asked for the leading run (one request per
    node, a node fault a miss), for a namespace the pool knows (else none held)."""
    if not keys:
        return []
    if isinstance(tier, RemoteTier):
        ns = next((n for n in pool.namespaces() if n.id == ns_id), None)
        run = tier.lookup(ns, keys) if ns is not None else 0
        return [i < run for i in range(len(keys))]
    return tier.contains_many(keys, ns_id)


def local_answer(pool: KVPool, query: Query, incarnation: str | None,
                 filing: Filing | None = None) -> dict[str, Any]:
    """This pool's figures for the query, in tokens: per medium the leading run of chunks its
    tiers hold, and ``longest_matched`` over all of them. Raises PoolClosedError."""
    ns_id = query.namespace_id
    keys = filing(ns_id, query.keys) if filing is not None else query.keys
    by_medium: dict[str, list[bool]] = {}
    for tier in pool.tiers():
        medium = MEDIUM_OF.get(tier.label, tier.label.upper())
        held = _held(pool, tier, keys, ns_id)
        prev = by_medium.get(medium)
        by_medium[medium] = held if prev is None else [a or b for a, b in zip(prev, held,
                                                                              strict=True)]
    anywhere = [any(flags) for flags in zip(*by_medium.values(), strict=True)] \
        if by_medium and keys else []
    tokens = query.chunk_tokens or 1  # unknown chunk size: answered in chunks
    out: dict[str, Any] = {"longest_matched": leading_run(anywhere) * tokens}
    for medium, flags in by_medium.items():
        out[medium] = leading_run(flags) * tokens
    out.update(status="ok", chunks=len(keys), unit="tokens" if query.chunk_tokens else "chunks")
    if incarnation is not None:
        out["incarnation"] = incarnation
    return out


def _ask(node: NodeInfo, query: Query, timeout: float) -> dict[str, Any]:
    """One peer's local answer, or a ``dead`` entry saying why; never raises."""
    host = f"[{node.host}]" if ":" in node.host else node.host
    url = f"http://{host}:{node.metrics_port}/query_by_hash"
    body = json.dumps({"namespace_id": query.namespace_id.hex(), "scope": "local",
                       "block_size": query.chunk_tokens or None,
                       "seq_hashes": [k.hex() for k in query.keys],
                       "tenant_id": query.tenant}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer = json.loads(resp.read())
        entry = answer[query.tenant][node.node_id]
        if not isinstance(entry, dict):
            raise ValueError("malformed answer")
        return entry
    except (OSError, ValueError, KeyError, TypeError) as exc:  # URLError is an OSError
        reason = getattr(exc, "reason", exc)
        return {"longest_matched": 0, "status": "dead", "error": str(reason)}


#: Which pool answers for a request's ``tenant_id``; raises QueryError for a tenant it has
#: not (a 400 naming it), PoolClosedError when stopping.
PoolFor = Callable[[str], KVPool]


class QueryService:
    """The handlers of a node's (or a host pool's) query API. ``pool``: the pool that
    answers, or a PoolFor choosing it by the request's tenant (a host pool: one pool per
    tenant); ``members``: the live nodes (with their metrics ports), None where there is no
    cluster to fan out to (``scope: cluster`` is then a 400); ``expected``: ids of every node
    that should be there (etcd's expected set); ``filing``: how the pool files chunk keys
    (None: as they are)."""

    def __init__(self, pool: KVPool | PoolFor, node_id: str,
                 incarnation: Callable[[], str | None],
                 members: Callable[[], list[NodeInfo]] | None,
                 expected: Callable[[], frozenset[str]], timeout_s: float,
                 filing: Filing | None = None) -> None:
        self._pool_for: PoolFor = (lambda _tenant: pool) if isinstance(pool, KVPool) else pool
        self.node_id, self._filing = node_id, filing
        self._incarnation, self._members, self._expected = incarnation, members, expected
        self._timeout = timeout_s
        self._threads = ThreadPoolExecutor(8, thread_name_prefix="kvpool-query")

    def handlers(self) -> dict[str, RequestHandler]:
        return {"/query": lambda m, b: self.answer("/query", m, b),
                "/query_by_hash": lambda m, b: self.answer("/query_by_hash", m, b)}

    def answer(self, path: str, method: str, body: bytes) -> Page:
        if method != "POST":
            return _json(400, {"error": f"POST a JSON body to {path} (docs/routing.md)"})
        try:
            req = load_body(body)
            pool = self._pool_for(tenant_of(req))
            query = parse_request(path, req, pool.namespaces())
            nodes = self.cluster(pool, query) if query.scope == "cluster" else \
                {self.node_id: local_answer(pool, query, self._incarnation(), self._filing)}
        except QueryError as exc:
            return _json(400, {"error": str(exc)})
        except PoolClosedError:
            return _json(503, {"error": "pool closed (node stopping)"})
        return _json(200, {query.tenant: nodes})

    def cluster(self, pool: KVPool, query: Query) -> dict[str, dict[str, Any]]:
        """Every node's answer: this one's locally, the others' over HTTP in parallel.
        Raises QueryError where there is no cluster membership (a host pool)."""
        if self._members is None:
            raise QueryError("scope cluster: this pool follows no cluster membership; ask a "
                             "storage node (its REMOTE figure is what the cluster holds)")
        members = {n.node_id: n for n in self._members()}
        out: dict[str, dict[str, Any]] = {}
        asks = {node_id: self._threads.submit(_ask, node, query, self._timeout)
                for node_id, node in members.items()
                if node_id != self.node_id and node.metrics_port is not None}
        out[self.node_id] = local_answer(pool, query, self._incarnation(), self._filing)
        for node_id, node in members.items():
            if node_id != self.node_id and node.metrics_port is None:
                out[node_id] = {"longest_matched": 0, "status": "dead",
                                "error": "serves no metrics port (server.metrics_port)"}
        for node_id, future in asks.items():
            out[node_id] = future.result()
        for node_id in self._expected() - set(members) - {self.node_id}:
            out[node_id] = {"longest_matched": 0, "status": "dead",
                            "error": "not registered in etcd (lease expired or stopped)"}
        return dict(sorted(out.items()))

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def _json(code: int, obj: object) -> Page:
    return code, "application/json", json.dumps(obj).encode()
