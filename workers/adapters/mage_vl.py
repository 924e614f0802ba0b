"""Mage-VL: the proactive video adapter (rolling windows, cognition gate).

Theory of operation, per session:

- Video input becomes a ``VisualWindow`` kept in a rolling deque of
  ``max_windows``. Text input sets the pending query (a newer one replaces
  an older one that has not been answered yet).
- Once ``window_size`` windows exist, every new window schedules a *gate
  task*: the injected ``gate(session_id, windows, None)`` looks at the latest
  ``window_size`` windows and answers whether something worth saying happened.
  Gate tasks belong to the session; at most ``max_gate_tasks`` run at once (a
  window arriving past that skips its evaluation: the next window covers the
  same moment). A gate failure is logged and the session goes on.
- A positive decision is queued (at most ``max_pending_decisions``, oldest
  dropped) unless its ``event_id`` was already accepted in this session: each
  event speaks at most once. The runtime is then notified.
- ``should_respond`` is true when a query is pending and windows exist (the
  gate's opinion does not matter for an explicit question), or when a
  decision is queued and no response of this adapter is streaming: a
  proactive remark never cuts into a response, while a new question does.
- ``respond`` takes one job, the query first, else the oldest decision.
  With ``generate`` injected it streams ``generate(windows, cue)`` where the
  cue is the query string or the ``GateDecision`` and ``windows`` is the whole
  retained history. Without it, a decision's text is spoken as is, and a
  query is put to the gate (``gate(session_id, windows, query)``) whose text
  is the answer; a silent gate gives an empty response (``done`` only, with
  ``answered=False``). Decisions that could not be voiced (no text, no
  ``generate``) are dropped when they arrive.
- Barge-in clears the query and queued decisions and cancels gate tasks;
  windows and the set of spoken events stay.
- ``flush`` waits for gate tasks so decisions they produce are queued;
  ``on_close`` (graceful) waits for them too, non-graceful cancels them, and
  then the session is forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from workers.adapters.base import AdapterCapabilities, Notifier, OutputChunk
from workers.adapters.mage_vl_types import (
    GateDecision,
    VisualWindow,
    coerce_decision,
    parse_input,
)

__all__ = ["GateFn", "GenerateFn", "MageVLAdapter"]

logger = logging.getLogger(__name__)

GateFn = Callable[[str, tuple[VisualWindow, ...], str | None], Awaitable[object]]
"""``gate(session_id, windows, query)``: a decision, mapping, bool, string or None."""

GenerateFn = Callable[
    [tuple[VisualWindow, ...], str | GateDecision], Awaitable[str] | AsyncIterator[str]
]
"""``generate(windows, cue)``: the full text, or an async iterator of text pieces."""

MAGE_VL_CAPABILITIES = AdapterCapabilities(
    input_modalities=frozenset({"text", "video"}),
    output_modalities=frozenset({"text"}),
    proactive=True,
)


@dataclass(frozen=True, slots=True)
class _Job:
    """One response's work: an explicit query or a queued gate decision."""

    query: str | None = None
    decision: GateDecision | None = None


class _Session:
    """Everything Mage-VL knows about one session; dropped on close."""

    __slots__ = (
        "decisions",
        "gate_tasks",
        "generation",
        "notify",
        "query",
        "responding",
        "seen_events",
        "windows",
    )

    def __init__(self, max_windows: int, max_decisions: int) -> None:
        self.windows: deque[VisualWindow] = deque(maxlen=max_windows)
        self.query: str | None = None
        self.decisions: deque[GateDecision] = deque(maxlen=max_decisions)
        self.seen_events: set[str] = set()
        self.gate_tasks: set[asyncio.Task[None]] = set()
        self.notify: Notifier | None = None
        # Token of the respond() stream now running; None when not responding.
        self.responding: object | None = None
        # Bumped by barge-in: gate answers from an older generation are ignored.
        self.generation = 0


class MageVLAdapter:
    """Proactive video stage adapter; the model calls are injected (see module docs)."""

    capabilities = MAGE_VL_CAPABILITIES

    def __init__(
        self,
        gate: GateFn,
        generate: GenerateFn | None = None,
        *,
        window_size: int = 4,
        max_windows: int = 16,
        max_gate_tasks: int = 4,
        max_pending_decisions: int = 8,
    ) -> None:
        for name, value in (
            ("window_size", window_size),
            ("max_windows", max_windows),
            ("max_gate_tasks", max_gate_tasks),
            ("max_pending_decisions", max_pending_decisions),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window_size > max_windows:
            raise ValueError(f"window_size ({window_size}) exceeds max_windows ({max_windows})")
        self._gate = gate
        self._generate = generate
        self._window_size = window_size
        self._max_windows = max_windows
        self._max_gate_tasks = max_gate_tasks
        self._max_decisions = max_pending_decisions
        self._sessions: dict[str, _Session] = {}

    # -- introspection ----------------------------------------------------

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def windows(self, session_id: str) -> tuple[VisualWindow, ...]:
        """The session's retained windows, oldest first (empty if unknown)."""
        state = self._sessions.get(session_id)
        return tuple(state.windows) if state else ()

    def gate_tasks_in_flight(self, session_id: str) -> int:
        state = self._sessions.get(session_id)
        return len(state.gate_tasks) if state else 0

    # -- adapter contract -------------------------------------------------

    def set_notifier(self, session_id: str, notify: Notifier | None) -> None:
        if notify is None:
            state = self._sessions.get(session_id)
            if state is not None:
                state.notify = None
            return
        self._session(session_id).notify = notify

    async def on_input(self, session_id: str, item: object) -> None:
        # Parse before touching state, so a bad input changes nothing.
        parsed = parse_input(item)
        if parsed is None:
            return  # a turn commit: a pending query is answerable without one
        state = self._session(session_id)
        if isinstance(parsed, str):
            state.query = parsed
            return
        state.windows.append(parsed)
        if len(state.windows) >= self._window_size:
            self._schedule_gate(session_id, state)

    def should_respond(self, session_id: str) -> bool:
        state = self._sessions.get(session_id)
        if state is None:
            return False
        if state.query is not None and state.windows:
            return True
        return bool(state.decisions) and state.responding is None

    async def respond(self, session_id: str) -> AsyncIterator[OutputChunk]:
        state = self._sessions.get(session_id)
        job = _take_job(state) if state is not None else None
        if state is None or job is None:
            return
        token = object()
        state.responding = token
        try:
            # aclosing: when the runtime stops this stream early, the nested
            # generators (and generate()'s iterator) are closed right away too.
            async with contextlib.aclosing(self._speak(session_id, state, job)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            # A superseding respond() may already own the flag; leave it then.
            if state.responding is token:
                state.responding = None

    async def on_barge_in(self, session_id: str) -> None:
        state = self._sessions.get(session_id)
        if state is None:
            return
        state.generation += 1
        state.query = None
        state.decisions.clear()
        await _cancel_tasks(state.gate_tasks)

    async def flush(self, session_id: str) -> None:
        state = self._sessions.get(session_id)
        if state is not None:
            await _wait_tasks(state.gate_tasks)

    async def on_close(self, session_id: str, *, graceful: bool) -> None:
        state = self._sessions.get(session_id)
        if state is None:
            return
        try:
            if graceful:
                await _wait_tasks(state.gate_tasks)
        finally:
            # Also on a cancelled graceful close: no gate task outlives the session.
            await _cancel_tasks(state.gate_tasks)
            if self._sessions.get(session_id) is state:
                del self._sessions[session_id]

    # -- gate -------------------------------------------------------------

    def _session(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            if not isinstance(session_id, str) or not session_id:
                raise ValueError("session_id must be a non-empty string")
            state = _Session(self._max_windows, self._max_decisions)
            self._sessions[session_id] = state
        return state

    def _gate_view(self, state: _Session) -> tuple[VisualWindow, ...]:
        """The latest ``window_size`` windows (fewer if fewer exist)."""
        return tuple(state.windows)[-self._window_size :]

    def _schedule_gate(self, session_id: str, state: _Session) -> None:
        if len(state.gate_tasks) >= self._max_gate_tasks:
            logger.debug("session %s: gate busy, window not evaluated", session_id)
            return
        task = asyncio.create_task(
            self._evaluate(session_id, state, state.generation, self._gate_view(state)),
            name=f"mage-vl-gate-{session_id}",
        )
        state.gate_tasks.add(task)
        task.add_done_callback(state.gate_tasks.discard)

    async def _evaluate(
        self,
        session_id: str,
        state: _Session,
        generation: int,
        windows: tuple[VisualWindow, ...],
    ) -> None:
        """Body of a gate task; never raises except CancelledError."""
        try:
            decision = coerce_decision(await self._gate(session_id, windows, None))
        except Exception:
            logger.exception("session %s: cognition gate failed", session_id)
            return
        if self._sessions.get(session_id) is not state or state.generation != generation:
            return  # the session was closed or barged in while the gate ran
        if self._accept(state, decision) and state.notify is not None:
            try:
                state.notify()
            except Exception:
                logger.exception("session %s: notifier failed", session_id)

    def _accept(self, state: _Session, decision: GateDecision) -> bool:
        """Queue a positive, voiceable, not-yet-seen decision; True if queued."""
        if not decision.respond:
            return False
        if self._generate is None and not decision.text:
            logger.debug("gate decision without text and no generate(): nothing to say")
            return False
        if decision.event_id is not None:
            if decision.event_id in state.seen_events:
                return False
            state.seen_events.add(decision.event_id)
        state.decisions.append(decision)
        return True

    # -- speaking ---------------------------------------------------------

    async def _speak(
        self, session_id: str, state: _Session, job: _Job
    ) -> AsyncGenerator[OutputChunk, None]:
        history = tuple(state.windows)
        metadata: dict[str, object] = {"trigger": "query" if job.query is not None else "gate"}
        if job.query is not None:
            if self._generate is not None:
                async with contextlib.aclosing(self._generated(history, job.query)) as pieces:
                    async for piece in pieces:
                        yield OutputChunk.text_delta(piece)
            else:
                answer = coerce_decision(
                    await self._gate(session_id, self._gate_view(state), job.query)
                )
                if answer.event_id is not None:
                    # The answer covered this event; the proactive path need not repeat it.
                    state.seen_events.add(answer.event_id)
                if answer.respond and answer.text:
                    yield OutputChunk.text_delta(answer.text)
                else:
                    metadata["answered"] = False
        else:
            assert job.decision is not None
            decision = job.decision
            if decision.event_id is not None:
                metadata["event_id"] = decision.event_id
            if self._generate is not None:
                async with contextlib.aclosing(self._generated(history, decision)) as pieces:
                    async for piece in pieces:
                        yield OutputChunk.text_delta(piece)
            else:
                yield OutputChunk.text_delta(decision.text)
        yield OutputChunk.done(**metadata)

    async def _generated(
        self, windows: tuple[VisualWindow, ...], cue: str | GateDecision
    ) -> AsyncGenerator[str, None]:
        """Normalise generate()'s result (text, awaitable, async iterator) to pieces."""
        assert self._generate is not None
        result: object = self._generate(windows, cue)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, str):
            if result:
                yield result
            return
        if not hasattr(result, "__aiter__"):
            raise TypeError(f"generate() returned {type(result).__name__}, not text")
        try:
            async for piece in result:
                if not isinstance(piece, str):
                    raise TypeError(f"generate() yielded {type(piece).__name__}, not str")
                if piece:
                    yield piece
        finally:
            aclose = getattr(result, "aclose", None)
            if aclose is not None:
                await aclose()


def _take_job(state: _Session) -> _Job | None:
    if state.query is not None and state.windows:
        query, state.query = state.query, None
        return _Job(query=query)
    if state.decisions:
        return _Job(decision=state.decisions.popleft())
    return None


async def _wait_tasks(tasks: set[asyncio.Task[None]]) -> None:
    # Done callbacks shrink the set; wait on a copy until nothing is pending.
    while pending := {task for task in tasks if not task.done()}:
        await asyncio.wait(pending)


async def _cancel_tasks(tasks: set[asyncio.Task[None]]) -> None:
    pending = set(tasks)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
