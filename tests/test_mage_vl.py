"""Mage-VL adapter: the upstream adapter's behaviour, one behaviour per test, then the options.

The upstream adapter is vLLM-Omni's ``fullduplex/mage_vl/adapter.py``. Names:

=======================================  ==============================================
upstream                                 duplexq
=======================================  ==============================================
``MageVLDuplexAdapter(gate=, generate=,  ``MageVLAdapter(gate, generate, window_size=,
window_size=, max_windows=,              max_windows=, output_modality=)``
output_modality=)``
``on_input(session, modality, data)``    ``on_input(session_id, item)``: the modality is
                                         read from the item (text vs anything else)
``respond(session)`` / ``OutputChunk(    ``respond(session_id)``; ``OutputChunk``
modality, data)``                        text/audio deltas and one ``done``
``MageVLCodecWindow(data, kind, ...)``   ``VisualWindow(data, kind, ...)``
``MageVLGateDecision(should_respond,     ``GateDecision(respond, text, event_id, score,
text, event_id, score, reason)``         reason)``
``gate(session, windows)``               ``gate(session_id, windows)``
``generate(session, windows, query,      ``generate(session_id, windows, query,
gate)``                                  decision)``
``state.pending_gate``                   ``pending_decision(session_id)``
``MageVLDuplexRuntime`` gate watcher     ``AdapterRuntime`` + ``set_notifier``
=======================================  ==============================================
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
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


def win(segment: str, data: object = b"\xff\xd8") -> dict[str, Any]:
    return {"frames": data, "segment_id": segment}


class Gate:
    """An async gate that records what it saw; optionally blocks until released."""

    def __init__(self, answer: Any = False, *, block: bool = False) -> None:
        self.answer = answer
        self.block = block
        self.calls: list[tuple[str, list[str | None]]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = 0
        self.finished = 0

    async def __call__(self, session_id: str, windows: tuple[VisualWindow, ...]) -> Any:
        self.calls.append((session_id, [w.segment_id for w in windows]))
        self.started.set()
        try:
            if self.block:
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return self.answer(session_id, windows) if callable(self.answer) else self.answer


class Generate:
    """Records each call and returns ``result`` (or what ``result`` builds)."""

    def __init__(self, result: Any = "said") -> None:
        self.result = result
        self.calls: list[tuple[str, list[str | None], str | None, GateDecision | None]] = []

    def __call__(self, session_id, windows, query, decision):
        self.calls.append((session_id, [w.segment_id for w in windows], query, decision))
        return self.result() if callable(self.result) else self.result


async def collect(adapter: MageVLAdapter, session_id: str = A) -> list[OutputChunk]:
    return [chunk async for chunk in adapter.respond(session_id)]


def texts(chunks: list[OutputChunk]) -> list[str]:
    return [c.text for c in chunks if c.kind is OutputKind.TEXT_DELTA]


async def feed(adapter: MageVLAdapter, *segments: str, session_id: str = A) -> None:
    for segment in segments:
        await adapter.on_input(session_id, win(segment))
    await adapter.flush(session_id)


# -- construction ---------------------------------------------------------------------


def test_defaults_are_upstreams() -> None:
    adapter = MageVLAdapter()
    assert (adapter._window_size, adapter._max_windows) == (4, 64)
    assert adapter.capabilities.output_modalities == {"text"}
    assert adapter.capabilities.input_modalities == {"text", "video"}
    assert adapter.capabilities.proactive
    assert isinstance(adapter, ProactiveAdapter)


def test_output_modality_names_the_capability() -> None:
    assert MageVLAdapter(output_modality="audio").capabilities.output_modalities == {"audio"}
    with pytest.raises(ValueError, match="output_modality"):
        MageVLAdapter(output_modality="smell")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_size": 0},
        {"max_windows": 0, "window_size": 0},
        {"window_size": 5, "max_windows": 4},
        {"max_gate_tasks": 0},
    ],
)
def test_bounds_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MageVLAdapter(**kwargs)


# -- inputs ---------------------------------------------------------------------------


def test_text_is_stripped_and_blank_text_means_nothing() -> None:
    assert parse_input("  what is that?\n") == "what is that?"
    assert parse_input(TextPayload(text=" and now? ")) == "and now?"
    assert parse_input({"text": "hm"}) == "hm"
    assert parse_input("   ") is None
    assert parse_input({"text": None}) is None


async def test_a_newer_query_replaces_the_pending_one_and_blank_keeps_it() -> None:
    generate = Generate()
    adapter = MageVLAdapter(generate=generate, window_size=1)
    await adapter.on_input(A, "first?")
    await adapter.on_input(A, "second?")
    await adapter.on_input(A, "  ")
    await feed(adapter, "w1")
    await collect(adapter)
    assert generate.calls[0][2] == "second?"


@pytest.mark.parametrize(
    ("item", "data"),
    [
        (b"raw", b"raw"),
        ([1, 2, 3], (1, 2, 3)),  # a decoded array-like, not bytes
        ({"data": "tensor-ref"}, "tensor-ref"),
        ({"frames": [b"a", b"b"]}, (b"a", b"b")),
        ({"frame": b"one"}, b"one"),
        ({"codec": {"mv": [0, 1]}}, {"mv": [0, 1]}),  # codec-native side information
        ({"data": b"d", "frames": b"f"}, b"d"),  # data wins
        ({"segment_id": 3}, None),  # no payload at all
    ],
)
def test_windows_take_any_payload(item: object, data: object) -> None:
    assert coerce_window(item).data == data


def test_window_fields_from_a_mapping() -> None:
    window = coerce_window(
        {"frames": [b"x"], "kind": "screen", "segment_id": 7, "pts_ms": "40", "duration_ms": 33}
    )
    assert (window.kind, window.segment_id, window.pts_ms, window.duration_ms) == (
        "screen",
        "7",
        40,
        33,
    )
    assert coerce_window({"frames": [b"x"], "metadata": "note"}).metadata == {"metadata": "note"}
    assert coerce_window({"frames": [b"x"]}).kind == "video"
    assert coerce_window({"frames": [b"x"]}).pts_ms is None
    with pytest.raises(TypeError):
        coerce_window({"frames": [b"x"], "metadata": {"k": 1}}).metadata["k"] = 2  # type: ignore[index]


def test_frames_view_is_the_encoded_frames_only() -> None:
    assert coerce_window(b"jpg").frames == (b"jpg",)
    assert coerce_window({"frames": [b"a", b"b"]}).frames == (b"a", b"b")
    assert coerce_window([1, 2]).frames == ()


def test_wire_payloads_and_events() -> None:
    payload = VideoPayload(frames=(b"f1", b"f2"), codec="png", pts_ms=100, duration_ms=66)
    expected = VisualWindow(data=(b"f1", b"f2"), codec="png", pts_ms=100, duration_ms=66)
    assert coerce_window(payload) == expected
    assert coerce_window(UnitPayload(video=payload)) == expected
    event = InputEvent(Fence(A), 1, 1, InputMode.APPEND_VIDEO_FRAME, payload)
    assert parse_input(event) == expected
    commit = InputEvent(Fence(A), 2, 1, InputMode.TURN_COMMIT_ONLY, CommitPayload())
    assert parse_input(commit) is None
    for item in (AudioPayload(data=b"\x00"), TokensPayload(token_ids=(1,)), UnitPayload()):
        with pytest.raises(UnsupportedModeError):
            parse_input(item)


async def test_windows_are_capped_at_max_windows() -> None:
    adapter = MageVLAdapter(window_size=2, max_windows=3)
    await feed(adapter, "1", "2", "3", "4", "5")
    assert [w.segment_id for w in adapter.windows(A)] == ["3", "4", "5"]


# -- gate decisions -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (GateDecision(True, "x", "e"), GateDecision(True, "x", "e")),
        (None, GateDecision(False)),
        (True, GateDecision(True)),
        (False, GateDecision(False)),
        (1, GateDecision(True)),
        (0.0, GateDecision(False)),
        ("  a dog enters ", GateDecision(True, "a dog enters")),
        ("   ", GateDecision(False)),
        ({"open": True}, GateDecision(True)),
        ({"respond": True, "text": "hi", "event_id": 3}, GateDecision(True, "hi", "3")),
        ({"should_respond": False, "respond": True}, GateDecision(False)),
        ({"respond": False, "open": True}, GateDecision(False)),
        ({"text": "bare text"}, GateDecision(False, "bare text")),
        (
            {"open": 1, "text": 5, "score": "0.5", "reason": "motion"},
            GateDecision(True, "5", score=0.5, reason="motion"),
        ),
        ({"respond": True, "metadata": {"k": 1}}, GateDecision(True, metadata={"k": 1})),
    ],
)
def test_gate_answer_coercion(answer: object, expected: GateDecision) -> None:
    assert coerce_decision(answer) == expected


async def test_gate_runs_once_window_size_windows_exist_on_the_latest_ones() -> None:
    gate = Gate()
    adapter = MageVLAdapter(gate, window_size=2, max_windows=4)
    await feed(adapter, "1")
    assert gate.calls == []
    await feed(adapter, "2")
    await feed(adapter, "3")
    assert gate.calls == [(A, ["1", "2"]), (A, ["2", "3"])]


async def test_gate_sees_the_windows_as_they_are_when_it_runs() -> None:
    gate = Gate()
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("1"))
    await adapter.on_input(A, win("2"))  # both tasks start after both inputs
    await adapter.flush(A)
    assert gate.calls == [(A, ["2"]), (A, ["2"])]


async def test_a_plain_sync_gate_works() -> None:
    calls: list[int] = []

    def gate(session_id: str, windows: tuple[VisualWindow, ...]) -> object:
        calls.append(len(windows))
        return {"should_respond": True, "text": "sync says hi"}

    adapter = MageVLAdapter(gate, window_size=1)
    await feed(adapter, "1")
    assert calls == [1]
    assert adapter.should_respond(A)
    assert texts(await collect(adapter)) == ["sync says hi"]


async def test_without_a_gate_windows_never_respond() -> None:
    adapter = MageVLAdapter(window_size=1)
    await feed(adapter, "1", "2")
    assert adapter.gate_tasks_in_flight(A) == 0
    assert not adapter.should_respond(A)


async def test_negative_decisions_are_ignored() -> None:
    adapter = MageVLAdapter(Gate({"text": "not opened"}), window_size=1)
    await feed(adapter, "1")
    assert adapter.pending_decision(A) is None
    assert not adapter.should_respond(A)


async def test_one_decision_slot_the_latest_wins() -> None:
    gate = Gate(lambda _s, windows: {"open": True, "text": f"saw {windows[-1].segment_id}"})
    generate = Generate()
    adapter = MageVLAdapter(gate, generate, window_size=1)
    await feed(adapter, "1", "2", "3")
    pending = adapter.pending_decision(A)
    assert pending is not None and pending.text == "saw 3"
    await collect(adapter)
    assert [call[3].text for call in generate.calls if call[3]] == ["saw 3"]
    assert not adapter.should_respond(A)  # the older decisions are gone, not queued


async def test_an_event_is_accepted_once() -> None:
    gate = Gate({"respond": True, "text": "a cat", "event_id": "cat"})
    adapter = MageVLAdapter(gate, window_size=1)
    await feed(adapter, "1")
    assert texts(await collect(adapter)) == ["a cat"]
    await feed(adapter, "2")
    assert not adapter.should_respond(A)
    assert len(gate.calls) == 2


async def test_a_decision_without_text_or_generate_is_accepted_and_says_nothing() -> None:
    adapter = MageVLAdapter(Gate({"open": True, "event_id": "e"}), window_size=1)
    await feed(adapter, "1")
    assert adapter.should_respond(A)
    chunks = await collect(adapter)
    assert [c.kind for c in chunks] == [OutputKind.DONE]
    assert chunks[-1].metadata["event_id"] == "e"


async def test_gate_failure_is_logged_and_the_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: Iterator[object] = iter([RuntimeError("model down"), "back again"])

    def gate(session_id: str, windows: tuple[VisualWindow, ...]) -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    adapter = MageVLAdapter(gate, window_size=1)
    with caplog.at_level(logging.ERROR):
        await feed(adapter, "1")
    assert "cognition gate failed" in caplog.text
    await feed(adapter, "2")
    assert texts(await collect(adapter)) == ["back again"]


# -- responding -----------------------------------------------------------------------


async def test_a_query_needs_a_window() -> None:
    adapter = MageVLAdapter(generate=Generate(), window_size=1)
    await adapter.on_input(A, "what is there?")
    assert not adapter.should_respond(A)
    await feed(adapter, "1")
    assert adapter.should_respond(A)


async def test_query_and_decision_are_answered_in_one_generate_call() -> None:
    generate = Generate("both at once")
    adapter = MageVLAdapter(Gate({"open": True, "text": "look"}), generate, window_size=1)
    await feed(adapter, "1")
    await adapter.on_input(A, "what now?")
    assert texts(await collect(adapter)) == ["both at once"]
    assert len(generate.calls) == 1
    (_, _, query, decision) = generate.calls[0]
    assert query == "what now?"
    assert decision == GateDecision(True, "look")
    assert not adapter.should_respond(A)


async def test_generate_gets_the_last_window_size_windows() -> None:
    generate = Generate()
    adapter = MageVLAdapter(generate=generate, window_size=2, max_windows=8)
    await feed(adapter, "1", "2", "3", "4")
    await adapter.on_input(A, "recap?")
    await collect(adapter)
    assert generate.calls == [(A, ["3", "4"], "recap?", None)]


async def test_a_query_without_generate_outputs_nothing() -> None:
    gate = Gate()
    adapter = MageVLAdapter(gate, window_size=1)
    await feed(adapter, "1")
    await adapter.on_input(A, "hello?")
    assert adapter.should_respond(A)
    chunks = await collect(adapter)
    assert [c.kind for c in chunks] == [OutputKind.DONE]
    assert len(gate.calls) == 1  # the query was not put to the gate
    assert not adapter.should_respond(A)  # and it is consumed


async def test_without_generate_the_decision_text_is_spoken() -> None:
    adapter = MageVLAdapter(Gate("a cat walks in"), window_size=1)
    await feed(adapter, "1")
    chunks = await collect(adapter)
    assert texts(chunks) == ["a cat walks in"]
    assert chunks[-1].metadata["trigger"] == "gate"


async def _async_pieces() -> AsyncIterator[str]:
    yield "a"
    yield "b"


def _sync_pieces() -> Iterator[object]:
    yield "c"
    yield OutputChunk.text_delta("d")


async def _awaitable_list() -> list[str]:
    return ["e", "f"]


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ("one string", ["one string"]),
        (OutputChunk.text_delta("a chunk"), ["a chunk"]),
        (["x", OutputChunk.text_delta("y")], ["x", "y"]),
        (("t1", "t2"), ["t1", "t2"]),
        (_async_pieces, ["a", "b"]),
        (_sync_pieces, ["c", "d"]),
        (_awaitable_list, ["e", "f"]),
    ],
)
async def test_generate_result_shapes(result: Any, expected: list[str]) -> None:
    adapter = MageVLAdapter(generate=Generate(result), window_size=1)
    await feed(adapter, "1")
    await adapter.on_input(A, "go")
    assert texts(await collect(adapter)) == expected


async def test_audio_output_modality_turns_bytes_into_audio_deltas() -> None:
    adapter = MageVLAdapter(
        generate=Generate([b"\x01\x02", b""]), window_size=1, output_modality="audio"
    )
    await feed(adapter, "1")
    await adapter.on_input(A, "say it")
    chunks = await collect(adapter)
    assert [(c.kind, c.data) for c in chunks[:-1]] == [(OutputKind.AUDIO_DELTA, b"\x01\x02")]
    adapter_text = MageVLAdapter(generate=Generate([b"\x01"]), window_size=1)
    await feed(adapter_text, "1")
    await adapter_text.on_input(A, "say it")
    with pytest.raises(TypeError, match="text adapter"):
        await collect(adapter_text)


async def test_a_stopped_response_closes_generates_iterator() -> None:
    closed = asyncio.Event()

    async def pieces() -> AsyncIterator[str]:
        try:
            yield "first"
            yield "second"
        finally:
            closed.set()

    adapter = MageVLAdapter(generate=Generate(pieces), window_size=1)
    await feed(adapter, "1")
    await adapter.on_input(A, "go")
    stream = adapter.respond(A)
    assert (await anext(stream)).text == "first"
    await stream.aclose()  # type: ignore[attr-defined]
    assert closed.is_set()


# -- barge-in and close ---------------------------------------------------------------


async def test_barge_in_clears_query_and_decision_and_cancels_gates() -> None:
    gate = Gate("too late", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await adapter.on_input(A, "a question")
    await gate.started.wait()
    assert adapter.should_respond(A)
    await adapter.on_barge_in(A)
    assert (gate.cancelled, gate.finished) == (1, 0)
    assert adapter.gate_tasks_in_flight(A) == 0
    assert not adapter.should_respond(A)
    assert len(adapter.windows(A)) == 1  # what was seen stays seen
    await adapter.on_close(A, graceful=True)


async def test_graceful_close_waits_for_gate_tasks_then_forgets() -> None:
    gate = Gate("noted", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await gate.started.wait()
    closing = asyncio.create_task(adapter.on_close(A, graceful=True))
    await settle()
    assert not closing.done()
    gate.release.set()
    await closing
    assert (gate.finished, gate.cancelled) == (1, 0)
    assert not adapter.has_session(A)
    assert adapter.windows(A) == ()


async def test_non_graceful_close_cancels_gate_tasks() -> None:
    gate = Gate("noted", block=True)
    adapter = MageVLAdapter(gate, window_size=1)
    await adapter.on_input(A, win("w1"))
    await gate.started.wait()
    await adapter.on_close(A, graceful=False)
    assert (gate.finished, gate.cancelled) == (0, 1)
    assert not adapter.has_session(A)


async def test_graceful_runtime_close_speaks_the_pending_decision() -> None:
    gate = Gate({"respond": True, "text": "final remark", "event_id": "end"}, block=True)
    adapter, sink = MageVLAdapter(gate, window_size=1), Collector()
    runtime = AdapterRuntime(adapter, A, sink)
    assert await runtime.push(win("w1")) is None
    await gate.started.wait()
    closing = asyncio.create_task(runtime.close(graceful=True))
    await settle()
    gate.release.set()
    await closing
    assert [(c.kind, c.text, c.response_id) for c in sink.chunks] == [
        (OutputKind.TEXT_DELTA, "final remark", 1),
        (OutputKind.DONE, "", 1),
    ]


async def test_runtime_speaks_gate_decisions_proactively() -> None:
    gate = Gate(lambda _s, ws: {"open": True, "text": "hi", "event_id": ws[-1].segment_id})
    adapter, sink = MageVLAdapter(gate, window_size=1), Collector()
    async with AdapterRuntime(adapter, A, sink) as runtime:
        await runtime.push(win("w1"))
        await sink.wait_until(has_terminal(1))
        await runtime.push(win("w2"))
        await sink.wait_until(has_terminal(2))
    done = [c.metadata.get("event_id") for c in sink.chunks if c.kind is OutputKind.DONE]
    assert done == ["w1", "w2"]


async def test_sessions_are_isolated() -> None:
    gate = Gate(lambda sid, _w: {"open": True, "text": f"{sid} saw it", "event_id": "shared"})
    adapter = MageVLAdapter(gate, window_size=2)
    for segment in ("1", "2"):
        for sid in (A, B):
            await adapter.on_input(sid, win(f"{sid}-{segment}"))
    await adapter.flush(A)
    await adapter.flush(B)
    assert sorted(gate.calls) == [(A, [f"{A}-1", f"{A}-2"]), (B, [f"{B}-1", f"{B}-2"])]
    assert texts(await collect(adapter, A)) == [f"{A} saw it"]
    assert texts(await collect(adapter, B)) == [f"{B} saw it"]  # event ids are per session
    await adapter.on_close(A, graceful=True)
    assert adapter.has_session(B) and not adapter.has_session(A)


# -- options beyond upstream ----------------------------------------------------------


async def test_option_max_gate_tasks_skips_windows_while_the_gate_is_busy() -> None:
    gate = Gate(block=True)
    adapter = MageVLAdapter(gate, window_size=1, max_gate_tasks=1)
    await adapter.on_input(A, win("1"))
    await adapter.on_input(A, win("2"))
    await gate.started.wait()
    assert adapter.gate_tasks_in_flight(A) == 1
    gate.release.set()
    await adapter.flush(A)
    assert len(gate.calls) == 1
    unbounded = MageVLAdapter(Gate(), window_size=1)
    await unbounded.on_input(A, win("1"))
    await unbounded.on_input(A, win("2"))
    assert unbounded.gate_tasks_in_flight(A) == 2
    await unbounded.flush(A)


@pytest.mark.parametrize("hold", [False, True])
async def test_option_hold_decisions_while_responding(hold: bool) -> None:
    release = asyncio.Event()

    async def pieces() -> AsyncIterator[str]:
        yield "answer"
        await release.wait()

    gate = Gate(lambda _s, windows: {"open": True, "event_id": windows[-1].segment_id})
    adapter = MageVLAdapter(
        gate, Generate(pieces), window_size=1, hold_decisions_while_responding=hold
    )
    await adapter.on_input(A, "question")
    await feed(adapter, "1")
    stream = adapter.respond(A)
    assert (await anext(stream)).text == "answer"
    await feed(adapter, "2")  # a decision arrives while the answer streams
    assert adapter.should_respond(A) is not hold
    await adapter.on_input(A, "another question")
    assert adapter.should_respond(A)  # a question always may
    release.set()
    await stream.aclose()  # type: ignore[attr-defined]
