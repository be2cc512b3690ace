"""Real network partitions on one machine: a network namespace per role (etcd, each node, the
client), a veth pair between every two roles, and links cut and healed one pair at a time.

Each role's address (``10.77.0.<i>``, /32) sits on its namespace's loopback, and a /32 route
per peer leads over the veth to that peer, so cutting one pair's link leaves every other pair
talking. The namespaces have no other interface and no default route: their traffic cannot
leave the machine, and an address outside the lab is unreachable at once.

A cut puts the ``blackhole`` queueing discipline on both ends of the pair's veth: every packet
is dropped silently, as a partitioned network does (senders see no error; TCP retransmits,
reads and connects time out). Healing removes it; open connections carry on. This kernel has no
``netem`` (CONFIG_NET_SCH_NETEM), so there is no delay or partial loss here.

Names are ``kvpt-<pid>-<random>-<role>``: runs in parallel never collide, and a later run
deletes the namespaces of runs whose process is gone, and what still runs in them
(:func:`sweep_stale`). :meth:`Netlab.close`
deletes every namespace it made (their veths go with them) and never raises; stop the
processes inside first (a namespace lives on while a process is in it).

Failure: anything ``ip`` or ``tc`` refuses raises :class:`NetnsError` with its message; a lab
that fails half-built removes what it made.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from etcd_fixture import EtcdServer

PREFIX = "kvpt-"
_PROBE = ("import sys, urllib.request\n"
          "sys.exit(0 if b'\"true\"' in urllib.request.urlopen(sys.argv[1], timeout=1).read()"
          " else 1)")


class NetnsError(RuntimeError):
    """An ``ip`` / ``tc`` command failed (not root, no iproute2, a kernel without veth...)."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if check and out.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
    return out


def netns_unavailable() -> str | None:
    """None if this process can build a lab (namespaces, veth pairs, the blackhole qdisc);
    otherwise why not, in one line."""
    try:
        Netlab(["a", "b"]).close()
    except NetnsError as exc:
        return f"network namespaces are not available (run as root with iproute2): {exc}"
    return None


def sweep_stale() -> None:
    """Delete the namespaces of earlier runs whose process no longer exists (a test run killed
    before its finalizers ran), SIGKILLing what that run left running in them."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", name], check=False)


class Netlab:
    """Namespaces for ``roles`` (names of at most 12 characters), fully meshed."""

    def __init__(self, roles: Sequence[str]) -> None:
        if len(set(roles)) != len(roles) or any(not 0 < len(r) <= 12 for r in roles):
            raise ValueError(f"roles must be distinct names of 1..12 characters: {roles}")
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.roles = list(roles)
        self._address = {role: f"10.77.0.{i + 1}" for i, role in enumerate(roles)}
        self._made: list[str] = []
        self._cut: set[frozenset[str]] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def netns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def address(self, role: str) -> str:
        return self._address[role]

    def exec_prefix(self, role: str) -> list[str]:
        """Prepend to a command to run it in ``role``'s namespace (``ip netns exec`` execs the
        command itself: its PID is the command's, signals reach it directly)."""
        return ["ip", "netns", "exec", self.netns(role)]

    def run(self, role: str, argv: Sequence[str],
            timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``role``'s namespace to completion (output captured)."""
        return subprocess.run([*self.exec_prefix(role), *argv], capture_output=True, text=True,
                              timeout=timeout_s)

    def _ip(self, role: str, *args: str) -> None:
        _run(["ip", "-n", self.netns(role), *args])

    def _build(self) -> None:
        sweep_stale()
        for role in self.roles:
            _run(["ip", "netns", "add", self.netns(role)])
            self._made.append(self.netns(role))
            self._ip(role, "link", "set", "lo", "up")
            self._ip(role, "addr", "add", f"{self._address[role]}/32", "dev", "lo")
        for i, a in enumerate(self.roles):
            for b in self.roles[i + 1:]:
                _run(["ip", "link", "add", f"to-{b}", "netns", self.netns(a), "type", "veth",
                      "peer", "name", f"to-{a}", "netns", self.netns(b)])
                for here, there in ((a, b), (b, a)):
                    self._ip(here, "link", "set", f"to-{there}", "up")
                    self._ip(here, "route", "add", f"{self._address[there]}/32",
                             "dev", f"to-{there}", "src", self._address[here])

    def _qdisc(self, a: str, b: str, *args: str) -> None:
        for here, there in ((a, b), (b, a)):
            _run(["tc", "-n", self.netns(here), "qdisc", *args[:1], "dev", f"to-{there}",
                  "root", *args[1:]])

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b`` (both directions), silently."""
        self._qdisc(a, b, "replace", "blackhole")
        self._cut.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`cut`; a link that is not cut is left alone."""
        pair = frozenset((a, b))
        if pair in self._cut:
            self._qdisc(a, b, "del")
            self._cut.discard(pair)

    def heal_all(self) -> None:
        for pair in list(self._cut):
            self.heal(*sorted(pair))

    def close(self) -> None:
        """Delete every namespace made (and so every veth); idempotent, never raises."""
        made, self._made = self._made, []
        for name in made:
            with contextlib.suppress(NetnsError):
                _run(["ip", "netns", "del", name], check=False)


class NetnsEtcd(EtcdServer):
    """An :class:`EtcdServer` in ``role``'s namespace, on that role's address (ports 2379 and
    2380: the namespace is its own). Its health is probed from inside the namespace."""

    def __init__(self, base_dir: Path, lab: Netlab, role: str) -> None:
        super().__init__(base_dir)
        self.lab, self.role = lab, role
        host = lab.address(role)
        self.client_port, self.peer_port = 2379, 2380
        self.endpoint = f"http://{host}:2379"
        self.peer_url = f"http://{host}:2380"
        self.command_prefix = lab.exec_prefix(role)

    def healthy(self) -> bool:
        try:
            out = self.lab.run(self.role, [sys.executable, "-c", _PROBE,
                                           self.endpoint + "/health"], timeout_s=5)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0
