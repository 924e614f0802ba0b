"""The coordinator's ASGI app: ``/v1/realtime``, client secrets, health, readiness
(``/readyz``; ``/v1/stages`` for the demo page), metrics and the demo page.

Served by uvicorn (``duplexq coordinator``). One ``Hub`` per process: the
journal reader loop starts and stops with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from coordinator.auth import presented, split_subprotocols
from coordinator.connection import Connection
from coordinator.hub import Hub
from coordinator.socket_io import ExposeTransport
from dataplane.metrics import exposition
from dataplane.readiness import StageReadiness, read_stage
from schemas.config import PipelineConfig, Settings
from schemas.errors import AuthError

READY_WITHIN_S = 0.8
"""Longest /readyz takes to answer, Redis down or not."""

STATIC_DIR = Path(__file__).with_name("static")
"""The browser demo (``/``): plain HTML and JS, served as files, no build step."""


def create_app(settings: Settings, pipeline: PipelineConfig) -> Starlette:
    hub = Hub(settings, pipeline)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(hub.run(), name="hub")
        try:
            yield
        finally:
            await hub.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def realtime(websocket: WebSocket) -> None:
        headers = websocket.headers
        offered = split_subprotocols(headers.getlist("sec-websocket-protocol"))
        credential = presented(headers.get("authorization"), offered)
        try:
            identity = await hub.secrets.identify(credential.credential)
        except AuthError:
            # Refused before the handshake completes: the client sees HTTP 403.
            await websocket.close(code=1008, reason="unauthorized")
            return
        await websocket.accept(subprotocol=credential.subprotocol)
        await Connection(hub, websocket, identity).serve()

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness() -> tuple[bool, list[StageReadiness]]:
        """Whether Redis answers, and each stage's live workers: a worker heartbeats
        once its model is loaded (``dataplane.readiness``)."""
        bus = hub.coordinator.bus
        redis_ok = False
        found: list[StageReadiness] = []
        # Whatever is down, the answer comes within READY_WITHIN_S: a probe must not
        # wait out the Redis client's connect retries.
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(READY_WITHIN_S):
                redis_ok = await bus.ping()
                if redis_ok:
                    fresh_ms = 5 * settings.heartbeat_ms
                    for stage in pipeline.stage_names:
                        found.append(await read_stage(bus, stage, fresh_ms))
        return redis_ok, found

    def all_ready(redis_ok: bool, found: list[StageReadiness]) -> bool:
        return redis_ok and len(found) == len(pipeline.stages) and all(s.ready for s in found)

    async def readyz(request: Request) -> Response:
        redis_ok, found = await readiness()
        ready = all_ready(redis_ok, found)
        body = {
            "ready": ready,
            "redis": redis_ok,
            "workers": {s.stage: len(s.models) for s in found},
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def stages(request: Request) -> Response:
        """For the demo page (always 200): which stages have their model loaded, and
        what they serve, the random-weight fallback included."""
        redis_ok, found = await readiness()
        body = {
            "ready": all_ready(redis_ok, found),
            "redis": redis_ok,
            "stages": [s.public() for s in found],
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def metrics(request: Request) -> Response:
        body, content_type = exposition()
        return Response(body, headers={"Content-Type": content_type})

    async def demo_page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app = Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", realtime),
            Route("/v1/realtime/client_secrets", hub.secrets.handle_mint, methods=["POST"]),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/v1/stages", stages),
            Route("/metrics", metrics),
            Route("/", demo_page),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        lifespan=lifespan,
        # A stalled client's connection can be aborted (``coordinator.socket_io``).
        middleware=[Middleware(ExposeTransport)],
    )
    app.state.hub = hub
    return app
