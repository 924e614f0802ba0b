"""How the coordinator's WebSocket server is run (uvicorn): frame size and keep-alive.

``duplexq coordinator`` and the tests' server take the same options from here.

- ``ws_max_size`` is ``FRAME_SIZE_FACTOR`` x ``Settings.max_event_bytes``: a frame
  over the documented event limit still reaches the connection, which answers
  ``event_too_large`` and goes on; only a frame over this bigger size is refused by
  the server itself, with close 1009.
- The keep-alive ping's timeout (``PING_TIMEOUT_S``) is longer than a stalled client
  needs to be let go with 4008 (``client_send_timeout_ms`` then
  ``client_close_wait_ms``, ``coordinator.socket_io``): a client that stops reading is
  closed with the documented code, not by the keep-alive (1011).
"""

from __future__ import annotations

from typing import Any

from schemas.config import Settings

FRAME_SIZE_FACTOR = 4
"""The server takes frames up to this many times ``max_event_bytes``."""

PING_INTERVAL_S = 20.0
"""Seconds between the server's keep-alive pings."""

PING_TIMEOUT_S = 60.0
"""Seconds the server waits for a ping's pong before it drops the connection (1011)."""


def websocket_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's WebSocket options (``uvicorn.Config`` / ``uvicorn.run`` keywords)."""
    return {
        "ws_max_size": FRAME_SIZE_FACTOR * settings.max_event_bytes,
        "ws_ping_interval": PING_INTERVAL_S,
        "ws_ping_timeout": PING_TIMEOUT_S,
    }
