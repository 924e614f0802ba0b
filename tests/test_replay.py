"""Replay: record a session through echo workers, replay it, compare the outputs."""

import argparse
import asyncio
import io
from dataclasses import replace

import msgspec
import pytest
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job

from coordinator.controlplane.control import (
    enqueue_replay,
    job_deserializer,
    queue_name,
    replay_job_id,
    run_control,
)
from coordinator.controlplane.replay import (
    Comparison,
    Mismatch,
    ProgressPrinter,
    ReplayReport,
    as_read,
    client_outputs,
    compare_outputs,
    compare_sessions,
    pace_delay,
    pipeline_outputs,
    progress_bar,
    replay_greedily,
    replay_session,
)
from coordinator.launcher.replay_cli import GREEDY_HINT, add_commands, replay_hint
from coordinator.output_reader import JournalFollower
from coordinator.service import Coordinator
from dataplane.bus import Entry
from schemas.config import echo_pipeline
from schemas.errors import SessionExistsError, SessionNotFoundError
from schemas.events import (
    CommitPayload,
    ControlEvent,
    ControlKind,
    InputMode,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    TextPayload,
    decode_input,
    encode_event,
)
from schemas.fence import Fence
from schemas.realtime import SessionConfig
from schemas.session_shape import settings_from_json, stage_settings
from tests.pipeline_helpers import collect, fast_settings, running_worker

ECHO = echo_pipeline("echo")
TEXTS = [f"hello-{i}" for i in range(5)]
GAPS_MS = [100, 250, 50, 400, 300]
"""Recorded gaps between the inputs (the commit comes last)."""


def _chunked():
    stage = ECHO.stages[0].model_copy(update={"options": {"chunks": 2}})
    return ECHO.model_copy(update={"stages": (stage,)})


# -- pure parts -----------------------------------------------------------------------------


def _out(text, *, stage="echo", kind=OutputKind.TEXT_DELTA, seq=1, fence=None, data=b""):
    fence = fence or Fence("s")
    return OutputEvent(fence, stage, kind, seq, text=text, data=data)


def _said(text, **fields):
    """An output that is not streamed: each is its own output, as read."""
    return _out(text, kind=OutputKind.TRANSCRIPT, **fields)


def test_compare_outputs_ignores_fences_and_seqs():
    a = [_said("x", seq=1), _said("y", seq=2)]
    b = [_said("x", seq=7, fence=Fence("t", 3, 2)), _said("y", seq=9)]
    result = compare_outputs(a, b)
    assert result.identical and result.matched == 2


@pytest.mark.parametrize(
    ("b", "index", "target"),
    [
        ([_said("x"), _said("z")], 1, "'z'"),
        ([_said("x")], 1, "(none)"),  # target stopped short
        # Another stage's output in its place: echo's 'y' is the record missing first.
        ([_said("x"), _said("y", stage="tts")], 1, "(none)"),
        ([_said("x"), _said("y", data=b"1")], 1, "data=1B"),
        ([_said("x"), _out("y", kind=OutputKind.DONE)], 1, "echo/done"),
        ([_said("x"), _said("y"), _said("extra")], 2, "'extra'"),
    ],
)
def test_compare_outputs_finds_the_first_mismatch(b, index, target):
    result = compare_outputs([_said("x"), _said("y")], b)
    assert not result.identical
    assert result.first_mismatch.index == index == result.matched
    assert result.first_mismatch.stage == "echo"
    assert target in result.first_mismatch.target


def _tokens(text, ids, **fields):
    return msgspec.structs.replace(_out(text, **fields), token_ids=ids)


def test_a_stream_is_read_as_one_output_however_it_was_cut():
    """vLLM hands a stream every token made since its last read: the same answer
    comes in one delta per token on a quiet machine, fewer and longer on a busy one."""
    done = _out("", kind=OutputKind.DONE)
    per_token = [_tokens("ry", (5,)), _tokens(".", (6,)), _tokens(" a", (7,)), done]
    busy = [_tokens("ry.", (5, 6)), _tokens(" a", (7,), seq=9), done]
    assert compare_outputs(per_token, busy).identical
    read = as_read(busy)
    assert [(o.kind, o.text, o.token_ids) for o in read] == [
        (OutputKind.TEXT_DELTA, "ry. a", (5, 6, 7)),
        (OutputKind.DONE, "", ()),
    ]
    assert read[0].seq == 1  # the first piece's seq and meta are kept
    audio = [_out("", kind=OutputKind.AUDIO_DELTA, data=b"ab"),
             _out("", kind=OutputKind.AUDIO_DELTA, data=b"c")]  # fmt: skip
    assert [o.data for o in as_read(audio)] == [b"abc"]
    # A different answer is still different, wherever the cut falls.
    other = [_tokens("ry", (5,)), _tokens(". b", (6, 8)), done]
    result = compare_outputs(per_token, other)
    assert not result.identical and result.matched == 0
    assert "'ry. a'" in result.first_mismatch.source and "'ry. b'" in result.first_mismatch.target


def test_only_one_stream_is_joined_a_different_stage_kind_or_fence_starts_another():
    second = Fence("s", 0, 1, 1, 1)
    outputs = [
        _out("a"), _out("b"),  # one run
        _out("c", stage="tts"),  # another stage
        _out("d", kind=OutputKind.AUDIO_DELTA),  # another kind
        _out("e", fence=second), _out("f", fence=second),  # the next answer
        _said("g"), _said("h"),  # not streamed: never joined
        _out("i"),
    ]  # fmt: skip
    assert [o.text for o in as_read(outputs)] == ["ab", "c", "d", "ef", "g", "h", "i"]
    assert as_read([]) == []


def _entry(n, event):
    field = b"c" if isinstance(event, ControlEvent) else b"e"
    return Entry("j", f"{n}-0", {field: encode_event(event)})


def test_replay_judges_a_journal_with_the_readers_own_follower():
    follower = JournalFollower("s", Fence("s"), metrics=False)
    old = Fence("s", 0, 0)
    cancel = ControlEvent(ControlKind.CANCEL, Fence("s", 0, 1), cancelled=old)
    entries = [
        _entry(1, _out("a", seq=1, fence=old)),
        _entry(2, _out("a", seq=1, fence=old)),  # duplicate (a retried write)
        _entry(3, cancel),
        _entry(4, _out("late", seq=2, fence=old)),  # of the cancelled epoch
        _entry(5, _out("b", seq=3, fence=Fence("s", 0, 1))),
        Entry("j", "6-0", {b"e": b"\xc1garbage"}),
        _entry(7, _out("{}", stage="coordinator", kind=OutputKind.NOTICE, fence=Fence("s", 0, 1))),
        _entry(8, _out("c", seq=4, fence=Fence("s", 0, 1))),
    ]
    # The coordinator's notice is no pipeline output: it is never compared.
    assert [o.text for o in pipeline_outputs(follower, entries)] == ["a", "b", "c"]


def test_pace_delay():
    assert pace_delay(None, 5000, 1.0) == 0.0
    assert pace_delay(1000, 1250, 1.0) == pytest.approx(0.25)
    assert pace_delay(1000, 1250, 10.0) == pytest.approx(0.025)
    assert pace_delay(1000, 900, 1.0) == 0.0  # clock went backwards
    assert pace_delay(0, 900, 1.0) == 0.0  # no recorded time


def test_progress_bar_and_printer():
    assert progress_bar(0, 4, width=4) == "[....] 0/4   0%"
    assert progress_bar(2, 4, width=4) == "[##..] 2/4  50%"
    assert progress_bar(0, 0, width=2) == "[##] 0/0 100%"
    lines = io.StringIO()
    printer = ProgressPrinter(lines, step=25)
    for done in range(1, 9):
        printer(done, 8)
    assert lines.getvalue().splitlines() == [
        "replay: 0% (1/8)",
        "replay: 25% (2/8)",
        "replay: 50% (4/8)",
        "replay: 75% (6/8)",
        "replay: 100% (8/8)",
    ]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = ProgressPrinter(tty)
    bar(1, 2)
    bar(2, 2)
    assert tty.getvalue().startswith("\rreplay [") and tty.getvalue().endswith("2/2 100%\n")


def test_replay_command_is_registered():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", "a", "b", "--pace", "recorded", "--speed", "4"])
    assert (args.source, args.target, args.pace, args.speed) == ("a", "b", "recorded", 4.0)
    assert callable(args.func) and not args.enqueue
    with pytest.raises(SystemExit):
        parser.parse_args(["replay", "a", "b", "--pace", "slow"])
    assert not args.greedy and args.again is None
    greedy = parser.parse_args(["replay", "a", "b", "--greedy", "--again", "c"])
    assert greedy.greedy and greedy.again == "c"


def test_again_names_the_second_target_of_a_greedy_replay_only(capsys):
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", "a", "b", "--again", "c"])
    assert args.func(args) == 2
    assert "--again names the second target of a --greedy replay" in capsys.readouterr().err


def _report(source_out, target_out, *, matched, target="t", stage="echo", **fields):
    mismatch = (None if matched == max(source_out, target_out)
                else Mismatch(matched, "x", "y", stage, "text_delta"))  # fmt: skip
    comparison = Comparison(source_out, target_out, matched, mismatch)
    return ReplayReport(source="s", target=target, pipeline="chat", pace="fast", speed=1.0,
                        inputs=4, skipped=0, first_seq=1, complete=True,
                        comparison=comparison, elapsed_s=0.5, **fields)  # fmt: skip


def test_a_greedy_replay_of_a_sampled_source_is_judged_by_its_second_replay():
    again = _report(3, 3, matched=3, target="t.again", greedy=True, reference="t")
    report = _report(3, 3, matched=1, greedy=True, again=again)
    assert report.identical and not report.matches  # the sampled source differs: expected
    text = report.summary()
    assert text.splitlines()[0] == "replay s -> t (chat, fast, greedy): greedy replays identical"
    assert "the source sampled, so the verdict compares two greedy replays" in text
    assert "against the source this one is different" in text
    assert "second greedy replay t.again, against t:" in text
    assert "outputs 3 -> 3 (against t), matched 3" in text
    assert report.to_dict()["again"]["target"] == "t.again"
    assert replay_hint(report, ECHO) is None

    differs = _report(3, 3, matched=1, greedy=True, again=_report(3, 3, matched=2, greedy=True,
                      reference="t", target="t.again"))  # fmt: skip
    assert not differs.identical
    assert "greedy replays DIFFERENT" in differs.summary()
    assert "first mismatch at 2:" in differs.summary() and "      t x" in differs.summary()
    # The echo stage does not sample: the note says so, not that a model sampled.
    assert "stage echo's, which does not sample" in replay_hint(differs, ECHO)

    # A greedy source (a greedy replay's target) is compared directly, once.
    direct = _report(3, 3, matched=3, greedy=True, source_greedy=True)
    assert direct.identical and "greedy): identical" in direct.summary()
    assert "second greedy replay" not in direct.summary()


# -- on Redis, with echo workers ---------------------------------------------------------------


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


@pytest.fixture
async def coordinator(settings):
    coordinator = Coordinator(settings, ECHO)
    yield coordinator
    await coordinator.aclose()


async def _record(coordinator, session_id="src"):
    """A session of five texts and a commit at known recorded times; six outputs (two as
    read: the five texts are one answer's deltas)."""
    await coordinator.open(session_id)
    ts = 1_000_000
    inputs = [(InputMode.APPEND_TEXT, TextPayload(t)) for t in TEXTS]
    inputs.append((InputMode.TURN_COMMIT_ONLY, CommitPayload()))
    for (mode, payload), gap in zip(inputs, [0, *GAPS_MS], strict=True):
        ts += gap
        await coordinator.authority.append(session_id, mode, payload, ts_ms=ts)
    return await collect(coordinator, 6)


async def test_replay_fast_and_at_recorded_pace_reproduces_the_outputs(settings, coordinator):
    bus = coordinator.bus
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
        seen = []
        report = await replay_session(
            bus, ECHO, "src", "fast1", progress=lambda done, total: seen.append((done, total))
        )
        assert report.identical, report.summary()
        assert (report.inputs, report.skipped, report.first_seq) == (6, 0, 1)
        c = report.comparison
        assert (c.source_outputs, c.target_outputs, c.matched) == (2, 2, 2)  # as read
        assert seen == [(n, 6) for n in range(1, 7)]

        delays = []

        async def fake_sleep(seconds):
            delays.append(seconds)
            await asyncio.sleep(0)

        paced = await replay_session(
            bus, ECHO, "src", "paced1", pace="recorded", speed=20.0, sleep=fake_sleep
        )
        assert paced.identical, paced.summary()
        assert delays == pytest.approx([gap / 1000 / 20 for gap in GAPS_MS])
        assert (await compare_sessions(bus, "src", "paced1")).identical
    # The targets were closed once compared; the source is untouched.
    assert (await coordinator.authority.status("fast1"))["status"] == "closed"
    assert (await coordinator.authority.status("src"))["status"] == "open"
    assert "identical" in report.summary() and report.to_dict()["identical"] is True


async def test_a_replay_target_stores_the_sources_settings_for_new_owners(settings, coordinator):
    """A stage's new owner starts from the session's stored settings: a target that
    did not store the source's would lose its instructions and voice at a failover."""
    bus = coordinator.bus
    config = SessionConfig(instructions="answer briefly", voice="verse")
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
        await bus.hset(bus.keys.session("src").meta, {"config": config.model_dump_json()})
        await replay_session(bus, ECHO, "src", "plain1")
        await replay_session(bus, ECHO, "src", "greedy1", greedy=True, quiet_s=1.0)
    for target, greedy in (("plain1", False), ("greedy1", True)):
        raw = (await bus.hmget(bus.keys.session(target).meta, ["config"]))[0]
        stored = settings_from_json(raw)
        assert stored.instructions == "answer briefly" and stored.greedy is greedy, target
        assert stored.voice == stage_settings(config).voice


async def test_replay_into_a_different_pipeline_reports_the_mismatch(settings, coordinator):
    bus = coordinator.bus
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
    await coordinator.close("src")  # so the next pipeline's worker has nothing to take over
    # Every answer streamed in two pieces: the same text as read, so no difference.
    chunked = _chunked()
    async with running_worker(settings, chunked, "echo"):
        report = await replay_session(bus, chunked, "src", "chunky", quiet_s=1.0)
    assert report.identical, report.summary()
    assert len(await client_outputs(bus, "chunky")) == 11  # 5 x 2 pieces and a done
    # Another stage answers: that is a difference.
    other = echo_pipeline("shout")
    async with running_worker(settings, other, "shout"):
        report = await replay_session(bus, other, "src", "shouted", quiet_s=1.0)
    assert not report.identical
    mismatch = report.comparison.first_mismatch
    assert mismatch.index == 0 and report.comparison.matched == 0
    # Stage by stage: the first record that differs is echo's answer, missing in the target.
    assert (mismatch.stage, mismatch.kind) == ("echo", "text_delta")
    assert "echo/text_delta text='hello-0hello-1" in mismatch.source
    assert mismatch.target == "(none)"
    assert "first mismatch at 0: text_delta output #0 of stage echo" in report.summary()
    again = await compare_sessions(bus, "src", "shouted")
    assert again.first_mismatch.index == 0 and again.target_outputs == 2


async def test_a_replay_that_ends_on_a_stream_is_complete_once_it_has_every_piece(
    settings, coordinator
):
    """Texts and no commit: the session's outputs end on a stream that could still grow.
    The target is complete once it has as many pieces as the source, with no wait for
    it to stay quiet (here longer than the timeout: waiting would report incomplete)."""
    bus = coordinator.bus
    async with running_worker(settings, ECHO, "echo"):
        await coordinator.open("src")
        for text in TEXTS:
            await coordinator.authority.append("src", InputMode.APPEND_TEXT, TextPayload(text))
        await collect(coordinator, len(TEXTS))
        report = await replay_session(
            bus, ECHO, "src", "open-ended", wait_timeout_s=20.0, quiet_s=60.0
        )
    assert report.complete and report.identical, report.summary()
    assert report.comparison.target_outputs == 1  # five deltas of one answer, as read


async def test_replay_needs_a_known_source_and_a_new_target(coordinator):
    with pytest.raises(SessionNotFoundError):
        await replay_session(coordinator.bus, ECHO, "nobody", "t")
    await coordinator.open("src")
    await coordinator.open("old")
    await coordinator.close("old")
    with pytest.raises(SessionExistsError):
        await replay_session(coordinator.bus, ECHO, "src", "old")  # never reopens a record
    with pytest.raises(ValueError, match="speed"):
        await replay_session(coordinator.bus, ECHO, "nobody", "t", speed=0)


async def test_replay_job_runs_once_on_the_control_plane(settings, coordinator):
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
        assert await enqueue_replay(settings, "src", "job1")
        assert not await enqueue_replay(settings, "src", "job1")  # a duplicate does nothing
        worker = await run_control(settings, ECHO, burst=True, handle_signals=False)
    assert worker.jobs_failed == 0 and worker.jobs_complete == 4  # replay + 3 periodic
    pool = await create_pool(
        RedisSettings.from_dsn(settings.redis_url), job_deserializer=job_deserializer
    )
    try:
        job = Job(
            replay_job_id(settings, "src", "job1"),
            pool,
            _queue_name=queue_name(settings),
            _deserializer=job_deserializer,
        )
        info = await job.result_info()
    finally:
        await pool.aclose()
    assert info is not None and info.success
    assert info.result["identical"] is True and info.result["target"] == "job1"
    assert info.result["comparison"]["matched"] == 2
    # Done within the result's lifetime: asking again still does nothing.
    assert not await enqueue_replay(settings, "src", "job1")


def test_a_replay_of_a_sampling_pipeline_explains_why_it_may_differ():
    from coordinator.launcher.replay_cli import sampled_stages, sampling_hint
    from schemas.config import load_pipeline
    from tests.processes import ROOT

    shipped = load_pipeline(ROOT / "configs" / "default.toml")
    assert sampled_stages(shipped) == ["thinker (temperature 0.2, no seed)"]
    hint = sampling_hint(shipped)
    assert hint is not None and "temperature = 0" in hint and "fixed seed" in hint
    assert "replay with --greedy to check that the pipeline reproduces itself" in hint
    sampled = _report(3, 3, matched=1, stage="thinker")
    assert replay_hint(sampled, shipped) == hint  # a plain replay that differs at the thinker
    assert replay_hint(_report(3, 3, matched=3), shipped) is None
    # Sampling is blamed only when the first difference is the sampling stage's, and only
    # for a plain replay: speech recognition does not sample, a greedy thinker does not.
    heard = replay_hint(_report(3, 3, matched=1, stage="asr"), shipped)
    assert heard is not None and "stage asr's, which does not sample" in heard
    assert "temperature" not in heard
    greedy_thinker = _report(3, 3, matched=1, stage="thinker", greedy=True, source_greedy=True)
    assert replay_hint(greedy_thinker, shipped) == f"{GREEDY_HINT}; here the model stage thinker"
    late = replay_hint(replace(_report(3, 3, matched=3), complete=False), shipped)
    assert late is not None and "had not given them all" in late
    greedy = [
        s.model_copy(update={"options": {**s.options, "temperature": 0.0}}) for s in shipped.stages
    ]
    assert sampling_hint(shipped.model_copy(update={"stages": tuple(greedy)})) is None
    assert sampling_hint(load_pipeline(ROOT / "configs" / "echo.toml")) is None


async def _log(bus, session_id):
    return [decode_input(e.event) for e in await bus.xrange(
        bus.keys.session(session_id).input, "-", "+")]  # fmt: skip


async def test_a_greedy_replay_runs_twice_and_says_greedy_from_the_first_event(
    settings, coordinator
):
    bus = coordinator.bus
    async with running_worker(settings, ECHO, "echo"):
        await coordinator.open("src")
        await coordinator.append("src", InputMode.UPDATE_SESSION, SettingsPayload(voice="marin"))
        await coordinator.append("src", InputMode.APPEND_TEXT, TextPayload("hello"))
        await coordinator.commit("src")
        await collect(coordinator, 2)
        report = await replay_greedily(bus, ECHO, "src", "g1", quiet_s=0.5)
        assert report.identical and report.matches, report.summary()
        assert report.greedy and not report.source_greedy
        again = report.again
        assert again is not None and again.target == "g1.again" and again.reference == "g1"
        assert again.matches and again.comparison.matched == 2
        # The targets' stages are greedy from their first event on, and a new owner too.
        for target in ("g1", "g1.again"):
            log = await _log(bus, target)
            assert log[0].payload == SettingsPayload(greedy=True)
            assert log[1].payload == SettingsPayload(voice="marin", greedy=True)
            assert [e.mode for e in log[2:]] == [InputMode.APPEND_TEXT, InputMode.TURN_COMMIT_ONLY]
        meta = await bus.hgetall(bus.keys.session("g1").meta)
        assert '"greedy":true' in meta["config"]
        # A greedy replay's target replays greedily against itself, once.
        direct = await replay_greedily(bus, ECHO, "g1", "g2", quiet_s=0.5)
        assert direct.source_greedy and direct.again is None and direct.identical
        assert await bus.xlen(bus.keys.session("g2.again").input) == 0
    # A plain replay keeps the recorded settings as they were.
    assert (await _log(bus, "src"))[0].payload == SettingsPayload(voice="marin")


async def test_the_control_plane_replays_greedily_on_request(settings, coordinator):
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
        assert await enqueue_replay(settings, "src", "gjob", greedy=True, again="gjob-2")
        worker = await run_control(settings, ECHO, burst=True, handle_signals=False)
    assert worker.jobs_failed == 0
    pool = await create_pool(
        RedisSettings.from_dsn(settings.redis_url), job_deserializer=job_deserializer
    )
    try:
        job = Job(replay_job_id(settings, "src", "gjob"), pool,
                  _queue_name=queue_name(settings), _deserializer=job_deserializer)  # fmt: skip
        info = await job.result_info()
    finally:
        await pool.aclose()
    assert info is not None and info.success
    assert info.result["identical"] is True and info.result["greedy"] is True
    assert info.result["again"]["target"] == "gjob-2"
    assert info.result["again"]["comparison"]["matched"] == 2


async def test_duplexq_replay_greedy_prints_the_verdict_of_two_greedy_replays(
    settings, coordinator, tmp_path, capsys
):
    from coordinator.launcher.cli import main

    path = tmp_path / "settings.json"
    path.write_text(f'{{"key_prefix": "{settings.key_prefix}"}}')
    echo = tmp_path / "echo.json"
    echo.write_text(ECHO.model_dump_json())
    argv = ["replay", "src", "cli1", "--greedy", "--again", "cli2", "--timeout", "20"]
    argv += ["--settings", str(path), "--redis-url", settings.redis_url, "--pipeline", str(echo)]
    async with running_worker(settings, ECHO, "echo"):
        await _record(coordinator)
        code = await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "replay src -> cli1 (echo, fast, greedy): greedy replays identical" in out
    assert "second greedy replay cli2, against cli1:" in out and "note:" not in out
    assert (await coordinator.authority.status("cli2"))["status"] == "closed"
