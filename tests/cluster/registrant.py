"""Registers one storage node in etcd and stays registered until killed (for tests).

    python registrant.py ENDPOINT CLUSTER NODE_ID PORT [TTL_S]

Prints ``registered`` once the key is in etcd. SIGTERM closes the registration cleanly
(revoking the lease); SIGKILL leaves the key to expire after the TTL.
"""

from __future__ import annotations

import signal
import sys
import threading

from kvpool.cluster import NodeInfo, NodeRegistration


def main(argv: list[str]) -> int:
    endpoint, cluster, node_id, port = argv[:4]
    ttl_s = float(argv[4]) if len(argv) > 4 else 2.0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reg = NodeRegistration([endpoint], cluster, NodeInfo(node_id, "127.0.0.1", int(port)),
                           ttl_s=ttl_s).start()
    print("registered", flush=True)
    stop.wait()
    reg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
