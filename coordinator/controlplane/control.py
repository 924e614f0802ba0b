"""The control plane: safety nets and replay, run as arq jobs.

Each job is a plain async function of arq's ``ctx`` (callable directly with
one from ``open_context``); the decisions it makes are small pure functions
in ``coordinator.controlplane.control_core``, tested without Redis.

- ``audit_leases`` (cron): an open session whose client connection's hold on it
  lapsed longer than ``resume_grace_s`` ago is closed (whatever happened to its
  coordinator; the close script re-checks the hold, so a resume always wins),
  which ends its stages' leases. An open session whose stage holds no lease is put
  back in front of that stage's workers: its entry in the lease index gets an
  expired score (every live worker's orphan scan sees it) and, while a worker
  of the stage is alive, an assignment ``why=audit`` is queued. Taking it
  over goes through the acquire script, which bumps the incarnation only if
  the stage had an owner, so racing detectors cause one takeover. Ids in the
  sessions index whose session is closed (or gone) are dropped.
- ``trim_streams`` (cron): trims each open session's input log and stage
  output streams with XTRIM MINID to their newest ``*_retention`` entries and,
  with ``retention_s``, to entries younger than that, never past an entry a
  consumer has not applied; the client journal is capped at
  ``output_retention`` (MAXLEN ~) and ``retention_s``; assignment streams
  are trimmed up to what their consumer group has delivered and acked.
- ``expire_closed`` (cron): any key of a closed (or metaless) session that
  has no TTL gets ``closed_ttl_s``, atomically with the status check, so a
  session reopened meanwhile is never touched.
- ``replay`` (on request, job id per (source, target)): see
  ``coordinator.controlplane.replay``.

Jobs travel as msgpack (never pickle). The queue name and every job id
carry the key prefix, so deployments sharing a Redis never see each other's
jobs. Burst mode runs each periodic job once, plus whatever is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
from arq.connections import RedisSettings, create_pool
from arq.cron import CronJob, cron
from arq.typing import WorkerCoroutine
from arq.worker import Function, Worker, create_worker, func
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coordinator.controlplane.control_core import (
    ControlSchedule,
    RequeueBackoff,
    age_floor,
    floor_in_page,
    group_floor,
    newest,
    parse_id,
    plan_audit,
    safe_min_id,
    session_of_key,
    stream_consumers,
)
from coordinator.controlplane.replay import LogProgress, replay_greedily, replay_session
from dataplane import session_meta
from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import SESSION_INPUT, PipelineConfig, Settings
from schemas.keys import Keys, worker_bell

log = logging.getLogger("duplexq.control")

PAGE = 500
"""Entries (or keys) one Redis round trip handles in the scans below."""
TRIM_SCAN_LIMIT = 20_000
"""Most entries one trim run walks per stream; a longer excess is trimmed over several runs."""
FORGET_WORKERS_AFTER_MS = 600_000
"""A worker not heard from for this long is forgotten (its entry in the stage's worker
set and its model record): one that was killed never withdrew them, and a deployment
that scales up and down would otherwise keep every worker it ever ran."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the jobs ------------------------------------------------------------------------


@dataclass
class ControlState:
    """What the jobs share in arq's ``ctx`` (under ``"control"``)."""

    settings: Settings
    pipeline: PipelineConfig
    bus: RedisBus
    backoff: RequeueBackoff = field(init=False)
    authority: SessionAuthority = field(init=False)

    def __post_init__(self) -> None:
        base = max(self.settings.assign_claim_idle_ms, 1000)
        self.backoff = RequeueBackoff(base, max(base, 60_000))
        self.authority = SessionAuthority(self.bus, self.pipeline)

    @property
    def keys(self) -> Keys:
        return self.bus.keys

    async def sessions(self) -> AsyncIterator[tuple[str, int]]:
        """Every indexed (session id, indexed at ms)."""
        async for member, score in self.bus.client.zscan_iter(self.keys.sessions, count=PAGE):
            yield member.decode(), int(score)


async def open_context(settings: Settings, pipeline: PipelineConfig) -> dict[str, Any]:
    """A ctx for calling the jobs directly (arq's ``on_startup`` does the same)."""
    bus = RedisBus(settings.redis_url, Keys(settings.key_prefix))
    return {"control": ControlState(settings, pipeline, bus)}


async def close_context(ctx: Mapping[str, Any]) -> None:
    state = ctx.get("control")
    if isinstance(state, ControlState):
        await state.bus.aclose()


def _state(ctx: Mapping[str, Any]) -> ControlState:
    state = ctx["control"]
    if not isinstance(state, ControlState):
        raise TypeError("ctx['control'] is not a ControlState; use open_context()")
    return state


async def _status(state: ControlState, session_id: str) -> str | None:
    return await session_meta.status(state.bus, session_id)


async def _live_workers(state: ControlState, stage: str, now: int) -> int:
    oldest = now - 3 * state.settings.lease_ttl_ms
    return int(await state.bus.client.zcount(state.keys.workers(stage), oldest, "+inf"))


async def _forget_dead_workers(state: ControlState, stage: str, now: int) -> int:
    """Forget ``stage``'s workers silent for ``FORGET_WORKERS_AFTER_MS`` (their records
    and their bells); how many."""
    workers, models = state.keys.workers(stage), state.keys.stage_models(stage)
    dead = await state.bus.client.zrangebyscore(
        workers, "-inf", f"({now - FORGET_WORKERS_AFTER_MS}"
    )
    if dead:
        await state.bus.client.zrem(workers, *dead)
        await cast(Awaitable[int], state.bus.client.hdel(models, *dead))
        for worker in dead:
            name = worker.decode() if isinstance(worker, bytes) else str(worker)
            await state.bus.client.delete(*state.bus.keys.bells(worker_bell(stage, name)))
    return len(dead)


async def audit_leases(ctx: dict[str, Any]) -> dict[str, int]:
    """Re-offer (session, stage) pairs that have no lease; forget closed sessions and
    workers long dead."""
    state = _state(ctx)
    now = now_ms()
    stages = state.pipeline.stage_names
    live = {stage: await _live_workers(state, stage, now) > 0 for stage in stages}
    counts: Counter[str] = Counter()
    for stage in stages:
        if forgotten := await _forget_dead_workers(state, stage, now):
            counts["workers_forgotten"] += forgotten
    grace_ms = state.settings.resume_grace_s * 1000
    async for session_id, indexed_ms in state.sessions():
        sk = state.keys.session(session_id)
        async with state.bus.client.pipeline(transaction=False) as pipe:
            session_meta.queue_attachment_read(pipe, state.bus, session_id)
            for stage in stages:
                pipe.exists(sk.lease(stage))
            attachment, *held = await pipe.execute()
        status, until = session_meta.attachment_of(attachment)
        leased = dict(zip(stages, map(bool, held), strict=True))
        detached = now - until if until is not None else None
        plan = plan_audit(status, leased, now - indexed_ms, detached, grace_ms)
        if plan.forget:
            await state.bus.client.zrem(state.keys.sessions, session_id)
            state.backoff.clear(session_id)
            counts["forgotten"] += 1
            continue
        if plan.close:
            closed = await state.authority.close_detached(
                session_id, idle_before_ms=now - grace_ms, reason="detached",
                ttl_s=state.settings.closed_ttl_s,
            )  # fmt: skip
            if closed is not None:
                log.info("closed session %s: its client left %d ms ago", session_id, detached)
                counts["closed"] += 1
            continue
        for stage in (s for s, ok in leased.items() if ok):
            state.backoff.clear(session_id, stage)
        for stage in plan.requeue:
            # LT: a missing entry is added; a live worker's future expiry is lowered.
            await state.bus.client.zadd(state.keys.lease_index(stage), {session_id: now}, lt=True)
            counts["orphans"] += 1
            if live[stage] and state.backoff.take((session_id, stage), now):
                await state.bus.client.xadd(
                    state.keys.assign(stage), {"sid": session_id, "why": "audit"}
                )
                counts["requeued"] += 1
    return dict(counts)


async def _retention_floor(
    bus: RedisBus, stream: str, keep: int, stop_at: str | None
) -> str | None:
    """The oldest entry to keep so that at least ``keep`` stay, or None when the
    stream holds no more; the walk stops early at ``stop_at`` (and after
    TRIM_SCAN_LIMIT entries) and only reads entries that are about to go."""
    to_skip = await bus.xlen(stream) - keep
    if to_skip <= 0:
        return None
    start, walked = "-", 0
    while True:
        page = await bus.xrange(stream, start, "+", count=min(PAGE, to_skip + 1))
        if not page:
            return None
        floor, skipped = floor_in_page([e.id for e in page], to_skip, stop_at)
        if floor is not None:
            return floor
        to_skip -= skipped
        walked += skipped
        if walked >= TRIM_SCAN_LIMIT:
            return page[-1].id
        start = "(" + page[-1].id


async def trim_stream(
    bus: RedisBus,
    stream: str,
    reads: Sequence[str | None],
    keep: int,
    older_than: str | None = None,
) -> int:
    """Trim ``stream`` as far as its consumers' positions and the retention (``keep``
    newest entries, and nothing before ``older_than`` if given) allow."""
    if any(read is None for read in reads):
        return 0
    known = [read for read in reads if read is not None]
    stop_at = min(known, key=parse_id) if known else None
    floor = newest(await _retention_floor(bus, stream, keep, stop_at), older_than)
    min_id = safe_min_id(reads, floor)
    return 0 if min_id is None else await bus.trim_before(stream, min_id)


async def _trim_session(state: ControlState, session_id: str) -> int:
    sk = state.keys.session(session_id)
    snapshot = await session_meta.snapshot(state.bus, session_id)
    settings = state.settings
    aged = age_floor(now_ms(), settings.retention_s)
    removed = 0
    for source, consumers in stream_consumers(state.pipeline).items():
        reads = [snapshot and snapshot.read(consumer) for consumer in consumers]
        if source == SESSION_INPUT:
            stream, keep = sk.input, settings.input_retention
        else:
            stream, keep = sk.stage_out(source), settings.output_retention
        removed += await trim_stream(state.bus, stream, reads, keep, aged)
    removed += await state.bus.trim_maxlen(sk.client, settings.output_retention)
    if aged is not None:
        removed += await state.bus.trim_before(sk.client, aged)
    return removed


async def trim_streams(ctx: dict[str, Any]) -> dict[str, int]:
    """Apply retention to every open session's streams and to the assignment streams."""
    state = _state(ctx)
    counts: Counter[str] = Counter()
    async for session_id, _ in state.sessions():
        if await _status(state, session_id) == "open":
            counts["sessions"] += 1
            counts["removed"] += await _trim_session(state, session_id)
    for stage in state.pipeline.stage_names:
        stream = state.keys.assign(stage)
        floor = group_floor(await state.bus.group_positions(stream))
        if floor is not None:
            counts["assignments_removed"] += await state.bus.trim_before(stream, floor)
    return dict(counts)


async def _expire_session(state: ControlState, session_id: str, keys: Sequence[str]) -> int:
    """EXPIRE NX the keys if the session is not open, atomically with the check (one
    script in the session's slot, so on a cluster too)."""
    meta = state.keys.session(session_id).meta
    reply = await state.bus.run(
        state.bus.expire_closed_script, [meta, *keys], [state.settings.closed_ttl_s]
    )
    return int(reply[0])


async def expire_closed(ctx: dict[str, Any]) -> dict[str, int]:
    """Give every key of a closed session a TTL; drop closed ids from the index."""
    state = _state(ctx)
    counts: Counter[str] = Counter()
    now = now_ms()
    async for session_id, indexed_ms in state.sessions():
        if plan_audit(await _status(state, session_id), {}, now - indexed_ms).forget:
            await state.bus.client.zrem(state.keys.sessions, session_id)
            counts["forgotten"] += 1
    by_session: dict[str, list[str]] = {}
    pattern = state.keys.session_pattern()
    async for raw_key in state.bus.client.scan_iter(match=pattern, count=PAGE):
        key = raw_key.decode()
        owner = session_of_key(state.keys.prefix, key)
        if owner is not None:
            by_session.setdefault(owner, []).append(key)
    for owner, keys in by_session.items():
        counts["keys_expired"] += await _expire_session(state, owner, keys)
    return dict(counts)


async def replay(
    ctx: dict[str, Any],
    source: str,
    target: str,
    pace: str = "fast",
    speed: float = 1.0,
    pipeline: dict[str, Any] | None = None,
    greedy: bool = False,
    again: str | None = None,
) -> dict[str, Any]:
    """Replay ``source`` into ``target`` (optionally under another pipeline, and
    greedily: ``coordinator.controlplane.replay.replay_greedily``); the report is the
    job's result."""
    state = _state(ctx)
    target_pipeline = PipelineConfig.model_validate(pipeline) if pipeline else state.pipeline
    options: dict[str, Any] = {
        "pace": "recorded" if pace == "recorded" else "fast",
        "speed": speed,
        "progress": LogProgress(f"replay {source} -> {target}", log),
        "closed_ttl_s": state.settings.closed_ttl_s,
    }
    if greedy:
        report = await replay_greedily(
            state.bus, target_pipeline, source, target, again=again, **options
        )
    else:
        report = await replay_session(state.bus, target_pipeline, source, target, **options)
    log.info("%s", report.summary())
    return report.to_dict()


# -- arq wiring -------------------------------------------------------------------------


def _encode_extra(obj: Any) -> Any:
    if isinstance(obj, BaseException):  # a failed job's result
        return f"{type(obj).__name__}: {obj}"
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_job_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)


def job_serializer(data: dict[str, Any]) -> bytes:
    """arq job and result encoding: msgpack, never pickle."""
    return _job_encoder.encode(data)


def job_deserializer(raw: bytes) -> dict[str, Any]:
    data = msgspec.msgpack.decode(raw)
    if not isinstance(data, dict):
        raise ValueError("an arq job must decode to a map")
    return data


def queue_name(settings: Settings) -> str:
    return f"{settings.key_prefix}:arq:queue"


def replay_job_id(settings: Settings, source: str, target: str) -> str:
    """One replay job per (source, target): a duplicate request is a no-op."""
    return f"{settings.key_prefix}:replay:{source}:{target}"


PERIODIC = (audit_leases, trim_streams, expire_closed)


def _job(fn: Any) -> WorkerCoroutine:
    # arq's protocol wants (ctx, *args, **kwargs); our jobs name their arguments.
    return cast(WorkerCoroutine, fn)


def worker_settings(
    settings: Settings,
    pipeline: PipelineConfig,
    *,
    burst: bool = False,
    schedule: ControlSchedule | None = None,
) -> type:
    """arq ``WorkerSettings`` for this deployment's control plane."""
    schedule = schedule or ControlSchedule()
    prefix = settings.key_prefix
    everies = (schedule.audit_every_s, schedule.trim_every_s, schedule.expire_every_s)
    crons: list[CronJob] = [
        # Cron job ids are ``{name}:{time}``, global in Redis: the name carries the prefix.
        cron(_job(fn), name=f"{prefix}:{fn.__name__}", second=schedule.seconds(every), timeout=60)
        for fn, every in zip(PERIODIC, everies, strict=True)
    ]
    functions: list[Function] = [func(_job(fn), timeout=60, max_tries=1) for fn in PERIODIC]
    functions.append(func(_job(replay), timeout=86_400, max_tries=1, keep_result=86_400))

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx.update(await open_context(settings, pipeline))
        if burst:  # run each periodic job once
            for fn in PERIODIC:
                await ctx["redis"].enqueue_job(fn.__name__, _queue_name=queue_name(settings))

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        await close_context(ctx)

    attrs = {
        "functions": functions,
        "cron_jobs": [] if burst else crons,
        "redis_settings": RedisSettings.from_dsn(settings.queue_redis_url),
        "queue_name": queue_name(settings),
        "on_startup": on_startup,
        "on_shutdown": on_shutdown,
        "job_serializer": job_serializer,
        "job_deserializer": job_deserializer,
        "poll_delay": 0.2,
        "keep_result": 0,
    }
    return type("ControlWorkerSettings", (), attrs)


async def run_control(
    settings: Settings,
    pipeline: PipelineConfig,
    *,
    burst: bool = False,
    handle_signals: bool = True,
    schedule: ControlSchedule | None = None,
) -> Worker:
    """Run the control plane's arq worker until SIGTERM/SIGINT (or, in burst mode,
    until the queue is empty); returns the worker for its counters.

    Losing Redis is a pause, not an end: arq's worker stops on a connection
    error (or anything else, such as a full Redis refusing its writes), so a new one
    is started, with a growing pause, until Redis answers again
    (``tests/test_control.py``). The signals are handled here, not by arq: arq's
    handler belongs to one worker, and a signal between two of them, or during one
    that is failing to start, was lost (the process then ignored SIGTERM)."""
    cls = worker_settings(settings, pipeline, burst=burst, schedule=schedule)
    stop = asyncio.Event()
    attempt: asyncio.Future[None] | None = None

    def on_signal() -> None:
        stop.set()
        if attempt is not None:
            attempt.cancel()

    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    pause_s = 0.2
    try:
        while True:
            worker = create_worker(dict(vars(cls)), burst=burst, handle_signals=False)
            attempt = asyncio.ensure_future(worker.async_run())
            try:
                await attempt
                return worker
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                return worker  # a signal stopped it: the normal way to stop
            except Exception:
                # Mostly Redis going away or full (arq also raises a WatchError for a
                # connection lost inside its job pickup): log and start again.
                log.exception("the control plane's worker stopped; restarting in %.1f s", pause_s)
            finally:
                await _shutdown(worker)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause_s)
            if stop.is_set():
                return worker
            pause_s = min(pause_s * 2, 5.0)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _shutdown(worker: Worker) -> None:
    """arq's ``Worker.close`` uses a deprecated redis call; this does its work (Redis
    may be unreachable: what needs it is skipped)."""
    for task in worker.tasks.values():
        task.cancel()
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    pool = getattr(worker, "_pool", None)
    if pool is None:
        return
    with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
        await pool.delete(worker.health_check_key)
    await close_context(worker.ctx)
    with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
        await pool.aclose()


async def enqueue_replay(
    settings: Settings,
    source: str,
    target: str,
    *,
    pace: str = "fast",
    speed: float = 1.0,
    pipeline: PipelineConfig | None = None,
    greedy: bool = False,
    again: str | None = None,
) -> bool:
    """Ask the control plane to replay ``source`` into ``target`` (``greedy``: see
    ``coordinator.controlplane.replay.replay_greedily``); False if that replay was already
    requested (queued, running or done within a day)."""
    pool = await create_pool(
        RedisSettings.from_dsn(settings.queue_redis_url),
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=queue_name(settings),
    )
    try:
        job = await pool.enqueue_job(
            "replay",
            source,
            target,
            pace,
            speed,
            pipeline.model_dump(mode="json") if pipeline else None,
            greedy,
            again,
            _job_id=replay_job_id(settings, source, target),
        )
    finally:
        await pool.aclose()
    return job is not None
