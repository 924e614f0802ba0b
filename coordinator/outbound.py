"""A connection's server events on their way to its socket, bounded.

The hub's journal reader puts every delivery of a session into the queue of
the connection serving it and never waits: one slow client must not hold up
the others. A client that stops reading lets its queue fill; at
``max_outbound_events`` the queue refuses and sets ``overflowed``, and the
connection closes its socket with ``OVERFLOW_CLOSE_CODE``. A client whose socket
does not take one event within ``client_send_timeout_ms`` is closed the same way
(``stall``: the socket's buffers are full long before the queue is). The session
stays open for a resume: what the queue dropped is in the session's journal.

Besides deliveries, the queue carries server events that are not journaled
(errors beyond the journaling allowance, ``coordinator.limits``), so that one
task, the connection's pump, is the only writer of the socket.
"""

from __future__ import annotations

import asyncio
from typing import Any

from coordinator.output_reader import Delivery

OVERFLOW_CLOSE_CODE = 4008
OVERFLOW_REASON = "the client is not reading: outbound queue full"
STALLED_REASON = "the client is not reading: send timed out"

Outgoing = Delivery | dict[str, Any]
"""A journal delivery, or a ready server event sent to the socket only."""


class Outbound:
    """A bounded queue that never blocks its producer."""

    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=limit)
        self.overflowed = asyncio.Event()
        self.reason = OVERFLOW_REASON
        """Why ``overflowed`` was set: the close's reason."""

    def put(self, item: Outgoing) -> bool:
        """Queue ``item``; False (and ``overflowed`` set) when the queue is full."""
        if self.overflowed.is_set():
            return False
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed.set()
            return False
        return True

    def stall(self) -> None:
        """The socket did not take an event in time: refuse more, as a full queue does."""
        self.reason = STALLED_REASON
        self.overflowed.set()

    async def get(self) -> Outgoing:
        return await self._queue.get()
