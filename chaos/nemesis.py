"""The nemesis: one fault every few seconds, chosen by a seeded random generator.

Fault classes (``FAULTS``):

- ``kill_worker``: SIGKILL a worker; a replacement starts a moment later;
- ``pause_worker``: SIGSTOP a worker for longer than the lease TTL, then
  SIGCONT: it wakes as a zombie whose sessions moved on;
- ``kill_redis``: SIGKILL Redis (on a cluster: a primary) and start it again on
  its AOF;
- ``kill_coordinator``: SIGKILL a coordinator and start it again (its clients'
  sockets die; they resume on any coordinator);
- ``drop_socket``: a client loses its socket, or (half-open) resumes on a new
  socket while its old one still looks open.

Every fault is recorded with the time it struck, for the recovery figures.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from chaos.checker import Fault
from chaos.client import ChaosClient
from chaos.cluster import Cluster

FAULTS = ("kill_worker", "pause_worker", "kill_redis", "kill_coordinator", "drop_socket")


class Nemesis:
    def __init__(
        self,
        cluster: Cluster,
        clients: Sequence[ChaosClient],
        rng: random.Random,
        started: float,
        *,
        faults: Sequence[str] = FAULTS,
        every_s: tuple[float, float] = (2.5, 5.0),
    ) -> None:
        self.cluster = cluster
        self.clients = clients
        self.rng = rng
        self.started = started
        self.faults = list(faults)
        self.every_s = every_s
        self.log: list[Fault] = []
        self._healing: set[asyncio.Task[None]] = set()

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def run(self, stop: asyncio.Event) -> None:
        """Strike until ``stop``: every class once per round, in a shuffled order, so
        even a short run meets each of them."""
        round_: list[str] = []
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.rng.uniform(*self.every_s))
            except TimeoutError:
                if not round_:
                    round_ = self.rng.sample(self.faults, len(self.faults))
                await self.strike(round_.pop())
        await asyncio.gather(*self._healing)

    async def strike(self, kind: str) -> None:
        target = await getattr(self, f"_{kind}")()
        if target is not None:
            self.log.append(Fault(self._now(), kind, target))

    def _later(self, delay_s: float, heal: object) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(heal)  # type: ignore[arg-type]

        task = asyncio.create_task(run())
        self._healing.add(task)
        task.add_done_callback(self._healing.discard)

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

    async def _kill_redis(self) -> str | None:
        down_s = self.rng.uniform(0.2, 1.5)
        return await asyncio.to_thread(self.cluster.redis.bounce, self.rng, down_s)

    async def _kill_coordinator(self) -> str | None:
        alive = [n for n in self.cluster.coordinator_names() if self.cluster.procs[n].alive]
        if len(alive) < 2:
            return None  # keep one serving: clients need somewhere to resume
        name = self.rng.choice(alive)
        await asyncio.to_thread(self.cluster.procs[name].kill)
        self._later(self.rng.uniform(0.5, 2.0), self.cluster.procs[name].start)
        return name

    async def _drop_socket(self) -> str | None:
        client = self.rng.choice(list(self.clients))
        await client.drop(half_open=self.rng.random() < 0.5)
        return f"client-{client.index}"

    async def heal(self) -> None:
        """Everything back: paused workers continued, the killed ones replaced."""
        await asyncio.gather(*self._healing)
        for proc in self.cluster.procs.values():
            if proc.stopped:
                proc.resume()
        self.cluster.redis.heal()
