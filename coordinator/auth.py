"""Who a client is: API keys, client secrets, and where a client may put them.

A client presents one credential, in the first of these places that has one:

- ``Authorization: Bearer <credential>`` (servers, the official SDK);
- the WebSocket subprotocol ``openai-insecure-api-key.<credential>`` (browsers,
  which cannot set headers on a WebSocket: ``new WebSocket(url, ["realtime",
  "openai-insecure-api-key." + secret])``). The server then accepts the
  ``realtime`` subprotocol when offered and never echoes the credential.

The credential is an API key (``Settings.api_keys``) or a client secret
(``ek_...``, minted by ``coordinator.client_secrets``). Either way the session
records the digest of an API key, the minting key's for a secret, so its
sessions count against that key and a resume needs a credential of that key.
A URL never carries a credential: URLs end up in access logs and browser
history. A wrong, expired or malformed credential is refused the same way
(``AuthError``), whatever bytes it holds.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.attachments import key_digest
from schemas.config import Settings
from schemas.errors import AuthError

SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
ACCEPTED_SUBPROTOCOLS = ("realtime",)
"""Subprotocols the server selects when a client offers one (the reference API's)."""
SECRET_PREFIX = "ek_"
_BEARER = "bearer "


@dataclass(frozen=True, slots=True)
class Presented:
    """What a client's handshake carries."""

    credential: str | None
    subprotocol: str | None
    """The subprotocol to accept (one the client offered), or None."""


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated client."""

    key_digest: str
    """Digest of the API key its sessions count against ('' when anonymous)."""
    session: Mapping[str, Any] | None = None
    """Session settings its client secret carries, applied when a session opens."""


def presented(authorization: str | None, subprotocols: Iterable[str]) -> Presented:
    """The credential of an ``Authorization`` header or of the offered subprotocols
    (each stripped; empty or malformed ones are ignored)."""
    offered = [p.strip() for p in subprotocols if p and p.strip()]
    accept = next((p for p in offered if p in ACCEPTED_SUBPROTOCOLS), None)
    auth = authorization or ""
    if auth[: len(_BEARER)].lower() == _BEARER:
        return Presented(auth[len(_BEARER) :].strip() or None, accept)
    for protocol in offered:
        if protocol.startswith(SUBPROTOCOL_KEY_PREFIX):
            return Presented(protocol[len(SUBPROTOCOL_KEY_PREFIX) :] or None, accept)
    return Presented(None, accept)


def split_subprotocols(header_values: Iterable[str]) -> list[str]:
    """The subprotocols named by ``Sec-WebSocket-Protocol`` headers (comma-separated)."""
    return [part for value in header_values for part in value.split(",")]


def check_key(settings: Settings, credential: str | None) -> Identity:
    """The identity of an API key, or of no key where anonymous clients are allowed."""
    if settings.allow_anonymous and not credential:
        return Identity("")
    # Compared as UTF-8 bytes: compare_digest refuses str with non-ASCII characters,
    # and a malformed key must be refused like any wrong one, not crash the handshake.
    given = (credential or "").encode("utf-8", "surrogateescape")
    if given and any(hmac.compare_digest(given, key.encode()) for key in settings.api_keys):
        return Identity(key_digest(credential))
    raise AuthError("a valid API key is required")
