"""The session authority on Redis: open, append, accept, cancel, close.

A thin shell over the Lua in ``dataplane.scripts``: it builds key lists,
encodes what the scripts embed, and turns status words into typed results or
the errors of ``schemas.errors``. Any number of coordinator processes can use
it on the same session at once.

Every mutating call is idempotent across retries: each ``SessionAuthority`` is
a producer with an id of its own, makes its calls on one session one at a time
and numbers them; the script answers a repeated number with the reply it gave
the first time (see ``dataplane.scripts``). So a reply lost to a dropped
connection, which the bus retries, never appends an input twice, bumps an
epoch twice or journals a notice twice (``tests/test_idempotence.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import msgspec

from dataplane import session_meta
from dataplane.bus import RedisBus
from dataplane.sessions import ALL_MODES
from schemas.config import SESSION_INPUT, PipelineConfig
from schemas.errors import (
    FenceMismatchError,
    SessionClosedError,
    SessionExistsError,
    SessionNotFoundError,
    SessionReplacedError,
    UnsupportedModeError,
)
from schemas.events import PAYLOAD_FOR_MODE, InputMode, OutputKind, Payload
from schemas.fence import Fence, require_fence
from schemas.keys import CLIENT, PerSession

_tail_encoder = msgspec.msgpack.Encoder()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class AppendReceipt(NamedTuple):
    """Where an accepted input landed: its counters, fence and log entry id."""

    seq: int
    turn_seq: int
    turn_id: int
    fence: Fence
    entry_id: str


class CancelResult(NamedTuple):
    cancelled: Fence
    fence: Fence
    applied: bool
    """False when the epoch had already moved past the one asked to cancel."""


def encode_tail(mode: InputMode, payload: Payload, ts_ms: int) -> bytes:
    """The msgpack map entries (without the map header) for mode, payload and ts_ms."""
    # An InputMode is a str (its value): neither here nor in the script's arguments does
    # it need its ``.value``, a descriptor call.
    raw = _tail_encoder.encode({"mode": mode, "payload": payload, "ts_ms": ts_ms})
    return raw[1:]  # drop the fixmap header; the script writes a header for 7 entries


def _as_text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _fence(session_id: str, reply: list[Any], start: int) -> Fence:
    # Indexed one by one: a generator over the slice cost twice the Fence itself per append.
    return Fence(
        session_id,
        int(reply[start]),
        int(reply[start + 1]),
        int(reply[start + 2]),
        int(reply[start + 3]),
    )


class _Serial:
    """One session's lock and how many calls hold it or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class SessionAuthority:
    """Fence authority for the sessions of one pipeline, backed by Redis."""

    def __init__(self, bus: RedisBus, pipeline: PipelineConfig) -> None:
        self.bus = bus
        self.pipeline = pipeline
        self._input_readers = [s.name for s in pipeline.stages if s.input == SESSION_INPUT]
        """The stages that read the session's input log: an append rings their bells."""
        self.producer = secrets.token_hex(8)
        """This authority's producer id in the scripts' retry detection."""
        self._numbers = itertools.count(1)
        self._append_keys = PerSession(self._make_append_keys)
        self._serial: dict[str, _Serial] = {}
        """The sessions with a call in flight or waiting, each with its lock: an entry is
        removed when its last user leaves, so the map holds only busy sessions."""

    async def _call(
        self,
        script: Any,
        session_id: str,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        raw: bool = False,
    ) -> list[Any]:
        """Run a mutating script as this producer's next call on ``session_id``: one at a
        time per session (the session's lock), numbered in increasing order. With ``raw``
        the reply is as Redis gave it (``RedisBus.run_raw``)."""
        serial = self._serial.get(session_id)
        if serial is None:
            serial = self._serial[session_id] = _Serial()
        serial.users += 1
        try:
            async with serial.lock:
                numbered = [*args, self.producer, next(self._numbers)]
                if raw:
                    return await self.bus.run_raw(script, keys, numbered)
                return await self.bus.run(script, keys, numbered)
        finally:
            serial.users -= 1
            if not serial.users:
                del self._serial[session_id]

    def _make_append_keys(self, session_id: str) -> list[str]:
        """KEYS of the append script: meta, the input log, then the bell of each stage
        reading the session's input (an append rings the bell of the worker holding the
        stage's lease, which acquire records in meta under that key)."""
        sk = self.bus.keys.session(session_id)
        return [sk.meta, sk.input, *(sk.bell(name) for name in self._input_readers)]

    def script_keys(self, session_id: str) -> list[str]:
        """KEYS for the lifecycle scripts: meta in ctl out prog client_bell, then
        (stage out, lease, bell)*."""
        sk = self.bus.keys.session(session_id)
        keys = [sk.meta, sk.input, sk.control, sk.client, sk.progress, sk.bell(CLIENT)]
        for name in self.pipeline.stage_names:
            keys += [sk.stage_out(name), sk.lease(name), sk.bell(name)]
        return keys

    def _raise(self, session_id: str, reply: list[Any]) -> None:
        status = reply[0]
        if status == "missing":
            raise SessionNotFoundError(f"no session {session_id!r}")
        if status == "closed":
            raise SessionClosedError(f"session {session_id!r} is closed")
        if status == "exists":
            raise SessionExistsError(f"session {session_id!r} is already open")
        if status == "replaced":
            raise SessionReplacedError(
                f"session {session_id!r} is served by another connection now"
            )
        if status == "unsupported":
            raise UnsupportedModeError(f"input mode is not supported by session {session_id!r}")
        if status == "mismatch":
            raise FenceMismatchError(str(reply[1]), f"session {session_id!r}: {reply[2:]}")
        raise RuntimeError(f"unexpected authority reply {reply!r}")

    async def open(
        self,
        session_id: str,
        capabilities: Iterable[InputMode] | None = None,
        *,
        incarnation: int | None = None,
    ) -> Fence:
        """Open (or reopen at a higher incarnation) and index the session."""
        Fence(session_id)  # validates the id
        caps = frozenset(capabilities) if capabilities is not None else ALL_MODES
        caps_text = "" if caps == ALL_MODES else " ".join(sorted(m.value for m in caps))
        ts = now_ms()
        await self.bus.client.zadd(self.bus.keys.sessions, {session_id: ts})
        reply = await self._call(
            self.bus.open_script,
            session_id,
            self.script_keys(session_id),
            [session_id, caps_text, ts, -1 if incarnation is None else incarnation],
        )
        if reply[0] != "ok":
            self._raise(session_id, reply)
        for stage in self.pipeline.stage_names:
            await self.bus.client.xadd(
                self.bus.keys.assign(stage), {"sid": session_id, "why": "open"}
            )
        return Fence(session_id, int(reply[1]))

    async def append(
        self,
        session_id: str,
        mode: InputMode | str,
        payload: Payload,
        *,
        fence: Fence | None = None,
        ts_ms: int | None = None,
        attachment: str = "",
        taken: bool = False,
    ) -> AppendReceipt:
        """Append one input to the session log under ``fence`` (or the current fence).
        With ``attachment`` (a client connection's id) the input is refused
        (``SessionReplacedError``) unless that connection still serves the session, in
        the same atomic step (``tests/test_coordinator_fencing.py``). ``taken``: the
        client was already told it was taken (a commit after its response's request
        notice): it is written on a full Redis too (``scripts.APPEND_TAKEN``)."""
        try:
            checked = mode if type(mode) is InputMode else InputMode(mode)
        except ValueError as exc:
            raise UnsupportedModeError(f"input mode {mode!r} is not supported") from exc
        if type(payload) is not PAYLOAD_FOR_MODE[checked]:
            raise TypeError(f"mode {checked.value} needs a {PAYLOAD_FOR_MODE[checked].__name__}")
        given: list[Any] = ["0"]
        if fence is not None:
            fence = require_fence(fence)
            if fence.session_id != session_id:
                raise FenceMismatchError("session", f"{fence} is not session {session_id!r}")
            given = ["1", fence.incarnation, fence.epoch, fence.turn_id, fence.response_seq]
        tail = encode_tail(checked, payload, now_ms() if ts_ms is None else ts_ms)
        reply = await self._call(
            self.bus.append_taken_script if taken else self.bus.append_script,
            session_id,
            self._append_keys(session_id),
            [session_id, checked, tail, attachment, *given],
            raw=True,  # read here as Redis gave it: numbers, and bytes for the id
        )
        if reply[0] not in (b"ok", "ok"):
            self._raise(session_id, [_as_text(item) for item in reply])
        return AppendReceipt(
            int(reply[1]), int(reply[2]), int(reply[5]), _fence(session_id, reply, 3),
            _as_text(reply[7]),
        )  # fmt: skip

    async def accept(self, fence: Fence) -> Fence:
        """Move the session's fence forward to ``fence`` (turn or response advance)."""
        fence = require_fence(fence)
        sk = self.bus.keys.session(fence.session_id)
        args = [fence.incarnation, fence.epoch, fence.turn_id, fence.response_seq]
        reply = await self.bus.run(self.bus.accept_script, [sk.meta], args)
        if reply[0] != "ok":
            self._raise(fence.session_id, reply)
        return fence

    async def reserve_response(self, session_id: str, *, attachment: str = "") -> Fence:
        """Advance the session's response_seq; the response's inputs and outputs carry it.
        ``attachment``: as for ``append``."""
        sk = self.bus.keys.session(session_id)
        reply = await self._call(self.bus.reserve_script, session_id, [sk.meta], [attachment])
        if reply[0] != "ok":
            self._raise(session_id, reply)
        return _fence(session_id, reply, 1)

    async def cancel(
        self,
        session_id: str,
        *,
        expect_epoch: int | None = None,
        reason: str = "cancel",
        attachment: str = "",
    ) -> CancelResult:
        """Interrupt: bump the epoch and put the cancel ahead of queued data.
        ``attachment``: as for ``append``."""
        expect = -1 if expect_epoch is None else expect_epoch
        reply = await self._call(
            self.bus.cancel_script,
            session_id,
            self.script_keys(session_id),
            [session_id, reason, now_ms(), expect, attachment],
        )
        if reply[0] == "already":
            current = _fence(session_id, reply, 1)
            return CancelResult(current, current, applied=False)
        if reply[0] != "ok":
            self._raise(session_id, reply)
        fence = _fence(session_id, reply, 1)
        return CancelResult(fence.replace(epoch=fence.epoch - 1), fence, applied=True)

    async def close(
        self,
        session_id: str,
        *,
        expect_incarnation: int | None = None,
        reason: str = "closed",
        ttl_s: int = 3600,
    ) -> Fence:
        """Close the session; its keys expire after ``ttl_s``."""
        fence = await self._close(session_id, expect_incarnation, reason, ttl_s, 0)
        assert fence is not None
        return fence

    async def close_detached(
        self, session_id: str, *, idle_before_ms: int, reason: str, ttl_s: int = 3600
    ) -> Fence | None:
        """Close the session if a client connection once attached to it and none has
        held it since ``idle_before_ms``; None when it is (or never was) attached."""
        return await self._close(session_id, None, reason, ttl_s, max(1, idle_before_ms))

    async def _close(
        self,
        session_id: str,
        expect_incarnation: int | None,
        reason: str,
        ttl_s: int,
        idle_before_ms: int,
    ) -> Fence | None:
        expect = -1 if expect_incarnation is None else expect_incarnation
        reply = await self._call(
            self.bus.close_script,
            session_id,
            self.script_keys(session_id),
            [session_id, reason, now_ms(), expect, ttl_s, idle_before_ms],
        )
        if reply[0] == "attached":
            return None
        if reply[0] != "ok":
            self._raise(session_id, reply)
        await self.bus.client.zrem(self.bus.keys.sessions, session_id)
        return _fence(session_id, reply, 1)

    async def configure(self, session_id: str, config: str, *, attachment: str) -> None:
        """Store the session's configuration (JSON) while ``attachment`` serves it."""
        sk = self.bus.keys.session(session_id)
        reply = await self.bus.run(self.bus.configure_script, [sk.meta], [attachment, config])
        if reply[0] != "ok":
            self._raise(session_id, reply)

    async def current(self, session_id: str) -> Fence:
        """The session's current fence as Redis has it."""
        fence = await session_meta.fence(self.bus, session_id)
        if fence is None:
            raise SessionNotFoundError(f"no session {session_id!r}")
        return fence

    async def status(self, session_id: str) -> dict[str, str]:
        """The session's authority hash, decoded (for inspection tools)."""
        snapshot = await session_meta.snapshot(self.bus, session_id)
        return dict(snapshot.fields) if snapshot is not None else {}

    async def journal(
        self,
        session_id: str,
        event: dict[str, Any],
        *,
        attachment: str = "",
        receipt: bool = False,
    ) -> int:
        """Append a coordinator notice (a server event as JSON) to the client journal;
        returns its server_event_seq. ``attachment``: as for ``append``. ``receipt``: the
        notice acknowledges a write Redis took, and is journaled on a full Redis too
        (``scripts.RECEIPT``)."""
        sk = self.bus.keys.session(session_id)
        tail = _tail_encoder.encode(
            {
                "stage": "coordinator",
                "kind": OutputKind.NOTICE.value,
                "source_seq": 0,
                "text": json.dumps(event, separators=(",", ":")),
                "data": b"",
                "token_ids": [],
                "meta": {},
                "ts_ms": now_ms(),
            }
        )[1:]
        reply = await self._call(
            self.bus.receipt_script if receipt else self.bus.journal_script,
            session_id,
            [sk.meta, sk.client, sk.bell(CLIENT)],
            [session_id, tail, attachment],
        )
        if reply[0] != "ok":
            self._raise(session_id, reply)
        return int(reply[1])
