"""The ``mage_vl`` stage: its pure core, then the adapter wired to a real vLLM engine.

The engine tests run the CPU build of vLLM on the tiny random-weight model of
``tests.tiny_model`` with greedy sampling; one engine serves the whole module.
Each test builds its own stage backend on it, runs it in an in-process worker
against a real redis-server and reads what reaches the client through a real
coordinator. The gate's verdict policy (``gate_decision``) is forced to
``always``/``never`` where a test needs a fixed outcome; the gate still asks
the engine every time, and ``model`` mode is tested against the text the
engine really generates.
"""

from __future__ import annotations

import asyncio
import functools
import io
import re

import pytest
from PIL import Image

from coordinator.service import Coordinator
from dataplane.request_ids import parse_request_id
from schemas.config import PipelineConfig, StageConfig
from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    TextPayload,
    UnitPayload,
    VideoPayload,
)
from schemas.fence import Fence
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    greedy_steps,
    held_after,
    model_dir_fixture,
)
from tests.engine_helpers import eventually as _eventually
from tests.pipeline_helpers import fast_settings, read_until, running_worker
from tests.pipeline_helpers import outputs_of as outputs
from tests.tiny_model import build_tiny_model
from workers.adapters.base import OutputChunk
from workers.adapters.mage_vl_types import GateDecision
from workers.backends.base import BackendError, StageContext
from workers.backends.mage_vl_core import (
    Kind,
    Speaking,
    answer_builder,
    classify,
    describe,
    event_id,
    fit_lines,
    make_window,
    parse_options,
    remark_builder,
    to_draft,
    verdict,
)
from workers.backends.registry import create_backend

STAGE = "watcher"
ENGINE_OPTIONS = {**TINY_ENGINE_OPTIONS}


def jpeg(shade: int = 90, size: tuple[int, int] = (32, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, 40)).save(buffer, format="JPEG")
    return buffer.getvalue()


def frame(pts_ms: int, shade: int = 90) -> VideoPayload:
    return VideoPayload((jpeg(shade),), "jpeg", pts_ms, 100)


def opts(**options):
    return parse_options(STAGE, {"model": "/m", **options}).stage


# -- the pure core (no engine) -----------------------------------------------------------


def test_options_split_engine_keys_and_refuse_mistakes():
    config = parse_options(STAGE, {"model": "/m", "dtype": "bfloat16", "window_size": 2})
    assert config.engine.model == "/m" and config.engine.dtype == "bfloat16"
    assert config.stage.window_size == 2 and config.stage.gate_decision == "model"
    cases = [
        ({}, r"model: Field required"),
        ({"model": "/m", "max_tokens": 8}, r"max_tokens: Extra inputs"),
        ({"model": "/m", "window_size": 9, "max_windows": 8}, r"exceeds max_windows"),
        ({"model": "/m", "gate_accept": "(yes"}, r"gate_accept: .*not a regular expression"),
        ({"model": "/m", "gate_prompt": "no windows here"}, r"gate_prompt lacks \{windows\}"),
        ({"model": "/m", "remark_prompt": "{windows} {who}"}, r"unknown placeholder \{who\}"),
        ({"model": "/m", "gate_decision": "maybe"}, r"gate_decision"),
        (
            {"model": "/m", "max_model_len": 64, "generate_max_tokens": 64},
            r"generate_max_tokens: must be below max_model_len \(64\)",
        ),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=rf"mage_vl stage 'watcher'.*{message}"):
            parse_options(STAGE, options)


def test_the_gpu_pipeline_file_is_valid():
    from pathlib import Path

    from schemas.config import load_pipeline

    pipeline = load_pipeline(Path(__file__).parent.parent / "configs" / "mage_vl.toml")
    (stage,) = pipeline.stages
    assert stage.backend == "mage_vl" and stage.to_client
    config = parse_options(stage.name, stage.options)
    assert config.engine.dtype == "bfloat16" and config.stage.gate_decision == "model"


def test_the_registry_builds_the_stage_without_starting_an_engine():
    stage = StageConfig(name=STAGE, backend="mage_vl", options={"model": "/m", "window_size": 3})
    backend = create_backend(stage)
    assert backend.name == "mage_vl" and backend.stage == STAGE
    assert backend.continuous_input is False and backend.follows_responses is True
    assert backend.options.window_size == 3 and backend.engine.unfinished() == 0


def test_events_are_classified_and_frames_become_windows():
    def event(payload, mode):
        return InputEvent(Fence("s", 0), 7, 1, mode, payload)

    video = frame(2500)
    assert classify(event(video, InputMode.APPEND_VIDEO_FRAME)) == (Kind.WINDOW, video, "")
    unit = UnitPayload(audio=AudioPayload(b"\0" * 8), video=video)
    assert classify(event(unit, InputMode.APPEND_UNIT)).video == video
    assert classify(event(UnitPayload(audio=AudioPayload(b"\0" * 8)), InputMode.APPEND_UNIT))[
        0
    ] is (Kind.NOTHING)
    assert classify(event(TextPayload("hi"), InputMode.APPEND_TEXT)).text == "hi"
    assert classify(event(CommitPayload(), InputMode.TURN_COMMIT_ONLY)).kind is Kind.COMMIT
    upstream = OutputEvent(Fence("s", 0), "asr", OutputKind.TRANSCRIPT, 1, text="look")
    assert classify(upstream).kind is Kind.QUERY_PART
    assert classify(OutputEvent(Fence("s", 0), "asr", OutputKind.DONE, 2)).kind is Kind.COMMIT

    window = make_window(video, seq=7, session_id="s", segment_ms=1000)
    assert window.segment_id == "2" and window.pts_ms == 2500 and window.duration_ms == 100
    assert dict(window.metadata) == {"session_id": "s", "seq": 7, "sizes": "32x24"}
    assert describe(window, 3) == "3. t=2500 ms, 100 ms long, segment 2, 1 jpeg frame (32x24)"
    with pytest.raises(BackendError, match="input 7: frame 1 is not an image"):
        make_window(VideoPayload((jpeg(), b"junk")), seq=7, session_id="s", segment_ms=1000)


def test_gate_text_becomes_a_decision_tied_to_an_event():
    windows = (make_window(frame(4100), seq=1, session_id="s", segment_ms=2000),)
    model = opts()
    said = verdict(model, "Yes: a red car stops.", windows)
    gate_text = {"gate_text": "Yes: a red car stops."}
    assert said == GateDecision(True, "a red car stops.", "segment-2", gate_text)
    for silent in ("no", "yesterday it rained", "", "maybe yes"):
        assert not verdict(model, silent, windows).respond
    # The fixed policies override the model's text (which the gate still asked for).
    assert verdict(opts(gate_decision="always"), "zq!", windows).respond
    assert verdict(opts(gate_decision="always"), "zq!", windows).text == ""
    assert not verdict(opts(gate_decision="never"), "yes: look", windows).respond
    # A pattern may name the event itself.
    named = opts(gate_accept=r"event (?P<event>\w+):")
    assert verdict(named, "event door: it opens", windows).event_id == "door"
    assert verdict(named, "event door: it opens", windows).text == "it opens"
    # Event keys: segment of the latest window, its frames, or none.
    by_frames = opts(event_key="frames")
    same = (make_window(frame(9000), seq=2, session_id="s", segment_ms=2000),)
    other = (make_window(frame(4100, shade=200), seq=3, session_id="s", segment_ms=2000),)
    assert event_id(by_frames, windows) == event_id(by_frames, same)
    assert event_id(by_frames, windows) != event_id(by_frames, other)
    assert event_id(opts(event_key="none"), windows) is None


def test_prompts_keep_the_newest_windows_that_fit():
    windows = [
        make_window(frame(pts), seq=i, session_id="s", segment_ms=1000)
        for i, pts in enumerate((0, 1000, 2000), 1)
    ]
    lines = [describe(w, i) for i, w in enumerate(windows, 1)]
    build = answer_builder(opts(system_prompt=None), "what now?")

    def count(chat):
        return sum(len(m["content"]) for m in chat)

    chat, kept = fit_lines(build, lines, count, 10_000)
    assert kept == 3 and chat[0]["role"] == "user" and chat[0]["content"].endswith("what now?")
    budget = count(build(lines[1:]))
    chat, kept = fit_lines(build, lines, count, budget)
    assert kept == 2 and "t=0 ms" not in chat[0]["content"] and "t=2000 ms" in chat[0]["content"]
    with pytest.raises(BackendError, match="even with one window"):
        fit_lines(build, lines, count, 10)
    remark = remark_builder(opts(), GateDecision(True, "a cat jumps"))(lines)
    assert remark[0]["role"] == "system" and "(a cat jumps)" in remark[1]["content"]


def test_chunks_become_drafts():
    speaking = Speaking("rid", "gate")
    delta = to_draft(OutputChunk.text_delta("hi").tagged(2), speaking)
    assert (delta.kind, delta.text) == (OutputKind.TEXT_DELTA, "hi")
    assert delta.meta == {"response": 2, "request_id": "rid", "trigger": "gate"}
    done = to_draft(OutputChunk.done(trigger="gate", event_id="segment-1", odd=[1]).tagged(2), None)
    assert done.meta == {"response": 2, "trigger": "gate", "event_id": "segment-1"}
    error = to_draft(OutputChunk.error("boom", phase="input"), speaking)
    assert error.kind is OutputKind.ERROR and error.text == "boom"
    assert error.meta == {"response": 0, "code": "backend_error", "phase": "input"}


class ScriptedEngine:
    """The ``VllmEngine`` members the stage uses, producing one letter per step.

    Only for the shell's fencing rules below, which need a response to be
    mid-stream at a chosen moment; what the engine does is tested on vLLM.
    """

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.submitted: list[str] = []

    def start_soon(self) -> None:
        pass

    async def ready(self) -> None:
        return None

    def render(self, chat) -> str:
        return "\n".join(m["content"] for m in chat)

    def encode(self, text: str) -> list[int]:
        return [1] * (len(text) // 8)

    def count(self, chat) -> int:
        return len(self.encode(self.render(chat)))

    def live_request_ids(self) -> set[str]:
        return set(self.live)

    async def abort(self, request_ids) -> None:
        self.aborted += [r for r in request_ids if r in self.live]
        self.live -= set(request_ids)

    async def generate(self, prompt_ids, spec, request_id):
        from workers.backends.vllm_engine import EngineStep

        self.submitted.append(request_id)
        self.live.add(request_id)
        try:
            for step in range(spec.max_tokens):
                await asyncio.sleep(0.005)
                if request_id not in self.live:
                    return
                last = step == spec.max_tokens - 1
                yield EngineStep("x", (7,), "length" if last else None)
                if last:
                    self.live.discard(request_id)
        finally:
            if request_id in self.live:  # cancelled or closed early: aborted, as vLLM does
                await self.abort([request_id])


async def test_nothing_of_an_old_epoch_is_published_under_a_newer_fence():
    from workers.backends.mage_vl_stage import MageVLStage

    engine = ScriptedEngine()
    stage = MageVLStage(
        {"model": "/m", "gate_decision": "always", "window_size": 1, "segment_ms": 1000,
         "gate_max_tokens": 2, "generate_max_tokens": 60},
        stage=STAGE, engine=engine,
    )  # fmt: skip
    ctx = StageContext("s", STAGE, Fence("s", 0), {})
    published: list[tuple[int, OutputKind]] = []
    ctx.emit = lambda draft: published.append((ctx.fence.epoch, draft.kind))
    await stage.start(ctx, [], [])

    async def frame_at(seq: int, pts: int) -> None:
        event = InputEvent(ctx.fence, seq, 1, InputMode.APPEND_VIDEO_FRAME, frame(pts))
        assert [d async for d in stage.handle(ctx, event)] == []

    async def until(check) -> None:
        async with asyncio.timeout(5):
            while not check():
                await asyncio.sleep(0.005)

    await frame_at(1, 0)
    await until(lambda: len(published) >= 3)  # the remark is streaming
    # A cancel moves the serving fence first (the actor does), the release comes after:
    # in between, the old epoch's remark goes on but nothing of it is published.
    ctx.stage_fence.on_cancel(ctx.fence.replace(epoch=1))
    before = len(published)
    await asyncio.sleep(0.05)
    assert len(published) == before
    await stage.release(ctx, Fence("s", 0, 0))
    (remark,) = [r for r in stage.records.values() if r.purpose == "remark"]
    assert remark.outcome == "released" and remark.request_id in engine.aborted
    assert not engine.live and stage.session("s").runtime.active_response_id is None
    assert all(epoch == 0 for epoch, _ in published)

    # An input of a newer epoch that arrives before its cancel releases the old work too.
    await frame_at(2, 1000)
    await until(lambda: any(epoch == 1 for epoch, _ in published))
    ctx.stage_fence.follow(ctx.fence.replace(epoch=2))
    await frame_at(3, 5000)
    assert len([r for r in engine.aborted if parse_request_id(r).epoch == 1]) == 1
    await until(lambda: (2, OutputKind.DONE) in published)
    epochs = [epoch for epoch, _ in published]
    assert epochs == sorted(epochs) and published[-1] == (2, OutputKind.DONE)
    # Each epoch's first frame was a new event: spoken; release cut epochs 0 and 1 short.
    assert [kind for epoch, kind in published if epoch < 2].count(OutputKind.DONE) == 0
    await stage.stop(ctx)
    assert stage.session("s") is None and not engine.live


# -- through the engine ----------------------------------------------------------------------

engine_test = engine_test_marks()
model_dir = model_dir_fixture(build_tiny_model, "tiny-model")


def start_engine(model_dir: str):
    from workers.backends.vllm_engine import VllmEngine
    from workers.backends.vllm_options import parse_options as engine_options

    return VllmEngine(engine_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}))


engine = engine_fixture(start_engine)


@pytest.fixture
def settings(redis_server, key_prefix):
    # Leases as long as the defaults: on a loaded two-core machine a 1 s lease can
    # lapse while vLLM computes, and a failover (not tested here) would reset the
    # session's windows in the middle of a test.
    return fast_settings(redis_server.url, key_prefix, lease_ttl_ms=3000, heartbeat_ms=750)


def stage_for(engine, **options):
    from workers.backends.mage_vl_stage import MageVLStage

    merged = {"model": engine.options.model, **ENGINE_OPTIONS, **options}
    return MageVLStage(merged, stage=STAGE, engine=engine)


def video_pipeline() -> PipelineConfig:
    stage = StageConfig(name=STAGE, backend="mage_vl", to_client=True, options={"model": "x"})
    return PipelineConfig(name="video", stages=(stage,))


def dones(count, session=None):
    return lambda got: len(outputs(got, OutputKind.DONE, session)) >= count


eventually = functools.partial(_eventually, timeout=20.0)


def records(backend, session, purpose=None):
    return [
        r
        for r in backend.records.values()
        if r.session_id == session and (purpose is None or r.purpose == purpose)
    ]


def settled(backend, session, gates):
    """All ``gates`` gate calls of the session ran, and nothing of it is running."""
    state = backend.session(session)
    return (
        state is not None  # the worker has taken the session
        and len(records(backend, session, "gate")) == gates
        and all(r.outcome != "running" for r in records(backend, session))
        and backend.adapter.gate_tasks_in_flight(session) == 0
        and state.runtime.active_response_id is None
    )


async def reference(engine, prompt: str, max_tokens: int) -> str:
    """What the engine generates, uninterrupted and greedily, for ``prompt``."""
    return "".join([step.text async for step in greedy_steps(engine, prompt, max_tokens)])


def responses(found):
    """Outputs grouped by the stage's response number, in order."""
    grouped: dict[int, list[OutputEvent]] = {}
    for output in found:
        grouped.setdefault(output.meta["response"], []).append(output)
    return list(grouped.values())


@engine_test
async def test_a_frames_alone_speak_once_per_event(engine, settings):
    backend = stage_for(
        engine, gate_decision="always", window_size=2, segment_ms=1000,
        gate_max_tokens=4, generate_max_tokens=6,
    )  # fmt: skip
    pipeline = video_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            # Two sessions, frames only: nobody asks anything.
            for sid in ("cam", "cam2"):
                await coordinator.open(sid)
            for pts in (0, 250, 500, 750):  # one segment: one event
                for sid in ("cam", "cam2"):
                    await coordinator.append(sid, "append_video_frame", frame(pts))
            got = await read_until(
                coordinator, lambda d: dones(1, "cam")(d) and dones(1, "cam2")(d)
            )
            await eventually(lambda: settled(backend, "cam", 3) and settled(backend, "cam2", 3))
            for pts in (1000, 1250, 1500):  # the next segment: a new event
                await coordinator.append("cam", "append_video_frame", frame(pts))
            got += await read_until(coordinator, dones(1, "cam"))
            await eventually(lambda: settled(backend, "cam", 6))
            got += await coordinator.outputs(block_ms=300)  # nothing more is coming

            for sid, events in (("cam", ["segment-0", "segment-1"]), ("cam2", ["segment-0"])):
                spoken = responses(outputs(got, session=sid))
                assert [r[-1].meta["event_id"] for r in spoken] == events
                remarks = records(backend, sid, "remark")
                assert len(remarks) == len(events)
                for response, remark in zip(spoken, remarks, strict=True):
                    *deltas, done = response
                    # Six tokens; vLLM merges steps into one delta when its consumer
                    # lags behind the engine, so the deltas number one to six.
                    assert deltas and all(o.kind is OutputKind.TEXT_DELTA for o in deltas)
                    assert done.kind is OutputKind.DONE and done.meta["trigger"] == "gate"
                    assert {o.meta["request_id"] for o in response} == {remark.request_id}
                    assert all(o.meta["trigger"] == "gate" for o in response)
                    # What reached the client is what the engine generated for the prompt.
                    assert "".join(o.text for o in deltas) == remark.text
                    assert remark.text == await reference(engine, remark.prompt, 6)
                    assert remark.outcome == "finished:length"
                # Every window past the first was gated, each call an engine request of
                # this session; the repeats of an event were not spoken again.
                calls = records(backend, sid)
                assert len(records(backend, sid, "gate")) == (6 if sid == "cam" else 3)
                assert all(parse_request_id(r.request_id)[:3] == (sid, 0, 0) for r in calls)
                assert all(parse_request_id(r.request_id).role.startswith(STAGE) for r in calls)
                assert all(r.outcome == "finished:length" and r.tokens for r in calls)
            gate = records(backend, "cam", "gate")[2]
            assert gate.windows == 2 and "t=500 ms" in gate.prompt and "t=750 ms" in gate.prompt
            assert "1 jpeg frame (32x24)" in gate.prompt and "t=250 ms" not in gate.prompt
            assert not engine.live_request_ids()
    finally:
        await coordinator.aclose()


@engine_test
async def test_b_a_question_is_answered_from_the_windows(engine, settings):
    backend = stage_for(
        engine, gate_decision="never", window_size=2, gate_max_tokens=4, generate_max_tokens=8
    )
    pipeline = video_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("q")
            await coordinator.append("q", "append_video_frame", frame(0))
            await coordinator.append("q", "append_video_frame", frame(500))
            await coordinator.append("q", "append_text", TextPayload("what is on "))
            await coordinator.append("q", "append_text", TextPayload("the screen?"))
            commit = await coordinator.commit("q")
            got = await read_until(coordinator, dones(1))
            *deltas, done = outputs(got)
            assert deltas and all(o.kind is OutputKind.TEXT_DELTA for o in deltas)
            assert done.meta["trigger"] == "query"
            # Answered under the response the commit reserved.
            assert all(o.fence == commit.fence for o in outputs(got))
            (answer,) = records(backend, "q", "answer")
            assert answer.request_id == done.meta["request_id"]
            assert "The viewer asks: what is on the screen?" in answer.prompt
            assert "1. t=0 ms" in answer.prompt and "2. t=500 ms" in answer.prompt
            assert "".join(o.text for o in deltas) == answer.text
            assert answer.text == await reference(engine, answer.prompt, 8)
            # The gate ran on the second window, and its fixed verdict kept it silent.
            await eventually(lambda: settled(backend, "q", 1))
            assert records(backend, "q", "gate")[0].text
            assert not records(backend, "q", "remark")

            # A commit with no question is answered by a done alone.
            await coordinator.commit("q")
            more = await read_until(coordinator, dones(1))
            assert [(o.kind, o.meta) for o in outputs(more)] == [
                (OutputKind.DONE, {"finish_reason": "nothing_to_answer"})
            ]
    finally:
        await coordinator.aclose()


@engine_test
async def test_c_model_mode_reads_the_verdict_from_the_gate_text(engine, settings):
    pipeline = video_pipeline()
    coordinator = Coordinator(settings, pipeline)
    common = {"window_size": 2, "gate_max_tokens": 8, "generate_max_tokens": 5}
    try:
        # The default acceptance wants a "yes"; the random model does not say it.
        backend = stage_for(engine, **common)
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("m1")
            for pts in (0, 300):
                await coordinator.append("m1", "append_video_frame", frame(pts))
            await eventually(lambda: settled(backend, "m1", 1))
            silent = await coordinator.outputs(block_ms=300)
            (gate,) = records(backend, "m1", "gate")
        said = gate.text
        assert said and not re.match(r"\W*yes\b", said, re.I)
        assert not outputs(silent) and not records(backend, "m1", "remark")

        # Accept what the model really says: its opening names the event, the rest
        # is the remark the spoken sentence is asked to voice.
        opening = said[:4]
        backend = stage_for(engine, gate_accept=f"(?P<event>{re.escape(opening)})", **common)
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("m2")
            for pts in (0, 300):
                await coordinator.append("m2", "append_video_frame", frame(pts))
            got = await read_until(coordinator, dones(1))
            await eventually(lambda: settled(backend, "m2", 1))
        (gate,) = records(backend, "m2", "gate")
        (remark,) = records(backend, "m2", "remark")
        assert gate.text == said  # same windows, same prompt, greedy: same verdict text
        *deltas, done = outputs(got)
        assert done.meta["event_id"] == opening and done.meta["trigger"] == "gate"
        assert f"({said[len(opening) :].strip()})" in remark.prompt
        assert remark.text and "".join(o.text for o in deltas) == remark.text
    finally:
        await coordinator.aclose()


@engine_test
async def test_d_barge_in_cancels_gate_calls_and_aborts_their_requests(engine, settings):
    # Long gate calls (a few seconds each on CPU) so that they are still running.
    backend = stage_for(
        engine, gate_decision="always", window_size=2, gate_max_tokens=300, generate_max_tokens=4
    )
    pipeline = video_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("b")

            def live_gates():
                return [r.request_id for r in records(backend, "b", "gate")
                        if r.request_id in engine.live_request_ids()]  # fmt: skip

            def generating():  # both gate calls are in the engine, producing tokens
                live = live_gates()
                return len(live) == 2 and all(backend.records[r].tokens >= 3 for r in live)

            # The engine stops where it stands once both gate calls have a few tokens,
            # so they are certainly still running when the cancel reaches the worker.
            async with held_after(engine, tokens=4, requests=2) as hold:
                for pts in (0, 100, 200):
                    await coordinator.append("b", "append_video_frame", frame(pts))
                await hold.wait()
                await eventually(generating)
                doomed = live_gates()
                result = await coordinator.cancel("b", reason="barge_in")
                assert result.fence.epoch == 1
                # The worker applies the cancel: the gate tasks end, their requests
                # leave the engine (long before 300 tokens each).
                await eventually(
                    lambda: (
                        not engine.live_request_ids()
                        and backend.adapter.gate_tasks_in_flight("b") == 0
                    )
                )
            assert list(backend.released) == [result.cancelled]
            for request_id in doomed:
                record = backend.records[request_id]
                assert record.outcome == "released" and 0 < record.tokens < 300
            assert not records(backend, "b", "remark")  # no gate got to decide
            assert len(backend.adapter.windows("b")) == 3  # what was seen stays

            # The session goes on at the new epoch: a new frame, a new event, spoken.
            await coordinator.append("b", "append_video_frame", frame(10_000))
            got = await read_until(coordinator, dones(1), timeout=60)
            assert outputs(got) and all(o.fence.epoch == 1 for o in outputs(got))
            assert all(o.fence.incarnation == 0 for o in outputs(got))
            assert outputs(got, OutputKind.DONE)[0].meta["event_id"] == "segment-5"
            (remark,) = records(backend, "b", "remark")
            assert parse_request_id(remark.request_id)[:3] == ("b", 0, 1)
    finally:
        await coordinator.aclose()
