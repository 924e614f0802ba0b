"""The coordinator's session API: what the client layer calls.

Wraps the Redis authority (fences, the session log) and an output reader
(the client journals) for the sessions this process serves. Every method is
safe to call from any coordinator process for any session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from coordinator.output_reader import Delivery, OutputReader
from dataplane.authority import AppendReceipt, CancelResult, SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import PipelineConfig, Settings
from schemas.events import CommitPayload, InputMode, Payload
from schemas.fence import Fence
from schemas.keys import Keys


class Coordinator:
    """Open, append, commit, cancel and close sessions; read their outputs."""

    def __init__(self, settings: Settings, pipeline: PipelineConfig) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.bus = RedisBus(
            settings.redis_url,
            Keys(settings.key_prefix),
            linger_ms=settings.linger_ms,
            batch_size=settings.append_batch,
        )
        self.authority = SessionAuthority(self.bus, pipeline)
        self.reader = OutputReader(self.bus, block_ms=settings.block_ms, sweep_ms=settings.sweep_ms)

    async def aclose(self) -> None:
        await self.reader.aclose()
        await self.bus.aclose()

    async def open(self, session_id: str, capabilities: Iterable[InputMode] | None = None) -> Fence:
        """Open a session and start following its outputs."""
        fence = await self.authority.open(session_id, capabilities)
        self.reader.attach(session_id, fence)
        return fence

    async def attach(self, session_id: str, *, after: str = "0-0") -> Fence:
        """Follow an already open session (a reconnect, or another coordinator's session)."""
        fence = await self.authority.current(session_id)
        self.reader.attach(session_id, fence, after=after)
        return fence

    async def append(
        self, session_id: str, mode: InputMode | str, payload: Payload, *, attachment: str = ""
    ) -> AppendReceipt:
        """Accept one input into the session log under the session's current fence; with
        ``attachment``, only while that client connection serves the session."""
        return await self.authority.append(session_id, mode, payload, attachment=attachment)

    async def commit(self, session_id: str, *, attachment: str = "") -> AppendReceipt:
        """End the user's turn and reserve the response to it (response_seq + 1)."""
        await self.authority.reserve_response(session_id, attachment=attachment)
        return await self.authority.append(
            session_id, InputMode.TURN_COMMIT_ONLY, CommitPayload(), attachment=attachment
        )

    async def cancel(
        self, session_id: str, *, reason: str = "cancel", attachment: str = ""
    ) -> CancelResult:
        """Interrupt (barge-in / response.cancel): once this returns, nothing of the
        cancelled epoch is delivered by this coordinator's reader. With ``attachment``,
        only while that client connection serves the session."""
        result = await self.authority.cancel(session_id, reason=reason, attachment=attachment)
        self.reader.advance(result.fence)
        return result

    async def close(self, session_id: str, *, reason: str = "closed") -> Fence:
        fence = await self.authority.close(
            session_id, reason=reason, ttl_s=self.settings.closed_ttl_s
        )
        self.reader.detach(session_id)
        return fence

    async def outputs(self, block_ms: int | None = None) -> list[Delivery]:
        """One read round over every attached session's journal."""
        return await self.reader.read(block_ms)

    async def follow(self, block_ms: int | None = None) -> AsyncIterator[Delivery]:
        """Deliveries as they come, until the caller stops iterating."""
        while True:
            for delivery in await self.reader.read(block_ms):
                yield delivery
