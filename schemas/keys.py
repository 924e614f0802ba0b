"""Every Redis key duplexq uses, named in this one module.

Per-session keys carry the hash tag ``{session_id}`` so that one session's
keys live in one Redis Cluster slot and a Lua script may touch them together.
Global keys (assignment streams, indexes, metrics) are written with separate
commands, never from a per-session script.

==========================  ======  =============================================
key                         type    contents
==========================  ======  =============================================
dq:{sid}:meta               hash    fence authority: inc, epoch, turn, resp, seq,
                                    tseq, tkey, oseq, status, caps, timestamps
dq:{sid}:in                 stream  session input log (field ``e``: InputEvent)
dq:{sid}:ctl                stream  session control (field ``c``: ControlEvent)
dq:{sid}:st:{stage}         stream  a stage's accepted outputs (``e``) and fence
                                    barriers (``c``)
dq:{sid}:out                stream  client journal: outputs for the client with
                                    their ``server_event_seq`` (``n``)
dq:{sid}:lease:{stage}      string  lease of (session, stage): "worker token inc"
dq:{sid}:prog               hash    per-stage progress: applied seq, read position,
                                    output seq, owner count
dq:assign:{stage}           stream  sessions to hand to the stage's workers
dq:leases:{stage}           zset    session -> lease expiry (ms), orphan detection
dq:workers:{stage}          zset    worker id -> last heartbeat (ms)
dq:wake:{worker}            stream  wakes a worker's blocking reads (capped)
dq:resume:{sha256}          string  resume token digest -> session id (24 h TTL)
dq:sessions                 zset    open session ids -> opened at (ms)
dq:metrics                  hash    counters shared by all processes
==========================  ======  =============================================
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "dq"
ASSIGN_GROUP = "workers"
"""Consumer group every stage's workers share on ``dq:assign:{stage}``."""


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys of one session, all in one cluster slot."""

    meta: str
    input: str
    control: str
    client: str
    progress: str
    tag: str
    prefix: str

    def stage_out(self, stage: str) -> str:
        return f"{self.tag}:st:{stage}"

    def lease(self, stage: str) -> str:
        return f"{self.tag}:lease:{stage}"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests use a prefix of their own)."""

    prefix: str = DEFAULT_PREFIX

    def session(self, session_id: str) -> SessionKeys:
        tag = f"{self.prefix}:{{{session_id}}}"
        return SessionKeys(
            meta=f"{tag}:meta",
            input=f"{tag}:in",
            control=f"{tag}:ctl",
            client=f"{tag}:out",
            progress=f"{tag}:prog",
            tag=tag,
            prefix=self.prefix,
        )

    def assign(self, stage: str) -> str:
        return f"{self.prefix}:assign:{stage}"

    def lease_index(self, stage: str) -> str:
        return f"{self.prefix}:leases:{stage}"

    def workers(self, stage: str) -> str:
        return f"{self.prefix}:workers:{stage}"

    def wake(self, worker_id: str) -> str:
        """A worker's own stream; writing to it ends the worker's blocking reads early."""
        return f"{self.prefix}:wake:{worker_id}"

    def resume(self, token_digest: str) -> str:
        """Resume-token index: sha256 of a session's resume token -> session id."""
        return f"{self.prefix}:resume:{token_digest}"

    @property
    def sessions(self) -> str:
        return f"{self.prefix}:sessions"

    @property
    def metrics(self) -> str:
        return f"{self.prefix}:metrics"

    def session_pattern(self) -> str:
        """SCAN pattern matching every per-session key."""
        return f"{self.prefix}:{{*}}:*"
