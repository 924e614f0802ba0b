"""The stage worker: takes sessions while it has capacity and serves them.

One worker serves one stage for many sessions. Its loops, all owned by one
task group:

- assignment: reads the stage's assignment stream through the consumer group,
  only as many entries as it has free capacity, and acquires their leases;
  entries a dead worker read but never acknowledged are claimed after a while;
- orphans: with spare capacity, looks for leases that expired (a worker died)
  and takes those sessions over, which bumps their incarnation;
- heartbeat: renews every lease it holds; a lease it cannot renew was lost,
  and that session's actor stops at once. Renewals run on a full Redis too
  (``dataplane.scripts.ALLOW_OOM``), and a take, a publish or a backend's cancel or
  turn end that a full Redis refuses is made again once it has room
  (``dataplane.full``): a full Redis pauses sessions, it fails none over;
- bells: blocks on the stage's bells (``dataplane.bells``) and marks the
  sessions that rang, for the two loops below;
- control: reads the control streams of the marked sessions and applies
  cancel, close and failover to the actors directly, never queued behind data;
- data: reads the marked sessions' input streams in batches and hands them to
  the actors, which apply them in order.

A taken session is marked at once, and every session is marked each
``sweep_ms``, so a lost ring only delays. Neither read is ever O(sessions
owned) per round: a read touches the sessions that have news.

The loops start once the stage's model is loaded (``workers.loading``): the first
heartbeat is what makes the worker count as ready (``dataplane.readiness``).

Shutdown is a small state machine: (STARTING ->) RUNNING -> DRAINING -> STOPPED. A signal
only requests it; the loops see DRAINING, stop taking work, and the worker
hands each session back (lease released, session re-queued) instead of
letting leases expire. Burst mode drains what is there and then stops the
same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from enum import Enum, auto
from typing import TypeVar

import redis.asyncio as aioredis

from dataplane import heap
from dataplane.authority import SessionAuthority
from dataplane.bells import BellReader, Dirty
from dataplane.bus import Entry, RedisBus
from dataplane.full import until_room
from dataplane.logs import session_extra
from dataplane.metrics import FAILOVERS, OWNED_SESSIONS, STAGE_LAG, STAGE_PENDING
from dataplane.pacing import Pacer
from dataplane.readiness import StageModel, announce, withdraw
from dataplane.tracing import span_sink
from schemas.config import SESSION_INPUT, PipelineConfig, Settings
from schemas.errors import DuplexqError, ErrorCode, RedisFullError, WireDecodeError
from schemas.events import SettingsPayload, decode_control
from schemas.fence import Fence
from schemas.keys import ASSIGN_GROUP, Keys, worker_bell
from schemas.session_shape import settings_from_json
from workers.actor import ActorState, SessionActor
from workers.backends import StageBackend, StageContext, create_backend
from workers.heartbeat import Renewals
from workers.loading import ModelLoadFailed, load_until_stopped
from workers.ownership import AcquireStatus, Lease, StageOwnership
from workers.rebuild import load_takeover
from workers.stage_trace import StageTracer

log = logging.getLogger("duplexq.worker")

RoundFn = Callable[[], Awaitable[None]]
T = TypeVar("T")

TAKE_CONCURRENCY = 32
"""Sessions a worker takes at once from one assignment read."""


class WorkerState(Enum):
    STARTING = auto()
    RUNNING = auto()
    DRAINING = auto()
    STOPPED = auto()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Worker:
    """A worker process's runtime for one stage."""

    def __init__(
        self,
        settings: Settings,
        pipeline: PipelineConfig,
        stage: str,
        *,
        worker_id: str | None = None,
        burst: bool = False,
        backend: StageBackend | None = None,
        settle_heap: bool = False,
    ) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.stage_config = pipeline.stage(stage)
        self.stage = stage
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{stage}"
        self.burst = burst
        self.settle_heap = settle_heap
        """Once the model is loaded, exempt what exists from garbage collection
        (``dataplane.heap``): for a worker process of its own, not one embedded in
        another program."""
        self.capacity = self.stage_config.capacity or settings.worker_capacity
        self.bus = RedisBus(
            settings.redis_url, Keys(settings.key_prefix), linger_ms=settings.linger_ms
        )
        self.keys = self.bus.keys
        self.backend = backend or create_backend(self.stage_config)
        self.authority = SessionAuthority(self.bus, pipeline)
        self.ownership = StageOwnership(
            self.bus, pipeline, stage, self.worker_id, settings.lease_ttl_ms
        )
        self.actors: dict[str, SessionActor] = {}
        self.state = WorkerState.STARTING
        self._actor_tasks: dict[str, asyncio.Task[None]] = {}
        self._data = Dirty(settings.sweep_ms)
        self._data_pacer = Pacer(self.bus.linger_ms)
        self._control = Dirty(settings.sweep_ms)
        self._bells = BellReader(
            self.bus, worker_bell(stage, self.worker_id), self._ring, block_ms=settings.block_ms,
            running=lambda: self.state is WorkerState.RUNNING, on_gap=self._rings_missed,
        )  # fmt: skip
        self._stopping = asyncio.Event()
        self._quiet_rounds = 0
        self._readers: dict[str, aioredis.Redis] = {}
        self._taking: dict[str, Lease] = {}
        """Leases of sessions being taken (history loading): renewed like the others."""
        self._renewals = Renewals(self.ownership, self._renewed)
        self.model: StageModel | None = None
        """What the worker serves, once its model is loaded (``workers.loading``)."""

    # -- lifecycle -------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the worker to drain and stop (safe from a signal handler)."""
        if self.state in (WorkerState.STARTING, WorkerState.RUNNING):
            self.state = WorkerState.DRAINING
            self._stopping.set()
            for actor in self.actors.values():
                actor.stop()

    async def run(self) -> None:
        """Load the stage's model, then serve until stopped (or, in burst mode, until
        nothing is left to do). A worker started while Redis is full waits for room to
        create its group and record its model (both are writes)."""

        def starting() -> bool:
            return self.state is WorkerState.STARTING

        await until_room(
            lambda: self.bus.ensure_group(self.keys.assign(self.stage), ASSIGN_GROUP),
            what="creating the assignment group", log=log, wanted=starting,
        )  # fmt: skip
        try:
            try:
                model = await load_until_stopped(self.backend, self._stopping)
            except Exception as exc:
                raise ModelLoadFailed(
                    f"stage {self.stage}: its model did not load: {type(exc).__name__}: {exc}"
                ) from exc
            if model is None or self.state is not WorkerState.STARTING:
                return  # stopped while loading
            # Recorded before the first heartbeat: a live worker is a loaded one.
            await until_room(
                lambda: announce(self.bus, self.stage, self.worker_id, model),
                what="recording the worker's model", log=log, wanted=starting,
            )  # fmt: skip
            if not starting():
                return  # stopped while Redis was full
            self.model = model
            if self.settle_heap:
                heap.settle()  # the model and everything loaded with it are long-lived
            self.state = WorkerState.RUNNING
            loaded = f" ({model.model}, loaded in {model.load_s:.1f} s)" if model.model else ""
            log.info("worker %s serving stage %s%s", self.worker_id, self.stage, loaded)
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._loop(self._assignment_round, 0), name="assignment")
                group.create_task(
                    self._loop(self._orphan_round, self.settings.orphan_scan_ms), name="orphans"
                )
                group.create_task(
                    self._loop(self._heartbeat_round, self.settings.heartbeat_ms),
                    name="heartbeat",
                )
                group.create_task(self._bells.run(), name="bells")
                group.create_task(self._loop(self._control_round, 0), name="control")
                group.create_task(self._loop(self._data_round, 0), name="data")
        finally:
            await self._renewals.aclose()
            await self._hand_back_all()
            await withdraw(self.bus, self.stage, self.worker_id)
            await self.backend.aclose()
            await self.bus.aclose()
            self.state = WorkerState.STOPPED
            log.info("worker %s stopped", self.worker_id)

    async def _loop(self, round_fn: RoundFn, pause_ms: int) -> None:
        """Run one loop until draining; an error in a round is logged, never fatal."""
        while self.state is WorkerState.RUNNING:
            try:
                await round_fn()
            except RedisFullError as exc:  # expected while Redis is full: no traceback
                log.warning("worker %s: %s round: %s", self.worker_id, round_fn.__name__, exc)
                await self._pause(200)
            except Exception:
                log.exception("worker %s: %s round failed; retrying", self.worker_id, round_fn)
                await self._pause(200)
            if pause_ms:
                await self._pause(pause_ms)

    async def _pause(self, ms: int) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), ms / 1000)

    def _ring(self, session_id: str, kind: str) -> None:
        """A bell rang for ``session_id``: read it next (its control too for ``c``)."""
        if session_id in self.actors:
            self._data.mark(session_id)
            if kind == "c":
                self._control.mark(session_id)

    def _rings_missed(self) -> None:
        """Rings may have been lost (``BellReader.on_gap``): read every session now."""
        self._data.sweep_now()
        self._control.sweep_now()

    # -- taking sessions -------------------------------------------------------

    @property
    def spare(self) -> int:
        return self.capacity - len(self.actors)

    async def _assignment_round(self) -> None:
        await self._bells.started.wait()  # a session taken before would miss rings
        if self.spare <= 0:
            await self._pause(self.settings.block_ms)
            return
        stream = self.keys.assign(self.stage)
        entries = await self.bus.xautoclaim(
            stream, ASSIGN_GROUP, self.worker_id, self.settings.assign_claim_idle_ms, self.spare
        )
        if not entries:
            reader = self._reader("assign")
            entries = await self.bus.xreadgroup(
                reader, ASSIGN_GROUP, self.worker_id, stream, self.spare, self._block_ms()
            )
        # Sessions are taken several at a time: each take waits on Redis (and a
        # rebuild), and a worker coming up to a backlog must not take them one by one.
        for start in range(0, len(entries), TAKE_CONCURRENCY):
            chunk = entries[start : start + TAKE_CONCURRENCY]
            await asyncio.gather(*(self._take_assigned(stream, entry) for entry in chunk))
        self._note_activity(bool(entries))

    async def _take_assigned(self, stream: str, entry: Entry) -> None:
        session_id = entry.fields.get(b"sid", b"").decode()
        if session_id and self.state is WorkerState.RUNNING:
            await self._take(session_id)
        elif session_id:
            # Read while stopping (a blocked read can return our own
            # hand-backs): not ours to take, so queue it for the others.
            await self.bus.client.xadd(stream, {"sid": session_id, "why": "requeue"})
        await self.bus.xack(stream, ASSIGN_GROUP, entry.id)

    async def _orphan_round(self) -> None:
        await self._bells.started.wait()
        if self.spare <= 0:
            return
        expired = await self.bus.client.zrangebyscore(
            self.keys.lease_index(self.stage), "-inf", now_ms(), start=0, num=self.spare
        )
        orphans = [raw.decode() for raw in expired if raw.decode() not in self.actors]
        for start in range(0, len(orphans), TAKE_CONCURRENCY):
            chunk = orphans[start : start + TAKE_CONCURRENCY]
            await asyncio.gather(*(self._take(session_id) for session_id in chunk))

    def _tracer(self, session_id: str) -> StageTracer | None:
        """The session's stage tracer while tracing is on (``workers.stage_trace``)."""
        sink = span_sink(f"duplexq-{self.stage}")
        if sink is None:
            return None
        starts = self.stage_config.input == SESSION_INPUT
        return StageTracer(self.stage, session_id, sink, starts_turns=starts)

    async def _take(self, session_id: str) -> None:
        if session_id in self.actors or self.state is not WorkerState.RUNNING:
            return
        taken = await until_room(
            lambda: self.ownership.acquire(session_id, now_ms()),
            what=f"taking session {session_id}",
            log=log,
            wanted=lambda: self.state is WorkerState.RUNNING,
        )
        if taken is None:
            return  # stopping: a session not taken is another worker's to take
        status, lease = taken
        if status is AcquireStatus.CLOSED:
            await self.bus.client.zrem(self.keys.lease_index(self.stage), session_id)
            return
        if lease is None:
            return
        if self.state is not WorkerState.RUNNING:
            await self.ownership.release(lease, hand_back=True)  # stopped meanwhile
            return
        if lease.failover:
            FAILOVERS.labels(stage=self.stage).inc()
            # The shared hash mirrors the counter above: a full Redis may cost it a count,
            # never the take its session.
            with contextlib.suppress(RedisFullError):
                await self.bus.hincrby(self.keys.metrics, f"failovers:{self.stage}")
            log.info(
                "took over the session", extra=session_extra(
                    session_id, lease.fence, stage=self.stage, worker=self.worker_id
                ),
            )  # fmt: skip
        ctx = StageContext(session_id, self.stage, lease.fence, self.stage_config.options)
        ctx.session = _starting_settings(lease)
        ctx.interrupt = functools.partial(self._interrupt, ctx)
        ctx.end_turn = functools.partial(self._end_turn, ctx)
        # The heartbeat renews the lease while the history loads and the backend
        # rebuilds: a long session's takeover must not outlast the lease.
        self._taking[session_id] = lease
        try:
            takeover = await load_takeover(
                self.bus, self._input_stream(session_id), self._output_stream(session_id),
                read_id=lease.read_id, applied_seq=lease.applied_seq,
                window=self.backend.rebuild,
                stage=self.stage if self.ownership.journal_only else None,
            )  # fmt: skip
            await self.backend.start(ctx, takeover.inputs, takeover.outputs)
        except Exception:
            self._taking.pop(session_id, None)
            log.exception("could not rebuild the session", extra=session_extra(
                session_id, lease.fence, stage=self.stage))  # fmt: skip
            await self._failed(lease, ctx)
            return
        finally:
            lost = self._taking.pop(session_id, None) is None
        if lost or self.state is not WorkerState.RUNNING:
            await self.backend.stop(ctx)
            if not lost:
                await self.ownership.release(lease, hand_back=True)
            return
        published = {} if self.backend.rebuild.resumes_answers else takeover.published
        actor = SessionActor(lease, self.ownership, self.backend, ctx, published, self.settings)
        actor.tracer = self._tracer(session_id)
        ctx.emit = actor.emit
        serving = self._serve(actor)
        try:
            task = self._group.create_task(serving, name=f"actor {session_id}")
        except RuntimeError:  # the worker is shutting down: hand the session back
            serving.close()
            await self.backend.stop(ctx)
            await self.ownership.release(lease, hand_back=True)
            return
        self.actors[session_id] = actor
        self._actor_tasks[session_id] = task
        OWNED_SESSIONS.labels(stage=self.stage).set(len(self.actors))
        self._data.mark(session_id)
        self._control.mark(session_id)

    def _output_stream(self, session_id: str) -> str:
        """Where this stage's outputs are kept: its own stream, or the client journal."""
        sk = self.keys.session(session_id)
        return sk.client if self.ownership.journal_only else sk.stage_out(self.stage)

    def _input_stream(self, session_id: str) -> str:
        sk = self.keys.session(session_id)
        source = self.stage_config.input
        return sk.input if source == SESSION_INPUT else sk.stage_out(source)

    async def _interrupt(self, ctx: StageContext, reason: str) -> Fence:
        """A backend barges in: the same epoch bump a client cancel makes (once a full
        Redis has room; ``expect_epoch`` keeps a late one from cancelling a later
        response)."""
        epoch = ctx.fence.epoch
        result = await self._when_room(
            lambda: self.authority.cancel(ctx.session_id, expect_epoch=epoch, reason=reason),
            "a barge-in",
        )
        ctx.stage_fence.on_interrupt(result.fence)
        return result.fence

    async def _end_turn(self, ctx: StageContext) -> Fence:
        """A backend ended the user's turn: the reservation a client commit makes (once a
        full Redis has room)."""
        fence = await self._when_room(
            lambda: self.authority.reserve_response(ctx.session_id), "a turn's end"
        )
        ctx.stage_fence.on_reserve(fence)
        return fence

    async def _when_room(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call()`` for a backend, made again while a full Redis refuses it; the backend's
        work being cancelled (its session stopped) ends the wait."""
        result = await until_room(call, what=what, log=log)
        assert result is not None  # waits for as long as it takes: never given up
        return result

    # -- serving -----------------------------------------------------------------

    async def _serve(self, actor: SessionActor) -> None:
        try:
            while actor.active:
                batch = await actor.next_batch()
                if actor.session_id in self._data.pending:
                    self._data.ready.set()  # it was held back while its queue was full
                try:
                    await actor.apply(batch)
                except Exception:
                    # One session's failure must not take the worker (and its other
                    # sessions) down: hand this one back (or quarantine it) and go on.
                    log.exception(
                        "session failed; handing it back",
                        extra=session_extra(actor.session_id, actor.ctx.fence, stage=self.stage),
                    )
                    actor.end(ActorState.FAILED)
        finally:
            try:
                await self._retire(actor)
            except Exception:
                # Redis unreachable while handing back: the lease expires by itself and
                # another worker takes the session over; this worker serves on.
                log.exception("could not retire the session", extra=session_extra(
                    actor.session_id, actor.ctx.fence, stage=self.stage))  # fmt: skip

    async def _retire(self, actor: SessionActor) -> None:
        session_id = actor.session_id
        self.actors.pop(session_id, None)
        self._actor_tasks.pop(session_id, None)
        OWNED_SESSIONS.labels(stage=self.stage).set(len(self.actors))
        await actor.shutdown()
        if actor.state is ActorState.CLOSED:
            await self.ownership.release(actor.lease, hand_back=False)
        elif actor.state is ActorState.STOPPED:
            await self.ownership.release(actor.lease, hand_back=True)
        elif actor.state is ActorState.FAILED:
            await self._failed(actor.lease, actor.ctx)
        # LOST: the lease is someone else's now; touch nothing.

    async def _failed(self, lease: Lease, ctx: StageContext) -> None:
        """The stage failed on this session: hand it back to be tried elsewhere, or, after
        ``max_session_failures`` failures in a row at the same input, close it with a
        ``session_failed`` error to its client (quarantine)."""
        failures = await self.ownership.note_failure(lease.session_id)
        if failures < self.settings.max_session_failures:
            await self.ownership.release(lease, hand_back=True)
            return
        log.error("quarantining the session after %d failures", failures,
                  extra=session_extra(lease.session_id, ctx.fence, stage=self.stage))  # fmt: skip
        await self.bus.hincrby(self.keys.metrics, f"quarantined:{self.stage}")
        message = f"stage {self.stage} failed {failures} times on this session; it was closed"
        with contextlib.suppress(DuplexqError):
            await self.authority.journal(lease.session_id, {"type": "error", "error": {
                "type": "server_error", "code": ErrorCode.SESSION_FAILED.value,
                "message": message}})  # fmt: skip
            await self.authority.close(
                lease.session_id, reason="quarantined", ttl_s=self.settings.closed_ttl_s
            )
        await self.ownership.release(lease, hand_back=False)

    async def _hand_back_all(self) -> None:
        """Hand back sessions whose actor task did not get to (the group failed)."""
        for actor in list(self.actors.values()):
            actor.stop()
            await self._retire(actor)

    async def _heartbeat_round(self) -> None:
        """Start this heartbeat's writes (``workers.heartbeat``): none is waited for, so
        a slow Redis node holds back only what lives on it."""
        self._renewals.flights.start("registry", self._register)
        pending = [actor.pending(now_ms()) for actor in self.actors.values()]
        STAGE_PENDING.labels(stage=self.stage).set(sum(n for n, _ in pending))
        STAGE_LAG.labels(stage=self.stage).set(max((lag for _, lag in pending), default=0.0))
        active = [a.lease for a in self.actors.values() if a.active]
        self._renewals.start([*active, *self._taking.values()])

    async def _register(self) -> None:
        """This worker's place among the stage's live workers, scored by now."""
        try:
            await self.bus.rescore(self.keys.workers(self.stage), {self.worker_id: now_ms()})
        except RedisFullError:
            # Only a worker not in the set yet is refused (a full Redis still moves an
            # entry): it counts as live once Redis has room; its leases are renewed now.
            log.warning("Redis is full: worker %s cannot join the live workers yet",
                        self.worker_id)  # fmt: skip

    def _renewed(self, lease: Lease, ok: bool) -> None:
        """A renewal's outcome: a lost lease ends its take, or its actor."""
        if ok:
            return
        taking = self._taking.get(lease.session_id)
        if taking is not None and taking.token == lease.token:
            self._taking.pop(lease.session_id, None)  # the take is abandoned
            return
        actor = self.actors.get(lease.session_id)
        if actor is not None and actor.active and actor.lease.token == lease.token:
            log.warning(
                "lost the lease", extra=session_extra(
                    actor.session_id, actor.ctx.fence, stage=self.stage, worker=self.worker_id
                ),
            )  # fmt: skip
            actor.end(ActorState.LOST)

    async def _control_round(self) -> None:
        if self._control.sweep_due():
            self._control.mark_all(self.actors)
        streams: dict[str, str] = {}
        owners: dict[str, SessionActor] = {}
        for session_id in self._control.pending:
            actor = self.actors.get(session_id)
            if actor is not None:
                stream = self.keys.session(session_id).control
                streams[stream] = actor.control_cursor
                owners[stream] = actor
        self._control.pending.clear()
        if not streams:
            await self._control.wait(self.settings.block_ms)
            return
        entries = await self.bus.xread_now(streams, 256)
        counts: dict[str, int] = {}
        for entry in entries:
            owner = owners[entry.stream]
            counts[entry.stream] = counts.get(entry.stream, 0) + 1
            owner.control_cursor = entry.id
            try:
                control = decode_control(entry.fields.get(b"c", b""))
            except WireDecodeError as exc:
                log.warning("skipping control entry %s: %s", entry.id, exc,
                            extra=session_extra(owner.session_id, owner.ctx.fence,
                                                stage=self.stage))  # fmt: skip
                await owner.count_drop("undecodable_control")
                continue
            await owner.on_control(control)
            if not owner.active:
                owner.queue.put_nowait([])
        for stream, count in counts.items():
            if count >= 256:
                self._control.mark(owners[stream].session_id)  # more to read

    async def _data_round(self) -> None:
        if self._data.pending:
            await self._data_pacer.pace()  # under load, what comes meanwhile joins this read
        if self._data.sweep_due():
            self._data.mark_all(self.actors)
        streams: dict[str, str] = {}
        owners: dict[str, SessionActor] = {}
        for session_id in list(self._data.pending):
            actor = self.actors.get(session_id)
            if actor is None or not actor.active:
                self._data.pending.discard(session_id)
            elif actor.queue.qsize() < 4:
                # An actor with batches still queued stays marked and is read once its
                # queue drains (backpressure); ``_serve`` sets ``ready`` then.
                self._data.pending.discard(session_id)
                stream = self._input_stream(session_id)
                streams[stream] = actor.read_cursor
                owners[stream] = actor
        if not streams:
            self._note_activity(False)
            if self.burst:
                await self._maybe_finish_burst()
            await self._data.wait(self._block_ms())
            return
        entries = await self.bus.xread_now(streams, self.settings.read_batch)
        self._data_pacer.carried(len(entries))
        batches: dict[str, list[Entry]] = {}
        for entry in entries:
            owners[entry.stream].read_cursor = entry.id
            batches.setdefault(entry.stream, []).append(entry)
        for stream, batch in batches.items():
            owner = owners[stream]
            owner.enqueue(batch)
            if len(batch) >= self.settings.read_batch:
                self._data.mark(owner.session_id)  # more to read
        self._note_activity(bool(batches))

    # -- helpers ---------------------------------------------------------------

    def _reader(self, name: str) -> aioredis.Redis:
        """One dedicated blocking-read connection per loop."""
        if name not in self._readers:
            self._readers[name] = self.bus.reader(self.settings.block_ms)
        return self._readers[name]

    def _block_ms(self) -> int:
        if self.burst:
            return min(self.settings.block_ms, 100)
        return self.settings.block_ms

    def _note_activity(self, active: bool) -> None:
        self._quiet_rounds = 0 if active else self._quiet_rounds + 1

    def _burst_idle(self) -> bool:
        """Nothing is left in this worker: rounds have found nothing to read, no session is
        being taken or has data marked to read, and every actor is done."""
        return (
            self._quiet_rounds >= 3
            and not self._taking
            and not self._data.pending
            and all(a.idle.is_set() and a.queue.empty() for a in self.actors.values())
        )

    async def _maybe_finish_burst(self) -> None:
        """In burst mode, stop once no assignment, data or work is left.

        The worker is judged again after asking Redis: an assignment read meanwhile makes
        a take, and a take finishes by marking its session to read. Redis is asked about
        undelivered assignments before pending ones, so an assignment delivered between
        the two questions is seen as pending (the take acks it only once it is done)."""
        if not self._burst_idle():
            return
        unread = await self._unread_assignments()
        pending = await self.bus.client.xpending(self.keys.assign(self.stage), ASSIGN_GROUP)
        if pending["pending"] == 0 and not unread and self._burst_idle():
            log.info("worker %s: burst done", self.worker_id)
            self.request_stop()

    async def _unread_assignments(self) -> bool:
        """Whether the stage's assignment stream has entries not delivered to the group
        yet. Where Redis cannot tell the group's lag (it may not after deletions), the
        last entry delivered is compared with the stream's last entry."""
        stream = self.keys.assign(self.stage)
        groups = await self.bus.client.xinfo_groups(stream)
        for group in groups:
            if group["name"] in (ASSIGN_GROUP, ASSIGN_GROUP.encode()):
                lag = group.get("lag")
                if lag is not None:
                    return bool(lag)
                info = await self.bus.client.xinfo_stream(stream)
                return _text(group["last-delivered-id"]) != _text(info["last-generated-id"])
        return False


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _starting_settings(lease: Lease) -> SettingsPayload:
    """The settings a new owner starts from: the session's latest. Settings events the
    stage has not applied yet are applied in order as it reaches them, so from there on
    each input meets the settings in force when it was accepted."""
    try:
        return settings_from_json(lease.config)
    except ValueError:
        log.warning("the session's stored settings do not parse; using the defaults",
                    extra=session_extra(lease.session_id, lease.fence))  # fmt: skip
        return SettingsPayload()
