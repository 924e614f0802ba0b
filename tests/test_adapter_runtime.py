"""AdapterRuntime against a scripted adapter: supersede, barge-in, close, errors."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from schemas.errors import SessionClosedError
from schemas.events import OutputKind
from workers.adapters.base import (
    AdapterCapabilities,
    DuplexAdapter,
    OutputChunk,
    ProactiveAdapter,
)
from workers.adapters.runtime import AdapterRuntime, RuntimeState

SID = "sess-1"
CAPS = AdapterCapabilities(frozenset({"text"}), frozenset({"text"}))


class Collector:
    """Sink that records chunks and lets a test wait for a condition on them."""

    def __init__(self) -> None:
        self.chunks: list[OutputChunk] = []
        self._changed = asyncio.Condition()

    async def __call__(self, chunk: OutputChunk) -> None:
        async with self._changed:
            self.chunks.append(chunk)
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[list[OutputChunk]], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self.chunks))

    def of(self, response_id: int) -> list[OutputChunk]:
        return [c for c in self.chunks if c.response_id == response_id]

    def texts(self, response_id: int) -> list[str]:
        return [c.text for c in self.of(response_id) if c.kind is OutputKind.TEXT_DELTA]

    def kinds(self, response_id: int) -> list[OutputKind]:
        return [c.kind for c in self.of(response_id)]


class ScriptedAdapter:
    """Responds to inputs starting with "q"; each response follows a queued script.

    A script step is an OutputChunk (yielded), an asyncio.Event (awaited) or an
    exception (raised). ``log`` records the calls the runtime made, in order.
    """

    capabilities = CAPS

    def __init__(self) -> None:
        self.scripts: deque[list[Any]] = deque()
        self.log: list[str] = []
        self.want = False
        self.fail_input = False
        self.want_after_flush = 0
        self.swallow_cancel = False

    async def on_input(self, session_id: str, item: object) -> None:
        self.log.append(f"input:{item}")
        if self.fail_input:
            raise ValueError("bad input")
        self.want = isinstance(item, str) and item.startswith("q")

    def should_respond(self, session_id: str) -> bool:
        return self.want

    async def respond(self, session_id: str) -> AsyncIterator[OutputChunk]:
        self.want = False
        script = self.scripts.popleft() if self.scripts else [OutputChunk.text_delta("hi")]
        number = sum(entry.startswith("respond") for entry in self.log) + 1
        self.log.append(f"respond:{number}")
        try:
            for step in script:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                elif isinstance(step, BaseException):
                    raise step
                else:
                    yield step
        except asyncio.CancelledError:
            self.log.append(f"cancelled:{number}")
            if not self.swallow_cancel:
                raise
            yield OutputChunk.text_delta("late")
        finally:
            self.log.append(f"closed:{number}")

    async def on_barge_in(self, session_id: str) -> None:
        self.log.append("barge_in")
        self.want = False

    async def flush(self, session_id: str) -> None:
        self.log.append("flush")
        if self.want_after_flush:
            self.want = True

    async def on_close(self, session_id: str, *, graceful: bool) -> None:
        self.log.append(f"on_close:{graceful}")


class ProactiveScripted(ScriptedAdapter):
    """Scripted adapter that can ask to speak: ``request()`` queues one response."""

    capabilities = AdapterCapabilities(frozenset({"text"}), frozenset({"text"}), proactive=True)

    def __init__(self) -> None:
        super().__init__()
        self.notify: Callable[[], None] | None = None
        self.queued = 0

    def set_notifier(self, session_id: str, notify: Callable[[], None] | None) -> None:
        self.log.append(f"notifier:{notify is not None}")
        self.notify = notify

    def request(self, count: int = 1) -> None:
        self.queued += count
        assert self.notify is not None
        self.notify()

    def should_respond(self, session_id: str) -> bool:
        return self.want or self.queued > 0

    async def respond(self, session_id: str) -> AsyncIterator[OutputChunk]:
        if self.queued:
            self.queued -= 1
        async for chunk in super().respond(session_id):
            yield chunk


def delta(text: str) -> OutputChunk:
    return OutputChunk.text_delta(text)


def has_terminal(response_id: int) -> Callable[[list[OutputChunk]], bool]:
    return lambda chunks: any(c.response_id == response_id and c.terminal for c in chunks)


async def settle(rounds: int = 5) -> None:
    """Give other tasks a few scheduling turns (no timing involved)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_adapters_satisfy_protocols() -> None:
    assert isinstance(ScriptedAdapter(), DuplexAdapter)
    assert not isinstance(ScriptedAdapter(), ProactiveAdapter)
    assert isinstance(ProactiveScripted(), ProactiveAdapter)


async def test_response_is_tagged_and_ends_with_one_done() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.scripts.append([delta("a"), delta("b")])
    runtime = AdapterRuntime(adapter, SID, sink)
    assert await runtime.push("noise") is None
    assert await runtime.push("question") == 1
    await sink.wait_until(has_terminal(1))
    assert sink.kinds(1) == [OutputKind.TEXT_DELTA, OutputKind.TEXT_DELTA, OutputKind.DONE]
    assert sink.texts(1) == ["a", "b"]
    assert runtime.active_response_id is None
    await runtime.close()
    assert runtime.state is RuntimeState.CLOSED


async def test_new_response_supersedes_and_old_one_emits_nothing_more() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    gate = asyncio.Event()
    adapter.scripts.extend([[delta("old-1"), gate, delta("old-2")], [delta("new")]])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q1")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    assert await runtime.push("q2") == 2
    await sink.wait_until(has_terminal(2))
    gate.set()
    await runtime.close()
    assert sink.texts(1) == ["old-1"]
    assert OutputKind.DONE not in sink.kinds(1)
    assert sink.kinds(2) == [OutputKind.TEXT_DELTA, OutputKind.DONE]
    assert "cancelled:1" in adapter.log


async def test_superseded_stream_that_ignores_cancellation_is_still_dropped() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.swallow_cancel = True
    gate = asyncio.Event()
    adapter.scripts.extend([[delta("old"), gate], [delta("new")]])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q1")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    await runtime.push("q2")
    await sink.wait_until(has_terminal(2))
    await runtime.close()
    # The old stream yielded "late" and ended normally, but it had been superseded.
    assert sink.texts(1) == ["old"]
    assert "late" not in [c.text for c in sink.chunks]
    assert [c.kind for c in sink.chunks].count(OutputKind.DONE) == 1


async def test_barge_in_cancels_drops_deltas_and_emits_no_done() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    gate = asyncio.Event()
    adapter.scripts.append([delta("start"), gate, delta("after")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    assert await runtime.barge_in() == 1
    # The response unwound before the adapter heard about the barge-in.
    assert adapter.log.index("closed:1") < adapter.log.index("barge_in")
    gate.set()
    await settle()
    assert sink.texts(1) == ["start"]
    assert OutputKind.DONE not in sink.kinds(1)
    assert await runtime.barge_in() is None
    await runtime.close()


async def test_graceful_close_waits_for_the_response_in_flight() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    gate = asyncio.Event()
    adapter.scripts.append([delta("a"), gate, delta("b")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    closing = asyncio.create_task(runtime.close(graceful=True))
    await settle()
    assert not closing.done()
    assert runtime.state is RuntimeState.CLOSING
    assert "flush" not in adapter.log
    with pytest.raises(SessionClosedError):
        await runtime.push("q-late")
    gate.set()
    await closing
    assert sink.texts(1) == ["a", "b"]
    assert sink.kinds(1)[-1] is OutputKind.DONE
    assert adapter.log[-2:] == ["flush", "on_close:True"]


async def test_graceful_close_runs_what_flush_left_pending() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.want_after_flush = 1
    adapter.scripts.append([delta("last words")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.close()
    assert sink.texts(1) == ["last words"]
    assert sink.kinds(1)[-1] is OutputKind.DONE
    assert adapter.log.index("closed:1") < adapter.log.index("on_close:True")


async def test_non_graceful_close_cancels_the_response() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    gate = asyncio.Event()
    adapter.scripts.append([delta("a"), gate, delta("b")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    await runtime.close(graceful=False)
    assert "cancelled:1" in adapter.log
    assert "flush" not in adapter.log
    assert adapter.log[-1] == "on_close:False"
    assert sink.kinds(1) == [OutputKind.TEXT_DELTA]
    await runtime.close()  # idempotent


async def test_cancelled_close_falls_back_to_non_graceful() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    gate = asyncio.Event()
    adapter.scripts.append([gate])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await settle()
    closing = asyncio.create_task(runtime.close())
    await settle()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert runtime.state is RuntimeState.CLOSED
    assert "cancelled:1" in adapter.log
    assert adapter.log[-1] == "on_close:False"


async def test_respond_exception_gives_error_chunk_and_runtime_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.scripts.extend([[delta("x"), RuntimeError("model exploded")], [delta("ok")]])
    runtime = AdapterRuntime(adapter, SID, sink)
    with caplog.at_level(logging.ERROR):
        await runtime.push("q1")
        await sink.wait_until(has_terminal(1))
    assert sink.kinds(1) == [OutputKind.TEXT_DELTA, OutputKind.ERROR]
    error = sink.of(1)[-1]
    assert error.text == "model exploded"
    assert error.metadata["phase"] == "respond"
    assert "response 1 failed" in caplog.text
    await runtime.push("q2")
    await sink.wait_until(has_terminal(2))
    assert sink.kinds(2) == [OutputKind.TEXT_DELTA, OutputKind.DONE]
    await runtime.close()


async def test_adapter_error_chunk_ends_response_without_done() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.scripts.append([delta("x"), OutputChunk.error("gave up"), delta("never")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(has_terminal(1))
    await runtime.close()
    assert sink.kinds(1) == [OutputKind.TEXT_DELTA, OutputKind.ERROR]
    assert "closed:1" in adapter.log


async def test_adapter_done_is_merged_into_the_single_done() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    adapter.scripts.append([delta("x"), OutputChunk.done(reason="eos"), delta("never")])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(has_terminal(1))
    await runtime.close()
    assert sink.kinds(1) == [OutputKind.TEXT_DELTA, OutputKind.DONE]
    assert sink.of(1)[-1].metadata["reason"] == "eos"


async def test_input_error_is_reported_and_session_continues() -> None:
    adapter, sink = ScriptedAdapter(), Collector()
    runtime = AdapterRuntime(adapter, SID, sink)
    adapter.fail_input = True
    assert await runtime.push("q") is None
    assert [(c.kind, c.response_id, c.metadata["phase"]) for c in sink.chunks] == [
        (OutputKind.ERROR, 0, "input")
    ]
    adapter.fail_input = False
    assert await runtime.push("q") == 1
    await sink.wait_until(has_terminal(1))
    await runtime.close()


async def test_sink_failure_does_not_stop_the_runtime(caplog: pytest.LogCaptureFixture) -> None:
    adapter, seen = ScriptedAdapter(), Collector()
    adapter.scripts.append([delta("a"), delta("b")])

    async def flaky(chunk: OutputChunk) -> None:
        if chunk.text == "a":
            raise ConnectionError("client went away")
        await seen(chunk)

    runtime = AdapterRuntime(adapter, SID, flaky)
    with caplog.at_level(logging.ERROR):
        await runtime.push("q")
        await seen.wait_until(has_terminal(1))
    assert seen.kinds(1) == [OutputKind.TEXT_DELTA, OutputKind.DONE]
    assert "output sink failed" in caplog.text
    await runtime.close()


async def test_queue_sink() -> None:
    adapter, queue = ScriptedAdapter(), asyncio.Queue[OutputChunk]()
    runtime = AdapterRuntime(adapter, SID, queue.put)
    await runtime.push("q")
    first, second = await queue.get(), await queue.get()
    assert (first.text, second.kind, second.response_id) == ("hi", OutputKind.DONE, 1)
    await runtime.close()


async def test_proactive_notify_starts_a_response_without_input() -> None:
    adapter, sink = ProactiveScripted(), Collector()
    adapter.scripts.extend([[delta("one")], [delta("two")]])
    async with AdapterRuntime(adapter, SID, sink) as runtime:
        assert adapter.log == ["notifier:True"]
        adapter.request(count=2)
        # The second queued response runs after the first completes, unprompted.
        await sink.wait_until(has_terminal(2))
        assert runtime.state is RuntimeState.OPEN
    assert sink.texts(1) == ["one"]
    assert sink.texts(2) == ["two"]
    assert [c.kind for c in sink.chunks].count(OutputKind.DONE) == 2
    assert adapter.log[-2:] == ["notifier:False", "on_close:True"]


async def test_proactive_wish_waits_for_the_response_in_flight() -> None:
    adapter, sink = ProactiveScripted(), Collector()
    gate = asyncio.Event()
    adapter.scripts.extend([[delta("answer"), gate], [delta("remark")]])
    runtime = AdapterRuntime(adapter, SID, sink)
    await runtime.push("q")
    await sink.wait_until(lambda chunks: len(chunks) == 1)
    adapter.request()
    await settle()
    assert runtime.active_response_id == 1  # the wake-up did not supersede
    gate.set()
    await sink.wait_until(has_terminal(2))
    assert sink.texts(1) == ["answer"]
    assert sink.texts(2) == ["remark"]
    assert sink.kinds(1)[-1] is OutputKind.DONE
    await runtime.close()


def test_proactive_adapter_without_notifier_is_rejected() -> None:
    class Lying(ScriptedAdapter):
        capabilities = AdapterCapabilities(frozenset({"text"}), frozenset({"text"}), True)

    with pytest.raises(TypeError, match="set_notifier"):
        AdapterRuntime(Lying(), SID, Collector())


async def test_closed_runtime_rejects_input() -> None:
    runtime = AdapterRuntime(ScriptedAdapter(), SID, Collector())
    await runtime.close()
    with pytest.raises(SessionClosedError):
        await runtime.push("q")
    assert await runtime.barge_in() is None


def test_runtime_arguments_are_validated() -> None:
    with pytest.raises(ValueError):
        AdapterRuntime(ScriptedAdapter(), "", Collector())
    with pytest.raises(ValueError):
        AdapterRuntime(ScriptedAdapter(), SID, Collector(), max_drain_responses=-1)


def test_output_chunk_normalises_and_freezes() -> None:
    chunk = OutputChunk("text_delta", text="x", metadata={"a": 1})  # type: ignore[arg-type]
    assert chunk.kind is OutputKind.TEXT_DELTA
    with pytest.raises(TypeError):
        chunk.metadata["a"] = 2  # type: ignore[index]
    tagged = chunk.tagged(7)
    assert (tagged.response_id, chunk.response_id, tagged.text) == (7, 0, "x")
    assert OutputChunk.done().terminal and OutputChunk.error("e").terminal
    assert not chunk.terminal
    with pytest.raises(ValueError):
        OutputChunk("nonsense")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OutputChunk(OutputKind.DONE, response_id=-1)


def test_capabilities_validation() -> None:
    caps = AdapterCapabilities(frozenset({"video"}), frozenset({"text"}), proactive=True)
    assert hash(caps) == hash(AdapterCapabilities(frozenset({"video"}), frozenset({"text"}), True))
    with pytest.raises(TypeError):
        AdapterCapabilities("video", frozenset())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AdapterCapabilities(frozenset({""}), frozenset())
