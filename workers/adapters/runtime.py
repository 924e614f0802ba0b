"""The per-session duplex runtime: one session, one adapter, one output sink.

Theory of operation
-------------------
``AdapterRuntime`` turns the adapter contract of ``workers.adapters.base``
into a running session:

- ``push(item)`` calls ``on_input``; when ``should_respond`` then says yes, a
  new *response task* starts with the next response id (1, 2, 3 ...). A new
  response supersedes the one in flight: the old task is cancelled, and any
  chunk it still tries to emit is dropped, so it never emits ``done``.
- Proactive adapters get a notifier. Calling it wakes a *watcher task* that
  re-checks ``should_respond`` when no response is in flight; the watcher is
  also woken after every response that ends on its own (done or error), so a
  wish signalled mid-response, or queued proactive work, is spoken in turn.
  Only input supersedes a response; a wake-up never does.
- ``barge_in()`` cancels the response in flight (its remaining chunks are
  dropped, no ``done``), waits until its task has unwound, then calls
  ``on_barge_in``.
- ``close(graceful=True)`` stops the watcher, lets the response in flight
  finish, calls ``flush``, runs responses while ``should_respond`` holds (at
  most ``max_drain_responses``), then calls ``on_close``. A non-graceful
  close, or a close that is itself cancelled, cancels the response instead and
  calls ``on_close(graceful=False)``.

Output goes to ``sink``, an async callable receiving each tagged chunk in
order (pass ``asyncio.Queue.put`` to read chunks from a queue). A completed
response ends with exactly one ``done``; a response whose stream raises ends
with one ``error`` chunk and no ``done``; a cancelled one ends with nothing.

Failures of the adapter (or of the sink) never end the runtime: they are
logged, reported as an ``error`` chunk where there is a place for one
(``response_id`` 0 for errors outside a response), and the session goes on.

Lifecycle: ``OPEN -> CLOSING -> CLOSED``. ``push`` outside ``OPEN`` raises
``SessionClosedError``; ``barge_in`` after close is a no-op. Every task the
runtime creates is held in an attribute and awaited before ``close`` returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import StrEnum
from types import TracebackType

from schemas.errors import SessionClosedError
from schemas.events import OutputKind
from workers.adapters.base import DuplexAdapter, OutputChunk, ProactiveAdapter

__all__ = ["AdapterRuntime", "OutputSink", "RuntimeState"]

logger = logging.getLogger(__name__)

OutputSink = Callable[[OutputChunk], Awaitable[None]]
"""Receives every chunk the runtime emits, in order."""


class RuntimeState(StrEnum):
    """Lifecycle of one runtime: accepting input, shutting down, finished."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class AdapterRuntime:
    """Drives one ``DuplexAdapter`` for one session and sends its output to a sink."""

    def __init__(
        self,
        adapter: DuplexAdapter,
        session_id: str,
        sink: OutputSink,
        *,
        max_drain_responses: int = 8,
    ) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        if max_drain_responses < 0:
            raise ValueError("max_drain_responses must be >= 0")
        proactive = adapter.capabilities.proactive
        if proactive and not isinstance(adapter, ProactiveAdapter):
            raise TypeError(
                f"{type(adapter).__name__} declares proactive=True but has no set_notifier"
            )
        self._adapter = adapter
        # The same adapter seen through its proactive interface, when it has one.
        self._proactive_adapter = adapter if isinstance(adapter, ProactiveAdapter) else None
        self._session_id = session_id
        self._sink = sink
        self._proactive = proactive
        self._max_drain = max_drain_responses
        self._state = RuntimeState.OPEN
        self._started = False
        # Serialises push/barge_in/the start of close so a barge-in never lands
        # between an input's on_input and the response it triggers.
        self._lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._wake = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._next_response_id = 1
        # The response whose chunks may reach the sink; None when idle.
        self._active: tuple[int, asyncio.Task[None]] | None = None
        # Superseded or cancelled response tasks that have not unwound yet.
        self._retired: set[asyncio.Task[None]] = set()

    # -- public API -------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def state(self) -> RuntimeState:
        return self._state

    @property
    def active_response_id(self) -> int | None:
        """Id of the response in flight, or ``None`` when idle."""
        return self._active[0] if self._active else None

    async def start(self) -> None:
        """Attach the notifier and start the watcher (``push`` does this on demand)."""
        if self._started or self._state is not RuntimeState.OPEN:
            return
        self._started = True
        if self._proactive and self._proactive_adapter is not None:
            self._proactive_adapter.set_notifier(self._session_id, self._wake.set)
            self._watcher = asyncio.create_task(
                self._watch(), name=f"duplexq-watch-{self._session_id}"
            )

    async def push(self, item: object) -> int | None:
        """Feed one input; returns the id of the response it started, if any."""
        await self.start()
        async with self._lock:
            if self._state is not RuntimeState.OPEN:
                raise SessionClosedError(f"session {self._session_id!r} is {self._state.value}")
            if not await self._call_adapter("input", self._adapter.on_input, item):
                return None
            return await self._maybe_respond()

    async def barge_in(self) -> int | None:
        """Cancel the response in flight and drop the adapter's pending work.

        Returns the id of the cancelled response, or ``None`` if none was running.
        """
        async with self._lock:
            if self._state is RuntimeState.CLOSED:
                return None
            cancelled = await self._cancel_responses()
            await self._call_adapter("barge_in", self._adapter.on_barge_in)
            return cancelled

    async def close(self, *, graceful: bool = True) -> None:
        """End the session; see the module docstring for graceful vs not."""
        if self._state is not RuntimeState.OPEN:
            await self._closed.wait()
            return
        self._state = RuntimeState.CLOSING
        clean = False
        try:
            # Let a push or barge-in that is half-way through finish first.
            async with self._lock:
                pass
            await self._stop_watcher()
            if graceful:
                await self._settle()
            clean = True
        finally:
            # Runs on a cancelled close too: nothing of this session keeps running.
            await self._stop_watcher()
            await self._cancel_responses()
            if self._started and self._proactive_adapter is not None:
                self._proactive_adapter.set_notifier(self._session_id, None)
            await self._call_adapter("close", self._close_adapter, graceful and clean)
            self._state = RuntimeState.CLOSED
            self._closed.set()

    async def __aenter__(self) -> AdapterRuntime:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(graceful=exc_type is None)

    # -- responses --------------------------------------------------------

    async def _maybe_respond(self) -> int | None:
        """Ask the adapter; start (superseding) a response if it says yes."""
        try:
            wanted = bool(self._adapter.should_respond(self._session_id))
        except Exception as exc:
            await self._report("should_respond", exc)
            return None
        if not wanted:
            return None
        return self._start_response()[0]

    def _start_response(self) -> tuple[int, asyncio.Task[None]]:
        # Synchronous on purpose: the decision and the start happen in one step.
        self._retire_active()
        response_id = self._next_response_id
        self._next_response_id += 1
        task = asyncio.create_task(
            self._run_response(response_id),
            name=f"duplexq-response-{self._session_id}-{response_id}",
        )
        self._active = (response_id, task)
        return self._active

    def _retire_active(self) -> None:
        if self._active is None:
            return
        _, task = self._active
        self._active = None
        if not task.done():
            task.cancel()
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    async def _cancel_responses(self) -> int | None:
        """Cancel the response in flight and wait until every retired task unwound."""
        cancelled = None
        if self._active is not None and not self._active[1].done():
            cancelled = self._active[0]
        self._retire_active()
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
        return cancelled

    async def _run_response(self, response_id: int) -> None:
        """Body of a response task; never raises except CancelledError."""
        stream: AsyncIterator[OutputChunk] | None = None
        ended = False
        try:
            stream = self._adapter.respond(self._session_id)
            terminal = await self._relay(response_id, stream)
            if terminal.kind is OutputKind.DONE:
                await self._emit(response_id, terminal)
            ended = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("session %s: response %d failed", self._session_id, response_id)
            await self._emit(response_id, _error_chunk("respond", exc))
            ended = True
        finally:
            if stream is not None:
                await _close_stream(stream)
            if self._active is not None and self._active[0] == response_id:
                self._active = None
            if ended and self._proactive:
                self._wake.set()

    async def _relay(self, response_id: int, stream: AsyncIterator[OutputChunk]) -> OutputChunk:
        """Forward deltas; return the terminal chunk (the stream's own, or a fresh done)."""
        async for chunk in stream:
            if not isinstance(chunk, OutputChunk):
                raise TypeError(f"respond() yielded {type(chunk).__name__}, not OutputChunk")
            if chunk.kind is OutputKind.ERROR:
                # The adapter reported the failure itself: it is this response's end.
                await self._emit(response_id, chunk)
                return chunk
            if chunk.kind is OutputKind.DONE:
                return chunk
            await self._emit(response_id, chunk)
        return OutputChunk.done()

    async def _emit(self, response_id: int, chunk: OutputChunk) -> None:
        # Chunks of a superseded or barged-in response are dropped here.
        if self._active is None or self._active[0] != response_id:
            return
        await self._deliver(chunk.tagged(response_id))

    async def _deliver(self, chunk: OutputChunk) -> None:
        try:
            await self._sink(chunk)
        except Exception:
            logger.exception("session %s: output sink failed; chunk dropped", self._session_id)

    # -- watcher and close ------------------------------------------------

    async def _watch(self) -> None:
        """Re-check ``should_respond`` whenever the adapter or a response signals."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._state is not RuntimeState.OPEN:
                return
            if self._active is not None:
                # A wake-up never supersedes: the response in flight may not even
                # have taken its work yet. Its end wakes us again to re-check.
                continue
            await self._maybe_respond()

    async def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _settle(self) -> None:
        """Graceful part of close: finish, flush, then speak what is left."""
        if self._active is not None:
            await asyncio.wait({self._active[1]})
        await self._call_adapter("flush", self._adapter.flush)
        for _ in range(self._max_drain):
            if await self._maybe_respond() is None:
                return
            assert self._active is not None
            await asyncio.wait({self._active[1]})
        if self._max_drain and self._adapter_wants_more():
            logger.warning(
                "session %s: adapter still wants to respond after %d drain responses",
                self._session_id,
                self._max_drain,
            )

    def _adapter_wants_more(self) -> bool:
        try:
            return bool(self._adapter.should_respond(self._session_id))
        except Exception:
            return False

    async def _close_adapter(self, session_id: str, graceful: bool) -> None:
        await self._adapter.on_close(session_id, graceful=graceful)

    # -- failure reporting ------------------------------------------------

    async def _call_adapter(
        self, phase: str, method: Callable[..., Awaitable[None]], *args: object
    ) -> bool:
        """Await ``method(session_id, *args)``; report a failure instead of raising."""
        try:
            await method(self._session_id, *args)
        except Exception as exc:
            await self._report(phase, exc)
            return False
        return True

    async def _report(self, phase: str, exc: Exception) -> None:
        logger.error(
            "session %s: adapter %s failed: %r", self._session_id, phase, exc, exc_info=exc
        )
        await self._deliver(_error_chunk(phase, exc))


def _error_chunk(phase: str, exc: BaseException) -> OutputChunk:
    return OutputChunk.error(
        str(exc) or type(exc).__name__, phase=phase, exception=type(exc).__name__
    )


async def _close_stream(stream: AsyncIterator[OutputChunk]) -> None:
    """``aclose()`` the stream if it can be closed; its errors are only logged."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("respond() stream failed while closing")
