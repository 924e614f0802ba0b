"""A coordinator served by uvicorn in the test's event loop (or in a child process),
and a small client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
import websockets
from prometheus_client.parser import text_string_to_metric_families

from coordinator.app import create_app
from coordinator.server_options import websocket_options
from schemas.config import PipelineConfig, Settings, echo_pipeline
from tests.processes import ROOT, write_pipeline
from tests.redis_server import free_port


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, pipeline: PipelineConfig, ws: str = "auto"
) -> AsyncIterator[str]:
    """Serve the app on a free port (WebSockets by uvicorn's stack ``ws``, with the
    options ``duplexq coordinator`` serves with); yields the ws:// base URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, pipeline), host="127.0.0.1", port=port, log_level="warning",
        lifespan="on", ws=ws, **websocket_options(settings),
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@contextlib.asynccontextmanager
async def coordinator_process(
    settings: Settings,
    pipeline: PipelineConfig,
    directory: Path,
    *args: str,
    log: Path | None = None,
) -> AsyncIterator[str]:
    """``coordinator.launcher.cli coordinator`` (with ``args``) serving ``pipeline`` on a free port
    in a child process, its output to ``log`` if given; yields the ws:// base URL once
    it accepts connections and stops the process on the way out."""
    async with coordinator_child(settings, pipeline, directory, *args, log=log) as (base, _):
        yield base


@contextlib.asynccontextmanager
async def coordinator_child(
    settings: Settings,
    pipeline: PipelineConfig,
    directory: Path,
    *args: str,
    log: Path | None = None,
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """``coordinator_process``, yielding the child process too (to signal it)."""
    port = free_port()
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
    pipeline_path = write_pipeline(directory, pipeline)
    command = [sys.executable, "-m", "coordinator.launcher.cli", "coordinator", *args,
               "--pipeline", str(pipeline_path), "--port", str(port)]  # fmt: skip
    if log is None:
        proc = subprocess.Popen(command, cwd=ROOT, env=env)
    else:
        with log.open("wb") as output:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT
            )
    try:
        await _listening(proc, port)
        yield f"ws://127.0.0.1:{port}", proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a test may have left it stopped
        proc.terminate()
        proc.wait(20)


async def _listening(proc: subprocess.Popen[bytes], port: int) -> None:
    async with asyncio.timeout(20):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                assert proc.poll() is None, f"the coordinator exited ({proc.returncode})"
                await asyncio.sleep(0.05)
            else:
                writer.close()
                await writer.wait_closed()
                return


class Client:
    """A Realtime client: JSON events over one WebSocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, base: str, key: str | None = "k1") -> AsyncIterator[Client]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with websockets.connect(f"{base}/v1/realtime", additional_headers=headers) as ws:
            yield cls(ws)

    async def send(self, event: dict[str, Any] | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    async def recv(self, within_s: float = 10) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), within_s))
        self.seen.append(event)
        return event

    async def resume(self, token: str, last_received_seq: int) -> dict[str, Any]:
        """Ask to resume a session on this connection; the server's first answer."""
        await self.send({"type": "duplexq.session.resume", "resume_token": token,
                         "last_received_seq": last_received_seq})  # fmt: skip
        return await self.recv()

    async def until(self, event_type: str, within_s: float = 15) -> list[dict[str, Any]]:
        """Events received up to and including the first of ``event_type``."""
        got: list[dict[str, Any]] = []
        async with asyncio.timeout(within_s):
            while True:
                event = await self.recv(within_s)
                got.append(event)
                if event["type"] == event_type:
                    return got


async def until_completed(client: Client, within_s: float = 15) -> list[dict[str, Any]]:
    """Events up to the first ``response.done`` whose status is completed."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(within_s):
        while True:
            got += await client.until("response.done", within_s)
            if got[-1]["response"]["status"] == "completed":
                return got


def text_turn(text: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": text}]},
        },
        {"type": "response.create"},
    ]  # fmt: skip


def streaming_echo(chunks: int = 40, step_ms: int = 20) -> PipelineConfig:
    """The echo pipeline answering in ``chunks`` deltas ``step_ms`` apart: a response that
    streams long enough to be cancelled, dropped or resumed in the middle. Typed text is
    answered when asked, as the shipped echo and a model answer it: a typed turn's answer
    is the response its ``response.create`` asked for."""
    pipeline = echo_pipeline("echo")
    stage = pipeline.stages[0].model_copy(
        update={"options": {"chunks": chunks, "step_ms": step_ms, "when_asked": True}}
    )
    return pipeline.model_copy(update={"stages": (stage,)})


def asked_echo() -> PipelineConfig:
    """The echo pipeline answering typed text whole, when asked (the turn's commit or its
    ``response.create``), as a model does: a typed turn's answer is the response its
    client asked for. (Answering at once, echo's answer to typed text can begin before
    its ``response.create`` is taken, under the response reserved before: the answer is
    then that response, not the one asked for.)"""
    return streaming_echo(chunks=1, step_ms=0)


def sample(exposition: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` in a
    Prometheus text exposition (0 when there is none)."""
    wanted = (labels or {}).items()
    return sum(
        found.value
        for family in text_string_to_metric_families(exposition)
        for found in family.samples
        if found.name == name and wanted <= found.labels.items()
    )
