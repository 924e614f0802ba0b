"""Publishing a stage's outputs: one atomic step, repaired when refused, never twice.

Each test stages outputs on an actor holding a real lease and moves the
session's authority by hand between staging and publishing, so the refusal
it checks happens every run.
"""

from __future__ import annotations

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.events import OutputEvent, OutputKind, TextPayload, decode_output
from schemas.keys import Keys
from tests.actor_helpers import NEXT, PIPELINE, STAGE, fail_over, owned_actor
from workers.actor import SessionActor, Step, decide
from workers.backends.base import OutputDraft, StageContext
from workers.backends.echo import EchoBackend
from workers.ownership import PublishStatus, StageOwnership


def authority(actor: SessionActor) -> SessionAuthority:
    return SessionAuthority(actor.ownership.bus, PIPELINE)


async def published(actor: SessionActor) -> list:
    bus = actor.ownership.bus
    stream = bus.keys.session(actor.session_id).stage_out(STAGE)
    return [decode_output(e.fields[b"e"]) for e in await bus.xrange(stream) if b"e" in e.fields]


async def applied(actor: SessionActor) -> int:
    bus = actor.ownership.bus
    raw = await bus.hmget(bus.keys.session(actor.session_id).meta, [f"{STAGE}:applied"])
    return int(raw[0] or 0)


def stage_text(actor: SessionActor, text: str, source_seq: int, fence=None) -> None:
    draft = OutputDraft(OutputKind.TEXT_DELTA, text=text)
    actor._stage(draft, fence or actor.ctx.fence, source_seq)


async def test_a_batch_spanning_two_fences_is_published_in_one_step(redis_server, key_prefix):
    """Cause: each fence's group was a publish of its own and the first recorded the
    whole batch's progress; a crash between them lost the second group."""
    async with owned_actor(redis_server, key_prefix) as actor:
        old = actor.ctx.fence
        new = await authority(actor).reserve_response(actor.session_id)
        stage_text(actor, "a", 1, old)
        stage_text(actor, "b", 2, new)
        # Refused as a whole: the second group runs ahead of the authority's turn, and
        # the first, acceptable on its own, is not written either.
        ahead = new.replace(turn_id=5)
        groups = [(new, actor._pending[:1]), (ahead, actor._pending[1:])]
        result = await actor.ownership.publish(
            actor.lease, groups, applied_seq=2, read_id="2-0", out_seq=2
        )
        assert (result.status, result.group) == (PublishStatus.AHEAD, 1)
        assert await published(actor) == [] and await applied(actor) == 0
        # Through the actor: both groups (the echo's older one moved to the current
        # response) and the progress land together.
        actor.applied_seq, actor.read_id = 2, "2-0"
        await actor._flush()
        assert [o.text for o in await published(actor)] == ["a", "b"]
        assert await applied(actor) == 2


async def test_a_cancelled_group_is_dropped_and_the_rest_published(redis_server, key_prefix):
    async with owned_actor(redis_server, key_prefix) as actor:
        before = actor.ctx.fence
        stage_text(actor, "stale", 1, before)
        cancel = await authority(actor).cancel(actor.session_id)
        stage_text(actor, "fresh", 2, cancel.fence)
        actor.applied_seq, actor.read_id = 2, "2-0"
        await actor._flush()
        assert [(o.text, o.fence) for o in await published(actor)] == [("fresh", cancel.fence)]
        assert await applied(actor) == 2


async def test_restamps_follow_every_failover_and_response_in_between(redis_server, key_prefix):
    """Cause: one retry only, and the incarnation restamp kept the old response seq,
    so an input-describing stage's outputs were dropped as ``response``."""
    async with owned_actor(redis_server, key_prefix) as actor:
        stage_text(actor, "x", 1)
        auth = authority(actor)
        await fail_over(actor)
        await auth.reserve_response(actor.session_id)
        # Between each refusal and the retry, another failover: the authority moves again.
        real_publish = actor.ownership.publish
        moves = 3

        async def moving_publish(*args, **kwargs):
            nonlocal moves
            result = await real_publish(*args, **kwargs)
            if result.status is PublishStatus.STALE and moves:
                moves -= 1
                await fail_over(actor)
            return result

        actor.ownership.publish = moving_publish  # type: ignore[method-assign]
        actor.applied_seq, actor.read_id = 1, "1-0"
        await actor._flush()
        current = await auth.current(actor.session_id)
        assert current.incarnation == 4 and current.response_seq == 1
        assert [(o.text, o.fence) for o in await published(actor)] == [("x", current)]
        assert actor.ctx.fence.incarnation == 4


async def test_a_publish_ahead_of_the_authority_is_refused_and_resynced(redis_server, key_prefix):
    async with owned_actor(redis_server, key_prefix) as actor:
        current = actor.ctx.fence
        # As after a Redis that lost its last writes: this stage saw epoch 1, Redis did not.
        actor.ctx.stage_fence.on_interrupt(current.replace(epoch=1))
        stage_text(actor, "from the future", 1)
        actor.applied_seq, actor.read_id = 1, "1-0"
        await actor._flush()
        assert await published(actor) == []
        assert await applied(actor) == 1
        assert actor.ctx.fence == current
        # The session is not deaf: the next output goes out under the real fence.
        stage_text(actor, "now", 2)
        actor.applied_seq, actor.read_id = 2, "2-0"
        await actor._flush()
        assert [(o.text, o.fence) for o in await published(actor)] == [("now", current)]


async def test_a_repeated_publish_writes_nothing_twice(redis_server, key_prefix):
    async with owned_actor(redis_server, key_prefix) as actor:
        stage_text(actor, "once", 1)
        groups = [(actor.ctx.fence, list(actor._pending))]
        for _ in range(2):  # a retry after a lost reply sends the very same call
            result = await actor.ownership.publish(
                actor.lease, groups, applied_seq=1, read_id="1-0", out_seq=1
            )
            assert result.status is PublishStatus.OK
        assert [o.text for o in await published(actor)] == ["once"]


async def test_a_terminal_stages_outputs_are_stored_once_in_the_client_journal(
    redis_server, key_prefix
):
    """Cause: a client-facing stage that no stage reads kept every output twice, in its
    own stream (for takeovers only) and in the client journal; its takeover now reads
    the journal (``tests/test_takeover.py``)."""
    from dataplane.bus import RedisBus
    from schemas.config import echo_pipeline
    from schemas.events import OutputEvent
    from schemas.keys import Keys
    from workers.ownership import StageOwnership

    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        chain = echo_pipeline("thinker", "tts")
        thinker, tts = chain.stages
        both = chain.model_copy(  # a client-facing stage that another stage reads
            update={"stages": (thinker.model_copy(update={"to_client": True}), tts)}
        )
        for pipeline, stage, in_own, in_journal in (
            (echo_pipeline("tts"), "tts", False, True),  # client-facing, read by no stage
            (echo_pipeline("vad", "asr"), "vad", True, False),  # not client-facing
            (both, "thinker", True, True),
        ):
            sid = f"s-{stage}"
            await SessionAuthority(bus, pipeline).open(sid)
            ownership = StageOwnership(bus, pipeline, stage, "w1", 5000)
            assert ownership.journal_only is (in_journal and not in_own)
            _, lease = await ownership.acquire(sid, 0)
            sound = [
                OutputEvent(lease.fence, stage, OutputKind.AUDIO_DELTA, n, 1, data=bytes([n]) * 960)
                for n in (1, 2)
            ]  # fmt: skip
            result = await ownership.publish(
                lease, [(lease.fence, sound)], applied_seq=1, read_id="1-0", out_seq=2
            )
            assert result.status is PublishStatus.OK
            sk = bus.keys.session(sid)
            own = [decode_output(e.fields[b"e"]) for e in await bus.xrange(sk.stage_out(stage))]
            assert own == (sound if in_own else [])
            journal = [decode_output(e.fields[b"e"]) for e in await bus.xrange(sk.client)]
            assert journal == (sound if in_journal else [])
    finally:
        await bus.aclose()


async def test_a_refusal_for_a_cancel_moves_only_the_epoch_of_what_is_read_next(
    redis_server, key_prefix
):
    """Cause (found by the nemesis suite, an answer lost after a Redis restart): a publish
    refused for a cancel the stage had not read yet moved the stage's view of its input
    to the authority's whole fence, including a turn the user's commit had reserved
    since. The upstream output of the turn before that commit, still unread, was then
    dropped as a turn regression and its answer never came."""
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        authority_ = SessionAuthority(bus, PIPELINE)
        await authority_.open("s1")
        ownership = StageOwnership(bus, PIPELINE, NEXT, "w1", 5000)
        _, lease = await ownership.acquire("s1", 0)
        assert lease is not None
        actor = SessionActor(
            lease, ownership, EchoBackend({}), StageContext("s1", NEXT, lease.fence, {})
        )
        before = actor.ctx.fence
        actor._stage(OutputDraft(OutputKind.TEXT_DELTA, text="old"), before, 1)
        actor._producer_fence = before  # still producing the old epoch's answer
        cancelled = await authority_.cancel("s1")  # not read by the stage yet
        committed = await authority_.reserve_response("s1")  # the next turn, reserved
        assert committed.turn_id > cancelled.fence.turn_id
        await actor._flush(progress=False)  # refused: the old epoch's draft is dropped
        # What the upstream stage produced after the cancel, for the turn before the
        # commit, is still to be handled.
        unread = OutputEvent(fence=cancelled.fence, stage=STAGE, kind=OutputKind.TEXT_DELTA,
                             seq=2, source_seq=2, text="new")  # fmt: skip
        assert decide(unread, actor.applied_seq, actor.stage_fence) is Step.HANDLE
        # and the old epoch stays stale.
        old = OutputEvent(fence=before, stage=STAGE, kind=OutputKind.TEXT_DELTA, seq=3,
                          source_seq=3, text="old")  # fmt: skip
        assert decide(old, actor.applied_seq, actor.stage_fence) is Step.DROP
    finally:
        await bus.aclose()


async def test_an_input_after_an_unread_failover_and_cancel_is_answered(redis_server, key_prefix):
    """Cause (found by the nemesis suite on a cluster, an answer lost): another stage's
    failover raised the session's incarnation and a cancel its epoch, neither read by
    this stage yet; the next input, stamped with both, was answered under the stage's
    older fence, its older epoch included, and the publish dropped the answer."""
    async with owned_actor(redis_server, key_prefix) as actor:
        await fail_over(actor)  # the next stage moved: incarnation + 1, control unread
        await authority(actor).cancel(actor.session_id)  # epoch + 1, control unread
        await authority(actor).append(actor.session_id, "append_text", TextPayload("hi"))
        bus = actor.ownership.bus
        entries = await bus.xrange(bus.keys.session(actor.session_id).input)
        await actor.apply([entry for entry in entries if b"e" in entry.fields])
        assert [o.text for o in await published(actor)] == ["hi"]
        assert await applied(actor) == 1
