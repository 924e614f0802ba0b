"""The nemesis: one fault every few seconds, chosen by a seeded random generator.

Fault classes (``FAULTS``; ``faults_for`` gives those of one kind of Redis):

- ``kill_worker``: SIGKILL a worker; a replacement starts a moment later;
- ``pause_worker``: SIGSTOP a worker for longer than the lease TTL, then
  SIGCONT: it wakes as a zombie whose sessions moved on;
- ``cut_worker``: a worker cut off from Redis (its route stops forwarding,
  its sockets stay open) for longer than the lease TTL, then reconnected: its
  held requests reach Redis late, as a zombie's;
- ``kill_coordinator``: SIGKILL the coordinator serving the most clients and
  start it again (its clients' sockets die; they resume on any coordinator);
- ``pause_coordinator``: SIGSTOP the coordinator serving the most clients for
  longer than the attachment TTL, then SIGCONT: its clients' sockets do not
  die, they fall silent; the clients notice and resume on the other one, and
  the coordinator wakes as a zombie whose sessions are attached elsewhere;
- ``drop_socket``: a client loses its socket, or (half-open) resumes on a new
  socket while its old one still looks open;
- ``slow_redis``: one process's round trips to Redis (a worker's, a
  coordinator's or the control plane's) take 50 to 200 ms longer for a few
  seconds;
- ``redis_oom``: Redis (on a cluster: a primary) at its memory limit for a few
  seconds: it refuses writes;
- ``kill_redis``: SIGKILL Redis and start it again on its AOF; on a cluster,
  SIGKILL a replica and start it again (it syncs again from its primary);
- on a cluster only, ``restart_primary``: SIGKILL a primary and start it again
  before the node timeout (no failover), and ``promote_replica``: SIGKILL a
  primary, wait until its replica is promoted, start the old one again (it
  rejoins as a replica);
- with simulated hosts only (``--hosts``), ``partition``: a host holding a
  primary (and the minority of the processes placed with it) cut off from the
  others until the primary's replica is promoted, and 1 to 3 s more, then
  healed; the old primary rejoins as a replica and is failed back
  (``chaos.partition``). Classes that need the routes (``cut_worker``,
  ``slow_redis``) do not run on hosts.

Every fault is recorded with the time it struck (when the nemesis began it),
for the recovery figures; what a fault turned out to do, where that is known
only later (commands refused by a full Redis), goes to ``notes``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

from chaos import partition
from chaos.checker import Fault
from chaos.client import ChaosClient
from chaos.cluster import Cluster

FAULTS = (
    "kill_worker", "pause_worker", "cut_worker", "kill_coordinator", "pause_coordinator",
    "drop_socket", "slow_redis", "redis_oom", "kill_redis", "restart_primary",
    "promote_replica", "partition",
)  # fmt: skip
CLUSTER_ONLY = ("restart_primary", "promote_replica")
"""Classes that need a Redis Cluster (a primary and its replica)."""
HOSTS_ONLY = ("partition",)
"""Classes that need simulated hosts (``chaos.hosts``)."""
ROUTED_ONLY = ("cut_worker", "slow_redis")
"""Classes that act on a process's route to Redis (not there on hosts)."""
ON_REDIS = ("redis_oom", "kill_redis", "restart_primary", "promote_replica", "partition")
"""Classes that strike the Redis Cluster's nodes: one at a time."""


def faults_for(redis_cluster: bool, hosts: bool = False) -> tuple[str, ...]:
    """The fault classes a run on one Redis (or on a cluster, or on hosts) strikes."""
    if hosts:
        return tuple(f for f in FAULTS if f not in ROUTED_ONLY)
    left_out = HOSTS_ONLY if redis_cluster else CLUSTER_ONLY + HOSTS_ONLY
    return tuple(f for f in FAULTS if f not in left_out)


class Nemesis:
    def __init__(
        self,
        cluster: Cluster,
        clients: Sequence[ChaosClient],
        rng: random.Random,
        started: float,
        *,
        faults: Sequence[str] | None = None,
        every_s: tuple[float, float] = (2.5, 5.0),
    ) -> None:
        self.cluster = cluster
        self.clients = clients
        self.rng = rng
        self.started = started
        self.faults = list(faults or faults_for(cluster.redis_cluster, cluster.hosts is not None))
        self.every_s = every_s
        self.log: list[Fault] = []
        self.notes: list[str] = []
        """What faults turned out to do, learnt after they struck."""
        self._healing: set[asyncio.Task[None]] = set()
        self._partitioned = False
        """A host is partitioned, or healed but its old primary not failed back yet."""
        self._at = 0.0
        """When the fault being struck began (a class that prepares first moves it to
        the moment the fault itself begins)."""

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def run(self, stop: asyncio.Event) -> None:
        """Strike until ``stop``: every class once per round, in a shuffled order, so
        even a short run meets each of them. A class that finds nothing to strike (both
        coordinators needed, say, while one is down) is tried once more at the round's end."""
        round_: list[str] = []
        retried: set[str] = set()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.rng.uniform(*self.every_s))
            except TimeoutError:
                if not round_:
                    round_ = self.rng.sample(self.faults, len(self.faults))
                    retried.clear()
                kind = round_.pop()
                if not await self.strike(kind) and kind not in retried:
                    retried.add(kind)
                    round_.insert(0, kind)
        await asyncio.gather(*self._healing)

    async def strike(self, kind: str) -> bool:
        """Strike one fault of class ``kind``; False when there was nothing to strike."""
        self._at = self._now()
        if kind in ON_REDIS and self._partitioned:
            return False  # one fault on the cluster at a time
        target = await getattr(self, f"_{kind}")()
        if target is not None:
            self.log.append(Fault(self._at, kind, target))
        return target is not None

    def _later(self, delay_s: float, heal: Callable[[], object]) -> None:
        """Run ``heal`` (blocking: in a thread) ``delay_s`` from now."""

        async def run() -> None:
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(heal)

        task = asyncio.create_task(run())
        self._healing.add(task)
        task.add_done_callback(self._healing.discard)

    def _note(self, kind: str, what: Callable[[], str]) -> Callable[[], None]:
        """A heal that records what ``what`` reports."""
        return lambda: self.notes.append(f"{self._now():.3f} {kind}: {what()}")

    # -- workers ------------------------------------------------------------------------

    async def _kill_worker(self) -> str | None:
        workers = self.cluster.workers()
        if not workers:
            return None
        name = self.rng.choice(workers)
        stage = name.rsplit("-w", 1)[0]
        await asyncio.to_thread(self.cluster.procs[name].kill)
        self._later(self.rng.uniform(0.5, 2.0), lambda: self.cluster.add_worker(stage))
        return name

    async def _pause_worker(self) -> str | None:
        workers = self.cluster.workers()
        if not workers:
            return None
        name = self.rng.choice(workers)
        proc = self.cluster.procs[name]
        proc.pause()
        ttl_s = self.cluster.settings.lease_ttl_ms / 1000
        self._later(ttl_s + self.rng.uniform(0.5, 2.0), proc.resume)
        return name

    async def _cut_worker(self) -> str | None:
        workers = [w for w in self.cluster.workers() if not self.cluster.route(w).is_cut]
        if not workers:
            return None
        name = self.rng.choice(workers)
        route = self.cluster.route(name)
        route.cut()
        ttl_s = self.cluster.settings.lease_ttl_ms / 1000
        self._later(ttl_s + self.rng.uniform(0.5, 2.0), route.heal)
        return name

    # -- coordinators -------------------------------------------------------------------

    def _busiest_coordinator(self) -> str | None:
        """The serving coordinator with the most clients connected (clients move to the
        other one after each coordinator fault: a random one may serve none), or None
        when fewer than two serve (clients need somewhere to resume)."""
        serving = self.cluster.serving_coordinators()
        if len(serving) < 2:
            return None
        endpoints = self.cluster.endpoints_by_name()
        load = {n: sum(c.coordinator == endpoints[n] for c in self.clients) for n in serving}
        most = max(load.values())
        return self.rng.choice([n for n in serving if load[n] == most])

    async def _kill_coordinator(self) -> str | None:
        name = self._busiest_coordinator()
        if name is None:
            return None
        await asyncio.to_thread(self.cluster.procs[name].kill)
        self._later(self.rng.uniform(0.5, 2.0), self.cluster.procs[name].start)
        return name

    async def _pause_coordinator(self) -> str | None:
        name = self._busiest_coordinator()
        if name is None:
            return None
        proc = self.cluster.procs[name]
        proc.pause()
        ttl_s = self.cluster.settings.attach_ttl_ms / 1000
        self._later(ttl_s + self.rng.uniform(0.5, 2.0), proc.resume)
        return name

    async def _drop_socket(self) -> str | None:
        client = self.rng.choice(list(self.clients))
        await client.drop(half_open=self.rng.random() < 0.5)
        return f"client-{client.index}"

    # -- Redis --------------------------------------------------------------------------

    async def _slow_redis(self) -> str | None:
        routed = [n for n in self.cluster.routed() if self.cluster.route(n).delay_s == 0]
        if not routed:
            return None
        name = self.rng.choice(routed)
        route = self.cluster.route(name)
        delay_s, for_s = self.rng.uniform(0.05, 0.2), self.rng.uniform(2.0, 5.0)
        route.slow(delay_s)
        self._later(for_s, lambda: route.slow(0))
        return f"{name} +{delay_s * 1000:.0f} ms for {for_s:.1f} s"

    async def _redis_oom(self) -> str | None:
        redis = self.cluster.redis
        if redis.filled:
            return None  # one at a time: each restores the limit it lowered
        index, target = await asyncio.to_thread(redis.fill, self.rng)
        unfill = self._note("redis_oom", lambda: redis.unfill(index))
        self._later(self.rng.uniform(2.0, 5.0), unfill)
        return target

    async def _kill_redis(self) -> str | None:
        down_s = self.rng.uniform(0.2, 1.5)
        return await asyncio.to_thread(self.cluster.redis.bounce, self.rng, down_s)

    async def _restart_primary(self) -> str | None:
        # Back well before the node timeout (1 s): no replica is promoted.
        down_s = self.rng.uniform(0.1, 0.4)
        return await asyncio.to_thread(self.cluster.redis.restart_primary, self.rng, down_s)

    async def _promote_replica(self) -> str | None:
        redis = self.cluster.redis
        index, target = await asyncio.to_thread(redis.kill_primary, self.rng)
        self._later(self.rng.uniform(0.2, 1.5),
                    self._note("promote_replica", lambda: redis.rejoin(index)))  # fmt: skip
        return target

    # -- hosts ----------------------------------------------------------------------------

    async def _partition(self) -> str | None:
        if self.cluster.hosts is None or self.cluster.redis.filled:
            return None
        self._partitioned = True  # nothing else on the cluster meanwhile
        rebalanced, found = await asyncio.to_thread(partition.candidates, self.cluster)
        if not found:
            self._partitioned = False
            return None
        index = self.rng.choice(sorted(found))
        self._at = self._now()  # the partition begins now, after any failing back
        promoted = await asyncio.to_thread(partition.isolate, self.cluster, index, found[index])
        primaries = list(found[index])
        heal = self._note("partition", lambda: self._heal_host(index, primaries))
        self._later(self.rng.uniform(1.0, 3.0), heal)
        return partition.describe(self.cluster, index, found[index], promoted, rebalanced)

    def _heal_host(self, index: int, primaries: list[int]) -> str:
        try:
            return partition.heal(self.cluster, index, primaries)
        finally:
            self._partitioned = False

    async def heal(self) -> None:
        """Everything back: paused workers continued, the killed ones replaced."""
        await asyncio.gather(*self._healing)
        hosts = self.cluster.hosts
        for index in list(hosts.isolated if hosts is not None else ()):
            await asyncio.to_thread(self._heal_host, index, [])
        for proc in self.cluster.procs.values():
            if proc.stopped:
                proc.resume()
        for route in self.cluster.routes():
            route.heal()
            route.slow(0)
        self.cluster.redis.heal()
