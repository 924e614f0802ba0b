"""The hub: this process's coordinator, its journal reader loop and its connections.

One ``Hub`` per coordinator process. It owns the ``Coordinator`` and one journal
reader loop that routes every delivery to the queue of the connection serving
its session, renews the attachments of its connections (``coordinator.
attachments``) and closes a session whose client did not come back within
``resume_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from coordinator.admission import LiveSessions
from coordinator.attachments import Attachments
from coordinator.client_secrets import ClientSecrets
from coordinator.service import Coordinator
from coordinator.turn_trace import TurnTrace
from dataplane.authority import now_ms as _now_ms
from dataplane.metrics import SESSIONS
from dataplane.tracing import span_sink
from schemas.config import PipelineConfig, Settings
from schemas.errors import DuplexqError, RedisFullError, ResourceExhaustedError

if TYPE_CHECKING:
    from coordinator.connection import Connection

log = logging.getLogger("duplexq.coordinator")


def terminal_stages(pipeline: PipelineConfig) -> tuple[str, ...]:
    """Client-facing stages with no client-facing stage downstream (chain ends): their
    ``done`` ends a response."""

    def feeds_client(name: str) -> bool:
        return any(
            pipeline.stage(down).to_client or feeds_client(down)
            for down in pipeline.downstream(name)
        )

    return tuple(s.name for s in pipeline.stages if s.to_client and not feeds_client(s.name))


class Hub:
    """This process's coordinator, journal reader loop and connection registry."""

    def __init__(self, settings: Settings, pipeline: PipelineConfig) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.coordinator = Coordinator(settings, pipeline)
        self.attachments = Attachments(self.coordinator.bus, settings.attach_ttl_ms)
        self.live = LiveSessions(self.coordinator.bus, settings)
        self.secrets = ClientSecrets(self.coordinator.bus, settings)
        self.terminal = terminal_stages(pipeline)
        self.connections: dict[str, Connection] = {}
        self.graces: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()

    def reserve(self) -> None:
        if len(self.connections) >= self.settings.max_sessions:
            raise ResourceExhaustedError(
                f"this coordinator serves {self.settings.max_sessions} sessions; retry later"
            )

    async def run(self) -> None:
        """Route journal deliveries to connections and hold their attachments until
        ``stop``."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._route(), name="journal reader")
            group.create_task(self._hold(), name="attachments")

    async def _route(self) -> None:
        while not self._stopping.is_set():
            try:
                deliveries = await self.coordinator.outputs()
            except Exception:
                log.exception("journal reader failed; retrying")
                await asyncio.sleep(0.2)
                continue
            for delivery in deliveries:
                connection = self.connections.get(delivery.session_id)
                if connection is not None:
                    connection.deliver(delivery)

    async def _hold(self) -> None:
        """Renew the attachments of this process's connections and the counts of their
        sessions; close the ones whose session another connection took over."""
        period = self.settings.attach_ttl_ms / 3000
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            try:
                await self.hold_once()
            except Exception:
                log.exception("renewing attachments failed; retrying")

    async def hold_once(self) -> None:
        """One round of ``_hold``."""
        connections = dict(self.connections)
        held = {sid: conn.attachment for sid, conn in connections.items()}
        statuses = await self.attachments.hold(held, _now_ms())
        digests = {sid: conn.key_digest for sid, conn in connections.items()}
        try:
            await self.live.renew(
                {sid: digests[sid] for sid, status in statuses.items() if status == "ok"},
                {sid: digests[sid] for sid, status in statuses.items() if status == "closed"},
                _now_ms(),
            )
        except RedisFullError:
            # Holds run on a full Redis (``scripts.HOLD``); the live-session counts wait
            # for room (they add entries), and replaced connections still close.
            log.warning("Redis is full: live-session counts not renewed; retrying")
        # The connection Redis judged, not whichever is registered now: a resume on this
        # process meanwhile registered a fresh one, which must not be closed.
        for sid, status in statuses.items():
            if status == "replaced":
                await connections[sid].evict("session resumed on another connection")

    async def stop(self) -> None:
        self._stopping.set()
        for task in self.graces.values():
            task.cancel()
        for task in list(self.graces.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.coordinator.aclose()

    async def register(self, connection: Connection) -> None:
        """``connection`` now serves its session; one it replaces here is closed."""
        sid = connection.session_id
        if (sink := span_sink("duplexq-coordinator")) is not None:
            connection.turns.trace = TurnTrace(sink, sid, self.terminal)
        grace = self.graces.pop(sid, None)
        if grace is not None:
            grace.cancel()
        previous = self.connections.get(sid)
        self.connections[sid] = connection
        SESSIONS.set(len(self.connections))
        if previous is not None and previous is not connection:
            await previous.evict("session resumed on another connection")

    async def detach(self, connection: Connection) -> None:
        """``connection`` went away: if it still served its session, the session is kept
        for the grace period."""
        sid = connection.session_id
        if not sid or self.connections.get(sid) is not connection:
            return  # never served, or replaced by a newer connection
        del self.connections[sid]
        SESSIONS.set(len(self.connections))
        self.coordinator.reader.detach(sid)
        try:
            if not await self.attachments.detach(sid, connection.attachment, _now_ms()):
                return  # another coordinator's connection holds it now
            await self.live.detached(sid, connection.key_digest, _now_ms())
        except Exception:
            # Redis unreachable: the attachment lapses on its own and the grace
            # period runs from there.
            log.warning("could not record the detach of session %s", sid, exc_info=True)
        if not self._stopping.is_set():
            self.graces[sid] = asyncio.create_task(self._expire(sid, connection.key_digest))

    async def _expire(self, session_id: str, key_digest: str) -> None:
        grace_ms = self.settings.resume_grace_s * 1000
        try:
            await asyncio.sleep(grace_ms / 1000)
            closed = await self.coordinator.authority.close_detached(
                session_id,
                idle_before_ms=_now_ms() - grace_ms + 1,
                reason="detached",
                ttl_s=self.settings.closed_ttl_s,
            )
            if closed is not None:
                log.info("session %s closed after the resume grace period", session_id)
                await self.live.drop(session_id, key_digest)
        except RedisFullError:
            # The control plane's audit closes it once Redis has room (the grace is over).
            log.warning("Redis is full: session %s is left for the control plane to close",
                        session_id)  # fmt: skip
        except DuplexqError:
            pass  # closed meanwhile
        finally:
            self.graces.pop(session_id, None)
