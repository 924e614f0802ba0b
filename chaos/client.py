"""The generator: one realtime client that sends numbered inputs and records what it saw.

A client opens a session (declaring one function tool), then sends its inputs
one at a time (``conversation.item.create`` + ``response.create``) and waits
for each answer's four blocks. Some inputs ask for a function call
(``call:<blocks>``): the model calls the tool with the blocks as arguments,
the client answers with them as the result (``function_call_output`` +
``response.create``), and the answer to that is the four blocks. Some answers
it cancels (``response.cancel`` or ``duplexq.barge_in``) after 0..3 blocks or
right at the answer's end, and then waits for the cancel's acknowledgement
before going on. When its socket dies (a fault, or the nemesis
dropping it on purpose) it resumes on any coordinator with its token and the
last ``duplexq.seq`` it processed, and goes on. A socket that stays open but
falls silent (its coordinator stopped) is noticed as a real client notices it:
while an answer is owed, after ``silence_s`` without a word from the server
the client pings it, and gives the socket up when neither a pong nor anything
else comes within ``pong_within_s``, then resumes, on another coordinator
first; events are processed once
each, by ``duplexq.seq``, whichever socket brought them. It never guesses:
an attempt the server did not acknowledge before the socket died is sent again
as a new attempt. An event the server refuses because Redis is full (error
``redis_full``, naming the event's ``event_id``) was not taken: the client
sends it again after a pause, as the API documents (an input or a function's
result again with its ``response.create``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from chaos.history import BLOCKS, Attempt, History, Op, parse_blocks


@dataclass(frozen=True, slots=True)
class ClientConfig:
    api_key: str
    cancel_rate: float = 0.3
    """Share of answers the client cancels."""
    resume_within_s: float = 30.0
    """A session that cannot be resumed for this long is dead."""
    wait_s: float = 60.0
    """Longest wait for one answer (or cancel acknowledgement) before moving on."""
    think_s: float = 0.15
    """Longest pause between two inputs."""
    tool_rate: float = 0.25
    """Share of inputs answered through a function call the client runs."""
    silence_s: float = 2.0
    """While an answer is owed, how long the server may say nothing before it is
    pinged."""
    refused_pause_s: float = 0.3
    """How long to wait before sending again an event refused as ``redis_full``."""
    pong_within_s: float = 2.5
    """How long a ping may go unanswered, with nothing else heard meanwhile, before the
    socket is given up. With ``silence_s``, less than the shortest coordinator pause
    (``attach_ttl_ms`` + 0.5 s): its clients resume before it wakes."""


TOOL = {"type": "function", "name": "echo_back", "description": "Says the text back.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}  # fmt: skip


class SessionDead(Exception):
    """The session cannot go on (resume refused, closed, unreachable)."""


class ChaosClient:
    """One client's session, driven until ``stop`` is set, then drained."""

    def __init__(
        self,
        index: int,
        rng: random.Random,
        endpoints: Callable[[], Sequence[str]],
        config: ClientConfig,
        started: float,
    ) -> None:
        self.index = index
        self.rng = rng
        self.endpoints = endpoints
        self.config = config
        self.started = started
        self.history = History(index)
        self.token = ""
        self.last_seq = 0
        self.epoch = 0
        self.cancel_epoch = 0
        self.outstanding: Attempt | None = None
        self.acked = False
        self.blocks: set[int] = set()
        self._socket: ClientConnection | None = None
        self._base = ""
        """The coordinator the socket is connected to (its ws:// base)."""
        self._silent = ""
        """The coordinator whose socket fell silent last: tried last on a resume."""
        self._heard = 0.0
        """When the socket last brought anything (monotonic)."""
        self._probe: asyncio.Task[None] | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._cancel_from = 0
        self._cancel_refused = False
        """The last cancel found no response in progress (the answer had ended)."""
        self._changed = asyncio.Event()
        self._lost_socket = asyncio.Event()
        self.session_id = ""
        """The session's id (for finding it in the processes' logs)."""
        self._call: str | None = None
        self._call_ended = False
        """The response that made ``_call`` is done: its result may go (a response.create
        while a response is in progress is refused)."""
        """The outstanding attempt's function call, waiting for this client's result."""
        self._result_for: str | None = None
        """The call this client's last result answered, and the socket it went on."""
        self._result_socket: ClientConnection | None = None
        self._result_acked = False
        self._sent: dict[str, dict[str, Any]] = {}
        """The events sent on the current socket, by ``event_id`` (the newest 256)."""
        self._asked_after: dict[str, str] = {}
        """An item's ``event_id`` -> the ``response.create`` sent right after it."""
        self._superseded: set[str] = set()
        """``response.create`` events sent again with their refused item already."""
        self._refused: list[str] = []
        """Events refused as ``redis_full``, to send again in this order."""
        self._event_no = 0

    @property
    def coordinator(self) -> str:
        """The ws:// base of the coordinator the client's socket is connected to."""
        return self._base

    # -- recording -------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _record(self, kind: Any, **fields: Any) -> None:
        self.history.add(Op(kind, self._now(), **fields))
        self._changed.set()

    # -- the run ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._open()
            number = 0
            while not stop.is_set():
                number += 1
                await self._one_input(number)
                await asyncio.sleep(self.rng.uniform(0, self.config.think_s))
        except SessionDead as exc:
            self._record("dead", detail=str(exc))
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [*self._readers, *([self._probe] if self._probe else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._socket is not None:
            with contextlib.suppress(Exception):
                await self._socket.close()

    async def _one_input(self, number: int) -> None:
        plan = self._cancel_plan()
        tool = self.rng.random() < self.config.tool_rate
        for attempt_no in range(10):
            attempt = Attempt(self.index, number, attempt_no)
            self.outstanding, self.acked, self.blocks = attempt, False, set()
            self._call, self._result_for, self._result_acked = None, None, False
            self._record("send", attempt=attempt, detail="tool" if tool else "")
            await self._send_input(attempt, tool)
            if await self._answer(plan, tool):
                return
            # The socket died before the server acknowledged the attempt: send it again.

    def _cancel_plan(self) -> int | None:
        """After how many blocks to cancel (BLOCKS: right at the answer's end), or None."""
        if self.rng.random() >= self.config.cancel_rate:
            return None
        return self.rng.randint(0, BLOCKS)

    async def _answer(self, cancel_after: int | None, tool: bool = False) -> bool:
        """Wait for the outstanding answer (cancelling it as planned); False when the
        attempt must be sent again. ``tool``: the input asks for a function call."""
        deadline = time.monotonic() + self.config.wait_s
        cancel_sent = False
        while time.monotonic() < deadline:
            if self._refused and not self._lost_socket.is_set():
                await self._send_refused_again()
            if self._lost_socket.is_set():
                await self._resume()
                if not self.acked:
                    return False
                lost = self.cancel_epoch <= self._cancel_from and not self._cancel_refused
                if cancel_sent and lost:
                    await self._cancel()  # it may have been lost with the socket
                call_open = self._call is None or not self._call_ended
                if tool and call_open and self._result_for is None and not cancel_sent:
                    # The call's response ends with the answer that its response.create
                    # asked for; that request may have been lost with the socket after
                    # the item was taken, or refused on it (an error is not journaled,
                    # so the resume cannot bring it), whether or not the call has come
                    # yet: asked again. Taken twice, the second gets an empty answer.
                    await self._send({"type": "response.create"})
            if cancel_sent and (self.cancel_epoch > self._cancel_from or self._cancel_refused):
                return True
            if self._call is not None and self._call_ended and not cancel_sent:
                await self._send_result(self._call)
            if not cancel_sent and len(self.blocks) >= BLOCKS and cancel_after is None:
                return True
            due = cancel_after is not None and len(self.blocks) >= cancel_after
            if not cancel_sent and due and (self.acked or self.blocks):
                await self._cancel()
                cancel_sent = True
                continue
            await self._wait_change(deadline)
        return True  # gave up waiting: the checker sees what is missing

    async def _wait_change(self, deadline: float) -> None:
        """Wait for something to happen (until ``deadline``); a socket silent for
        ``silence_s`` meanwhile is pinged."""
        self._changed.clear()
        probing = self._probe is not None and not self._probe.done()
        wake = deadline if probing else min(deadline, self._heard + self.config.silence_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(0.0, wake - time.monotonic()))
        if not probing and time.monotonic() - self._heard >= self.config.silence_s:
            self._probe = asyncio.create_task(self._ping())

    async def _ping(self) -> None:
        """Ping the socket; give it up (abort it, as a real client's keepalive does)
        if no pong comes within ``pong_within_s``."""
        socket = self._socket
        if socket is None or self._lost_socket.is_set():
            return
        asked = time.monotonic()
        try:
            pong = await socket.ping()
            await asyncio.wait_for(pong, self.config.pong_within_s)
            self._heard = time.monotonic()
        except TimeoutError:
            # Events that came meanwhile prove the socket alive (a server reading no
            # more of it while it waits on Redis answers no ping either).
            if socket is self._socket and self._heard < asked:
                silent_s = time.monotonic() - self._heard
                self._record("silent", detail=f"{self._base} silent for {silent_s:.1f}s")
                self._silent = self._base
                socket.transport.abort()
                self._lost_socket.set()
        except (ConnectionError, websockets.WebSocketException):
            pass  # the reader sees the socket die
        finally:
            self._changed.set()

    async def _cancel(self) -> None:
        self._cancel_from = self.cancel_epoch
        self._cancel_refused = False
        kind = self.rng.choice(("response.cancel", "duplexq.barge_in"))
        self._record("cancel_sent", attempt=self.outstanding, detail=kind)
        await self._send({"type": kind})

    # -- the socket ----------------------------------------------------------------------

    async def _connect(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self.config.api_key}"}
        bases = self.rng.sample(list(self.endpoints()), len(self.endpoints()))
        bases.sort(key=lambda base: base == self._silent)  # the one that fell silent last
        for base in bases:
            try:
                socket = await asyncio.wait_for(
                    websockets.connect(f"{base}/v1/realtime", additional_headers=headers), 3
                )
            except (OSError, TimeoutError, websockets.WebSocketException):
                continue
            self._base = base
            return socket
        raise ConnectionError("no coordinator answered")

    async def _open(self) -> None:
        socket = await self._connect()
        created = json.loads(await asyncio.wait_for(socket.recv(), 10))
        if created.get("type") != "session.created":
            raise SessionDead(f"open: {created}")
        self.token = created["duplexq"]["resume_token"]
        self.session_id = str(created.get("session", {}).get("id", ""))
        self._adopt(socket)
        await self._send({"type": "session.update", "session": {"type": "realtime",
                                                                "tools": [TOOL]}})  # fmt: skip

    def _adopt(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._heard = time.monotonic()
        self._lost_socket.clear()
        # What was refused on the old socket is sent again by the resume's own logic.
        self._sent.clear()
        self._refused.clear()
        self._asked_after.clear()
        self._superseded.clear()
        task = asyncio.create_task(self._read(socket))
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)

    async def _resume(self) -> None:
        deadline = time.monotonic() + self.config.resume_within_s
        while True:
            try:
                socket = await self._connect()
                await socket.send(json.dumps({
                    "type": "duplexq.session.resume", "resume_token": self.token,
                    "last_received_seq": self.last_seq,
                }))  # fmt: skip
                answer = json.loads(await asyncio.wait_for(socket.recv(), 10))
            except (OSError, TimeoutError, ConnectionError, websockets.WebSocketException):
                if time.monotonic() > deadline:
                    raise SessionDead("no coordinator took the resume") from None
                await asyncio.sleep(0.2)
                continue
            if answer.get("type") != "duplexq.session.resumed":
                self._record("resume", detail=f"refused: {answer}")
                raise SessionDead(f"resume refused: {answer}")
            self.token = answer["resume_token"]
            self._record("resume", detail="ok")
            self._adopt(socket)
            # What the session sent while the socket was down comes first: wait for it,
            # so that whether the outstanding attempt was accepted is known.
            await self._caught_up(int(_own(answer).get("seq", 0)), deadline)
            return

    async def _caught_up(self, seq: int, deadline: float) -> None:
        while self.last_seq < seq and not self._lost_socket.is_set():
            await self._wait_change(deadline)
            if time.monotonic() >= deadline:
                return

    async def drop(self, *, half_open: bool) -> None:
        """The nemesis: lose this client's socket (abruptly), or with ``half_open``
        resume on a new socket while the old one still looks open."""
        socket = self._socket
        if socket is None:
            return
        self._record("drop", detail="half-open" if half_open else "abrupt")
        if not half_open:
            socket.transport.abort()
        self._lost_socket.set()
        self._changed.set()

    async def _send(self, event: dict[str, Any]) -> str:
        """Send ``event`` under a fresh ``event_id`` (returned)."""
        self._event_no += 1
        event_id = f"c{self.index}e{self._event_no}"
        self._sent[event_id] = event
        if len(self._sent) > 256:
            del self._sent[next(iter(self._sent))]
        socket = self._socket
        try:
            if socket is None:
                raise ConnectionError("no socket")
            await socket.send(json.dumps({**event, "event_id": event_id}))
        except (ConnectionError, websockets.WebSocketException):
            self._lost_socket.set()
        return event_id

    async def _send_item(self, item: dict[str, Any]) -> None:
        """An item, then a ``response.create`` asking for the answer to it."""
        item_id = await self._send({"type": "conversation.item.create", "item": item})
        self._asked_after[item_id] = await self._send({"type": "response.create"})

    async def _send_refused_again(self) -> None:
        """Send again, after a pause, what the server refused (``SENT_AGAIN``). A
        refused item goes again with a new ``response.create`` (the one sent after it
        is then not sent again: if it was taken, it found nothing new to answer)."""
        await asyncio.sleep(self.config.refused_pause_s)
        refused, self._refused = self._refused, []
        for event_id in refused:
            event = self._sent.get(event_id)
            if event is None or event_id in self._superseded:
                continue
            if event.get("type") == "conversation.item.create":
                self._superseded.add(self._asked_after.pop(event_id, ""))
                await self._send_item(event["item"])
            else:
                await self._send(event)

    async def _send_result(self, call_id: str) -> None:
        """Answer the model's call with the blocks it asked for (again after a lost
        socket when the result was not acknowledged: a result taken twice is answered
        by one response with the blocks and one empty one)."""
        if self._result_for == call_id and self._result_socket is self._socket:
            return  # sent on this socket: its acknowledgement will come
        assert self.outstanding is not None
        again = self._result_for == call_id
        self._result_for, self._result_socket = call_id, self._socket
        if not (again and self._result_acked):
            self._record("result_sent", attempt=self.outstanding, detail=call_id)
            result = {"type": "function_call_output", "call_id": call_id,
                      "output": self.outstanding.text()}  # fmt: skip
            await self._send_item(result)
            return
        # The answer is asked for again after a lost socket even when the result was
        # taken: the request for it may have been lost with the socket (a second one
        # is answered with nothing).
        await self._send({"type": "response.create"})

    async def _send_input(self, attempt: Attempt, tool: bool = False) -> None:
        text = f"call:{attempt.text()}" if tool else attempt.text()
        item = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}  # fmt: skip
        await self._send_item(item)

    async def _read(self, socket: ClientConnection) -> None:
        try:
            async for raw in socket:
                if socket is not self._socket:
                    continue  # resumed elsewhere: a client reads only its new socket
                self._heard = time.monotonic()
                self._handle(json.loads(raw))
        except websockets.WebSocketException:
            pass
        finally:
            if socket is self._socket:
                self._lost_socket.set()
                self._changed.set()

    def _on_created(self, event: dict[str, Any]) -> None:
        """The server accepted an item: which attempt it was is read from its text (a
        function's result: whose call it answers)."""
        item = event.get("item") or {}
        if item.get("type") == "function_call_output":
            self._result_acked = self._result_acked or item.get("call_id") == self._call
            return
        content = item.get("content") or [{}]
        blocks, _ = parse_blocks(str(content[0].get("text", "")))
        if not blocks:
            return
        attempt = blocks[0].attempt
        if attempt == self.outstanding:
            self.acked = True
        self._record("ack", attempt=attempt)

    def _on_delta(self, event: dict[str, Any], epoch: int) -> None:
        blocks, garbled = parse_blocks(str(event.get("delta", "")))
        if garbled:
            self._record("garbled", detail=str(event.get("delta"))[:80])
        for block in blocks:
            if block.attempt == self.outstanding:
                self.blocks.add(block.position)
            self._record("block", attempt=block.attempt, block=block.position, epoch=epoch)

    def _on_call(self, event: dict[str, Any], epoch: int) -> None:
        """The model called the tool: for which attempt is read from its arguments."""
        try:
            arguments = json.loads(str(event.get("arguments", "")))
        except ValueError:
            arguments = {}
        blocks, _ = parse_blocks(str(arguments.get("text", "")))
        if not blocks:
            self._record("garbled", detail=f"call arguments {event.get('arguments')!r}"[:80])
            return
        call_id = str(event.get("call_id", ""))
        self._record("call", attempt=blocks[0].attempt, epoch=epoch, detail=call_id)
        if blocks[0].attempt == self.outstanding:
            self._call, self._call_ended = call_id, False

    def _handle(self, event: dict[str, Any]) -> None:
        own = _own(event)
        seq = int(own.get("seq", 0))
        if seq:
            if seq <= self.last_seq:
                return  # already processed (brought again by a resume)
            self.last_seq = seq
            self._changed.set()
        kind = event.get("type")
        epoch = int((own.get("fence") or {}).get("epoch", -1))
        self.epoch = max(self.epoch, epoch)
        if kind == "conversation.item.created":
            self._on_created(event)
        elif kind == "duplexq.response.cancelled":
            self.cancel_epoch = max(self.cancel_epoch, epoch)
            self._record("cancelled", epoch=epoch)
        elif kind == "response.function_call_arguments.done":
            self._on_call(event, epoch)
        elif kind == "response.done":
            self._call_ended = True
        elif kind == "response.output_text.delta":
            self._on_delta(event, epoch)
        elif kind == "error":
            code = str((event.get("error") or {}).get("code"))
            if code == "response_cancel_not_active":
                self._cancel_refused = True
                self._record("cancel_refused")
            else:
                event_id = str((event.get("error") or {}).get("event_id", ""))
                if code in SENT_AGAIN and event_id in self._sent:
                    self._refused.append(event_id)
                self._record("error", detail=code)
        elif kind == "duplexq.session.closed":
            self._record("dead", detail="session closed")


SENT_AGAIN = frozenset({"redis_full", "conversation_already_has_active_response"})
"""Refusals of an event that the same event, sent again after a pause, gets past: Redis
had no room, or the response before was still in progress (echo streams the blocks of
a typed input before its response.create's commit ends that response)."""


def _own(event: dict[str, Any]) -> dict[str, Any]:
    """duplexq's own fields of a server event (its ``duplexq`` object)."""
    own = event.get("duplexq")
    return own if isinstance(own, dict) else {}
