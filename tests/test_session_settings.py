"""Session settings (``session.update``) reach every stage, in log order.

The coordinator appends them to the session log; each stage's runtime keeps them in
``StageContext.session`` and passes them down the chain as a ``settings`` output. They
belong to the session, not to a response: a cancel neither absorbs nor drops them, and
a new owner of a stage starts from the session's stored settings.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from coordinator.service import Coordinator
from dataplane.authority import SessionAuthority
from dataplane.bus import Entry, RedisBus
from schemas.config import echo_pipeline
from schemas.events import (
    CommitPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    TextPayload,
    decode_input,
    decode_output,
    encode_event,
    encode_session_payload,
)
from schemas.keys import Keys
from schemas.realtime import SessionConfig
from schemas.session_shape import merged, stage_settings
from tests.actor_helpers import PIPELINE, STAGE, owned_actor
from tests.pipeline_helpers import fast_settings, outputs_of, read_until, running_worker
from tests.realtime_helpers import Client, serving
from workers.backends.base import OutputDraft, StageContext, StageEvent
from workers.backends.echo import EchoBackend

SID = "s1"


def test_a_ga_update_becomes_the_settings_stages_act_on():
    config = merged(SessionConfig(), {
        "type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}, "output": {"voice": "marin"}},
    })  # fmt: skip
    assert stage_settings(config) == SettingsPayload(
        instructions="Be brief.", audio_output=False, voice="marin", server_vad=False,
        interrupt_response=False,
    )  # fmt: skip
    tuned = merged(config, {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.7, "silence_duration_ms": 800}}}})  # fmt: skip
    settings = stage_settings(tuned)
    assert settings.server_vad and settings.vad_threshold == 0.7
    assert settings.vad_silence_ms == 800 and settings.vad_prefix_padding_ms is None
    assert stage_settings(SessionConfig()) == SettingsPayload()


def test_greedy_is_a_replays_setting_that_no_client_update_sets_or_clears():
    for update in ({"greedy": True}, {"type": "realtime", "greedy": True}):
        assert not stage_settings(merged(SessionConfig(), update)).greedy
    replayed = SessionConfig(greedy=True)  # what a greedy replay stores for the target
    assert stage_settings(replayed) == SettingsPayload(greedy=True)
    # A client attached to a greedy target keeps it greedy while changing the rest.
    updated = merged(replayed, {"instructions": "Be brief.", "greedy": False})
    assert stage_settings(updated) == SettingsPayload(instructions="Be brief.", greedy=True)


def _entry(n: int, event: InputEvent | OutputEvent) -> Entry:
    return Entry("in", f"{n}-0", {b"e": encode_event(event)})


async def test_settings_accepted_before_a_cancel_are_applied_and_passed_on(
    redis_server, key_prefix
):
    async with owned_actor(redis_server, key_prefix) as actor:
        before = actor.ctx.fence
        settings = SettingsPayload(instructions="Speak slowly.")
        update = InputEvent(before, 1, 1, InputMode.UPDATE_SESSION, settings)
        # The cancel lands in Redis after the update was accepted and before this stage
        # read it: the update's epoch is behind, which would absorb any other input.
        await SessionAuthority(actor.ownership.bus, PIPELINE).cancel(actor.session_id)
        await actor.apply([_entry(1, update)])
        assert actor.ctx.session == settings
        bus = actor.ownership.bus
        stream = bus.keys.session(actor.session_id).stage_out(STAGE)
        entries = await bus.xrange(stream)
        published = [decode_output(e.fields[b"e"]) for e in entries if b"e" in e.fields]
        # Passed on although its publish was refused for the old epoch: moved to the
        # current fence, not dropped with the response's outputs.
        assert [(o.kind, o.fence.epoch, o.source_seq) for o in published] == [
            (OutputKind.SETTINGS, before.epoch + 1, 1)
        ]
        assert actor.applied_seq == 1


async def test_a_settings_output_of_an_older_epoch_is_applied_where_a_delta_is_dropped(
    redis_server, key_prefix
):
    async with owned_actor(redis_server, key_prefix) as actor:
        old = actor.ctx.fence
        actor.stage_fence.on_cancel(old.replace(epoch=old.epoch + 1))
        settings = SettingsPayload(voice="marin")
        passed = OutputEvent(
            old, "up", OutputKind.SETTINGS, 1, data=encode_session_payload(settings)
        )
        stale = OutputEvent(old, "up", OutputKind.TEXT_DELTA, 2, text="old answer")
        await actor.apply([_entry(1, passed), _entry(2, stale)])
        assert actor.ctx.session == settings
        assert not [e for e in actor._pending if e.kind is OutputKind.TEXT_DELTA]


class _Reporter(EchoBackend):
    """Echo, and at each turn end the instructions this stage holds, as ``[...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.starting: list[SettingsPayload] = []

    async def start(self, ctx: StageContext, inputs: Any, outputs: Any) -> None:
        self.starting.append(ctx.session)

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        ends = isinstance(event, OutputEvent) and event.kind is OutputKind.DONE
        if ends or (isinstance(event, InputEvent) and isinstance(event.payload, CommitPayload)):
            yield OutputDraft(OutputKind.TEXT_DELTA, text=f"[{ctx.session.instructions}]")
        async for draft in super().handle(ctx, event):
            yield draft


def _reports(deliveries: list[Any]) -> list[str]:
    texts = [o.text for o in outputs_of(deliveries, OutputKind.TEXT_DELTA)]
    return [t for t in texts if t.startswith("[")]


def _done(deliveries: list[Any]) -> bool:
    return bool(outputs_of(deliveries, OutputKind.DONE))


async def test_settings_travel_down_the_chain_in_log_order_and_survive_a_new_owner(
    redis_server, key_prefix
):
    settings = fast_settings(redis_server.url, key_prefix)
    pipeline = PIPELINE  # echo -> next -> client
    coordinator = Coordinator(settings, pipeline)
    first, second = _Reporter(), _Reporter()
    try:
        await coordinator.open(SID)
        async with (
            running_worker(settings, pipeline, "echo", backend=first),
            running_worker(settings, pipeline, "next", backend=second),
        ):
            await coordinator.commit(SID)
            got = await read_until(coordinator, _done)
            assert _reports(got) == ["[]", "[]"]  # the first stage's, echoed; the second's
            await coordinator.append(
                SID, InputMode.UPDATE_SESSION, SettingsPayload(instructions="one")
            )
            await coordinator.append(SID, InputMode.APPEND_TEXT, TextPayload("hi"))
            await coordinator.commit(SID)
            got = await read_until(coordinator, _done)
            assert _reports(got) == ["[one]", "[one]"]
            # Nothing of the settings reaches the client.
            assert not outputs_of(got, OutputKind.SETTINGS)
        # Both stages restart on new workers: they start from the session's stored
        # settings (what the coordinator keeps for a resume), then follow the log.
        sk = coordinator.bus.keys.session(SID)
        stored = SessionConfig(instructions="one")
        await coordinator.bus.hset(sk.meta, {"config": stored.model_dump_json()})
        third, fourth = _Reporter(), _Reporter()
        async with (
            running_worker(settings, pipeline, "echo", backend=third),
            running_worker(settings, pipeline, "next", backend=fourth),
        ):
            await coordinator.commit(SID)
            got = await read_until(coordinator, _done)
            assert _reports(got) == ["[one]", "[one]"]
            assert third.starting[-1].instructions == "one"
            assert fourth.starting[-1].instructions == "one"
            await coordinator.append(
                SID, InputMode.UPDATE_SESSION, SettingsPayload(instructions="two")
            )
            await coordinator.commit(SID)
            got = await read_until(coordinator, _done)
            assert _reports(got) == ["[two]", "[two]"]
    finally:
        await coordinator.aclose()


async def test_an_unchanged_update_appends_nothing_to_the_log(redis_server, key_prefix):
    """Only a change of what stages act on travels: a client re-sending its session (or
    changing a field only the coordinator reads) costs the pipeline nothing."""
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)
    async with serving(settings, echo_pipeline("echo")) as base, Client.connect(base) as client:
        sid = (await client.recv())["session"]["id"]
        for update in ({"instructions": "x"}, {"instructions": "x"},
                       {"input_audio_sample_rate": 16000}):  # fmt: skip
            await client.send({"type": "session.update", "session": update})
            await client.until("session.updated")
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        entries = await bus.xrange(bus.keys.session(sid).input)
    finally:
        await bus.aclose()
    log = [decode_input(e.event) for e in entries]
    assert [e.mode for e in log] == [InputMode.UPDATE_SESSION]
    assert log[0].payload == SettingsPayload(instructions="x")
