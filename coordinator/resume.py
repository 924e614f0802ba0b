"""Rebuilding a client's view of a session from its journal, for ``duplexq.session.resume``.

The journal is read from its start, page by page, through a fresh
``JournalFollower`` and ``ServerEventTranslator``, exactly as a live reader
would have judged and framed it; events up to ``last_received_seq``
only rebuild state, the rest are returned for sending. Before the first entry
the client has not received, the view's epoch floor is raised to the session's
current epoch: nothing of an epoch cancelled meanwhile is sent, while an older
response of the current epoch still owed to the client is. The view learns the
incarnation from the journal, so a journal trimmed past a failover's barrier
still resumes (``tests/test_resume.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from coordinator.output_reader import JournalFollower
from coordinator.realtime import SEQ_STRIDE, ServerEvent, ServerEventTranslator, server_seq
from coordinator.service import Coordinator
from dataplane.bus import Entry
from schemas.errors import AuthError, ErrorCode
from schemas.fence import Fence

PAGE = 512
"""Journal entries read per round trip."""


class Replay(NamedTuple):
    events: list[ServerEvent]
    follower: JournalFollower
    last_id: str
    last_seq: int


async def replay_journal(
    coordinator: Coordinator, session_id: str, after_seq: int, translator: ServerEventTranslator
) -> Replay:
    current = await coordinator.current(session_id)
    if not await coordinator.is_open(session_id):
        raise AuthError(f"session {session_id} is no longer open", ErrorCode.RESUME_FAILED)
    follower = JournalFollower(session_id, Fence(session_id))
    received = after_seq // SEQ_STRIDE
    """Journal seq of the last entry the client received (some of) the events of."""
    events: list[ServerEvent] = []
    floored = False
    after = ""
    while page := await coordinator.journal_page(session_id, after, PAGE):
        if not after:
            _check_not_trimmed(page, after_seq)
        after = page[-1].id
        for entry in page:
            if not floored and int(entry.fields.get(b"n", b"0")) > received:
                follower.view.raise_epoch_floor(current.epoch)
                floored = True
            delivery = follower.judge(entry)
            if delivery is None:
                continue
            for event in translator.translate(delivery.event, delivery.server_event_seq):
                if server_seq(event) > after_seq:
                    events.append(event)
    if not floored:
        follower.view.raise_epoch_floor(current.epoch)
    last_seq = server_seq(events[-1]) if events else after_seq
    return Replay(events, follower, follower.cursor, last_seq)


def _check_not_trimmed(first_page: list[Entry], after_seq: int) -> None:
    """A resume needs every journal entry after the client's last one."""
    first_seq = next((int(e.fields[b"n"]) for e in first_page if b"n" in e.fields), None)
    if after_seq and first_seq is not None and first_seq > after_seq // SEQ_STRIDE + 1:
        raise AuthError(
            f"the journal no longer holds events after {after_seq} (oldest is {first_seq})",
            ErrorCode.RESUME_FAILED,
        )
