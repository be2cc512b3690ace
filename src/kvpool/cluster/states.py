"""Each expected node's state, the one policy behind ``kvpool admin nodes``, ``kvpool monitor``
and the ``kvpool_cluster_nodes{state}`` gauge.

- ``live``: registered (or still within its grace period, see etcd_membership) and not drained;
- ``draining``: registered and drained (``kvpool admin drain``);
- ``missing``: in the expected set (it registered once and was not forgotten with
  ``kvpool admin forget``) but not registered now.

A registered node is shown whether expected or not (a record put by hand, an older node). Pure
functions: nothing here touches the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["DRAINING", "LIVE", "MISSING", "STATES", "node_states", "state_counts"]

LIVE, MISSING, DRAINING = "live", "missing", "draining"
STATES = (LIVE, MISSING, DRAINING)


def node_states(live: Iterable[str], expected: Iterable[str],
                drained: Iterable[str]) -> dict[str, str]:
    """``{node_id: state}`` for every live or expected node, sorted by node id."""
    live_ids, drained_ids = set(live), set(drained)
    every = sorted(live_ids | set(expected))
    return {n: (DRAINING if n in drained_ids else LIVE) if n in live_ids else MISSING
            for n in every}


def state_counts(states: Mapping[str, str]) -> dict[str, int]:
    """How many nodes are in each of STATES (zeros included)."""
    counts = dict.fromkeys(STATES, 0)
    for state in states.values():
        counts[state] += 1
    return counts
