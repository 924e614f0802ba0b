"""Turn traces over OpenTelemetry (``docs/tracing.md``): one trace per turn, a span per
stage, the context carried in stream events from process to process.

The shipped echo stack (``configs/echo.toml``: thinker -> talker) runs as real
processes (a coordinator and one worker per stage) exporting to a real OTLP/HTTP
receiver (``tests/otlp_receiver.py``); with the standard variable unset nothing is
exported and no event carries a trace.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.controlplane.replay import untraced
from coordinator.turn_trace import waterfall
from schemas.config import Settings, load_pipeline
from schemas.events import CommitPayload, OutputEvent, decode_event
from schemas.keys import Keys
from schemas.trace import StageMark, new_trace, with_mark
from tests.otlp_receiver import Receiver, otlp_receiver
from tests.processes import ROOT, WorkerProcess, write_pipeline
from tests.realtime_helpers import Client, coordinator_process, text_turn, until_completed

pytestmark = pytest.mark.timeout(120)

SHIPPED = load_pipeline(ROOT / "configs" / "echo.toml")
TURNS = ("Hello there, who are you?", "And what can you do?")


def _settings(redis_url: str, prefix: str) -> Settings:
    # Shipped settings but where Redis is and the test client's key (k1).
    return Settings.model_validate({"redis_url": redis_url, "key_prefix": prefix,
                                    "api_keys": ["k1"]})  # fmt: skip


def _tracing_env(receiver: Receiver) -> dict[str, str]:
    # The batch exporter's standard delay is 5 s; 100 ms lets the test see the spans
    # sooner. Nothing else about tracing changes.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


async def _turns(settings: Settings, tmp_path: Path, env: dict[str, str]) -> tuple[str, list[Any]]:
    """Two typed turns on the echo stack with ``env`` in every process: the session id
    and the server events."""
    saved = dict(os.environ)
    os.environ.update(env)  # the coordinator process inherits it
    pipeline_path = write_pipeline(tmp_path, SHIPPED)
    workers = [
        WorkerProcess(settings, pipeline_path, stage.name, f"w-{stage.name}", tmp_path, env=env)
        for stage in SHIPPED.stages
    ]
    events: list[Any] = []
    try:
        for worker in workers:
            worker.start()
        async with (
            coordinator_process(settings, SHIPPED, tmp_path) as base,
            Client.connect(base) as client,
        ):
            events += await client.until("session.created")
            for text in TURNS:
                for event in text_turn(text):
                    await client.send(event)
                events += await until_completed(client, within_s=60)
            if env:  # the waterfall is sent right after the answer's first output
                events += await _waterfalls(client, events)
        return events[0]["session"]["id"], events
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for worker in workers:
            worker.terminate()


async def _waterfalls(client: Client, events: list[Any]) -> list[Any]:
    got: list[Any] = []
    while sum(e["type"] == "duplexq.turn.trace" for e in events + got) < len(TURNS):
        got.append(await client.recv(20))
    return got


async def _spans_of(receiver: Receiver, count: int) -> list[Any]:
    deadline = time.monotonic() + 30
    while len(receiver.spans) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # anything more than expected would arrive by now
    return receiver.spans


async def _stage_events(redis_url: str, prefix: str, session_id: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    keys = Keys(prefix).session(session_id)
    try:
        for stage in SHIPPED.stages:
            for _id, fields in await client.xrange(keys.stage_out(stage.name)):
                if b"e" in fields:
                    yield fields[b"e"]
    finally:
        await client.aclose()


async def test_one_trace_per_turn_with_a_span_per_stage(redis_server, key_prefix, tmp_path):
    settings = _settings(redis_server.url, key_prefix)
    with otlp_receiver() as receiver:
        session_id, events = await _turns(settings, tmp_path, _tracing_env(receiver))
        spans = await _spans_of(receiver, len(TURNS) * (1 + len(SHIPPED.stages)))
    roots = [s for s in spans if s.name == "duplexq.turn"]
    assert len(roots) == len(TURNS), spans
    assert len({s.trace_id for s in spans}) == len(TURNS)
    for root in roots:
        assert root.parent_id == "" and root.service == "duplexq-coordinator"
        assert root.attributes["duplexq.session"] == session_id
        children = [s for s in spans if s.trace_id == root.trace_id and s is not root]
        assert sorted(s.name for s in children) == ["stage talker", "stage thinker"]
        for span in children:
            stage = span.attributes["duplexq.stage"]
            assert span.service == f"duplexq-{stage}"  # exported by the stage's process
            assert span.parent_id == root.span_id
            assert root.start_ns <= span.start_ns <= span.end_ns
            assert "first_output" in span.events
    shown = [e for e in events if e["type"] == "duplexq.turn.trace"]
    assert {e["trace_id"] for e in shown} == {r.trace_id for r in roots}
    for event in shown:
        assert [s["stage"] for s in event["stages"]] == ["thinker", "talker"]
        parts = sum(s["queued_ms"] + s["work_ms"] for s in event["stages"]) + event["delivery_ms"]
        assert parts == pytest.approx(event["total_ms"], abs=0.01)
        assert 0 < event["own_ms"] <= event["total_ms"]
    traced = [decode_event(raw) async for raw in _stage_events(redis_server.url, key_prefix,
                                                                 session_id)]  # fmt: skip
    assert any(isinstance(e, OutputEvent) and e.trace is not None for e in traced)


async def test_nothing_is_traced_when_not_configured(redis_server, key_prefix, tmp_path):
    assert not any(name.startswith("OTEL_EXPORTER_OTLP") for name in os.environ)
    settings = _settings(redis_server.url, key_prefix)
    with otlp_receiver() as receiver:
        session_id, events = await _turns(settings, tmp_path, {})
        await asyncio.sleep(1)
        assert receiver.posts == 0
    assert not [e for e in events if e["type"] == "duplexq.turn.trace"]
    raws = [raw async for raw in _stage_events(redis_server.url, key_prefix, session_id)]
    assert raws
    for raw in raws:
        assert b"trace" not in raw  # not even an empty field on the wire
        event = decode_event(raw)
        assert isinstance(event, OutputEvent) and event.trace is None


def test_the_waterfall_adds_up_and_a_replay_drops_the_trace():
    trace = new_trace(1_000_000_000)
    trace = with_mark(trace, StageMark("vad", 1_000_000_000, 1_002_000_000, 1_003_000_000))
    trace = with_mark(trace, StageMark("asr", 1_003_000_000, 1_004_000_000, 1_204_000_000))
    shown = waterfall(trace, 1_210_000_000)
    assert shown["total_ms"] == 210.0
    assert shown["own_ms"] == 2.0 + 1.0 + 6.0  # two hops between stages, one to the client
    assert [(s["start_ms"], s["end_ms"]) for s in shown["stages"]] == [(2.0, 3.0), (4.0, 204.0)]
    # A stage still busy with earlier input when its input was made: that wait is its own.
    busy = with_mark(trace, StageMark("thinker", 1_204_000_000, 1_304_000_000, 1_404_000_000,
                                      busy_ns=90_000_000))  # fmt: skip
    thinker = waterfall(busy, 1_405_000_000)["stages"][-1]
    assert (thinker["queued_ms"], thinker["work_ms"], thinker["busy_ms"]) == (10.0, 190.0, 90.0)
    assert untraced(CommitPayload(respond=True, trace=trace)) == CommitPayload(respond=True)
