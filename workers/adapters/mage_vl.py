"""Mage-VL: the proactive video adapter (rolling windows, cognition gate).

By default it behaves as the upstream Mage-VL adapter (vLLM-Omni); the
differences are opt-in options, listed at the end. Per session:

- Video input becomes a ``VisualWindow`` kept in a list of at most
  ``max_windows`` (oldest dropped). Text input, stripped, becomes the pending
  query (a newer one replaces an unanswered older one); blank text is
  ignored.
- Once ``window_size`` windows exist and a ``gate`` is injected, every new
  window schedules a *gate task*: ``gate(session_id, windows)``, sync or
  async, judges the latest ``window_size`` windows as they are when the task
  runs. A failure is logged and the session goes on.
- A positive decision whose ``event_id`` was not accepted before in this
  session takes the session's one decision slot: a newer decision replaces
  an older one not yet spoken (the latest wins). Each event is accepted at
  most once. The runtime is then notified.
- ``should_respond``: a query is pending and windows exist, or a positive
  decision waits in the slot.
- ``respond`` takes the pending query and the decision together (both are
  cleared) and makes one ``generate(session_id, windows, query, decision)``
  call over the last ``window_size`` windows. ``generate`` may return text,
  an ``OutputChunk``, a list or a (sync or async) iterator of those, or an
  awaitable of any of them; plain pieces become deltas of
  ``output_modality`` (text as text deltas, bytes as audio deltas). Without
  ``generate``, a decision's text is spoken as is (a text delta) and a query
  alone gives an empty response.
- Barge-in clears the query and the decision slot and cancels the gate
  tasks; windows and the accepted events stay.
- ``flush`` waits for gate tasks so the decision they produce is pending;
  ``on_close`` (graceful) waits for them too, non-graceful cancels them, and
  then the session is forgotten.

Options beyond upstream (off by default):

- ``max_gate_tasks``: at most this many gate calls per session at once; a
  window arriving past that is not gated (the next window covers the same
  moment). Bounds the engine load one fast video stream can cause.
- ``hold_decisions_while_responding``: a waiting decision does not make
  ``should_respond`` true while this adapter's response streams, so input
  arriving meanwhile never cuts a proactive remark or an answer short with
  another remark; a new question still does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Any

from workers.adapters.base import AdapterCapabilities, Notifier, OutputChunk
from workers.adapters.mage_vl_types import (
    GateDecision,
    VisualWindow,
    coerce_decision,
    parse_input,
)

__all__ = ["OUTPUT_MODALITIES", "GateFn", "GenerateFn", "MageVLAdapter"]

logger = logging.getLogger(__name__)

GateFn = Callable[[str, tuple[VisualWindow, ...]], object]
"""``gate(session_id, windows)``: a decision, mapping, bool, string or None, or an awaitable."""

GenerateFn = Callable[[str, tuple[VisualWindow, ...], str | None, GateDecision | None], object]
"""``generate(session_id, windows, query, decision)``: text, chunks or an iterator of them."""

OUTPUT_MODALITIES = frozenset({"text", "audio"})
"""What ``output_modality`` may name: the kind of delta plain pieces become."""


class _Session:
    """Everything Mage-VL knows about one session; dropped on close."""

    __slots__ = (
        "decision",
        "gate_tasks",
        "generation",
        "notify",
        "query",
        "responding",
        "seen_events",
        "windows",
    )

    def __init__(self) -> None:
        self.windows: list[VisualWindow] = []
        self.query: str | None = None
        self.decision: GateDecision | None = None
        self.seen_events: set[str] = set()
        self.gate_tasks: set[asyncio.Task[None]] = set()
        self.notify: Notifier | None = None
        # Token of the respond() stream now running; None when not responding.
        self.responding: object | None = None
        # Bumped by barge-in: gate answers from an older generation are ignored.
        self.generation = 0


class MageVLAdapter:
    """Proactive video stage adapter; the model calls are injected (see module docs)."""

    def __init__(
        self,
        gate: GateFn | None = None,
        generate: GenerateFn | None = None,
        *,
        window_size: int = 4,
        max_windows: int = 64,
        output_modality: str = "text",
        max_gate_tasks: int | None = None,
        hold_decisions_while_responding: bool = False,
    ) -> None:
        for name, value in (
            ("window_size", window_size),
            ("max_windows", max_windows),
            ("max_gate_tasks", 1 if max_gate_tasks is None else max_gate_tasks),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window_size > max_windows:
            raise ValueError(f"window_size ({window_size}) exceeds max_windows ({max_windows})")
        if output_modality not in OUTPUT_MODALITIES:
            raise ValueError(
                f"output_modality must be one of {sorted(OUTPUT_MODALITIES)}, "
                f"got {output_modality!r}"
            )
        self._gate = gate
        self._generate = generate
        self._window_size = window_size
        self._max_windows = max_windows
        self._output_modality = output_modality
        self._max_gate_tasks = max_gate_tasks
        self._hold = hold_decisions_while_responding
        self._sessions: dict[str, _Session] = {}
        self.capabilities = AdapterCapabilities(
            input_modalities=frozenset({"text", "video"}),
            output_modalities=frozenset({output_modality}),
            proactive=True,
        )

    # -- introspection ----------------------------------------------------

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def windows(self, session_id: str) -> tuple[VisualWindow, ...]:
        """The session's retained windows, oldest first (empty if unknown)."""
        state = self._sessions.get(session_id)
        return tuple(state.windows) if state else ()

    def pending_decision(self, session_id: str) -> GateDecision | None:
        """The decision waiting in the session's slot, if any."""
        state = self._sessions.get(session_id)
        return state.decision if state else None

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
            return  # a commit or blank text: nothing to keep
        state = self._session(session_id)
        if isinstance(parsed, str):
            state.query = parsed
            return
        state.windows.append(parsed)
        if len(state.windows) > self._max_windows:
            del state.windows[: len(state.windows) - self._max_windows]
        self._schedule_gate(session_id, state)

    def should_respond(self, session_id: str) -> bool:
        state = self._sessions.get(session_id)
        if state is None:
            return False
        if state.query is not None and state.windows:
            return True
        if self._hold and state.responding is not None:
            return False
        return state.decision is not None and state.decision.respond

    async def respond(self, session_id: str) -> AsyncIterator[OutputChunk]:
        state = self._sessions.get(session_id)
        if state is None or (state.query is None and state.decision is None):
            return
        query, decision = state.query, state.decision
        state.query = state.decision = None
        token = object()
        state.responding = token
        try:
            # aclosing: when the runtime stops this stream early, the nested
            # generators (and generate()'s iterator) are closed right away too.
            chunks = self._speak(session_id, state, query, decision)
            async with contextlib.aclosing(chunks) as stream:
                async for chunk in stream:
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
        state.decision = None
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
            state = _Session()
            self._sessions[session_id] = state
        return state

    def _latest(self, state: _Session) -> tuple[VisualWindow, ...]:
        """The latest ``window_size`` windows (fewer if fewer exist)."""
        return tuple(state.windows[-self._window_size :])

    def _schedule_gate(self, session_id: str, state: _Session) -> None:
        if self._gate is None or len(state.windows) < self._window_size:
            return
        if self._max_gate_tasks is not None and len(state.gate_tasks) >= self._max_gate_tasks:
            logger.debug("session %s: gate busy, window not evaluated", session_id)
            return
        task = asyncio.create_task(
            self._evaluate(session_id, state, state.generation),
            name=f"mage-vl-gate-{session_id}",
        )
        state.gate_tasks.add(task)
        task.add_done_callback(state.gate_tasks.discard)

    async def _evaluate(self, session_id: str, state: _Session, generation: int) -> None:
        """Body of a gate task; never raises except CancelledError."""
        assert self._gate is not None
        try:
            answer = await _resolve(self._gate(session_id, self._latest(state)))
            decision = coerce_decision(answer)
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

    @staticmethod
    def _accept(state: _Session, decision: GateDecision) -> bool:
        """Put a positive, not-yet-seen decision in the slot; True if it took it."""
        if not decision.respond:
            return False
        if decision.event_id is not None:
            if decision.event_id in state.seen_events:
                return False
            state.seen_events.add(decision.event_id)
        state.decision = decision
        return True

    # -- speaking ---------------------------------------------------------

    async def _speak(
        self,
        session_id: str,
        state: _Session,
        query: str | None,
        decision: GateDecision | None,
    ) -> AsyncGenerator[OutputChunk, None]:
        metadata: dict[str, object] = {"trigger": "query" if query is not None else "gate"}
        if decision is not None and decision.event_id is not None:
            metadata["event_id"] = decision.event_id
        if self._generate is not None:
            result = self._generate(session_id, self._latest(state), query, decision)
            async with contextlib.aclosing(_pieces(result)) as pieces:
                async for piece in pieces:
                    chunk = self._as_chunk(piece)
                    if chunk is not None:
                        yield chunk
        elif decision is not None and decision.text:
            # The gate's own words: text whatever the output modality.
            yield OutputChunk.text_delta(decision.text)
        yield OutputChunk.done(**metadata)

    def _as_chunk(self, piece: object) -> OutputChunk | None:
        """A chunk of ``output_modality`` for a plain piece; None for an empty one."""
        if isinstance(piece, OutputChunk):
            return piece
        if self._output_modality == "text" and isinstance(piece, str):
            return OutputChunk.text_delta(piece) if piece else None
        if self._output_modality == "audio" and isinstance(piece, bytes):
            return OutputChunk.audio_delta(piece) if piece else None
        raise TypeError(
            f"generate() gave a {type(piece).__name__}; a {self._output_modality} adapter takes "
            f"{'str' if self._output_modality == 'text' else 'bytes'} or OutputChunk"
        )


async def _resolve(value: object) -> object:
    return await value if inspect.isawaitable(value) else value


async def _pieces(result: object) -> AsyncGenerator[object, None]:
    """generate()'s result, however shaped, as a stream of pieces."""
    resolved: Any = await _resolve(result)
    if isinstance(resolved, str | bytes | OutputChunk):
        yield resolved
        return
    if hasattr(resolved, "__aiter__"):
        try:
            async for piece in resolved:
                yield piece
        finally:
            aclose = getattr(resolved, "aclose", None)
            if aclose is not None:
                await aclose()
        return
    if not isinstance(resolved, Iterable):
        raise TypeError(f"generate() returned {type(resolved).__name__}, not text or chunks")
    for piece in resolved:
        yield piece


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
