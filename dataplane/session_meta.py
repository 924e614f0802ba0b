"""The session's meta hash: the one Python module that reads and writes its fields.

Every session has one hash (``schemas.keys.SessionKeys.meta``) in its partition's slot.
The Lua scripts (``dataplane.scripts``) write it atomically with what it guards: the
fence (``status``, ``inc``, ``epoch``, ``turn``, ``resp``), the input log's ``seq``, the
attachment (``att``, ``att_until``, the API key's digest, the resume tokens), the
configuration the last ``session.update`` left (``config``), the input modes the
session was opened with (``caps``), each stage's holder bell and progress
(``{stage}:applied``, ``{stage}:read``, ``{stage}:oseq``) and the producers' retry
records. Python code asks this module for what it needs instead of naming fields: a
field renamed in the scripts is renamed here, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from dataplane.bus import RedisBus
from schemas.fence import Fence
from schemas.realtime import SessionConfig

STATUS = "status"
"""``open`` or ``closed``; absent for a session never opened."""
FENCE = ("inc", "epoch", "turn", "resp")
"""The fence's counters, in ``Fence`` order after the session id."""
RESP = "resp"
"""The newest response reserved (a commit, a ``response.create``, a VAD turn end)."""
SEQ = "seq"
"""The input log's last sequence number."""
CAPS = "caps"
"""The input modes the session was opened with, space-separated; absent: every mode."""
CONFIG = "config"
"""The session's configuration (``SessionConfig`` JSON) as the last update left it."""
ATTACHED_UNTIL = "att_until"
"""When the attachment lapses unless renewed (ms); when it left, for a detached one."""


def _applied(stage: str) -> str:
    return f"{stage}:applied"


def _read(consumer: str) -> str:
    return f"{consumer}:read"


def _oseq(stage: str) -> str:
    return f"{stage}:oseq"


def _int(raw: bytes | str | None) -> int:
    return int(raw or 0)


class Snapshot(NamedTuple):
    """Every field of one session's meta hash, decoded, at one moment."""

    session_id: str
    fields: Mapping[str, str]

    @property
    def fence(self) -> Fence:
        return Fence(self.session_id, *(_int(self.fields.get(name)) for name in FENCE))

    @property
    def status(self) -> str:
        return self.fields.get(STATUS, "")

    @property
    def seq(self) -> int:
        return _int(self.fields.get(SEQ))

    def applied(self, stage: str) -> int:
        """How far ``stage`` has applied the stream it reads."""
        return _int(self.fields.get(_applied(stage)))

    def produced(self, stage: str) -> int:
        """The last seq ``stage`` published on its output stream."""
        return _int(self.fields.get(_oseq(stage)))

    def owners(self, stage: str) -> int:
        """How many workers of ``stage`` have held the session so far."""
        return _int(self.fields.get(f"{stage}:owners"))

    def read(self, consumer: str) -> str | None:
        """The id of the last entry ``consumer`` confirmed it read (stream trimming)."""
        return self.fields.get(_read(consumer))


async def snapshot(bus: RedisBus, session_id: str) -> Snapshot | None:
    """Every field of the session's hash; None for a session unknown here."""
    fields = await bus.hgetall(bus.keys.session(session_id).meta)
    return Snapshot(session_id, fields) if fields else None


async def status(bus: RedisBus, session_id: str) -> str | None:
    """``open``, ``closed``, or None for a session never opened (or expired)."""
    raw = (await bus.hmget(bus.keys.session(session_id).meta, [STATUS]))[0]
    return raw.decode() if raw is not None else None


async def fence(bus: RedisBus, session_id: str) -> Fence | None:
    """The session's current fence as Redis has it; None for a session never opened."""
    raw = await bus.hmget(bus.keys.session(session_id).meta, [STATUS, *FENCE])
    if raw[0] is None:
        return None
    return Fence(session_id, *(_int(v) for v in raw[1:]))


async def config_json(bus: RedisBus, session_id: str) -> bytes | None:
    """The stored configuration's JSON as stored, None when no update stored one."""
    return (await bus.hmget(bus.keys.session(session_id).meta, [CONFIG]))[0]


async def config(bus: RedisBus, session_id: str) -> SessionConfig:
    """The session's configuration as its last ``session.update`` left it."""
    raw = await config_json(bus, session_id)
    return SessionConfig.model_validate_json(raw) if raw else SessionConfig()


async def store_config(bus: RedisBus, session_id: str, value: SessionConfig) -> None:
    """Store ``value`` as the session's configuration outside a connection (a replay's
    target before its first input; a live session's goes through ``scripts.CONFIGURE``,
    which checks the attachment)."""
    await bus.hset(bus.keys.session(session_id).meta, {CONFIG: value.model_dump_json()})


async def capabilities(bus: RedisBus, session_id: str) -> list[str]:
    """The input modes the session was opened with ([]: every mode)."""
    raw = (await bus.hmget(bus.keys.session(session_id).meta, [CAPS]))[0]
    return (raw or b"").decode().split()


async def reserved_response(bus: RedisBus, session_id: str) -> int:
    """The newest response number reserved for the session."""
    return _int((await bus.hmget(bus.keys.session(session_id).meta, [RESP]))[0])


async def applied(bus: RedisBus, session_id: str, stages: Iterable[str]) -> list[int]:
    """How far each of ``stages`` has applied its input, in order."""
    names = [_applied(stage) for stage in stages]
    return [_int(v) for v in await bus.hmget(bus.keys.session(session_id).meta, names)]


async def applied_by_many(bus: RedisBus, session_ids: Iterable[str], stage: str) -> list[int]:
    """How far ``stage`` has applied each session's input, in one round trip."""
    async with bus.client.pipeline(transaction=False) as pipe:
        for session_id in session_ids:
            pipe.hget(bus.keys.session(session_id).meta, _applied(stage))
        return [_int(v) for v in await pipe.execute()]


async def note_failure(bus: RedisBus, session_id: str, stage: str) -> int:
    """Count a failure of ``stage`` on the session; returns how many in a row at the
    stage's recorded progress (a failure after progress was made counts 1)."""
    meta = bus.keys.session(session_id).meta
    fields = [_applied(stage), f"{stage}:failed_at", f"{stage}:failures"]
    at_raw, failed_at, failures = await bus.hmget(meta, fields)
    at = _int(at_raw)
    same = failed_at is not None and int(failed_at) == at
    count = _int(failures) + 1 if same else 1
    await bus.hset(meta, {fields[1]: at, fields[2]: count})
    return count


def queue_attachment_read(pipe: Any, bus: RedisBus, session_id: str) -> None:
    """Queue on a redis-py pipeline the read ``attachment_of`` decodes (the control
    plane's audit reads it with each stage's lease in one round trip)."""
    pipe.hmget(bus.keys.session(session_id).meta, [STATUS, ATTACHED_UNTIL])


def attachment_of(reply: list[bytes | None]) -> tuple[str | None, int | None]:
    """(status, when the attachment lapses or lapsed in ms) from the queued read."""
    raw_status, raw_until = reply
    status_text = raw_status.decode() if raw_status is not None else None
    return status_text, int(raw_until) if raw_until else None
