"""Rebuilding a client's view of a session from its journal, for ``session.resume``.

The journal is replayed from its start through a fresh ``JournalFollower``
and ``ServerEventTranslator``, exactly as a live reader would have judged and
framed it; events up to ``last_received_server_event_seq`` only rebuild state,
the rest are returned for sending. The session's current epoch is applied
at the resume point, so nothing of an epoch cancelled meanwhile is sent.
"""

from __future__ import annotations

from typing import NamedTuple

from coordinator.output_reader import JournalFollower
from coordinator.realtime import SEQ_STRIDE, ServerEvent, ServerEventTranslator
from coordinator.service import Coordinator
from schemas.errors import AuthError, ErrorCode
from schemas.fence import Fence


class Replay(NamedTuple):
    events: list[ServerEvent]
    follower: JournalFollower
    last_id: str
    last_seq: int


async def replay_journal(
    coordinator: Coordinator, session_id: str, after_seq: int, translator: ServerEventTranslator
) -> Replay:
    bus = coordinator.bus
    sk = bus.keys.session(session_id)
    meta = await bus.hgetall(sk.meta)
    if meta.get("status") != "open":
        raise AuthError(f"session {session_id} is no longer open", ErrorCode.RESUME_FAILED)
    current = await coordinator.authority.current(session_id)
    follower = JournalFollower(session_id, Fence(session_id, int(meta.get("inc0", "0"))))
    entries = await bus.xrange(sk.client)
    first_seq = next((int(e.fields[b"n"]) for e in entries if b"n" in e.fields), None)
    if after_seq and first_seq is not None and first_seq > after_seq // SEQ_STRIDE + 1:
        raise AuthError(
            f"the journal no longer holds events after {after_seq} (oldest is {first_seq})",
            ErrorCode.RESUME_FAILED,
        )
    events: list[ServerEvent] = []
    crossed = after_seq == 0
    if crossed:
        follower.view.advance(current)
    for entry in entries:
        delivery = follower.judge(entry)
        if delivery is None:
            continue
        for event in translator.translate(delivery.event, delivery.server_event_seq):
            if not crossed and event["server_event_seq"] > after_seq:
                crossed = True
                follower.view.advance(current)
            if crossed:
                events.append(event)
    last_seq = events[-1]["server_event_seq"] if events else after_seq
    return Replay(events, follower, follower.cursor, last_seq)
