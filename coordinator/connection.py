"""One client connection on ``/v1/realtime`` (``coordinator.hub`` feeds them).

A connection authenticates, opens (or resumes) a session, then runs two
tasks: ``receive`` (client events -> session log, in order) and ``pump``
(journal -> server events). It does the socket's I/O, parses and dispatches:
what touches a turn or a response (input that waits for a commit, commits,
``response.create``, cancels) is ``coordinator.turns``'s to decide and carry
out, and Redis is reached through the ``Coordinator`` facade. A bad event gets
an ``error`` with a stable code and the connection goes on; nothing already
accepted is touched. What a connection may cost (event rate, pending input,
journaled errors, queued server events) is bounded: ``coordinator.limits``,
``coordinator.outbound``.

On disconnect the session is kept for ``resume_grace_s``; a
``duplexq.session.resume`` with its token (on this or any coordinator process, with
the API key that opened the session) receives a new token and every journal
event after ``last_received_seq``, then live ones. Which
connection serves a session is agreed on in Redis (``coordinator.attachments``):
a resume while the old socket still looks open closes the old one, and a
session whose client never comes back is closed after the grace period by its
coordinator or, if that coordinator is gone, by the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocketDisconnect

from coordinator import client_requests, conversation, socket_io
from coordinator.auth import Identity
from coordinator.limits import CONTROL_EVENTS, ConnectionLimits
from coordinator.outbound import OVERFLOW_CLOSE_CODE, Outbound, Outgoing
from coordinator.realtime import (
    EXTENSION,
    ServerEventTranslator,
    audio_payload,
    error_event,
    image_payload,
    parse_client_event,
    server_seq,
)
from coordinator.resume import replay_journal
from coordinator.socket_io import Socket
from coordinator.turns import Turns
from dataplane.metrics import DROPPED_STALE, FIRST_OUTPUT
from dataplane.stage_fence import released
from schemas.errors import (
    AuthError,
    DuplexqError,
    ErrorCode,
    InputBackpressureError,
    ProtocolError,
    RateLimitedError,
    SessionClosedError,
    SessionReplacedError,
)
from schemas.events import InputMode, OutputEvent, PlaybackPayload, TextPayload
from schemas.realtime import (
    AudioAppend,
    AudioClear,
    AudioCommit,
    BargeIn,
    ClientEvent,
    FunctionCallOutputItem,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    MessageItem,
    OutputAudioClear,
    PlaybackAck,
    ResponseCancel,
    ResponseCreate,
    SessionConfig,
    SessionResume,
    SessionUpdate,
    VideoAppend,
)
from schemas.session_fields import judged
from schemas.session_shape import session_object, stage_settings

if TYPE_CHECKING:
    from coordinator.hub import Hub

log = logging.getLogger("duplexq.coordinator")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class Connection:
    """One WebSocket client: its session, its event order, its errors."""

    def __init__(self, hub: Hub, socket: Socket, identity: Identity | None = None) -> None:
        self.hub = hub
        self.socket = socket
        self.coordinator = hub.coordinator
        self.attachment = secrets.token_hex(8)
        """This connection's id in the session's attachment."""
        self.identity = identity or Identity("")
        self.key_digest = self.identity.key_digest
        self.config = SessionConfig()
        self.translator = ServerEventTranslator(hub.terminal)
        self.outbound = Outbound(hub.settings.max_outbound_events)
        self.limits = ConnectionLimits(hub.settings, time.monotonic)
        self._sent_seq = 0
        """The ``duplexq.seq`` of the latest journaled event sent to the socket."""
        self.turns = Turns(self.coordinator, self.translator, self.attachment)
        """The session's turns and responses, as this connection serves them."""
        self.closed = False
        """Set once this connection stopped serving (evicted or overflowed): nothing more
        is sent on its socket or written for its session."""
        self._pump_task: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str:
        """The session this connection serves ("" until it opens or resumes one): held
        by its turns, which write to it too."""
        return self.turns.session_id

    # -- lifecycle ---------------------------------------------------------------

    async def serve(self) -> None:
        """Run until the client goes; the socket is already accepted."""
        first = await self._first_event()
        try:
            if isinstance(first, SessionResume):
                await self._resume(first)
                first = None
            else:
                await self._open()
        except DuplexqError as exc:
            await self.socket.send_json(
                {
                    **error_event(exc.code.value, exc.message),
                    "event_id": _fresh_event_id(),
                    EXTENSION: {"seq": 0},
                }
            )
            # 1013 (try again later) for a capacity limit, such as ``session_limit``.
            code = 1008 if isinstance(exc, AuthError) else 1013 if exc.retryable else 1011
            await self.socket.close(code=code)
            return
        try:
            async with asyncio.TaskGroup() as group:
                pump = self._pump_task = group.create_task(self._pump())
                guard = group.create_task(self._close_when_overflowed(pump))
                if first is not None:
                    await self._process(self._first_raw, first)
                await self._receive()
                pump.cancel()
                guard.cancel()
        finally:
            await self.hub.detach(self)

    def deliver(self, item: Outgoing) -> None:
        """Queue a server event for the socket; never waits (``coordinator.outbound``)."""
        if not self.closed:
            self.outbound.put(item)

    async def _close_when_overflowed(self, pump: asyncio.Task[None]) -> None:
        """A client that stopped reading: stop sending and close with 4008
        (``coordinator.socket_io``); its receive loop then ends and the session waits
        for a resume."""
        await self.outbound.overflowed.wait()
        self.closed = True
        pump.cancel()
        reason = self.outbound.reason
        log.warning("session %s: %s; closing its connection", self.session_id, reason)
        wait_s = self.hub.settings.client_close_wait_ms / 1000
        await socket_io.close_stalled(self.socket, OVERFLOW_CLOSE_CODE, reason, wait_s)

    async def evict(self, reason: str) -> None:
        """Another connection serves the session now: stop sending and close this socket
        with 4000 (its receive loop then ends; any write it had in flight is refused by
        Redis, ``SessionReplacedError``)."""
        if self.closed:
            return
        self.closed = True
        if self._pump_task is not None:
            self._pump_task.cancel()
        with contextlib.suppress(Exception):
            await self.socket.close(code=4000, reason=reason)

    async def _first_event(self) -> ClientEvent | None:
        wait_s = self.hub.settings.first_event_wait_ms / 1000
        try:
            raw = await asyncio.wait_for(socket_io.receive(self.socket), wait_s)
        except TimeoutError:
            return None
        self._first_raw = raw
        try:
            return parse_client_event(socket_io.text_of(raw), self.hub.settings.max_event_bytes)
        except ProtocolError as exc:
            self._early_error = exc
            return None

    async def _open(self) -> None:
        self.hub.reserve()
        self.turns.session_id = f"sess_{secrets.token_hex(12)}"
        await self.hub.live.admit(self.session_id, self.key_digest, _now_ms(), resume=False)
        token = secrets.token_urlsafe(32)
        fence = await self.coordinator.open(self.session_id)
        await self.hub.attachments.attach(
            self.session_id, self.attachment, self.key_digest, _now_ms(), resume=False,
            fresh=token_hash(token),
        )  # fmt: skip
        await self.coordinator.keep_resume_token(token_hash(token), self.session_id)
        await self.hub.register(self)
        await self.socket.send_json(
            {
                "type": "session.created",
                "event_id": _fresh_event_id(),
                "session": session_object(self.session_id, self.config),
                EXTENSION: {"seq": 0, "resume_token": token,
                            "fence": {"incarnation": fence.incarnation, "epoch": 0,
                                      "turn_id": 0, "response_seq": 0}},
            }
        )  # fmt: skip
        if self.identity.session:
            # The client secret's session settings, applied as a first update would be.
            update = {"type": "session.update", "session": dict(self.identity.session)}
            await self._handle(SessionUpdate.model_validate(update))
        early = getattr(self, "_early_error", None)
        if early is not None:
            await self._error(early)

    async def _resume(self, event: SessionResume) -> None:
        session_id = await self._session_for_token(event.resume_token)
        self.hub.reserve()
        # The new token is findable before the session accepts it. The one presented
        # stays good until the new one is used: if this reply is lost, the client can
        # resume again with it (``coordinator.attachments``).
        token = secrets.token_urlsafe(32)
        await self.coordinator.keep_resume_token(token_hash(token), session_id)
        try:
            dropped = await self.hub.attachments.attach(
                session_id, self.attachment, self.key_digest, _now_ms(), resume=True,
                token=token_hash(event.resume_token), fresh=token_hash(token),
            )  # fmt: skip
        except SessionClosedError as exc:
            raise AuthError(str(exc), ErrorCode.RESUME_FAILED) from exc
        await self.coordinator.drop_resume_tokens(dropped)
        await self.hub.live.admit(session_id, self.key_digest, _now_ms(), resume=True)
        self.turns.session_id = session_id
        self.config = await self.coordinator.stored_config(session_id)
        self.translator.spoken = stage_settings(self.config).audio_output
        self.turns.state.resumed()
        replay = await replay_journal(
            self.coordinator, session_id, event.last_received_seq, self.translator
        )
        # The replay's follower takes over the journal and this connection takes the
        # session's deliveries in one step (no await between): a delivery judged by the
        # old follower meanwhile would reach this connection besides the replay's own.
        self.coordinator.follow_from(replay.follower)
        await self.hub.register(self)
        await self.socket.send_json(
            {"type": "duplexq.session.resumed", "event_id": _fresh_event_id(),
             "session": {"id": session_id}, "resume_token": token,
             EXTENSION: {"seq": replay.last_seq}}
        )  # fmt: skip
        for server_event in replay.events:
            await self.socket.send_json(server_event)
        self._sent_seq = replay.last_seq

    async def _session_for_token(self, token: str) -> str:
        session_id = await self.coordinator.session_of_resume_token(token_hash(token))
        if session_id is None:
            raise AuthError("resume token is unknown or expired", ErrorCode.RESUME_FAILED)
        return session_id

    # -- client -> session ----------------------------------------------------------

    async def _receive(self) -> None:
        while not self.closed:
            try:
                raw = await socket_io.receive(self.socket)
            except Exception:  # the client went away (WebSocketDisconnect and kin)
                return
            await self._process(raw)

    async def _process(self, raw: str | bytes, event: ClientEvent | None = None) -> None:
        """Take one client event within the connection's limits, or answer an error."""
        settings = self.hub.settings
        try:
            if not self.limits.take_event():
                raise RateLimitedError(
                    f"more than {settings.max_events_per_s:g} events a second (bursts of "
                    f"{settings.event_burst}); this event was refused, slow down"
                )
            if event is None:
                event = parse_client_event(socket_io.text_of(raw), settings.max_event_bytes)
            cost = self.limits.budget.cost(event)
            if not isinstance(event, CONTROL_EVENTS):
                await self._check_backpressure(cost)
            await self._handle(event)
            self.limits.budget.charge(self.turns.last_seq, cost)
        except SessionReplacedError:
            # The client resumed on another connection: whatever this socket still had
            # buffered is not the session's any more.
            await self.evict("session resumed on another connection")
        except DuplexqError as exc:
            await self._error(exc, _client_event_id(raw))

    async def _error(self, exc: DuplexqError, client_event_id: str | None = None) -> None:
        """Journal the error (a resume replays it) while the connection's allowance
        lasts, else send it to the socket only; it names the client event it answers
        when that had an id. One that cannot be journaled (Redis is full, say) goes to
        the socket only too: the client hears of it either way."""
        param = getattr(exc, "param", None)  # a refused session field names itself
        event = error_event(exc.code.value, exc.message, client_event_id, param)
        if self.limits.journal_error():
            try:
                await self.turns.journal(event, receipt=False)
                return
            except SessionReplacedError:
                await self.evict("session resumed on another connection")
                return
            except DuplexqError:
                pass  # not journaled (Redis is full): the error still reaches the socket
        self.deliver(event)

    async def _handle(self, event: ClientEvent) -> None:
        if isinstance(event, SessionUpdate):
            await self._configure(event)
        elif isinstance(event, AudioAppend):
            await self.turns.take_input(
                InputMode.APPEND_AUDIO_CHUNK, audio_payload(event.audio, self.config)
            )
        elif isinstance(event, VideoAppend):
            # Decoding and verifying an image blocks for milliseconds: off the loop.
            frame = await asyncio.to_thread(image_payload, event.image, event.pts_ms)
            await self.turns.take_input(InputMode.APPEND_VIDEO_FRAME, frame)
        elif isinstance(event, ItemCreate | ItemDelete | ItemTruncate | PlaybackAck):
            if isinstance(event, ItemDelete):
                client_requests.check_delete(self, event)
            await self._edit_conversation(event)
        elif isinstance(event, AudioCommit | ResponseCreate | ItemRetrieve):
            await client_requests.handle(self, event)
        elif isinstance(event, AudioClear):
            await self.turns.clear()
        elif isinstance(event, ResponseCancel | BargeIn | OutputAudioClear):
            reason = event.type.removeprefix("duplexq.")  # barge_in, response.cancel, ...
            only_active = isinstance(event, ResponseCancel)
            cleared = await self.turns.cancel(reason, only_active=only_active)
            if isinstance(event, OutputAudioClear):
                await self._notice("output_audio_buffer.cleared", response_id=cleared)
        elif isinstance(event, SessionResume):
            raise ProtocolError(
                ErrorCode.INVALID_EVENT, "duplexq.session.resume must be the first event"
            )

    async def _edit_conversation(
        self, event: ItemCreate | ItemDelete | ItemTruncate | PlaybackAck
    ) -> None:
        """A user message is a turn's input (the model may answer it); every other edit
        changes the model's conversation (``coordinator.conversation``)."""
        sid = self.session_id
        item = event.item if isinstance(event, ItemCreate) else None
        if isinstance(event, ItemCreate) and isinstance(item, MessageItem) and item.role == "user":
            payload = TextPayload(conversation.text_of(item), item_id=item.id or "")
            receipt = await self.turns.take_input(InputMode.APPEND_TEXT, payload)
            notice = conversation.created_notice(event, item.id or f"item_{receipt}")
            await self.turns.journal(notice)
            return
        if isinstance(item, FunctionCallOutputItem):
            self.turns.function_result(item)
        if isinstance(event, PlaybackAck):
            # Recorded as the client said it; the model's answer is cut to what was heard
            # where this connection knows what was spoken when.
            ack = PlaybackPayload(event.response_id, event.played_ms)
            await self.turns.take_input(InputMode.PLAYBACK_ACK, ack)
            cut = conversation.acknowledged(event, self.translator)
            if cut is not None:
                await self.coordinator.append(
                    sid, InputMode.EDIT_CONVERSATION, cut, attachment=self.attachment
                )
            return
        if isinstance(event, ItemCreate):
            edit, notice = conversation.added(event)
        elif isinstance(event, ItemDelete):
            edit, notice = conversation.deleted(event)
        else:
            edit, notice = conversation.truncated(event, self.translator)
        await self.coordinator.append(
            sid, InputMode.EDIT_CONVERSATION, edit, attachment=self.attachment
        )
        await self.turns.journal(notice)

    async def _configure(self, event: SessionUpdate) -> None:
        """Store the merged configuration (resume and new stage owners start from it),
        then pass what stages act on down the session log, in order with the inputs.
        Each field takes effect or is refused by name, the others applying all the same
        (``schemas.session_fields``); ``session.updated`` follows unless every field was
        refused."""
        previous = self.config
        self.config, refusals = judged(previous, event.session)
        for refusal in refusals:
            await self._error(refusal.error(), event.event_id)
        sid = self.session_id
        try:
            await self.coordinator.configure(sid, self.config, attachment=self.attachment)
            settings = stage_settings(self.config)
            if settings != stage_settings(previous):
                await self.coordinator.append(
                    sid, InputMode.UPDATE_SESSION, settings, attachment=self.attachment
                )
        except BaseException:
            self.config = previous  # refused (Redis full): the same update sent again applies
            raise
        if not refusals or self.config != previous:  # all refused: the errors said it
            await self._notice("session.updated", session=session_object(sid, self.config))

    async def _notice(self, event_type: str, **fields: Any) -> None:
        await self.turns.journal({"type": event_type, **fields})

    async def _check_backpressure(self, cost: int) -> None:
        budget = self.limits.budget
        if budget.fits(cost):
            return
        budget.release(await self._applied_by_first_stages())
        if not budget.fits(cost):
            raise InputBackpressureError(
                f"{budget.pending} input bytes are not yet processed (limit {budget.limit}); "
                "slow down and retry"
            )

    async def _applied_by_first_stages(self) -> int:
        firsts = [s.name for s in self.hub.pipeline.stages if s.input == "session"]
        return min(await self.coordinator.applied(self.session_id, firsts))

    # -- session -> client ---------------------------------------------------------

    async def _pump(self) -> None:
        try:
            await self._pump_events()
        except WebSocketDisconnect:
            # The client went away while an event was on its way (a close the receive
            # loop had not read yet): the receive loop ends the connection; nothing here
            # is an error (it surfaced as "Exception in ASGI application").
            return

    async def _pump_events(self) -> None:
        while True:
            item = await self.outbound.get()
            if isinstance(item, dict):
                # Not journaled: no place in the session (no duplexq.seq), never replayed.
                # With the seq of the last event sent, a client that drops what it has
                # processed (seq at most its last) dropped it: an error never heard.
                if not await self._send({**item, "event_id": _fresh_event_id()}):
                    return
                continue
            delivery = item
            event = delivery.event
            if isinstance(event, OutputEvent) and released(event.fence, self.turns.state.min_epoch):
                # Queued before this connection's cancel returned: stale now, counted.
                DROPPED_STALE.labels(stage=event.stage, reason="epoch").inc()
                continue
            for server_event in self.translator.translate(event, delivery.server_event_seq):
                self.turns.state.sent(server_event)
                if not await self._send(server_event):
                    return
                self._sent_seq = server_seq(server_event)
                measured = self.turns.clock.sent(server_event, time.monotonic())
                if measured is not None:
                    FIRST_OUTPUT.labels(turn=measured[0]).observe(measured[1])
            if self.turns.trace is not None and isinstance(event, OutputEvent):
                shown = self.turns.trace.sent(event, time.time_ns())
                if shown is not None and not await self._send(
                    {**shown, "event_id": _fresh_event_id()}
                ):
                    return

    async def _send(self, server_event: dict[str, Any]) -> bool:
        """Send within ``client_send_timeout_ms``; a client that does not take it is
        closed with 4008 (``_close_when_overflowed``): False."""
        timeout_s = self.hub.settings.client_send_timeout_ms / 1000
        if await socket_io.send(self.socket, server_event, timeout_s):
            return True
        self.outbound.stall()
        return False


def _fresh_event_id() -> str:
    """The id of a server event that is not in the journal (journaled ones are numbered
    by their place in it: ``coordinator.realtime``)."""
    return f"event_{secrets.token_hex(8)}"


def _client_event_id(raw: str | bytes) -> str | None:
    """The ``event_id`` a client gave the event it sent, when it parses as one."""
    try:
        data = json.loads(raw)
    except (ValueError, TypeError):
        return None
    event_id = data.get("event_id") if isinstance(data, dict) else None
    return event_id[:128] if isinstance(event_id, str) and event_id else None
