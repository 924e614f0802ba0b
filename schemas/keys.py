"""Every Redis key duplexq uses, named in this one module.

Sessions are spread over ``PARTITIONS`` partitions by a hash of their id. A
session's keys carry its partition as the hash tag (``{p7}``), so one
session's keys, and the partition's bells, live in one Redis Cluster slot: a
Lua script may touch them together, and one XREAD may read many sessions of a
partition. Global keys (assignment streams, indexes, metrics) are written with
separate commands, never from a per-session script.

A bell is a doorbell for one consumer (a stage, or the coordinators' journal
readers, ``CLIENT``): every script that writes a stream a consumer reads rings
that consumer's bell in the same step with the session id. Readers block on
their bells and then read only the sessions that rang, never every session
they follow. On Redis Cluster (``Keys(cluster=True)``) each partition has its
own bells, in its slot, each a shard channel rather than a stream
(``dataplane.bell_channels``); on one Redis a consumer has a single bell.

==========================  ======  =============================================
key                         type    contents
==========================  ======  =============================================
dq:{p}:{sid}:meta           hash    fence authority: inc, epoch, turn, resp, seq,
                                    tseq, tkey, oseq, status, caps, timestamps;
                                    per-stage progress ({stage}:applied, :read,
                                    :oseq, :owners) and whom to ring for it
dq:{p}:{sid}:in             stream  session input log (field ``e``: InputEvent)
dq:{p}:{sid}:ctl            stream  session control (field ``c``: ControlEvent)
dq:{p}:{sid}:st:{stage}     stream  a stage's accepted outputs (``e``) and fence
                                    barriers (``c``)
dq:{p}:{sid}:out            stream  client journal: outputs for the client with
                                    their ``server_event_seq`` (``n``)
dq:{p}:{sid}:lease:{stage}  string  lease of (session, stage): "worker token inc"
dq:{p}:{sid}:prog           hash    per-stage progress of sessions opened before it
                                    moved into meta (acquire moves it there)
dq:assign:{stage}           stream  sessions to hand to the stage's workers
dq:leases:{stage}           zset    session -> lease expiry (ms), orphan detection
dq:workers:{stage}          zset    worker id -> last heartbeat (ms); a worker
                                    joins once its model is loaded
dq:models:{stage}           hash    worker id -> JSON: the model it serves, whether
                                    it is the random-weight fallback, load time
dq:bell[:{p}]:{consumer}    stream  session ids whose streams for ``consumer``
                                    changed (fields ``d`` data, ``c`` control:
                                    msgpack arrays), capped at ``BELL_LENGTH``;
                                    on a cluster a shard channel, not a key
dq:resume:{sha256}          string  resume token digest -> session id (24 h TTL)
dq:sessions                 zset    open session ids -> opened at (ms)
dq:{live}:all               zset    live session ids -> counted until (ms): admission
dq:{live}:key:{digest}      zset    the same, of the sessions of one API key digest
dq:secret:{sha256}          string  client secret digest -> JSON: minting key digest,
                                    session settings (TTL: the secret's lifetime)
dq:metrics                  hash    counters shared by all processes
==========================  ======  =============================================
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Generic, TypeVar

DEFAULT_PREFIX = "dq"
PARTITIONS = 16
"""Partitions sessions are spread over: the most Redis Cluster primaries the data
plane can use, and the number of bells each reader follows. Fixed by the product:
every process of a deployment derives the same key names from it."""
CLIENT = "@client"
"""The bell consumer name of the coordinators' journal readers."""


def worker_bell(stage: str, worker_id: str) -> str:
    """The bell consumer name of one worker of ``stage``. A stage's input is rung on the
    bell of the worker holding the session's lease (``dataplane.scripts``, which builds
    the same name: the stage's bell, a colon, the worker id), so no other worker wakes."""
    return f"{stage}:{worker_id}"


BELL_LENGTH = 10_000
"""Entries a bell keeps (approximately); a reader further behind than that misses
rings and finds those sessions on its next sweep."""
ASSIGN_GROUP = "workers"
"""Consumer group every stage's workers share on ``dq:assign:{stage}``."""


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys of one session, all in its partition's cluster slot."""

    partition: int
    meta: str
    input: str
    control: str
    client: str
    progress: str
    """Where sessions opened before stage progress moved into ``meta`` kept it: acquire
    moves a stage's fields from there, open deletes it and close expires it."""
    tag: str
    prefix: str

    def stage_out(self, stage: str) -> str:
        return f"{self.tag}:st:{stage}"

    def lease(self, stage: str) -> str:
        return f"{self.tag}:lease:{stage}"

    cluster: bool = False

    def bell(self, consumer: str) -> str:
        """The bell of ``consumer`` for this session (its partition's, on a cluster)."""
        return bell_key(self.prefix, self.partition if self.cluster else None, consumer)


def partition_of(session_id: str) -> int:
    """The partition of a session: a stable hash of its id."""
    return zlib.crc32(session_id.encode()) % PARTITIONS


def bell_key(prefix: str, partition: int | None, consumer: str) -> str:
    if partition is None:
        return f"{prefix}:bell:{consumer}"
    return f"{prefix}:bell:{{p{partition}}}:{consumer}"


@lru_cache(maxsize=65_536)
def _session_keys(prefix: str, session_id: str, cluster: bool) -> SessionKeys:
    partition = partition_of(session_id)
    tag = f"{prefix}:{{p{partition}}}:{session_id}"
    return SessionKeys(
        partition=partition,
        meta=f"{tag}:meta",
        input=f"{tag}:in",
        control=f"{tag}:ctl",
        client=f"{tag}:out",
        progress=f"{tag}:prog",
        tag=tag,
        prefix=prefix,
        cluster=cluster,
    )


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests use a prefix of their own)."""

    prefix: str = DEFAULT_PREFIX
    cluster: bool = False
    """Bells per partition (Redis Cluster) instead of one per consumer."""

    def session(self, session_id: str) -> SessionKeys:
        return _session_keys(self.prefix, session_id, self.cluster)

    def bells(self, consumer: str) -> list[str]:
        """``consumer``'s bells: one per partition on a cluster, else one."""
        if not self.cluster:
            return [bell_key(self.prefix, None, consumer)]
        return [bell_key(self.prefix, p, consumer) for p in range(PARTITIONS)]

    def assign(self, stage: str) -> str:
        return f"{self.prefix}:assign:{stage}"

    def lease_index(self, stage: str) -> str:
        return f"{self.prefix}:leases:{stage}"

    def workers(self, stage: str) -> str:
        """The stage's live workers (id -> last heartbeat, ms); a worker joins once its
        model is loaded (``dataplane.readiness``)."""
        return f"{self.prefix}:workers:{stage}"

    def stage_models(self, stage: str) -> str:
        """What each worker of the stage serves: worker id -> ``StageModel`` JSON."""
        return f"{self.prefix}:models:{stage}"

    def resume(self, token_digest: str) -> str:
        """Resume-token index: sha256 of a session's resume token -> session id."""
        return f"{self.prefix}:resume:{token_digest}"

    def client_secret(self, secret_digest: str) -> str:
        """Client-secret index: sha256 of a secret -> what it grants (TTL: its life)."""
        return f"{self.prefix}:secret:{secret_digest}"

    @property
    def live_sessions(self) -> str:
        """Every live session (``coordinator.admission``); its hash tag keeps it in the
        slot of the per-key sets, so one script checks both."""
        return f"{self.prefix}:{{live}}:all"

    def live_sessions_of(self, key_digest: str) -> str:
        """The live sessions of one API key digest (``anonymous``: no key)."""
        return f"{self.prefix}:{{live}}:key:{key_digest or 'anonymous'}"

    @property
    def sessions(self) -> str:
        return f"{self.prefix}:sessions"

    @property
    def metrics(self) -> str:
        return f"{self.prefix}:metrics"

    def session_pattern(self) -> str:
        """SCAN pattern matching every per-session key."""
        return f"{self.prefix}:{{p*}}:*"


_T = TypeVar("_T")


class PerSession(Generic[_T]):
    """What ``make`` gives for a session, made once and kept: the key lists of a script
    called for every event of a session are the same each time. At most ``most``
    sessions are kept; then the map starts again."""

    __slots__ = ("_kept", "_make", "_most")

    def __init__(self, make: Callable[[str], _T], most: int = 65_536) -> None:
        self._make = make
        self._most = most
        self._kept: dict[str, _T] = {}

    def __call__(self, session_id: str) -> _T:
        value = self._kept.get(session_id)
        if value is None:
            if len(self._kept) >= self._most:
                self._kept.clear()
            value = self._kept[session_id] = self._make(session_id)
        return value
