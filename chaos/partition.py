"""The ``partition`` fault of the hosts mode (``--hosts``), and what it reports.

A partition cuts off one data host (``chaos.hosts``): a primary of the Redis
Cluster, another primary's replica and the minority of the processes placed
with them (a coordinator, a worker or two). The steps, each blocking (the
nemesis runs them in a thread):

1. ``candidates``: a primary that another class moved (``promote_replica``) is
   failed back first, so that each data host holds one primary; a host is a
   candidate when it holds exactly one primary and a coordinator serves
   elsewhere. Isolating a host with two primaries would leave no majority of
   primaries to elect a replica: the whole cluster would stop until the heal,
   a fault of another kind;
2. ``isolate``: the host's link goes down and the primary's replica, on
   another host, is awaited as the new primary (node timeout 1 s, then the
   election);
3. ``heal`` (1 to 3 s after the promotion): the link comes up, the old primary
   rejoins as a replica and resyncs (whatever it took while cut off, never
   acknowledged to a client, is discarded), then takes its role back by the
   graceful handover (``CLUSTER FAILOVER``: its primary stops taking writes
   until it has them all; nothing is lost) for the next partition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chaos.hosts import DATA_HOSTS

if TYPE_CHECKING:
    from chaos.cluster import Cluster

Primaries = dict[int, int | None]
"""A host's primaries (node index) -> the node replicating each, if any."""


def candidates(cluster: Cluster) -> tuple[list[str], dict[int, Primaries]]:
    """Fail back moved primaries; returns what was failed back and the hosts that may be
    partitioned now, with their primaries."""
    assert cluster.hosts is not None
    rebalanced = cluster.redis.rebalance()
    serving = cluster.serving_coordinators()  # clients need one on the majority side
    found = {}
    for index in range(DATA_HOSTS):
        if any(cluster.placed.get(name) != index for name in serving):
            primaries = cluster.redis.primaries_at(cluster.hosts.address(index))
            if len(primaries) == 1:
                found[index] = primaries
    return rebalanced, found


def isolate(cluster: Cluster, index: int, primaries: Primaries) -> bool:
    """Cut host ``index`` off; True once every one of its primaries' replicas is
    promoted (False: not within 20 s)."""
    assert cluster.hosts is not None
    cluster.hosts.isolate(index)
    return cluster.redis.promoted([r for r in primaries.values() if r is not None])


def heal(cluster: Cluster, index: int, primaries: list[int]) -> str:
    """Host ``index`` back on the network, its old primaries failed back; says what
    they were on rejoining and what they are now."""
    assert cluster.hosts is not None
    cluster.hosts.heal(index)
    redis = cluster.redis
    redis.settled(20)
    rejoined = redis.roles(primaries)
    back = ", ".join(f"{redis.name(p)} {redis.fail_back(p)}" for p in primaries)
    return f"host {index} healed: {rejoined}; failed back: {back}"


def describe(cluster: Cluster, index: int, primaries: Primaries, promoted: bool,
             rebalanced: list[str]) -> str:  # fmt: skip
    """The fault's target as the report gives it."""
    redis = cluster.redis
    nodes = ", ".join(f"{redis.name(p)} -> {'?' if r is None else redis.name(r)}"
                      for p, r in primaries.items())  # fmt: skip
    first = f"failed back first: {', '.join(rebalanced)}; " if rebalanced else ""
    return (f"{first}host {index} ({', '.join(on_host(cluster, index))}): {nodes}"
            + ("" if promoted else " (no promotion in 20 s)"))  # fmt: skip


def on_host(cluster: Cluster, index: int) -> list[str]:
    """The processes running on host ``index``."""
    live = {n for n, proc in cluster.procs.items() if proc.alive}
    redis = cluster.redis
    live |= {redis.name(i) for i, node in enumerate(redis.nodes) if node.alive}
    live |= {"redis-queue"} if redis.queue is not None and redis.queue.alive else set()
    return [n for n, at in cluster.placed.items() if at == index and n in live]


def layout(cluster: Cluster) -> list[str]:
    """Where everything runs and which node replicates which (for the report)."""
    if cluster.hosts is None:
        return []
    lines = [f"host {i} ({cluster.hosts.address(i)}): {', '.join(on_host(cluster, i))}"
             for i in range(cluster.hosts.count)]  # fmt: skip
    redis = cluster.redis
    for primary, replica in redis.primaries_at("").items():  # every primary
        where = "none" if replica is None else (
            f"{redis.name(replica)} on host {cluster.placed[redis.name(replica)]}")  # fmt: skip
        lines.append(f"{redis.name(primary)} on host {cluster.placed[redis.name(primary)]} "
                     f"replicated by {where}")  # fmt: skip
    return lines
