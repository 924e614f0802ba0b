"""Linger: fewer, fuller rounds under load, at a bounded delay.

Every loop of the data plane (a bell read, a stage's read of its sessions'
inputs, a coordinator's read of the client journals, a batch of script calls)
works in rounds, and a round's cost is mostly fixed: a system call, a Redis
command, a wake-up. Under load, rounds come back to back and each carries a few
events, so that fixed cost is paid per event (measured in ``docs/benchmarks.md``:
CPU per event at 100 paced sessions is several times the saturated figure).

A ``Pacer`` lets a round that would follow the previous one by less than
``linger_ms`` wait out the rest, so that the work arriving meanwhile joins it
(Kafka's producer ``linger.ms`` is the same idea). It lingers only while rounds
are filling up: after a round that carried several items (rings, entries,
script calls). A lone caller (one call in flight at a time, as a replay's
appends or a single session's chunks) and a loop whose rounds are further apart
than the linger are never delayed.
"""

from __future__ import annotations

import asyncio
import math
import time


class Pacer:
    """Spaces one loop's rounds at least ``linger_ms`` apart; 0 turns it off."""

    def __init__(self, linger_ms: float) -> None:
        self.linger_s = max(0.0, linger_ms) / 1000
        self._last = -math.inf
        self._filling = False
        """The last round carried several items: others are arriving concurrently."""

    def due_in(self) -> float:
        """Seconds until the next round may start (0: now)."""
        if not self.linger_s or not self._filling:
            return 0.0
        return max(0.0, self._last + self.linger_s - time.monotonic())

    def started(self) -> None:
        """A round starts now: the next one is spaced from here."""
        if self.linger_s:
            self._last = time.monotonic()

    def carried(self, items: int) -> None:
        """The round carried ``items``: the next one lingers only if it was several."""
        self._filling = items > 1

    async def pace(self) -> None:
        """Wait until the next round may start, and count it as started."""
        wait = self.due_in()
        if wait > 0:
            await asyncio.sleep(wait)
        self.started()
