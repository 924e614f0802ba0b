"""A worker's lease renewals, each on its own, never waited for.

A lease lapses ``lease_ttl_ms`` after its last renewal; a worker renews every
lease it holds each heartbeat (``Settings.heartbeat_ms``). On a Redis Cluster
the leases live on every primary. Renewed as one batch whose round waited for
its slowest call, a primary that took no write for 2 s (restarting, or failing
over to its replica) held back the renewals on every other primary too, and
the worker lost its sessions on all of them.

Here each lease has its own renewal: a heartbeat starts one for each lease
that has none in flight, and waits for none of them. A renewal that waits on a
slow node holds back the next renewal of that lease only. On a single Redis a
heartbeat's renewals still go to Redis in one round trip (they are made in one
event-loop turn: ``dataplane.batching``). The lease index the orphan scans
read, and the worker's place among the stage's live workers, are written the
same way: one write of each in flight at a time, never waited for by the
heartbeat (``tests/test_heartbeat.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable

from dataplane.authority import now_ms
from workers.ownership import Lease, StageOwnership

log = logging.getLogger("duplexq.worker")

Renewed = Callable[[Lease, bool], None]
"""Told each renewal's outcome: the lease, and False when it was lost (another owner
holds the session, or it lapsed). A renewal that failed (Redis did not answer) tells
nothing: the next heartbeat tries again."""


class SingleFlight:
    """Background writes of which at most one of each name is in flight."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def busy(self, name: str) -> bool:
        return name in self._tasks

    def start(self, name: str, write: Callable[[], Awaitable[None]]) -> bool:
        """Start ``write`` unless one named ``name`` is in flight; whether it started."""
        if name in self._tasks:
            return False

        async def run() -> None:
            try:
                await write()
            except Exception as exc:  # retried by the next heartbeat
                log.warning("heartbeat write %s failed: %s: %s", name, type(exc).__name__, exc)

        task = asyncio.create_task(run(), name=f"heartbeat:{name}")
        self._tasks[name] = task
        task.add_done_callback(lambda _: self._tasks.pop(name, None))
        return True

    async def aclose(self) -> None:
        """Cancel what is in flight (the worker is stopping) and wait for it."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Renewals:
    """The renewals of one worker's leases (and of its leases' index entries)."""

    def __init__(self, ownership: StageOwnership, renewed: Renewed) -> None:
        self.ownership = ownership
        self.renewed = renewed
        self.flights = SingleFlight()
        self._expiry: dict[str, int] = {}
        """Lease index entries to write: session id -> the renewed lease's expiry."""
        self._failed = 0

    def start(self, leases: Iterable[Lease]) -> None:
        """Start a renewal of each lease that has none in flight, and the lease index's
        update with what was renewed since the last one."""
        if self._failed:
            log.warning("%d lease renewals got no answer from Redis; retrying", self._failed)
            self._failed = 0
        for lease in leases:
            self.flights.start(f"lease:{lease.token}", functools.partial(self._renew, lease))
        if self._expiry and not self.flights.busy("index"):
            expiry, self._expiry = self._expiry, {}
            self.flights.start("index", functools.partial(self._write_index, expiry))

    async def _renew(self, lease: Lease) -> None:
        asked = now_ms()
        try:
            ok = await self.ownership.renew_one(lease)
        except Exception:
            self._failed += 1  # counted, logged once per heartbeat; retried by the next
            return
        if ok:
            self._expiry[lease.session_id] = asked + self.ownership.ttl_ms
        self.renewed(lease, ok)

    async def _write_index(self, expiry: dict[str, int]) -> None:
        try:
            await self.ownership.index(expiry)
        except BaseException:
            # Written by a later heartbeat; a newer expiry of the same session wins.
            self._expiry = {**expiry, **self._expiry}
            raise

    async def aclose(self) -> None:
        await self.flights.aclose()
