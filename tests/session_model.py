"""The in-process session authority: the reference model of a session's life that the
upstream runtime's conformance tests (``tests/test_upstream_runtime_conformance.py``)
and ``tests/test_sessions.py`` run against. The product's authority is the Redis one
(``dataplane.authority``), which applies the same fence rule (``dataplane.sessions``)
in its scripts; this model is used by tests only.

Transitions of one session id::

    state    call                         rule                           next
    -------  ---------------------------  -----------------------------  ------
    absent   open(f)                      f.incarnation > closed inc.    open
    open     open(f)                      always refused                 open
    open     accept_fence / append(c)     c acceptable                   open, current = c
    open     cancel_fence(c, n)           c acceptable, n.epoch > c.epoch open, current = n
    open     close(c)                     c acceptable                   closed (inc. kept)
    closed   open(f)                      f.incarnation > closed inc.    open

A refused call raises and changes nothing.

Stage bindings: a request is reserved for a fence's ``(incarnation, epoch)``
and a role (or under an id the caller chose), and bound to one or more
stages. One epoch's request lives across its turns (a duplex request keeps
appending), so bindings are keyed by ``(incarnation, epoch)``; releasing a
fence releases everything bound to its epoch, reporting each request id once
even when several stages share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from dataplane.request_ids import check_binding, make_request_id
from dataplane.sessions import ALL_MODES, MismatchReason, check_fence
from schemas.errors import (
    FenceMismatchError,
    ResourceExhaustedError,
    SessionClosedError,
    SessionExistsError,
    SessionNotFoundError,
    UnsupportedModeError,
)
from schemas.events import InputMode
from schemas.fence import Fence, require_fence


class AppendResult(NamedTuple):
    """Where an accepted input landed in the session log."""

    seq: int
    turn_seq: int
    turn_id: int


@dataclass(slots=True)
class Session:
    """One open session's state. Mutate it only through ``SessionManager``."""

    fence: Fence
    capabilities: frozenset[InputMode]
    seq: int = 0
    turn_seq: int = 0
    turn_key: tuple[int, int] | None = None
    bindings: dict[tuple[int, int], dict[str | int, str]] = field(default_factory=dict)
    reserved: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def bound_requests(self, fence: Fence) -> list[str]:
        """Request ids bound to ``fence``'s epoch, each once, in binding order."""
        key = (fence.incarnation, fence.epoch)
        ids = list(self.reserved.get(key, ()))
        ids.extend(self.bindings.get(key, {}).values())
        return list(dict.fromkeys(ids))


class SessionManager:
    """The in-process session authority: open, append, cancel, close.

    ``max_sessions`` bounds live sessions (a full manager refuses opens with a
    retryable ResourceExhaustedError). Closed session ids remember their last
    incarnation, up to ``closed_memory`` ids (oldest forgotten first), so a
    reopen must move to a higher incarnation.
    """

    def __init__(
        self,
        max_sessions: int = 1024,
        *,
        default_capabilities: Iterable[InputMode] = ALL_MODES,
        closed_memory: int = 65536,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.max_sessions = max_sessions
        self.default_capabilities = frozenset(default_capabilities)
        self._closed_memory = closed_memory
        self._live: dict[str, Session] = {}
        self._closed: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._live

    def open(self, fence: Fence, capabilities: Iterable[InputMode] | None = None) -> Session:
        """Open a session at ``fence``; its counters start from the fence given."""
        fence = require_fence(fence)
        sid = fence.session_id
        if sid in self._live:
            raise SessionExistsError(f"session {sid!r} is already open")
        closed_inc = self._closed.get(sid)
        if closed_inc is not None and fence.incarnation <= closed_inc:
            raise FenceMismatchError(
                MismatchReason.INCARNATION.value,
                f"reopening {sid!r} needs incarnation > {closed_inc}, got {fence.incarnation}",
            )
        if len(self._live) >= self.max_sessions:
            raise ResourceExhaustedError(
                f"session limit of {self.max_sessions} reached; retry later"
            )
        caps = self.default_capabilities if capabilities is None else frozenset(capabilities)
        session = Session(fence=fence, capabilities=caps)
        self._live[sid] = session
        self._closed.pop(sid, None)
        return session

    def get(self, session_id: str) -> Session:
        session = self._live.get(session_id)
        if session is not None:
            return session
        if session_id in self._closed:
            raise SessionClosedError(f"session {session_id!r} is closed")
        raise SessionNotFoundError(f"no session {session_id!r}")

    def _checked(self, fence: object, argument: str = "fence") -> tuple[Session, Fence]:
        checked = require_fence(fence, argument)
        session = self.get(checked.session_id)
        return session, check_fence(session.fence, checked, argument)

    def accept_fence(self, fence: Fence) -> Fence:
        """Move the session forward to ``fence`` or raise, leaving it untouched."""
        session, fence = self._checked(fence)
        session.fence = fence
        return fence

    def append(self, fence: Fence, mode: InputMode | str) -> AppendResult:
        """Accept one input under ``fence``; returns its ``seq``, ``turn_seq``, ``turn_id``."""
        session, fence = self._checked(fence)
        try:
            checked_mode = InputMode(mode)
        except ValueError as exc:
            raise UnsupportedModeError(f"input mode {mode!r} is not supported") from exc
        if checked_mode not in session.capabilities:
            raise UnsupportedModeError(
                f"input mode {checked_mode.value} is not supported by session {fence.session_id!r}"
            )
        turn_key = (fence.epoch, fence.turn_id)
        session.fence = fence
        session.seq += 1
        session.turn_seq = session.turn_seq + 1 if turn_key == session.turn_key else 1
        session.turn_key = turn_key
        return AppendResult(session.seq, session.turn_seq, fence.turn_id)

    def reserve_request(self, fence: Fence, role: str, *, request_id: str | None = None) -> str:
        """Reserve the request id serving ``fence``'s epoch in ``role``.

        The id is derived from the fence and ``role`` unless the caller names
        its own ``request_id`` (checked like a binding).
        """
        session, fence = self._checked(fence)
        if request_id is None:
            request_id = make_request_id(fence, role)
        else:
            check_binding(request_id, fence)
        reserved = session.reserved.setdefault((fence.incarnation, fence.epoch), [])
        if request_id not in reserved:
            reserved.append(request_id)
        session.fence = fence
        return request_id

    def bind_request(self, fence: Fence, stage_id: str | int, request_id: str) -> None:
        """Record that ``stage_id`` serves ``fence``'s epoch through ``request_id``.

        ``request_id`` is a codec id of this epoch or an id the caller chose
        (``dataplane.request_ids.check_binding``).
        """
        session, fence = self._checked(fence)
        check_binding(request_id, fence)
        session.bindings.setdefault((fence.incarnation, fence.epoch), {})[stage_id] = request_id
        session.fence = fence

    def bound_requests(self, fence: Fence) -> list[str]:
        fence = require_fence(fence)
        return self.get(fence.session_id).bound_requests(fence)

    def release_fence(self, fence: Fence) -> list[str]:
        """Drop the bindings of ``fence``'s epoch; return their request ids, each once.

        Releasing an older epoch is allowed (that is how its late requests are
        aborted); the session id must match a live session.
        """
        fence = require_fence(fence)
        session = self.get(fence.session_id)
        released = session.bound_requests(fence)
        key = (fence.incarnation, fence.epoch)
        session.bindings.pop(key, None)
        session.reserved.pop(key, None)
        return released

    def cancel_fence(self, cancelled: Fence, next_fence: Fence) -> list[str]:
        """Interrupt: release ``cancelled``'s requests and move the session to ``next_fence``.

        ``next_fence`` must be the same session and incarnation with a higher
        epoch. Afterwards appends carrying ``cancelled`` are refused.
        """
        session, cancelled = self._checked(cancelled, "cancelled")
        next_fence = require_fence(next_fence, "next_fence")
        if (
            next_fence.session_id != cancelled.session_id
            or next_fence.incarnation != cancelled.incarnation
            or next_fence.epoch <= cancelled.epoch
        ):
            raise FenceMismatchError(
                MismatchReason.EPOCH.value,
                f"cancel must move to a higher epoch of the same incarnation: "
                f"{cancelled} -> {next_fence}",
            )
        released = self.release_fence(cancelled)
        session.fence = next_fence
        return released

    def close(self, fence: Fence) -> list[str]:
        """Close the session; returns every request id still bound to it."""
        session, fence = self._checked(fence)
        released: list[str] = []
        for key in list(session.reserved) + list(session.bindings):
            epoch_fence = Fence(fence.session_id, key[0], key[1])
            released.extend(session.bound_requests(epoch_fence))
        del self._live[fence.session_id]
        self._closed[fence.session_id] = fence.incarnation
        self._closed.move_to_end(fence.session_id)
        while len(self._closed) > self._closed_memory:
            self._closed.popitem(last=False)
        return list(dict.fromkeys(released))
