"""A Redis Cluster's members as ``CLUSTER NODES`` lists them.

Read by the configuration check (``dataplane.redis_config``: every primary has a
replica?) and by the script batches (``dataplane.replica_count``: does this primary's
batch wait for one?).
"""

from __future__ import annotations

from dataclasses import dataclass

DOWN_FLAGS = frozenset({"fail", "fail?", "noaddr", "handshake"})
"""``CLUSTER NODES`` flags of a node that is down, or not yet (or no longer) reachable."""


@dataclass(frozen=True, slots=True)
class Member:
    """One line of ``CLUSTER NODES``."""

    id: str
    host: str
    port: int
    flags: frozenset[str]
    primary_id: str
    """The node id of its primary (a replica); ``-`` for a primary."""
    serves_slots: bool
    linked: bool = True
    """The answering node's cluster-bus link to it is up (``link-state`` ``connected``):
    down at once when the node's process dies, where ``fail`` waits for the node
    timeout."""

    @property
    def name(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def down(self) -> bool:
        return bool(self.flags & DOWN_FLAGS)


def parse_cluster_nodes(text: str, seed_host: str = "") -> tuple[Member, ...]:
    """The members in a ``CLUSTER NODES`` reply. A node's address is
    ``ip:port@cport[,hostname[,aux=value...]]``; an announced hostname is what clients are
    meant to use, so it wins over the ip. A node that does not know its own ip yet
    (``:port``) is the one asked: ``seed_host``."""
    members: list[Member] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address, *extras = parts[1].split(",")
        hostname = extras[0] if extras and "=" not in extras[0] else ""
        ip, _, port = address.split("@", 1)[0].rpartition(":")
        members.append(
            Member(
                id=parts[0],
                host=hostname or ip or seed_host,
                port=int(port) if port.isdigit() else 0,
                flags=frozenset(parts[2].split(",")),
                primary_id=parts[3],
                serves_slots=len(parts) > 8,
                linked=parts[7] == "connected",
            )
        )
    return tuple(members)


def live_replicas(text: str, *, linked: bool = False) -> int:
    """The replicas of the node that answered ``CLUSTER NODES`` with ``text`` (its line is
    flagged ``myself``) that it does not see down, and with ``linked`` only those it is
    linked to: a replica whose process died loses its link at once, long before the
    cluster flags it failed (``dataplane.replica_count`` says when that counts)."""
    members = parse_cluster_nodes(text)
    me = next((m for m in members if "myself" in m.flags), None)
    if me is None:
        return 0
    return sum(1 for m in members
               if m.primary_id == me.id and not m.down and (m.linked or not linked))  # fmt: skip
