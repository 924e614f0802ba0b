"""Short-lived client secrets: a browser's credential that is not an API key.

``POST /v1/realtime/client_secrets`` (the reference API's request and answer;
the official SDK's ``client.realtime.client_secrets.create``) takes an API key
as ``Authorization: Bearer`` (none where anonymous clients are allowed) and an
optional body ``{"expires_after": {"anchor": "created_at", "seconds": N},
"session": {...}}``. It answers ``{"value": "ek_...", "expires_at": <unix s>,
"session": {...}}``.

A secret is stored in Redis by its sha256 (never the secret itself) with the
minting key's digest and the session settings, under a TTL of its lifetime,
so every coordinator accepts it until it expires. It opens any number of
sessions until then; each counts against the minting key, starts with the
secret's session settings (as a first ``session.update`` would set them) and
lives on after the secret expires. A client secret cannot mint another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from coordinator.auth import SECRET_PREFIX, Identity, check_key, presented
from dataplane.bus import RedisBus
from schemas.config import Settings
from schemas.errors import AuthError, ErrorCode, RedisFullError
from schemas.realtime import SessionConfig
from schemas.session_shape import merged, session_object

log = logging.getLogger("duplexq.coordinator")

MIN_TTL_S, MAX_TTL_S = 10, 7200
"""The lifetimes a request may ask for (the reference API's bounds)."""


class _ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(600, ge=MIN_TTL_S, le=MAX_TTL_S)


class _MintRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expires_after: _ExpiresAfter | None = None
    session: dict[str, Any] = Field(default_factory=dict)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


class ClientSecrets:
    """Minting and redeeming client secrets, and telling who a credential is."""

    def __init__(self, bus: RedisBus, settings: Settings) -> None:
        self.bus = bus
        self.settings = settings

    async def mint(
        self, identity: Identity, ttl_s: int, session: dict[str, Any]
    ) -> tuple[str, int]:
        """A new secret of ``identity``'s key; returns it and when it expires (unix s)."""
        value = SECRET_PREFIX + secrets.token_urlsafe(32)
        record = json.dumps({"key": identity.key_digest, "session": session})
        await self.bus.set_durable(self.bus.keys.client_secret(_digest(value)), record, ttl_s)
        return value, int(time.time()) + ttl_s

    async def identify(self, credential: str | None) -> Identity:
        """The identity of an API key or of a live client secret; ``AuthError`` for
        anything else."""
        if credential is None or not credential.startswith(SECRET_PREFIX):
            return check_key(self.settings, credential)
        raw = await self.bus.client.get(self.bus.keys.client_secret(_digest(credential)))
        if raw is None:
            raise AuthError("the client secret is unknown or expired")
        record = json.loads(raw)
        return Identity(str(record["key"]), record.get("session") or None)

    async def handle_mint(self, request: Request) -> Response:
        """``POST /v1/realtime/client_secrets``."""
        header = request.headers.get("authorization")
        credential = presented(header, ()).credential
        try:
            if credential is not None and credential.startswith(SECRET_PREFIX):
                raise AuthError("a client secret cannot mint another; use an API key")
            identity = check_key(self.settings, credential)
        except AuthError as exc:
            return _error(401, exc.code, exc.message)
        try:
            body = await request.body()
            mint = _MintRequest.model_validate_json(body) if body.strip() else _MintRequest()
            config = merged(SessionConfig(), mint.session)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            return _error(400, ErrorCode.INVALID_INPUT, f"{where}: {first['msg']}", where)
        except (ValueError, TypeError, AttributeError) as exc:  # a session of odd shape
            return _error(400, ErrorCode.INVALID_INPUT, f"session: {exc}", "session")
        ttl_s = mint.expires_after.seconds if mint.expires_after else None
        try:
            value, expires_at = await self.mint(
                identity, ttl_s or self.settings.client_secret_ttl_s, mint.session
            )
        except RedisFullError as exc:  # nothing was stored: the same request may succeed later
            return _error(503, exc.code, exc.message)
        answer = {"value": value, "expires_at": expires_at, "session": session_object("", config)}
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})


def _error(status: int, code: ErrorCode, message: str, param: str | None = None) -> Response:
    """The reference API's error body; ``code`` is one of duplexq's stable codes."""
    kind = (
        "authentication_error"
        if status == 401
        else "server_error"
        if status >= 500
        else "invalid_request_error"
    )
    body = {"error": {"type": kind, "code": code.value, "message": message, "param": param}}
    return JSONResponse(body, status_code=status)
