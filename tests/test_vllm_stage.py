"""The ``vllm`` stage: its pure core, then a real engine behind real stage workers.

The engine tests run vLLM (CPU build) on the tiny model of ``tests.tiny_model``
with greedy sampling, so every response is deterministic. One engine serves
the whole module (it takes about half a minute to start); each test builds
its own backend(s) and workers on it and talks to them through a real
coordinator and a real redis-server.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from coordinator.service import Coordinator
from dataplane.request_ids import make_request_id, parse_request_id
from schemas.config import PipelineConfig, Settings, StageConfig
from schemas.events import (
    AudioPayload,
    CommitPayload,
    ControlEvent,
    ControlKind,
    ConversationPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    TextPayload,
    TokensPayload,
    decode_output,
)
from schemas.fence import Fence
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    eventually,
    greedy_steps,
    held_after,
    model_dir_fixture,
)
from tests.pipeline_helpers import delta_tokens, fast_settings, read_until, running_worker
from tests.pipeline_helpers import outputs_of as outputs
from tests.tiny_model import build_tiny_model
from workers.backends.vllm_history import (
    ChatHistory,
    Produced,
    PromptTooLong,
    classify,
    rebuild,
    released_by,
)
from workers.backends.vllm_options import parse_options
from workers.runtime import Worker

STAGE = "thinker"
ENGINE_OPTIONS = {**TINY_ENGINE_OPTIONS}

# -- the pure core (no engine) ---------------------------------------------------------


def _in(seq: int, payload, mode: InputMode, epoch: int = 0) -> InputEvent:
    return InputEvent(Fence("s1", 0, epoch), seq, seq, mode, payload)


def _text(seq: int, text: str) -> InputEvent:
    return _in(seq, TextPayload(text), InputMode.APPEND_TEXT)


def _commit(seq: int) -> InputEvent:
    return _in(seq, CommitPayload(), InputMode.TURN_COMMIT_ONLY)


def _delta(seq: int, source_seq: int, text: str, ids: tuple[int, ...], inc: int = 0):
    return OutputEvent(
        Fence("s1", inc), STAGE, OutputKind.TEXT_DELTA, seq, source_seq, text, token_ids=ids
    )


def test_release_rule_decodes_request_ids():
    released = Fence("s1", 2, 3)
    assert released_by(make_request_id(Fence("s1", 2, 3), "thinker-t1-r1"), released)
    assert released_by(make_request_id(Fence("s1", 2, 1), "thinker-t1-r1"), released)
    assert released_by(make_request_id(Fence("s1", 1, 9), "thinker-t1-r1"), released)
    assert not released_by(make_request_id(Fence("s1", 2, 4), "thinker-t1-r1"), released)
    assert not released_by(make_request_id(Fence("s1", 3, 0), "thinker-t1-r1"), released)
    # A session whose id merely starts like s1's is another session.
    assert not released_by(make_request_id(Fence("s1-x", 2, 3), "r"), released)
    assert not released_by(make_request_id(Fence("s", 2, 3), "r"), released)
    assert not released_by("duplex-s.czE.i.2.e.3.r.x.extra", released)
    assert not released_by("not-ours", released)


def test_classify_contributions():
    kinds = [
        classify(_text(1, "hi"))[0].name,
        classify(_in(2, TokensPayload((5, 6)), InputMode.APPEND_TOKENS))[0].name,
        classify(_in(3, AudioPayload(b"\0" * 4), InputMode.APPEND_AUDIO_CHUNK))[0].name,
        classify(_commit(4))[0].name,
        classify(_delta(1, 1, "up", (1,)))[0].name,
    ]
    assert kinds == ["USER_PART", "USER_PART", "NOTHING", "COMMIT", "USER_PART"]


def test_rebuild_takes_answers_from_accepted_outputs_and_carries_unfinished_ones():
    history = ChatHistory(max_messages=32)
    inputs = [_text(1, "hello "), _text(2, "there"), _commit(3), _text(4, "more")]
    outputs = [
        _delta(1, 3, "Hi", (10,)),
        _delta(2, 3, " you", (11,)),
        _delta(3, 5, "Par", (12,)),  # commit 5 was not applied yet: carried
        _delta(1, 5, "tial", (13,), inc=1),
    ]
    rebuild(history, inputs, outputs)
    chat = history.chat(lambda ids: "?", system="sys")
    assert chat == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "Hi you"},
    ]
    assert history.pending == [("more", "item_4")]
    assert history.turns == 1
    carried = history.close_user(5)
    assert carried is not None and carried[0] == Produced("Partial", (12, 13))
    assert history.messages[-1].render(str) == "more"


def test_history_merges_unanswered_turns_and_is_bounded():
    history = ChatHistory(max_messages=4)
    for turn in range(4):
        history.add_user(f"q{turn}")
        history.close_user(turn + 1)
        if turn != 1:  # turn 1 was absorbed: no answer
            history.add_assistant(Produced(f"a{turn}"))
    chat = history.chat(str)
    # Oldest dropped first; the stored history starts with a user message.
    assert [(m["role"], m["content"]) for m in chat] == [
        ("user", "q1\nq2"),
        ("assistant", "a2"),
        ("user", "q3"),
        ("assistant", "a3"),
    ]


def test_client_edits_change_exactly_their_items():
    history = ChatHistory(max_messages=32)
    history.add_user("hello", "item_1")
    history.add_user("are you there", "item_2")  # merged into one user message
    history.close_user(3)
    history.add_assistant(Produced("Yes. I am here. Ask me anything."), "item_0_1_1")
    history.edit(ConversationPayload("truncate", "item_0_1_1", text="Yes. I am"))
    history.edit(ConversationPayload("add", "item_x", role="system", text="Be terse."))
    history.edit(ConversationPayload("add", "item_y", role="assistant", text="Noted."))
    history.edit(ConversationPayload("delete", "item_1"))
    history.edit(ConversationPayload("delete", "item_unknown"))  # changes nothing
    assert history.chat(str) == [
        {"role": "user", "content": "are you there"},
        {"role": "assistant", "content": "Yes. I am"},
        {"role": "system", "content": "Be terse."},
        {"role": "assistant", "content": "Noted."},
    ]
    history.edit(ConversationPayload("delete", "item_2"))
    assert [m["role"] for m in history.chat(str)] == ["assistant", "system", "assistant"]


def test_edits_replayed_by_a_rebuild_give_the_same_history():
    from schemas.events import encode_session_payload

    edit = ConversationPayload("truncate", "item_0_0_0", text="Hi")
    passed_on = OutputEvent(Fence("s1", 0, 0, 0, 0), "asr", OutputKind.CONVERSATION, 9,
                            data=encode_session_payload(edit))  # fmt: skip
    inputs = [_text(1, "hello"), _commit(2), passed_on]
    outputs = [_delta(1, 2, "Hi you", (10,))]
    history = ChatHistory(max_messages=32)
    rebuild(history, inputs, outputs)
    assert history.chat(str)[-1] == {"role": "assistant", "content": "Hi"}


def test_a_rebuild_leaves_out_of_band_answers_out_and_hands_on_options_not_taken():
    """A failover's new owner: an out-of-band answer never joined the conversation, and
    a response.create's options no commit took yet are the next response's."""
    import json

    def options(seq: int, **chosen: str) -> InputEvent:
        edit = ConversationPayload("next_response", "", text=json.dumps(chosen))
        return _in(seq, edit, InputMode.EDIT_CONVERSATION)

    inputs = [_text(1, "hi"), _commit(2), options(3, conversation="none"), _commit(4),
              _text(5, "more"), options(6, instructions="Be brief.")]  # fmt: skip
    history = ChatHistory(32)
    pending = rebuild(history, inputs, [_delta(1, 2, "hello", (5,)), _delta(2, 4, "aside", (6,))])
    assert [(m.role, m.parts) for m in history.messages] == [
        ("user", ["hi"]), ("assistant", ["hello"])]  # fmt: skip
    assert pending == {"instructions": "Be brief."}


def test_fit_drops_oldest_exchanges_then_refuses():
    history = ChatHistory(max_messages=32)
    for turn in range(3):
        history.add_user("u" * 10)
        history.close_user(turn + 1)
        history.add_assistant(Produced("a" * 10))
    history.add_user("q" * 10)
    history.close_user(9)

    def count(chat):
        return sum(len(m["content"]) for m in chat)

    chat, tokens = history.fit(str, count, 35, system="s" * 5)
    assert tokens == 35 and chat[0]["role"] == "system" and chat[1]["role"] == "user"
    assert len(chat) == 4  # system, one full exchange, the new question
    with pytest.raises(PromptTooLong):
        history.fit(str, count, 9, system=None)
    history.drop_last_user()
    assert history.messages[-1].role == "assistant"


def test_options_are_validated_with_clear_errors():
    assert parse_options(STAGE, {"model": "/m"}).prompt_budget == 4096 - 256
    with pytest.raises(ValueError, match=r"thinker.*model: Field required"):
        parse_options(STAGE, {})
    with pytest.raises(ValueError, match=r"max_tokens .* below max_model_len"):
        parse_options(STAGE, {"model": "/m", "max_model_len": 64, "max_tokens": 64})
    with pytest.raises(ValueError, match="temprature: Extra inputs"):
        parse_options(STAGE, {"model": "/m", "temprature": 0.5})
    with pytest.raises(ValueError, match="history_max_tokens"):
        parse_options(
            STAGE, {"model": "/m", "max_model_len": 100, "max_tokens": 20, "history_max_tokens": 90}
        )


# -- through the engine ------------------------------------------------------------------

engine_test = engine_test_marks()
model_dir = model_dir_fixture(build_tiny_model, "tiny-model")


def start_engine(model_dir: str):
    from workers.backends.vllm_engine import VllmEngine

    return VllmEngine(parse_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}))


engine = engine_fixture(start_engine)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


def backend_for(engine, **options):
    from workers.backends.vllm_backend import VllmBackend

    merged = {"model": engine.options.model, **ENGINE_OPTIONS, **options}
    return VllmBackend(merged, stage=STAGE, engine=engine)


def chat_pipeline() -> PipelineConfig:
    stage = StageConfig(name=STAGE, backend="vllm", to_client=True, options={"model": "x"})
    return PipelineConfig(name="chat", stages=(stage,))


def has_done(deliveries, **fence):
    return any(
        all(getattr(o.fence, k) == v for k, v in fence.items())
        for o in outputs(deliveries, OutputKind.DONE)
    )


async def reference(engine, prompt: str, max_tokens: int) -> tuple[int, ...]:
    """Token ids the engine produces, uninterrupted and greedily, for ``prompt``."""
    return tuple(
        [i async for step in greedy_steps(engine, prompt, max_tokens) for i in step.token_ids]
    )


def assistant_messages(prompt: str) -> list[str]:
    return re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", prompt, re.S)


@engine_test
async def test_a_text_turn_streams_tokens_then_done(engine, settings):
    backend = backend_for(engine, max_tokens=12)
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            got = []
            for sid in ("s1", "s2"):  # one after the other: each request runs alone
                await coordinator.open(sid)
                await coordinator.append(sid, "append_text", TextPayload("hello "))
                await coordinator.append(sid, "append_text", TextPayload("there"))
                await coordinator.commit(sid)
                got += await read_until(coordinator, has_done)
            by_session = {
                sid: [o for o in outputs(got) if o.fence.session_id == sid] for sid in ("s1", "s2")
            }
            first = by_session["s1"]
            # Deltas, then one done: twelve tokens in all. Each step is flushed as it
            # comes, but vLLM merges the steps a busy consumer has not taken yet, so on
            # a loaded machine a delta may carry more than one token.
            kinds = [o.kind for o in first]
            assert kinds == [OutputKind.TEXT_DELTA] * (len(first) - 1) + [OutputKind.DONE]
            deltas, done = first[:-1], first[-1]
            assert deltas and all(o.token_ids and o.text for o in deltas)
            assert sum(len(o.token_ids) for o in deltas) == 12
            assert [o.seq for o in first] == list(range(1, len(first) + 1))
            assert all(o.source_seq == 3 for o in first)
            request_id = done.meta["request_id"]
            assert {o.meta["request_id"] for o in deltas} == {request_id}
            assert parse_request_id(request_id)[:3] == ("s1", 0, 0)
            assert done.meta["finish_reason"] == "length" and done.meta["tokens"] == 12
            text = "".join(o.text for o in deltas)
            ids = tuple(i for o in deltas for i in o.token_ids)
            assert engine.decode(ids) == text
            # Greedy: the same conversation gives the same answer in another session.
            assert "".join(o.text for o in by_session["s2"][:-1]) == text
            # What the engine got: the chat template over the session's history.
            prompt = backend.records[request_id].prompt
            assert prompt == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
            assert ids == await reference(engine, prompt, 12)

            # The next turn's prompt carries the first exchange as the user got it.
            await coordinator.append("s1", "append_text", TextPayload("and then?"))
            await coordinator.commit("s1")
            more = await read_until(coordinator, has_done)
            second = outputs(more, OutputKind.DONE)[0].meta["request_id"]
            prompt = backend.records[second].prompt
            assert prompt.startswith("<|im_start|>user\nhello there<|im_end|>\n")
            assert assistant_messages(prompt) == [text]
            assert "<|im_start|>user\nand then?<|im_end|>" in prompt
            assert not engine.live_request_ids()
    finally:
        await coordinator.aclose()


@engine_test
async def test_b_barge_in_aborts_the_running_request(engine, settings):
    max_tokens = 400  # about three seconds of generation on CPU, uninterrupted
    backend = backend_for(engine, max_tokens=max_tokens)
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            # The engine stops where it stands after a few tokens, so the request is
            # certainly still running when the cancel reaches the worker.
            async with held_after(engine, tokens=4) as hold:
                await coordinator.append("s1", "append_text", TextPayload("tell me a story"))
                await coordinator.commit("s1")
                await hold.wait()
                before = await read_until(coordinator, lambda d: delta_tokens(d) >= 3)
                request_id = outputs(before)[0].meta["request_id"]
                assert request_id in engine.live_request_ids()  # mid-generation

                result = await coordinator.cancel("s1", reason="barge_in")
                assert result.cancelled.epoch == 0 and result.fence.epoch == 1
                # The worker applies the cancel: the request leaves the engine, aborted.
                await eventually(lambda: request_id not in engine.live_request_ids())
            record = backend.records[request_id]
            await eventually(lambda: record.outcome != "running")
            assert record.outcome == "released"
            assert 3 <= record.tokens < max_tokens
            assert list(backend.released) == [result.cancelled]
            assert engine.unfinished() == 0

            # Nothing of epoch 0 is delivered after the cancel returned.
            await coordinator.append("s1", "append_text", TextPayload("stop, another one"))
            await coordinator.commit("s1")
            after = await read_until(coordinator, lambda d: has_done(d, epoch=1))
            assert outputs(after) and all(o.fence.epoch == 1 for o in outputs(after))
            assert not [o for o in outputs(after) if o.meta.get("request_id") == request_id]

            # The history kept the interrupted answer cut where it was stopped:
            # what was published, maybe a queued token more, and a prefix of
            # the answer it would have given.
            # (A client-facing stage that no stage reads keeps its outputs in the journal.)
            sk = coordinator.bus.keys.session("s1")
            entries = await coordinator.bus.xrange(sk.client)
            published = [decode_output(e.fields[b"e"]) for e in entries if b"e" in e.fields]
            published = [o for o in published if o.stage == STAGE]
            old_text = "".join(o.text for o in published if o.meta.get("request_id") == request_id)
            new_request = outputs(after, OutputKind.DONE)[0].meta["request_id"]
            (kept,) = assistant_messages(backend.records[new_request].prompt)
            full = await reference(engine, record.prompt, max_tokens)
            assert len(old_text) >= 3 and kept.startswith(old_text)
            assert kept == engine.decode(full[: record.tokens])
            assert len(full) == max_tokens
            assert not engine.live_request_ids()
    finally:
        await coordinator.aclose()


@engine_test
async def test_c_failover_mid_generation_continues_with_the_rebuilt_history(
    engine, redis_server, key_prefix
):
    # The shipped lease TTL and heartbeat: this test needs exactly one failover, and with
    # the fast settings' 1 s TTL an event-loop stall of under a second (the engine and
    # both workers share two cores) lost the new owner its lease and made a second one.
    shipped = Settings()
    settings = fast_settings(redis_server.url, key_prefix, lease_ttl_ms=shipped.lease_ttl_ms,
                             heartbeat_ms=shipped.heartbeat_ms)  # fmt: skip
    # Short enough that both exchanges fit max_model_len (1024).
    max_tokens = 400
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)
    first_backend = backend_for(engine, max_tokens=max_tokens)
    first = Worker(settings, pipeline, STAGE, worker_id="w1", backend=first_backend)
    first_task = asyncio.create_task(first.run())
    try:
        await coordinator.open("s1")
        await coordinator.append("s1", "append_text", TextPayload("hello there"))
        await coordinator.commit("s1")
        turn1 = await read_until(coordinator, has_done)
        answer1 = "".join(o.text for o in outputs(turn1, OutputKind.TEXT_DELTA))
        # The engine stops where it stands after a few tokens of the second answer,
        # so the request is certainly still running when the worker dies.
        async with held_after(engine, tokens=4) as hold:
            await coordinator.append("s1", "append_text", TextPayload("what next?"))
            await coordinator.commit("s1")
            await hold.wait()
            turn2 = await read_until(coordinator, lambda d: len(outputs(d)) >= 1)
            doomed = outputs(turn2)[0].meta["request_id"]
            assert doomed in engine.live_request_ids()

            # The worker dies: its work stops at once and it hands nothing back, so
            # the session moves only when its lease expires.
            async def no_hand_back(*args, **kwargs):
                return None

            first.ownership.release = no_hand_back
            first.request_stop()
            await asyncio.wait_for(first_task, 20)
            await eventually(lambda: doomed not in engine.live_request_ids())
        assert first_backend.records[doomed].outcome == "cancelled"

        second_backend = backend_for(engine, max_tokens=max_tokens)
        async with running_worker(
            settings, pipeline, STAGE, worker_id="w2", backend=second_backend
        ):
            rest = await read_until(coordinator, lambda d: has_done(d, incarnation=1), timeout=60)
        turn2 += rest
        barrier = [
            i
            for i, d in enumerate(turn2)
            if isinstance(d.event, ControlEvent) and d.event.kind is ControlKind.FAILOVER
        ]
        assert barrier, "no failover barrier reached the client"
        assert all(o.fence.incarnation == 1 for o in outputs(turn2[barrier[0] :]))
        heard_before = outputs(turn2[: barrier[0]], OutputKind.TEXT_DELTA)
        assert heard_before and all(o.fence.incarnation == 0 for o in heard_before)

        # The new owner's prompt: the first exchange as delivered, the second
        # question, and the part of the answer the user already got.
        (continued,) = [r for r in second_backend.records.values() if r.outcome.startswith("fin")]
        partial = "".join(o.text for o in heard_before)
        assert continued.prompt == (
            "<|im_start|>user\nhello there<|im_end|>\n"
            f"<|im_start|>assistant\n{answer1}<|im_end|>\n"
            "<|im_start|>user\nwhat next?<|im_end|>\n"
            f"<|im_start|>assistant\n{partial}"
        )
        # ... so the answer goes on where it stopped and ends as if never cut.
        answer2 = outputs(turn2, OutputKind.TEXT_DELTA)
        answer2_ids = tuple(i for o in answer2 for i in o.token_ids)
        full = await reference(engine, first_backend.records[doomed].prompt, max_tokens)
        assert answer2_ids == full
        done = outputs(turn2, OutputKind.DONE)[-1]
        assert done.fence.incarnation == 1 and done.meta["finish_reason"] == "length"
        assert done.meta["tokens"] == max_tokens - sum(len(o.token_ids) for o in heard_before)
        assert not engine.live_request_ids()
    finally:
        if not first_task.done():
            first_task.cancel()
        await coordinator.aclose()


@engine_test
async def test_d_a_spoken_sentence_reaches_the_thinkers_prompt(engine, settings):
    """espeak-ng speech -> vad -> asr -> the vLLM thinker: the transcription is its prompt."""
    import numpy as np

    from tests.speech import chunks, silence, speak
    from workers.backends.asr import AsrBackend
    from workers.backends.vad import VadBackend

    pipeline = PipelineConfig(
        name="spoken",
        stages=(
            StageConfig(name="vad", backend="vad"),
            StageConfig(name="asr", backend="asr", input="vad"),
            StageConfig(
                name=STAGE, backend="vllm", input="asr", to_client=True, options={"model": "x"}
            ),
        ),
    )
    thinker = backend_for(engine, max_tokens=4)
    coordinator = Coordinator(settings, pipeline)
    try:
        async with (
            running_worker(settings, pipeline, "vad", backend=VadBackend({})),
            running_worker(settings, pipeline, "asr", backend=AsrBackend({})),
            running_worker(settings, pipeline, STAGE, backend=thinker),
        ):
            await coordinator.open("spoken")
            audio = np.concatenate(
                [silence(0.3), speak("good morning how are you today"), silence(1.0)]
            )
            for payload in chunks(audio, ms=40):
                await coordinator.append("spoken", "append_audio_chunk", payload)
            got = await read_until(coordinator, has_done, timeout=120)
        request_id = outputs(got, OutputKind.DONE)[0].meta["request_id"]
        prompt = thinker.records[request_id].prompt
        user = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)
        assert len(user) == 1
        assert re.findall(r"[a-z]+", user[0].lower()) == [
            "good", "morning", "how", "are", "you", "today"
        ]  # fmt: skip
    finally:
        await coordinator.aclose()


@engine_test
async def test_e_the_sessions_instructions_replace_the_system_prompt(engine, settings):
    backend = backend_for(engine, max_tokens=2, system_prompt="You are a stage default.")
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)

    async def turn(text: str) -> str:
        await coordinator.append("s1", "append_text", TextPayload(text))
        await coordinator.commit("s1")
        got = await read_until(coordinator, has_done)
        return backend.records[outputs(got, OutputKind.DONE)[0].meta["request_id"]].prompt

    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            first = await turn("hi")
            await coordinator.append(
                "s1", InputMode.UPDATE_SESSION, SettingsPayload(instructions="Answer in French.")
            )
            second = await turn("and now?")
            await coordinator.append("s1", InputMode.UPDATE_SESSION, SettingsPayload())
            third = await turn("back?")
        system = "<|im_start|>system\n{}<|im_end|>\n"
        assert first.startswith(system.format("You are a stage default."))
        assert second.startswith(system.format("Answer in French."))
        assert third.startswith(system.format("You are a stage default."))
    finally:
        await coordinator.aclose()


@engine_test
async def test_f_the_sessions_max_output_tokens_caps_each_answer(engine, settings):
    """``max_output_tokens`` (``session.update``) reaches the engine's sampling as its
    max_tokens; the stage's own applies again once the session says "inf"."""
    backend = backend_for(engine, max_tokens=12)
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)

    async def turn(text: str) -> tuple[int, str]:
        await coordinator.append("s1", "append_text", TextPayload(text))
        await coordinator.commit("s1")
        done = outputs(await read_until(coordinator, has_done), OutputKind.DONE)[0]
        return done.meta["tokens"], done.meta["finish_reason"]

    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            await coordinator.append(
                "s1", InputMode.UPDATE_SESSION, SettingsPayload(max_output_tokens=3)
            )
            assert await turn("hi") == (3, "length")
            await coordinator.append("s1", InputMode.UPDATE_SESSION, SettingsPayload())
            assert await turn("and now?") == (12, "length")
    finally:
        await coordinator.aclose()


@engine_test
async def test_g_a_forced_call_and_its_result_go_through_the_model(engine, settings):
    """tool_choice names a function: the engine is constrained to its arguments' schema;
    the call joins the history, the client's result comes back as the tool's message."""
    import json

    from schemas.tools import FunctionTool, tools_text

    schema = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
              "required": ["tz"], "additionalProperties": False}  # fmt: skip
    tools = tools_text((FunctionTool(name="get_time", description="now", parameters=schema),))
    backend = backend_for(engine, max_tokens=24, temperature=0.0)
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            forced = SettingsPayload(tools=tools, tool_choice="function:get_time")
            await coordinator.append("s1", InputMode.UPDATE_SESSION, forced)
            await coordinator.append("s1", "append_text", TextPayload("what time is it"))
            await coordinator.commit("s1")
            got = await read_until(coordinator, has_done)
            [call] = outputs(got, OutputKind.FUNCTION_CALL)
            assert not outputs(got, OutputKind.TEXT_DELTA)  # a forced call is no text
            assert (call.meta["name"], call.meta["call_id"]) == ("get_time", "call_0_1_1_0")
            assert json.loads(call.text)["tz"] in ("UTC", "CET")
            # The result, then a free answer: the prompt holds the tools, the call and
            # the result, as the model's own chat template writes them.
            result = ConversationPayload("add", "item_r", role="tool", text="12:00",
                                         call_id="call_0_1_1_0")  # fmt: skip
            await coordinator.append("s1", InputMode.EDIT_CONVERSATION, result)
            auto = SettingsPayload(tools=tools, tool_choice="auto")
            await coordinator.append("s1", InputMode.UPDATE_SESSION, auto)
            await coordinator.commit("s1")
            more = await read_until(coordinator, has_done)
            request_id = outputs(more, OutputKind.DONE)[0].meta["request_id"]
            prompt = backend.records[request_id].prompt
        assert '{"name": "get_time"' in prompt and "<tools>" in prompt
        assert f'"arguments": {call.text}}}</tool_call>' in prompt
        assert prompt.endswith(
            "<|im_start|>user\n<tool_response>12:00</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        # Free text of the tiny model names no function: only text came.
        assert not outputs(more, OutputKind.FUNCTION_CALL) and outputs(more, OutputKind.TEXT_DELTA)
    finally:
        await coordinator.aclose()


@engine_test
async def test_h_the_hermes_parser_finds_calls_in_free_text(engine):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    found = engine.parse_calls(
        "hermes", 'One moment. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'
        "</tool_call>", tools,
    )  # fmt: skip
    assert [(c.function.name, c.function.arguments) for c in found.tool_calls] == [
        ("get_time", '{"tz": "UTC"}')
    ]
    assert found.content == "One moment. "
