"""One session's events for one stage: applied in log order, exactly once.

The actor owns a lease on (session, stage). The worker's data reader hands it
batches of stream entries in order; the control reader calls ``on_control``
directly, so a cancel never waits behind queued data.

Per entry the decision is (``decide``, pure):

- a fence barrier (control entry in an upstream stream) moves the view;
- an event at or below the applied ``seq`` was applied before (a redelivery
  or a duplicated XADD) and is skipped;
- an upstream output whose fence regressed is dropped and counted;
- an input accepted before the current epoch is absorbed: it joins the
  model's context but nothing answers it;
- anything else is handled by the backend.

Backend work for one event runs in a producer task that only talks to the
backend; drafts come back through a queue and are published by the actor
itself, so cancelling the producer (on a cancel control) never interrupts a
Redis call. A backend that has an event's whole answer at once gives it from
``answer_now`` instead (nothing to wait for, so nothing to cancel), and the
actor stages it directly. The batches the data reader queued while the actor
was busy are applied as one (``next_batch``).

Non-flush drafts of a batch are published together with the progress cursor in
one atomic step, which is what makes application
exactly-once: a crash before that step re-delivers the events, after it they
are skipped by ``seq``.

A publish a full Redis refuses (``dataplane.full``) wrote nothing: the actor makes it
again with backoff for as long as its lease holds (renewals run on a full Redis), so
nothing is failed, dropped or skipped, and the session goes on once Redis has room
(``tests/test_redis_full.py``).

Flush drafts (a streaming answer's tokens) are published ahead of the cursor,
coalesced (``workers.coalesce``): an answer's first one at once, later ones
together at most once per window or per ``cap`` drafts, and any still held when
the answer ends then. Each stays its own output. A cancel discards what is held
as it discards any staged draft: its publish is refused for the old epoch and
the drafts are dropped and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from enum import Enum, auto

import msgspec

from dataplane.bus import Entry
from dataplane.full import until_room
from dataplane.logs import session_extra
from dataplane.metrics import (
    BARGE_IN_REACTION,
    COALESCE_DELAY,
    DROPPED_STALE,
    EVENTS_IN,
    EVENTS_OUT,
    PUBLISHES,
)
from dataplane.sessions import MismatchReason, fence_mismatch
from dataplane.stage_fence import StageFence, released
from schemas.config import Settings
from schemas.errors import WireDecodeError
from schemas.events import (
    ControlEvent,
    ControlKind,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    decode_control,
    decode_event,
    encode_session_payload,
    is_session_event,
    passed_down_kind,
    session_payload_of,
)
from schemas.fence import Fence
from workers.backends.base import OutputDraft, StageBackend, StageContext, StageEvent
from workers.coalesce import DEFAULT_POLICY, CoalescePolicy, Coalescer
from workers.failpoints import failpoint
from workers.ownership import (
    Lease,
    OutputGroup,
    PublishResult,
    PublishStatus,
    StageOwnership,
)
from workers.stage_trace import StageTracer

log = logging.getLogger("duplexq.worker")

PUBLISH_ATTEMPTS = 64
"""Most refusals one publish repairs (restamp or drop a group) before giving up."""


class _Due(Enum):
    """What waiting for the producer's next draft returns when held drafts are due."""

    DUE = auto()


class Step(Enum):
    BARRIER = auto()
    SKIP = auto()
    DROP = auto()
    ABSORB = auto()
    HANDLE = auto()


class ActorState(Enum):
    RUNNING = auto()
    LOST = auto()
    """The lease moved to another worker; this actor may publish nothing more."""
    CLOSED = auto()
    STOPPED = auto()
    FAILED = auto()
    """Applying an event raised: the worker hands the session back or quarantines it."""


def decide(event: StageEvent | ControlEvent, applied_seq: int, fence: StageFence) -> Step:
    """What to do with one entry of the stage's input (pure but for the upstream view,
    which an upstream output that is handled moves)."""
    if isinstance(event, ControlEvent):
        return Step.BARRIER
    if event.seq <= applied_seq:
        return Step.SKIP
    if isinstance(event, OutputEvent):
        return Step.DROP if fence.judge_upstream(event.fence) is not None else Step.HANDLE
    if fence.is_stale(event.fence):
        return Step.ABSORB
    return Step.HANDLE


class SessionActor:
    """Applies one session's events for one stage while its lease holds."""

    def __init__(
        self,
        lease: Lease,
        ownership: StageOwnership,
        backend: StageBackend,
        ctx: StageContext,
        published: Mapping[int, int] | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.lease = lease
        self._published_before = dict(published or {})
        """Input seq -> drafts a previous owner published for it before it died (see
        ``workers.rebuild``): that many of the answer's first drafts are dropped."""
        self.ownership = ownership
        self.backend = backend
        self.ctx = ctx
        self.stage_fence = ctx.stage_fence
        """The fence this stage serves and its view of the upstream stream; the upstream
        stream is read from ``read_id`` on, where the incarnation may still be an older
        one (outputs published before a failover's barrier)."""
        self.applied_seq = lease.applied_seq
        self.read_id = lease.read_id
        self.out_seq = lease.out_seq
        self.read_cursor = lease.read_id
        """Last entry handed to this actor by the data reader."""
        self.control_cursor = "0-0"
        self.state = ActorState.RUNNING
        self.queue: asyncio.Queue[list[Entry]] = asyncio.Queue()
        self._pending: list[OutputEvent] = []
        self._published_seq = lease.applied_seq
        self._producer: asyncio.Task[None] | None = None
        self._producer_fence: Fence | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self._proactive: list[OutputDraft] = []
        self.backlog: deque[tuple[int, int]] = deque()
        """(ms of a queued batch's first entry, its size), oldest first: lag and pending."""
        self.coalesce = DEFAULT_POLICY if settings is None else CoalescePolicy.of(settings)
        # The per-event counters, looked up once (a label lookup costs a lock and a dict).
        self._events_in = EVENTS_IN.labels(stage=ctx.stage)
        self._taken_in = 0
        """Events of the batch being applied, for ``_events_in``."""
        self._events_out = EVENTS_OUT.labels(stage=ctx.stage)
        self._publishes = PUBLISHES.labels(stage=ctx.stage)
        self._answer_now = getattr(backend, "answer_now", None)
        """The backend's ``AnswersAtOnce.answer_now``, if it has one."""
        self.tracer: StageTracer | None = None
        """Set by the worker while tracing is on (``workers.stage_trace``)."""

    def enqueue(self, batch: list[Entry]) -> None:
        """Queue a batch read from the stage's input (called by the data reader)."""
        if batch:
            self.backlog.append((int(batch[0].id.split("-", 1)[0]), len(batch)))
        self.queue.put_nowait(batch)

    async def next_batch(self) -> list[Entry]:
        """The entries to apply next: every batch queued by now, as one. Under load
        batches queue up while the one before is published; applied together they
        cost one publish instead of one each."""
        batch = await self.queue.get()
        if self.queue.empty():
            return batch
        merged = list(batch)
        while not self.queue.empty():
            merged += self.queue.get_nowait()
        return merged

    def pending(self, now_ms: int) -> tuple[int, float]:
        """(entries read but not applied, seconds since the oldest was written)."""
        if not self.backlog:
            return 0, 0.0
        return sum(n for _, n in self.backlog), max(0.0, (now_ms - self.backlog[0][0]) / 1000)

    @property
    def session_id(self) -> str:
        return self.lease.session_id

    @property
    def active(self) -> bool:
        return self.state is ActorState.RUNNING

    # -- data path -----------------------------------------------------------

    def emit(self, draft: OutputDraft) -> None:
        """A draft from the backend outside ``handle``'s own yields, under the current fence.

        During a batch it joins the batch's outputs in order (a VAD announcing speech
        after its barge-in); between batches it wakes the actor's loop to publish it.
        """
        if not self.active:
            return
        if not self.idle.is_set():
            self._stage(draft, self.ctx.fence, self.applied_seq)
            return
        self._proactive.append(draft)
        self.queue.put_nowait([])

    async def apply(self, entries: list[Entry]) -> None:
        """Apply one batch of entries, then publish outputs and progress together."""
        self.idle.clear()
        try:
            self._stage_proactive()
            for entry in entries:
                if not self.active:
                    return
                await self._apply_entry(entry)
            # Drafts the backend emits while a publish is under way are staged for the
            # next one: publish until none is left, or they would wait for an event.
            while self.active:
                await self._flush()
                if not self._pending and not self._proactive:
                    break
                self._stage_proactive()
        finally:
            if self._taken_in:  # counted once per batch: an increment takes a lock
                self._events_in.inc(self._taken_in)
                self._taken_in = 0
            covered = len(entries)  # whole queued batches (``next_batch``)
            while covered > 0 and self.backlog:
                covered -= self.backlog.popleft()[1]
            if self.queue.empty():
                self.idle.set()

    def _stage_proactive(self) -> None:
        proactive, self._proactive = self._proactive, []
        for draft in proactive:
            self._stage(draft, self.ctx.fence, self.applied_seq)

    async def _apply_entry(self, entry: Entry) -> None:
        event = self._decode(entry)
        if event is None:
            await self.count_drop("undecodable")
            self._advance(entry.id, None)
            return
        step = decide(event, self.applied_seq, self.stage_fence)
        if isinstance(event, ControlEvent):
            self.stage_fence.on_barrier(event.fence)
            self._advance(entry.id, None)
            return
        self._taken_in += 1
        if step is Step.SKIP:
            return
        if is_session_event(event):
            await self._configure(event)
            self._advance(entry.id, event.seq)
            return
        if step is Step.DROP:
            await self.count_drop(self.stage_fence.drop_reason(event.fence))
        elif step is Step.ABSORB and not self.backend.continuous_input:
            await self.backend.absorb(self.ctx, event)
        else:
            failpoint("after_read", event.seq)
            self.stage_fence.follow(event.fence)
            if self.tracer is not None:
                self.tracer.took(event)
            await self._handle(event)
            if self.tracer is not None:
                self.tracer.handled()
            if not self.active:
                return  # stopped mid-event: it stays unapplied for the next owner
        self._advance(entry.id, event.seq)

    async def _configure(self, event: StageEvent) -> None:
        """A session event: new settings (the backend sees them from the next event on)
        or a conversation edit (a backend that keeps the conversation takes it in as
        context, ``absorb``); either way the stages downstream get it in the same place
        of their input.

        Session events belong to the session, not to a response: an interruption
        neither absorbs nor drops them (a passed-on one is applied whatever its fence),
        and a publish refused for its fence moves them to the current one (``_repair``)."""
        payload = session_payload_of(event)
        if payload is None:
            await self.count_drop("undecodable")
            return
        if isinstance(payload, SettingsPayload):
            self.ctx.session = payload
        elif payload.op == "next_response":
            self.ctx.next_response = json.loads(payload.text or "{}")
        elif self.backend.edits_conversation:
            await self.backend.absorb(self.ctx, event)
        if self.ownership.feeds_stages:
            draft = OutputDraft(passed_down_kind(payload), data=encode_session_payload(payload))
            self._stage(draft, self.ctx.fence, event.seq)

    def _decode(self, entry: Entry) -> StageEvent | ControlEvent | None:
        try:
            if b"e" in entry.fields:
                decoded = decode_event(entry.event)
                if isinstance(decoded, ControlEvent):
                    raise WireDecodeError("control event in a data field")
                return decoded
            if b"c" in entry.fields:
                return decode_control(entry.fields[b"c"])
            raise WireDecodeError("entry has no event field (trimmed?)")
        except WireDecodeError as exc:
            log.warning("dead-lettering entry %s: %s", entry.id, exc, extra=self._extra())
            return None

    def _advance(self, entry_id: str, seq: int | None) -> None:
        self.read_id = entry_id
        if seq is not None:
            self.applied_seq = max(self.applied_seq, seq)

    async def _handle(self, event: StageEvent) -> None:
        if self._answer_now is not None and self._answered_now(event):
            return
        fence = self.ctx.fence
        drafts: asyncio.Queue[OutputDraft | None] = asyncio.Queue()

        async def produce() -> None:
            async for draft in self.backend.handle(self.ctx, event):
                drafts.put_nowait(draft)

        # The end of the hand-off is signalled by the task's completion, not by a
        # ``finally`` inside it: a task cancelled before its first step never runs
        # its body, and the relay would then wait for ever.
        self._producer = asyncio.create_task(produce(), name=f"produce {self.session_id}")
        self._producer.add_done_callback(lambda _: drafts.put_nowait(None))
        self._producer_fence = fence
        try:
            await self._relay(drafts, fence, event)
        except BaseException:
            self._cancel_producer()  # the actor itself is being cancelled: stop the backend
            raise
        finally:
            producer, self._producer = self._producer, None
            self._producer_fence = None
            await self._reap(producer, event)

    def _answered_now(self, event: StageEvent) -> bool:
        """Stage the backend's answer given at once (``AnswersAtOnce``); False when it
        has none and ``handle`` must run."""
        assert self._answer_now is not None
        try:
            drafts = self._answer_now(self.ctx, event)
        except Exception as exc:
            self._backend_failed(event, exc)
            return True
        if drafts is None:
            return False
        fence = self.ctx.fence
        for draft in drafts:
            if not self._published_before_death(event.seq):
                self._stage(draft, fence, event.seq)
        return True

    def _published_before_death(self, seq: int) -> bool:
        """True for each of the first drafts of the answer to ``seq`` that the previous
        owner published before it died: they are dropped, not published again."""
        if self._published_before.get(seq, 0) > 0:
            self._published_before[seq] -= 1
            return True
        return False

    async def _relay(
        self, drafts: asyncio.Queue[OutputDraft | None], fence: Fence, event: StageEvent
    ) -> None:
        """Stage the producer's drafts as they come; flush drafts are published as the
        answer's ``Coalescer`` decides, and none is left held when the answer ends."""
        coalescer = Coalescer(self.coalesce)
        released_drafts = 0
        epoch = MismatchReason.EPOCH.value
        try:
            while (draft := await _next_draft(drafts, coalescer.deadline)) is not None:
                if draft is _Due.DUE:
                    await self._publish_held(coalescer)
                    continue
                if not self.active:
                    continue  # stopped: the event stays unapplied for whoever serves next
                if self.stage_fence.is_stale(fence):
                    # Released while queued: never published. The process counts it at
                    # once; the shared metrics when the relay ends.
                    released_drafts += 1
                    DROPPED_STALE.labels(stage=self.ctx.stage, reason=epoch).inc()
                    continue
                if self._published_before_death(event.seq):
                    continue
                self._stage(draft, fence, event.seq)
                if draft.flush and coalescer.hold(_now(), draft.kind):
                    await self._publish_held(coalescer)
            if coalescer.held:
                await self._publish_held(coalescer)
        finally:
            # Cancelled midway too (the actor stops): the drafts released so far reach
            # the shared metrics, as far as Redis takes them then.
            if released_drafts:
                try:
                    await self.ownership.note_drop(epoch, released_drafts)
                except Exception as exc:  # a closing bus: the process's count stands
                    log.warning("%d released drafts are not in the shared metrics: %r",
                                released_drafts, exc, extra=self._extra())  # fmt: skip

    async def _publish_held(self, coalescer: Coalescer) -> None:
        """Publish what is staged, the drafts the coalescer holds among it."""
        waits = coalescer.published(_now())
        if self.active:
            for wait in waits:
                COALESCE_DELAY.labels(stage=self.ctx.stage).observe(wait)
            await self._flush(progress=False)

    async def _reap(self, producer: asyncio.Task[None], event: StageEvent) -> None:
        # wait() neither raises the producer's error nor hides our own cancellation.
        # After a relay that ended normally the producer is done already: no wait.
        if not producer.done():
            await asyncio.wait({producer})
        if producer.cancelled() or producer.exception() is None:
            return
        exc = producer.exception()
        assert exc is not None
        self._backend_failed(event, exc)

    def _backend_failed(self, event: StageEvent, exc: BaseException) -> None:
        log.warning("seq %s: backend failed: %r", event.seq, exc, extra=self._extra())
        self._stage(
            OutputDraft(OutputKind.ERROR, text=str(exc), meta={"code": "backend_error"}),
            self.ctx.fence,
            event.seq,
        )

    def _stage(self, draft: OutputDraft, fence: Fence, source_seq: int) -> None:
        self.out_seq += 1
        self._pending.append(
            OutputEvent(
                fence=fence,
                stage=self.ctx.stage,
                kind=draft.kind,
                seq=self.out_seq,
                source_seq=source_seq,
                text=draft.text,
                data=draft.data,
                token_ids=draft.token_ids,
                meta=dict(draft.meta),
                trace=None if self.tracer is None else self.tracer.stamp(draft),
            )
        )

    async def _flush(self, *, progress: bool = True) -> None:
        """Publish pending outputs (grouped by fence) and, with ``progress``, the cursor,
        all in one atomic step."""
        by_fence: list[tuple[Fence, list[OutputEvent]]] = []
        for event in self._pending:
            if by_fence and by_fence[-1][0] == event.fence:
                by_fence[-1][1].append(event)
            else:
                by_fence.append((event.fence, [event]))
        self._pending = []
        groups: list[OutputGroup] = list(by_fence)
        applied = self.applied_seq if progress else self._published_seq
        if groups or (progress and applied > self._published_seq):
            await self._publish(groups, applied)

    async def _publish(self, groups: list[OutputGroup], applied: int) -> None:
        if groups:
            failpoint("before_publish", groups[0][1][0].source_seq, groups[-1][1][-1].source_seq)
        for _ in range(PUBLISH_ATTEMPTS):
            last = groups[-1][1][-1].seq if groups else 0
            result = await self._publish_once(groups, applied, last)
            if result is None:
                return  # stopped while Redis was full: nothing of it was published
            if result.status not in (PublishStatus.STALE, PublishStatus.AHEAD):
                break
            groups = await self._repair(groups, result)
        else:
            # The authority kept moving under us; what is left is dropped, counted.
            log.error("publish refused %d times; dropping", PUBLISH_ATTEMPTS, extra=self._extra())
            await self.count_drop("contention", sum(len(events) for _, events in groups))
            groups = []
            result = await self._publish_once(groups, applied, 0)
            if result is None:
                return
        if result.status is PublishStatus.OK:
            self._publishes.inc()
            self._events_out.inc(sum(len(events) for _, events in groups))
            failpoint("after_publish", self._published_seq + 1, applied)
            self._published_seq = max(self._published_seq, applied)
        elif result.status is PublishStatus.LOST:
            log.warning("lost the lease: a publish found another owner", extra=self._extra())
            await self.count_drop("zombie", sum(len(events) for _, events in groups))
            self.end(ActorState.LOST)
        elif result.status is PublishStatus.CLOSED:
            self.end(ActorState.CLOSED)

    async def _publish_once(
        self, groups: list[OutputGroup], applied: int, out_seq: int
    ) -> PublishResult | None:
        """One publish, made again while a full Redis refuses it; None if the actor stopped
        meanwhile (lease lost, session closed, handed back): what it would have
        published is left to whoever serves the session next, as for a stop mid-event."""
        return await until_room(
            lambda: self.ownership.publish(
                self.lease, groups, applied_seq=applied, read_id=self.read_id, out_seq=out_seq
            ),
            what="a publish",
            log=log,
            wanted=lambda: self.active,
            extra=self._extra(),
        )

    async def _repair(self, groups: list[OutputGroup], result: PublishResult) -> list[OutputGroup]:
        """The groups to publish after ``result`` refused one: that group restamped to the
        current fence where its outputs are still ours to deliver, else dropped."""
        index, current = result.group, result.current
        fence, events = groups[index]
        if result.status is PublishStatus.AHEAD and current is not None:
            # Only a Redis that lost acknowledged writes is behind us: follow it back.
            log.error("the authority is behind this stage (%s < %s); resyncing", current,
                      fence, extra=self._extra())  # fmt: skip
            self.stage_fence.on_refused_ahead(current)
            restamp = None
        else:
            restamp = self._restamp(fence, current)
        repaired = list(groups)
        if restamp is not None:
            repaired[index] = (restamp, [msgspec.structs.replace(e, fence=restamp) for e in events])
            return repaired
        # Released meanwhile (cancel, superseded response): the outputs are dropped and
        # work still producing for that fence is stopped. Settings passed on are not
        # the response's: they go out under the current fence.
        del repaired[index]
        kept = [e for e in events if is_session_event(e)]
        if kept and current is not None:
            repaired.insert(index, (current, [msgspec.structs.replace(e, fence=current)
                                              for e in kept]))  # fmt: skip
        await self.count_drop(result.reason or str(result.status), len(events) - len(kept))
        if self._producer_fence == fence:
            # Released once: a cancel not yet read from the control stream is acted on
            # here, so when its control arrives there is nothing left to release.
            self._cancel_producer()
            self._producer_fence = None
            if current is not None:
                # Only the epoch moves: the authority's turn and response may already be
                # ahead of inputs of the new epoch still unread (a commit reserved the
                # next turn), and those must still be handled.
                self.stage_fence.on_refused_released(current)
            await self.backend.release(self.ctx, fence)
        return repaired

    def _restamp(self, fence: Fence, current: Fence | None) -> Fence | None:
        """The fence to publish refused outputs under instead of dropping them, if any.

        - Another stage failed over (incarnation grew) while our lease held: our
          outputs are still ours to publish, under the new incarnation.
        - A stage whose outputs describe its input rather than belong to a response
          (VAD, ASR, echo: ``follows_responses`` False): a newer turn or response
          reserved meanwhile does not make them stale, so they move to the current
          fence of the same epoch.
        An epoch regression (a cancel) is never restamped.
        """
        if current is None or released(fence, current.epoch):
            return None
        candidate = fence
        if current.incarnation > fence.incarnation:
            self.stage_fence.on_refused_incarnation(current)
            candidate = fence.replace(incarnation=current.incarnation)
        if fence_mismatch(current, candidate) is None:
            return candidate
        if not self.backend.follows_responses and current.epoch == fence.epoch:
            self.stage_fence.follow(current)
            return current
        return None

    async def count_drop(self, reason: str, count: int = 1) -> None:
        if count:
            DROPPED_STALE.labels(stage=self.ctx.stage, reason=reason).inc(count)
            await self.ownership.note_drop(reason, count)

    # -- control path ----------------------------------------------------------

    async def on_control(self, control: ControlEvent) -> None:
        """Apply a control event at once, ahead of any queued data."""
        if control.kind is ControlKind.CANCEL:
            await self._on_cancel(control)
        elif control.kind is ControlKind.FAILOVER:
            if control.fence.incarnation <= self.ctx.fence.incarnation:
                return
            if control.reason == self.ctx.stage:
                self.state = ActorState.LOST  # our own stage moved: we were presumed dead
                self._cancel_producer()
                return
            self.stage_fence.on_failover(control.fence)
        elif control.kind is ControlKind.CLOSE:
            self.state = ActorState.CLOSED
            self._cancel_producer()

    def _extra(self) -> dict[str, object]:
        return session_extra(self.session_id, self.ctx.fence, stage=self.ctx.stage)

    async def _on_cancel(self, control: ControlEvent) -> None:
        if not released(self.ctx.fence, control.fence.epoch) and self._producer_fence is None:
            return  # nothing served is released and nothing is being produced
        if control.ts_ms:
            reaction = max(0.0, time.time() - control.ts_ms / 1000)
            BARGE_IN_REACTION.labels(stage=self.ctx.stage).observe(reaction)
        self.stage_fence.on_cancel(control.fence)
        producing = self._producer_fence
        if producing is not None and self.stage_fence.is_stale(producing):
            self._cancel_producer()
            self._producer_fence = None  # released below, once
        if control.cancelled is not None:
            await self.backend.release(self.ctx, control.cancelled)

    def _cancel_producer(self) -> None:
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()

    def end(self, state: ActorState) -> None:
        """Stop serving (lease lost, session closed, hand-back): the backend work in
        progress is cancelled at once and the actor's loop woken to retire it."""
        if self.state is ActorState.RUNNING:
            self.state = state
        self._cancel_producer()
        self.queue.put_nowait([])

    def stop(self) -> None:
        """Stop at once for a hand-back: the event being handled stays unapplied."""
        self.end(ActorState.STOPPED)

    async def shutdown(self) -> None:
        """Stop producing and drop backend state; called once as the actor retires."""
        self.stop()
        if self.tracer is not None:
            self.tracer.close()
        await self.backend.stop(self.ctx)


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _next_draft(
    drafts: asyncio.Queue[OutputDraft | None], deadline: float | None
) -> OutputDraft | _Due | None:
    """The producer's next draft (None: it ended), or ``DUE`` once ``deadline`` passed.

    Drafts already queued come first: they join the publish that is due."""
    if not drafts.empty():
        return drafts.get_nowait()
    if deadline is None:
        return await drafts.get()
    if deadline <= _now():
        return _Due.DUE
    try:
        async with asyncio.timeout_at(deadline):
            return await drafts.get()
    except TimeoutError:
        return _Due.DUE
