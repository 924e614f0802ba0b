"""The coordinator's ASGI app: ``/v1/realtime``, client secrets, health, readiness and
metrics.

Served by uvicorn (``duplexq coordinator``). One ``Hub`` per process: the
journal reader loop starts and stops with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from coordinator.auth import presented, split_subprotocols
from coordinator.connection import Connection
from coordinator.hub import Hub
from dataplane.metrics import exposition
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

    async def readyz(request: Request) -> Response:
        bus = hub.coordinator.bus
        workers: dict[str, int] = {}
        redis_ok = False
        # Whatever is down, the answer comes within READY_WITHIN_S: a probe must not
        # wait out the Redis client's connect retries.
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(READY_WITHIN_S):
                redis_ok = await bus.ping()
                if redis_ok:
                    fresh = time.time() * 1000 - 5 * settings.heartbeat_ms
                    for stage in pipeline.stage_names:
                        key = bus.keys.workers(stage)
                        workers[stage] = await bus.client.zcount(key, fresh, "+inf")
        ready = redis_ok and all(workers.values()) and len(workers) == len(pipeline.stages)
        body = {"ready": ready, "redis": redis_ok, "workers": workers}
        return JSONResponse(body, status_code=200 if ready else 503)

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
            Route("/metrics", metrics),
            Route("/", demo_page),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        lifespan=lifespan,
    )
    app.state.hub = hub
    return app
