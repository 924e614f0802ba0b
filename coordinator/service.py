"""The coordinator's session API: what the client layer calls.

Wraps the Redis authority (fences, the session log) and an output reader
(the client journals) for the sessions this process serves. Every method is
safe to call from any coordinator process for any session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NamedTuple

from coordinator.output_reader import Delivery, JournalFollower, OutputReader
from dataplane import session_meta
from dataplane.authority import AppendReceipt, CancelResult, SessionAuthority
from dataplane.bus import Entry, RedisBus
from schemas.config import PipelineConfig, Settings
from schemas.events import CommitPayload, InputMode, Payload
from schemas.fence import Fence
from schemas.keys import Keys
from schemas.realtime import SessionConfig

RESUME_TOKEN_TTL_S = 86_400
"""How long a resume token is findable (the session's grace ends long before)."""

Notice = dict[str, Any]
"""A server event journaled for the client (``coordinator.realtime`` frames it)."""


class Commit(NamedTuple):
    """A turn's commit: the fence of the response it reserved, and where it landed."""

    fence: Fence
    receipt: AppendReceipt


class Coordinator:
    """Open, append, commit, cancel and close sessions; read their outputs; journal
    notices; keep resume tokens and a session's stored configuration."""

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

    async def commit(
        self,
        session_id: str,
        payload: CommitPayload | None = None,
        *,
        attachment: str = "",
        notice: Callable[[Fence], Notice | None] | None = None,
    ) -> Commit:
        """End the user's turn: reserve the response to it (response_seq + 1), then append
        the commit (``payload``, a plain one by default) that asks for it. ``notice``,
        given the reserved fence, is journaled between the two (as a receipt), so that it
        precedes the response's first output; it is never a conversation item. A commit
        after a notice is written on a full Redis too, as the notice is: the client was
        told of its response (``tests/test_redis_full.py``)."""
        fence = await self.authority.reserve_response(session_id, attachment=attachment)
        told = notice(fence) if notice is not None else None
        if told is not None:
            await self.journal(session_id, told, attachment=attachment, receipt=True)
        if payload is None:
            payload = CommitPayload()
        receipt = await self.authority.append(
            session_id, InputMode.TURN_COMMIT_ONLY, payload, attachment=attachment,
            taken=told is not None,
        )  # fmt: skip
        return Commit(fence, receipt)

    async def journal(
        self, session_id: str, event: Notice, *, attachment: str = "", receipt: bool = False
    ) -> int:
        """Journal a notice for the client (``SessionAuthority.journal``); its
        server_event_seq."""
        return await self.authority.journal(
            session_id, event, attachment=attachment, receipt=receipt
        )

    async def configure(self, session_id: str, config: SessionConfig, *, attachment: str) -> None:
        """Store the session's configuration (resume and new stage owners start from it)
        while ``attachment`` serves it."""
        await self.authority.configure(session_id, config.model_dump_json(), attachment=attachment)

    async def stored_config(self, session_id: str) -> SessionConfig:
        """The session's configuration as its last ``session.update`` left it."""
        return await session_meta.config(self.bus, session_id)

    async def current(self, session_id: str) -> Fence:
        """The session's current fence as Redis has it."""
        return await self.authority.current(session_id)

    async def is_open(self, session_id: str) -> bool:
        """Whether the session is open (not closed, expired or never opened)."""
        return await session_meta.status(self.bus, session_id) == "open"

    async def journal_page(self, session_id: str, after: str, count: int) -> list[Entry]:
        """Up to ``count`` entries of the session's client journal, oldest first, after
        the entry ``after`` (``""``: from its start)."""
        start = f"({after}" if after else "-"
        return await self.bus.xrange(self.bus.keys.session(session_id).client, start, "+",
                                     count=count)  # fmt: skip

    async def reserved_response(self, session_id: str) -> int:
        """The response_seq of the session's newest reserved response."""
        return await session_meta.reserved_response(self.bus, session_id)

    async def applied(self, session_id: str, stages: Iterable[str]) -> list[int]:
        """How far each of ``stages`` has applied the session's input, in order."""
        return await session_meta.applied(self.bus, session_id, stages)

    async def keep_resume_token(self, token_digest: str, session_id: str) -> None:
        """Make a resume token (by its digest) findable: it leads to ``session_id``."""
        bus = self.bus
        await bus.set_durable(bus.keys.resume(token_digest), session_id, RESUME_TOKEN_TTL_S)

    async def session_of_resume_token(self, token_digest: str) -> str | None:
        """The session a resume token leads to; None when unknown or expired."""
        raw = await self.bus.client.get(self.bus.keys.resume(token_digest))
        return None if raw is None else bytes(raw).decode()

    async def drop_resume_tokens(self, token_digests: Iterable[str]) -> None:
        """Forget resume tokens that a resume made stale."""
        for digest in token_digests:  # one by one: on a cluster each key has a slot of its own
            await self.bus.client.delete(self.bus.keys.resume(digest))

    async def cancel(
        self, session_id: str, *, reason: str = "cancel", attachment: str = ""
    ) -> CancelResult:
        """Interrupt (barge-in / response.cancel): once this returns, nothing of the
        cancelled epoch is delivered by this coordinator's reader. With ``attachment``,
        only while that client connection serves the session."""
        result = await self.authority.cancel(session_id, reason=reason, attachment=attachment)
        self.reader.advance(result.fence)
        return result

    def follow_from(self, follower: JournalFollower) -> None:
        """Follow a session's journal from where ``follower`` (a resume's replay) stopped,
        with its judgement of fences; this reader's deliveries of the session start
        there."""
        self.reader.attach(follower.session_id, follower.view.current, follower=follower)

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
