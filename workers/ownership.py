"""Leases and fenced publishing for one stage, over the Lua in ``dataplane.scripts``.

A worker owns (session, stage) through a lease: a key holding its id, a random
token and the incarnation it was granted under, with a TTL renewed by
heartbeat. Taking over a session whose stage had an owner before bumps the
session's incarnation (failover). Every publish checks, in the same atomic
step, that the lease still holds this token and that the outputs' fence has
not regressed; a stopped-then-resumed worker whose lease moved is refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

from dataplane import session_meta
from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import PipelineConfig
from schemas.errors import RedisFullError
from schemas.events import OutputEvent, encode_event
from schemas.fence import Fence
from schemas.keys import CLIENT, PerSession

log = logging.getLogger("duplexq.worker")


class Lease(NamedTuple):
    """A granted lease and where the stage left off in the session."""

    session_id: str
    token: str
    fence: Fence
    failover: bool
    applied_seq: int
    read_id: str
    out_seq: int
    config: str = ""
    """The session's settings as its last ``session.update`` left them (JSON), when the
    lease was granted: a new owner's starting point (``schemas.session_shape``)."""


class AcquireStatus(StrEnum):
    OK = "ok"
    HELD = "held"
    CLOSED = "closed"


class PublishStatus(StrEnum):
    OK = "ok"
    LOST = "lost"
    """The lease is no longer ours: we are a zombie for this session."""
    STALE = "stale"
    """A group's fence regressed (cancel or failover happened); nothing was written."""
    AHEAD = "ahead"
    """A group's fence is ahead of the authority (Redis lost writes); nothing was written."""
    CLOSED = "closed"


class PublishResult(NamedTuple):
    status: PublishStatus
    reason: str = ""
    current: Fence | None = None
    group: int = -1
    """For STALE and AHEAD: the index of the group that was refused."""
    server_event_seq: int = 0


OutputGroup = tuple[Fence, Sequence[OutputEvent]]
"""Outputs published under one fence."""


class StageOwnership:
    """Acquire, renew, release and publish for one stage's worker."""

    def __init__(
        self, bus: RedisBus, pipeline: PipelineConfig, stage: str, worker_id: str, ttl_ms: int
    ) -> None:
        self.bus = bus
        self.stage = stage
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.to_client = pipeline.stage(stage).to_client
        self.journal_only = pipeline.outputs_in_journal(stage)
        """A client-facing stage no stage reads publishes its outputs once, into the
        client journal: nothing reads its own stream but a takeover, which reads the
        journal instead (``workers.rebuild``)."""
        self._where = "2" if self.journal_only else "1" if self.to_client else "0"
        self._authority = SessionAuthority(bus, pipeline)
        self._stage_index = pipeline.stage_names.index(stage)
        self._consumers = list(pipeline.downstream(stage))
        """The stages that read what this stage publishes: a publish rings the bells of
        their lease holders (and the coordinators' for a client-facing stage)."""
        self._publish_keys = PerSession(self._make_publish_keys)
        self.feeds_stages = bool(self._consumers)
        """Other stages read what this stage publishes (settings are passed on to them)."""

    def _lifecycle_keys(self, session_id: str) -> list[str]:
        # The scripts expect this stage's (output, lease, bell) triple first, at KEYS[7].
        keys = self._authority.script_keys(session_id)
        head, triples = keys[:6], keys[6:]
        at = 3 * self._stage_index
        return head + triples[at : at + 3] + triples[:at] + triples[at + 3 :]

    async def acquire(self, session_id: str, now_ms: int) -> tuple[AcquireStatus, Lease | None]:
        token = secrets.token_hex(8)
        reply = await self.bus.run(
            self.bus.acquire_script,
            self._lifecycle_keys(session_id),
            [session_id, self.stage, self.worker_id, token, self.ttl_ms, now_ms],
        )
        status = AcquireStatus(reply[0])
        if status is not AcquireStatus.OK:
            return status, None
        inc, epoch, turn, resp = (int(v) for v in reply[1:5])
        lease = Lease(
            session_id=session_id,
            token=token,
            fence=Fence(session_id, inc, epoch, turn, resp),
            failover=bool(int(reply[5])),
            applied_seq=int(reply[6]),
            read_id=str(reply[7]),
            out_seq=int(reply[8]),
            config=_text(reply[9]) if len(reply) > 9 else "",
        )
        await self.index({session_id: now_ms + self.ttl_ms})
        return status, lease

    async def renew(self, leases: Sequence[Lease], now_ms: int) -> list[bool]:
        """Renew many leases together; False where the lease was lost. (A worker's
        heartbeat renews each on its own: ``workers.heartbeat``.)

        Only renewed leases get a new expiry in the lease index: a lost one keeps
        its old (past) score, so the orphan scans see it at once.
        """
        renewed = list(await asyncio.gather(*(self.renew_one(lease) for lease in leases)))
        expiry = {
            lease.session_id: now_ms + self.ttl_ms
            for lease, ok in zip(leases, renewed, strict=True)
            if ok
        }
        if expiry:
            await self.index(expiry)
        return renewed

    async def renew_one(self, lease: Lease) -> bool:
        """Renew one lease (its index entry is not written); False when it was lost.
        Calls made together go to a single Redis in one round trip."""
        keys = [self.bus.keys.session(lease.session_id).lease(self.stage)]
        return bool(
            (await self.bus.run_many(self.bus.renew_script, [(keys, [lease.token, self.ttl_ms])]))[
                0
            ]
        )

    async def index(self, expiry: Mapping[str, int]) -> None:
        """Record leases' expiries (session id -> ms) in the stage's lease index, which
        the orphan scans read. A full Redis still moves the sessions already in it; one
        not in it yet (taken just as Redis filled up) is added by a renewal once Redis
        has room, and until then its lease is renewed all the same."""
        try:
            await self.bus.rescore(self.bus.keys.lease_index(self.stage), expiry)
        except RedisFullError:
            log.warning("Redis is full: sessions new to the lease index of %s join it once "
                        "Redis has room", self.stage)  # fmt: skip

    async def release(self, lease: Lease, *, hand_back: bool) -> None:
        """Give the lease up; with ``hand_back`` the session is queued for another worker."""
        sk = self.bus.keys.session(lease.session_id)
        keys = [sk.lease(self.stage), sk.meta, sk.bell(self.stage)]
        released = await self.bus.run(self.bus.release_script, keys, [lease.token])
        await self.bus.client.zrem(self.bus.keys.lease_index(self.stage), lease.session_id)
        if hand_back and released[0]:
            await self.bus.client.xadd(
                self.bus.keys.assign(self.stage), {"sid": lease.session_id, "why": "handback"}
            )

    def _make_publish_keys(self, session_id: str) -> list[str]:
        """KEYS of the publish script (see ``dataplane.scripts``)."""
        sk = self.bus.keys.session(session_id)
        keys = [sk.meta, sk.lease(self.stage), sk.stage_out(self.stage), sk.client]
        keys += [sk.bell(consumer) for consumer in self._consumers]
        if self.to_client:
            keys.append(sk.bell(CLIENT))
        return keys

    async def publish(
        self,
        lease: Lease,
        groups: Sequence[OutputGroup],
        *,
        applied_seq: int,
        read_id: str,
        out_seq: int,
    ) -> PublishResult:
        """Append every group of outputs and record progress in one atomic step, if the
        lease holds and no group's fence regressed or runs ahead of the authority.

        ``out_seq`` is the stage's output counter once these outputs are out; a call
        repeated after its reply was lost is recognised by its outputs' seqs."""
        keys = self._publish_keys(lease.session_id)
        seqs = [event.seq for _, events in groups for event in events]
        args: list[object] = [
            self.stage,
            lease.token,
            applied_seq,
            read_id,
            self._where,
            seqs[0] if seqs else 0,
            out_seq,
            len(groups),
            lease.session_id,
        ]
        for fence, events in groups:
            args += [fence.incarnation, fence.epoch, fence.turn_id, fence.response_seq]
            args.append(len(events))
            encoded = [encode_event(event) for event in events]
            args += encoded
            if self.to_client and not self.journal_only:
                args += encoded  # once for the stage's own stream, once for the journal
        reply = await self.bus.run(self.bus.publish_script, keys, args)
        status = PublishStatus(reply[0])
        if status is PublishStatus.OK:
            return PublishResult(status, server_event_seq=int(reply[1]))
        if status in (PublishStatus.STALE, PublishStatus.AHEAD):
            inc, epoch, turn, resp = (int(v) for v in reply[3:7])
            current = Fence(lease.session_id, inc, epoch, turn, resp)
            return PublishResult(status, str(reply[2]), current, int(reply[1]) - 1)
        return PublishResult(status)

    async def note_failure(self, session_id: str) -> int:
        """Count a failure of this stage on the session; returns how many in a row at
        the stage's recorded progress (a failure after progress was made counts 1)."""
        return await session_meta.note_failure(self.bus, session_id, self.stage)

    async def note_drop(self, reason: str, count: int) -> None:
        """Count dropped outputs in the shared metrics hash (all processes add up)."""
        try:
            await self.bus.hincrby(self.bus.keys.metrics, f"dropped:{self.stage}:{reason}", count)
        except RedisFullError:
            # The hash mirrors the process's own counter, which has counted them: a full
            # Redis may cost the mirror a count, never the session its progress.
            log.warning("Redis is full: %d drops (%s) are not in the shared metrics", count,
                        reason)  # fmt: skip


def _text(value: object) -> str:
    """A script's string reply, whether the connection decodes replies or not."""
    return value.decode() if isinstance(value, bytes) else str(value or "")
