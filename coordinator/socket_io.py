"""A connection's WebSocket frame by frame: what it reads, how it writes, and how it
lets go of a client that stopped reading. The same on every stack uvicorn serves
WebSockets with (``websockets-sansio``, its default, and the legacy ``websockets``).

- ``receive``: the next client message, text or bytes. Realtime events are JSON text
  frames: ``text_of`` refuses a binary frame with ``invalid_event``, and the
  connection goes on. A frame over the server's ``ws_max_size``
  (``coordinator.server_options``) never gets here: the server closes with 1009.
- ``send``: one server event within ``client_send_timeout_ms``; False when the client
  did not take it in time (its socket buffers are full: it stopped reading).
- ``close_stalled``: the close with 4008 of a client that stopped reading, waited for
  ``client_close_wait_ms`` (a client that reads again meanwhile gets what was sent,
  then the close frame). A client that does not read even then has its TCP connection
  aborted where the server exposes it (``ExposeTransport``): a stack whose writes
  wait for the client would otherwise keep the socket, and its connection, forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from starlette.websockets import WebSocketDisconnect

from schemas.errors import ErrorCode, ProtocolError

TRANSPORT_KEY = "duplexq.transport"
"""Where ``ExposeTransport`` puts a WebSocket's transport in its ASGI scope."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Socket(Protocol):
    """The part of a WebSocket a connection uses (Starlette's fits)."""

    async def receive(self) -> MutableMapping[str, Any]: ...
    async def send_json(self, data: Any) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class ExposeTransport:
    """ASGI middleware: a WebSocket's scope gets the server's transport under
    ``TRANSPORT_KEY``, when the server's ``send`` is a method of a protocol that has one
    (every uvicorn stack), so that a stalled client's connection can be aborted."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if isinstance(transport, asyncio.WriteTransport):
                scope[TRANSPORT_KEY] = transport
        await self.app(scope, receive, send)


async def receive(socket: Socket) -> str | bytes:
    """The next client message; raises ``WebSocketDisconnect`` when the client is gone."""
    message = await socket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    return text if isinstance(text, str) else bytes(message.get("bytes") or b"")


def text_of(raw: str | bytes) -> str:
    """A client message as an event's text; a binary frame is refused (``invalid_event``)."""
    if isinstance(raw, bytes):
        raise ProtocolError(
            ErrorCode.INVALID_EVENT,
            f"a binary frame ({len(raw)} bytes) is not an event: send events as JSON text frames",
        )
    return raw


async def send(socket: Socket, event: dict[str, Any], timeout_s: float) -> bool:
    """Send one server event; False when the client did not take it within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await socket.send_json(event)
    except TimeoutError:
        return False
    return True


async def close_stalled(socket: Socket, code: int, reason: str, wait_s: float) -> None:
    """Close the socket of a client that stopped reading with ``code``; if the close is
    not through within ``wait_s``, abort the connection's transport."""
    try:
        async with asyncio.timeout(wait_s):
            await socket.close(code=code, reason=reason)
        return
    except TimeoutError:
        pass
    except Exception:  # the client is gone already: nothing left to close
        return
    scope = getattr(socket, "scope", None)
    transport = scope.get(TRANSPORT_KEY) if isinstance(scope, MutableMapping) else None
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()
