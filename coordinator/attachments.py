"""Which client connection serves a session, agreed on by every coordinator.

A session is *attached* to at most one client connection at a time. The
attachment lives in the session's meta hash (``att``: the connection's id,
``att_until``: until when it holds, in ms), so it is the same for every
coordinator process and survives any of them:

- ``attach`` (open or resume, on any coordinator) makes a connection the
  session's one; a resume must present the API key that opened the session and
  one of its two newest resume tokens (the one before the newest stays good until
  the newest is used, so a resume whose reply was lost can be made again). Every
  write a connection makes (inputs, cancels, notices, settings) names its
  attachment and is refused in the same atomic step once another connection
  took the session: a paused or partitioned coordinator that wakes up changes
  nothing (``tests/test_coordinator_fencing.py``).
- ``hold`` renews the attachments of a coordinator's live connections in one
  round trip, every third of ``attach_ttl_ms``. A connection whose session was
  attached elsewhere meanwhile is told ``replaced`` and is closed by its
  coordinator: a client that resumed on a new socket while its old one still
  looked open (a phone changing networks) is served by the new one only.
- ``detach`` (the socket closed) starts the resume grace period now.

A session whose coordinator died keeps its last ``att_until``; the grace
period runs from there. Closing a session whose attachment lapsed more than the
grace period ago is one atomic step (the close script checks ``att_until``), so
the control plane can do it whatever happened to the coordinator, and a resume
that arrived meanwhile always wins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from dataplane.bus import RedisBus
from schemas.errors import AuthError, ErrorCode, SessionClosedError


def key_digest(api_key: str | None) -> str:
    """What a session records of the API key that opened it (empty: anonymous)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class Attachments:
    """The attachment scripts for one deployment."""

    def __init__(self, bus: RedisBus, ttl_ms: int) -> None:
        self.bus = bus
        self.ttl_ms = ttl_ms

    async def attach(
        self,
        session_id: str,
        attachment: str,
        digest: str,
        now_ms: int,
        *,
        resume: bool,
        token: str = "",
        fresh: str = "",
    ) -> list[str]:
        """Make ``attachment`` the session's connection, ``fresh`` a resume token of its
        (a digest); a resume presents ``token``. Returns the digests of the tokens no
        longer good (``scripts.ATTACH`` says which), whose lookup keys the caller
        deletes."""
        meta = self.bus.keys.session(session_id).meta
        args = [attachment, digest, now_ms + self.ttl_ms, "1" if resume else "0", token, fresh]
        reply = await self.bus.run(self.bus.attach_script, [meta], args)
        if reply[0] == "closed":
            raise SessionClosedError(f"session {session_id} is no longer open")
        if reply[0] == "forbidden":
            raise AuthError("this session was opened with another API key", ErrorCode.RESUME_FAILED)
        if reply[0] == "expired":
            raise AuthError("resume token is no longer valid", ErrorCode.RESUME_FAILED)
        dropped = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
        return dropped.split()

    async def hold(self, held: Mapping[str, str], now_ms: int) -> dict[str, str]:
        """Renew each (session id -> attachment); returns each one's status:
        ``ok``, ``replaced`` (another connection took it) or ``closed``."""
        if not held:
            return {}
        calls = [
            ([self.bus.keys.session(session_id).meta], [attachment, now_ms + self.ttl_ms])
            for session_id, attachment in held.items()
        ]
        replies = await self.bus.run_many(self.bus.hold_script, calls)
        return {
            sid: r.decode() if isinstance(r, bytes) else str(r)
            for sid, r in zip(held, replies, strict=True)
        }

    async def detach(self, session_id: str, attachment: str, now_ms: int) -> bool:
        """The connection went away; False if another one holds the session now."""
        meta = self.bus.keys.session(session_id).meta
        reply = await self.bus.run(self.bus.detach_script, [meta], [attachment, now_ms])
        return bool(reply[0])
