"""Mage-VL adapter: window/decision coercion, gate scheduling, dedup, close, isolation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from schemas.errors import UnsupportedModeError
from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputEvent,
    InputMode,
    OutputKind,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
)
from schemas.fence import Fence
from workers.adapters.base import OutputChunk, ProactiveAdapter
from workers.adapters.mage_vl import MageVLAdapter
from workers.adapters.mage_vl_types import (
    GateDecision,
    VisualWindow,
    coerce_decision,
    coerce_window,
    parse_input,
)
from workers.adapters.runtime import AdapterRuntime

from .test_adapter_runtime import Collector, has_terminal, settle

A, B = "sess-a", "sess-b"


def win(segment: str, frame: bytes = b"\xff\xd8") -> dict[str, Any]:
    return {"frames": [frame], "segment_id": segment}


class FakeGate:
    """Records calls; optionally blocks until released; answers via ``answer``."""

    def __init__(self, answer: Any = False, *, block: bool = False) -> None:
        self.answer = answer
        self.block = block
        self.calls: list[tuple[str, list[str | None], str | None]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = 0
        self.finished = 0

    async def __call__(
        self, session_id: str, windows: tuple[VisualWindow, ...], query: str | None
    ) -> Any:
        self.calls.append((session_id, [w.segment_id for w in windows], query))
        self.started.set()
        try:
            if self.block:
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        if callable(self.answer):
            return self.answer(session_id, windows, query)
        return self.answer


async def collect(adapter: MageVLAdapter, session_id: str) -> list[OutputChunk]:
    return [chunk async for chunk in adapter.respond(session_id)]


def texts(chunks: list[OutputChunk]) -> list[str]:
    return [c.text for c in chunks if c.kind is OutputKind.TEXT_DELTA]


# -- coercion -----------------------------------------------------------------


def test_window_from_attribute_object() -> None:
    fields: dict[str, Any] = {"codec": "png", "kind": "screen", "pts_ms": 40, "duration_ms": 33}
    item = SimpleNamespace(
        frames=(b"a", bytearray(b"b")), segment_id=7, metadata={"k": 1}, **fields
    )
    window = coerce_window(item)
    assert window == VisualWindow((b"a", b"b"), segment_id="7", metadata={"k": 1}, **fields)
    with pytest.raises(TypeError):
        window.metadata["k"] = 2  # type: ignore[index]


def test_window_from_mapping_with_aliases() -> None:
    window = coerce_window({"data": b"jpg", "segment": "s1", "pts": 5, "duration": 10})
    assert window == VisualWindow((b"jpg",), "jpeg", "video", "s1", 5, 10)


def test_window_from_video_payloads_and_events() -> None:
    payload = VideoPayload(frames=(b"f1", b"f2"), codec="png", pts_ms=100, duration_ms=66)
    expected = VisualWindow(frames=(b"f1", b"f2"), codec="png", pts_ms=100, duration_ms=66)
    assert coerce_window(payload) == expected
    assert coerce_window(UnitPayload(video=payload)) == expected
    event = InputEvent(Fence(A), 1, 1, InputMode.APPEND_VIDEO_FRAME, payload)
    assert parse_input(event) == expected
    assert coerce_window(b"raw") == VisualWindow(frames=(b"raw",))
    assert coerce_window(UnitPayload(audio=AudioPayload(data=b"\x00"), video=payload)) == expected
    assert (
        parse_input(InputEvent(Fence(A), 2, 1, InputMode.TURN_COMMIT_ONLY, CommitPayload())) is None
    )


@pytest.mark.parametrize(
    ("item", "error"),
    [
        (42, TypeError),
        (None, TypeError),
        (object(), ValueError),
        ({"codec": "jpeg"}, ValueError),
        ({"frames": ["not bytes"]}, TypeError),
        ({"frames": []}, ValueError),
        ({"frames": [b"x"], "pts_ms": -1}, ValueError),
        ({"frames": [b"x"], "metadata": "nope"}, TypeError),
        (UnitPayload(audio=AudioPayload(data=b"\x00")), UnsupportedModeError),
        (AudioPayload(data=b"\x00"), UnsupportedModeError),
        (TokensPayload(token_ids=(1, 2)), UnsupportedModeError),
    ],
)
def test_unknown_window_shapes_are_rejected(item: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_input(item)


def test_text_inputs_are_queries() -> None:
    assert parse_input("what is that?") == "what is that?"
    assert parse_input(TextPayload(text="and now?")) == "and now?"
    assert parse_input({"text": "hm"}) == "hm"
    with pytest.raises(ValueError):
        parse_input("   ")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (GateDecision(True, "x", "e"), GateDecision(True, "x", "e")),
        (None, GateDecision(False)),
        (True, GateDecision(True)),
        (False, GateDecision(False)),
        ("a dog enters", GateDecision(True, "a dog enters")),
        ("", GateDecision(False)),
        ({"respond": True, "text": "hi", "event_id": 3}, GateDecision(True, "hi", "3")),
        ({"should_respond": False, "answer": "hi"}, GateDecision(False, "hi")),
        ({"answer": "implicit yes"}, GateDecision(True, "implicit yes")),
        (
            {"respond": True, "metadata": {"score": 0.9}},
            GateDecision(True, metadata={"score": 0.9}),
        ),
        (
            SimpleNamespace(should_respond=True, text="obj", event_id="ev"),
            GateDecision(True, "obj", "ev"),
        ),
        (SimpleNamespace(respond=False), GateDecision(False)),
    ],
)
def test_decision_coercion(answer: object, expected: GateDecision) -> None:
    assert coerce_decision(answer) == expected


@pytest.mark.parametrize("answer", [1, 0.5, b"yes", object(), {"text": 5}])
def test_bad_decisions_are_rejected(answer: object) -> None:
    with pytest.raises(TypeError):
        coerce_decision(answer)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_size": 5, "max_windows": 4},
        {"window_size": 0},
        {"max_windows": 0, "window_size": 0},
        {"window_size": -1},
        {"max_gate_tasks": 0},
    ],
)
def test_bounds_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MageVLAdapter(FakeGate(), **kwargs)


def test_adapter_is_proactive() -> None:
    adapter = MageVLAdapter(FakeGate())
    assert isinstance(adapter, ProactiveAdapter)
    assert adapter.capabilities.proactive
    assert {"text", "video"} <= adapter.capabilities.input_modalities


# -- gate scheduling and decisions -------------------------------------------


async def test_gate_runs_only_once_window_size_windows_exist() -> None:
    gate = FakeGate()
    adapter = MageVLAdapter(gate, window_size=3, max_windows=4)
    for segment in ("w1", "w2"):
        await adapter.on_input(A, win(segment))
    assert adapter.gate_tasks_in_flight(A) == 0
    await adapter.flush(A)
    assert gate.calls == []
    for segment in ("w3", "w4", "w5"):
        await adapter.on_input(A, win(segment))
        await adapter.flush(A)
    assert gate.calls == [
        (A, ["w1", "w2", "w3"], None),
        (A, ["w2", "w3", "w4"], None),
        (A, ["w3", "w4", "w5"], None),
    ]
    # The history is bounded by max_windows.
    assert [w.segment_id for w in adapter.windows(A)] == ["w2", "w3", "w4", "w5"]
    await adapter.on_close(A, graceful=True)


async def test_gate_text_is_spoken_as_is_without_generate() -> None:
    adapter = MageVLAdapter(FakeGate("a cat walks in"), window_size=1)
    await adapter.on_input(A, win("w1"))
    assert not adapter.should_respond(A)  # the gate has not answered yet
    await adapter.flush(A)
    assert adapter.should_respond(A)
    chunks = await collect(adapter, A)
    assert texts(chunks) == ["a cat walks in"]
    assert chunks[-1].kind is OutputKind.DONE
    assert chunks[-1].metadata["trigger"] == "gate"
    assert not adapter.should_respond(A)
    await adapter.on_close(A, graceful=True)


async def test_duplicate_event_is_spoken_once() -> None:
    gate = FakeGate({"respond": True, "text": "door opened", "event_id": "door"})
    adapter = MageVLAdapter(gate, window_size=1)
    for segment in ("w1", "w2", "w3"):
        await adapter.on_input(A, win(segment))
        await adapter.flush(A)
    assert len(gate.calls) == 3
    chunks = await collect(adapter, A)
    assert texts(chunks) == ["door opened"]
    assert chunks[-1].metadata["event_id"] == "door"
    assert not adapter.should_respond(A)
    # A different event still speaks.
    gate.answer = {"respond": True, "text": "light on", "event_id": "light"}
    await adapter.on_input(A, win("w4"))
    await adapter.flush(A)
    assert texts(await collect(adapter, A)) == ["light on"]
    await adapter.on_close(A, graceful=True)


async def test_gate_failure_is_logged_and_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def explode(*_: object) -> object:
        raise RuntimeError("gate model down")

    gate = FakeGate(explode)
    adapter = MageVLAdapter(gate, window_size=1)
    with caplog.at_level(logging.ERROR):
        await adapter.on_input(A, win("w1"))
        await adapter.flush(A)
    assert "cognition gate failed" in caplog.text
    gate.answer = "recovered"
    await adapter.on_input(A, win("w2"))
    await adapter.flush(A)
    assert texts(await collect(adapter, A)) == ["recovered"]
    await adapter.on_close(A, graceful=True)


# -- queries and generate -----------------------------------------------------


async def test_pending_query_is_answered_once_windows_exist_gate_silent() -> None:
    gate = FakeGate(False)
    cues: list[object] = []

    async def generate(windows: tuple[VisualWindow, ...], cue: str | GateDecision) -> str:
        cues.append((len(windows), cue))
        return "it is a red car"

    adapter = MageVLAdapter(gate, generate, window_size=2)
    await adapter.on_input(A, "what is that?")
    assert not adapter.should_respond(A)  # nothing seen yet
    await adapter.on_input(A, win("w1"))
    assert adapter.should_respond(A)  # below window_size and the gate never ran
    chunks = await collect(adapter, A)
    assert texts(chunks) == ["it is a red car"]
    assert chunks[-1].metadata["trigger"] == "query"
    assert cues == [(1, "what is that?")]
    assert gate.calls == []
    assert not adapter.should_respond(A)
    await adapter.on_close(A, graceful=True)


async def test_generate_may_stream_pieces_for_a_decision() -> None:
    seen: list[object] = []

    async def generate(
        windows: tuple[VisualWindow, ...], cue: str | GateDecision
    ) -> AsyncIterator[str]:
        seen.append(cue)
        for piece in ("some", "", "one ", "waves"):
            yield piece

    adapter = MageVLAdapter(
        FakeGate({"respond": True, "event_id": "wave"}), generate, window_size=1
    )
    await adapter.on_input(A, win("w1"))
    await adapter.flush(A)
    assert texts(await collect(adapter, A)) == ["some", "one ", "waves"]
    assert seen == [GateDecision(True, event_id="wave")]
    await adapter.on_close(A, graceful=True)


async def test_query_without_generate_asks_the_gate() -> None:
    gate = FakeGate(lambda _s, _w, query: f"answer to {query}" if query else False)
    adapter = MageVLAdapter(gate, window_size=3)
    await adapter.on_input(A, win("w1"))
    await adapter.on_input(A, TextPayload(text="who?"))
    assert texts(await collect(adapter, A)) == ["answer to who?"]
    assert gate.calls == [(A, ["w1"], "who?")]
    gate.answer = False
    await adapter.on_input(A, "and now?")
    chunks = await collect(adapter, A)
    assert [c.kind for c in chunks] == [OutputKind.DONE]
    assert chunks[0].metadata["answered"] is False
    await adapter.on_close(A, graceful=True)


async def test_textless_decision_without_generate_is_dropped() -> None:
    adapter = MageVLAdapter(FakeGate(True), window_size=1)
    await adapter.on_input(A, win("w1"))
    await adapter.flush(A)
    assert not adapter.should_respond(A)
    await adapter.on_close(A, graceful=True)


async def test_decision_waits_for_the_response_in_flight() -> None:
    release = asyncio.Event()

    async def generate(
        windows: tuple[VisualWindow, ...], cue: str | GateDecision
    ) -> AsyncIterator[str]:
        assert isinstance(cue, GateDecision)
        yield cue.text
        if cue.event_id == "e1":
            await release.wait()

    answers = iter(["e1", "e2"])
    gate = FakeGate(lambda *_: {"text": "saw", "event_id": next(answers)})
    adapter = MageVLAdapter(gate, generate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await adapter.flush(A)
    stream = adapter.respond(A)
    assert (await anext(stream)).text == "saw"
    await adapter.on_input(A, win("w2"))
    await adapter.flush(A)
    assert not adapter.should_respond(A)  # a remark does not cut into a response
    await adapter.on_input(A, "question")
    assert adapter.should_respond(A)  # an explicit question does
    await stream.aclose()  # type: ignore[attr-defined]
    release.set()
    await adapter.on_close(A, graceful=False)


# -- barge-in and close -------------------------------------------------------


async def test_barge_in_cancels_gate_tasks_and_clears_pending_work() -> None:
    gate = FakeGate("too late", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await adapter.on_input(A, "a question")
    await gate.started.wait()
    assert adapter.should_respond(A)
    await adapter.on_barge_in(A)
    assert gate.cancelled == 1
    assert gate.finished == 0
    assert adapter.gate_tasks_in_flight(A) == 0
    assert not adapter.should_respond(A)
    assert len(adapter.windows(A)) == 1  # what was seen stays seen
    await adapter.on_close(A, graceful=True)


async def test_graceful_close_waits_for_gate_tasks_then_forgets() -> None:
    gate = FakeGate("noted", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await gate.started.wait()
    closing = asyncio.create_task(adapter.on_close(A, graceful=True))
    await settle()
    assert not closing.done()
    assert adapter.has_session(A)
    gate.release.set()
    await closing
    assert (gate.finished, gate.cancelled) == (1, 0)
    assert not adapter.has_session(A)
    assert adapter.windows(A) == ()
    assert not adapter.should_respond(A)


async def test_non_graceful_close_cancels_gate_tasks() -> None:
    gate = FakeGate("noted", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await gate.started.wait()
    await adapter.on_close(A, graceful=False)
    assert (gate.finished, gate.cancelled) == (0, 1)
    assert not adapter.has_session(A)


async def test_graceful_runtime_close_speaks_pending_decision() -> None:
    gate = FakeGate({"respond": True, "text": "final remark", "event_id": "end"}, block=True)
    adapter, sink = MageVLAdapter(gate, window_size=1), Collector()
    runtime = AdapterRuntime(adapter, A, sink)
    assert await runtime.push(win("w1")) is None
    await gate.started.wait()
    closing = asyncio.create_task(runtime.close(graceful=True))
    await settle()
    assert not closing.done()
    gate.release.set()
    await closing
    assert [(c.kind, c.text, c.response_id) for c in sink.chunks] == [
        (OutputKind.TEXT_DELTA, "final remark", 1),
        (OutputKind.DONE, "", 1),
    ]
    assert not adapter.has_session(A)


async def test_runtime_speaks_gate_decisions_proactively() -> None:
    gate = FakeGate(lambda _s, windows, _q: {"text": "hello", "event_id": windows[-1].segment_id})
    adapter, sink = MageVLAdapter(gate, window_size=1), Collector()
    async with AdapterRuntime(adapter, A, sink) as runtime:
        await runtime.push(win("w1"))
        await sink.wait_until(has_terminal(1))
        await runtime.push(win("w2"))
        await sink.wait_until(has_terminal(2))
        assert await runtime.push("what now?") == 3
        await sink.wait_until(has_terminal(3))
    assert [c.metadata.get("event_id") for c in sink.chunks if c.kind is OutputKind.DONE] == [
        "w1",
        "w2",
        None,
    ]


# -- isolation ----------------------------------------------------------------


async def test_sessions_are_isolated_under_concurrent_gates() -> None:
    releases = {A: asyncio.Event(), B: asyncio.Event()}
    started = {A: asyncio.Event(), B: asyncio.Event()}
    seen: dict[str, list[list[str | None]]] = {A: [], B: []}

    async def gate(session_id: str, windows: tuple[VisualWindow, ...], query: str | None) -> object:
        if query is not None:
            return f"{session_id} answers {query}"
        seen[session_id].append([w.segment_id for w in windows])
        started[session_id].set()
        await releases[session_id].wait()
        # Both sessions report the same event id: dedup is per session.
        return {"text": f"{session_id} saw it", "event_id": "shared"}

    adapter = MageVLAdapter(gate, window_size=2)
    sinks = {A: Collector(), B: Collector()}
    runtimes = {sid: AdapterRuntime(adapter, sid, sinks[sid]) for sid in (A, B)}
    for segment in ("1", "2"):
        for sid in (A, B):
            await runtimes[sid].push(win(f"{sid}-{segment}"))
    await asyncio.gather(started[A].wait(), started[B].wait())
    assert adapter.gate_tasks_in_flight(A) == adapter.gate_tasks_in_flight(B) == 1
    await runtimes[A].push("only for A")
    await sinks[A].wait_until(has_terminal(1))
    assert not sinks[B].chunks
    releases[B].set()
    await sinks[B].wait_until(has_terminal(1))
    releases[A].set()
    await sinks[A].wait_until(has_terminal(2))
    for runtime in runtimes.values():
        await runtime.close()
    assert seen == {A: [[f"{A}-1", f"{A}-2"]], B: [[f"{B}-1", f"{B}-2"]]}
    assert [c.text for c in sinks[A].chunks if c.text] == [f"{A} answers only for A", f"{A} saw it"]
    assert [c.text for c in sinks[B].chunks if c.text] == [f"{B} saw it"]
    assert not adapter.has_session(A) and not adapter.has_session(B)
