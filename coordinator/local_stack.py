"""``duplexq up``: the whole stack on one machine, for development and demos.

Starts Redis (a private redis-server with AOF under ``var/`` unless a Redis
URL is given), one worker process per pipeline stage and the control plane,
then drives a demonstration session through the pipeline: streamed outputs,
a barge-in that silences the response at once, and a worker killed with
SIGKILL whose session another worker takes over. It keeps serving until
Ctrl-C (``--demo-only`` stops after the demonstration).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, Settings
from schemas.events import OutputEvent, TextPayload


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env_for(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(settings.to_env())
    return env


class LocalStack:
    """Child processes of one local deployment; stopped together."""

    def __init__(self, settings: Settings, pipeline_path: Path, workdir: Path) -> None:
        self.settings = settings
        self.pipeline_path = pipeline_path
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_redis(self) -> Settings:
        """Start a private redis-server; returns the settings pointing at it."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup installs it)")
        port = _free_port()
        data = self.workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        args = [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            "--appendonly", "yes", "--save", "", "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        self._spawn("redis", args)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        self.settings = self.settings.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{port}/0"}
        )
        return self.settings

    def start_worker(self, stage: str, name: str) -> None:
        args = [
            sys.executable, "-m", "workers", "--stage", stage,
            "--pipeline", str(self.pipeline_path), "--worker-id", name,
        ]  # fmt: skip
        self._spawn(name, args)

    def start_control(self) -> None:
        args = [sys.executable, "-m", "coordinator.cli", "control"]
        args += ["--pipeline", str(self.pipeline_path)]
        self._spawn("control", args)

    def start_coordinator(self, port: int) -> str:
        """Serve the client API on ``port``; returns its http:// base URL once it answers."""
        args = [sys.executable, "-m", "coordinator.cli", "coordinator", "--pipeline",
                str(self.pipeline_path), "--port", str(port)]  # fmt: skip
        self._spawn("coordinator", args)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.procs["coordinator"].poll() is not None:
                raise RuntimeError(f"the coordinator exited; see {self.workdir}/logs")
            try:
                socket.create_connection((self.settings.host, port), timeout=0.2).close()
                return f"http://{self.settings.host}:{port}"
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the coordinator did not start within 30 s")

    def _spawn(self, name: str, args: list[str]) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                args, env=_env_for(self.settings), stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        """Workers and the control plane first (they hand sessions back), Redis last."""
        for name in sorted(self.procs, key=lambda n: n == "redis"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.procs.clear()


async def _drain(
    coordinator: Coordinator, done: Callable[[list[OutputEvent]], bool], within_s: float
) -> list[OutputEvent]:
    """Read outputs until ``done(outputs)`` holds or ``within_s`` seconds pass."""
    got: list[OutputEvent] = []
    deadline = time.monotonic() + within_s
    while not done(got) and time.monotonic() < deadline:
        for delivery in await coordinator.outputs(block_ms=100):
            if isinstance(delivery.event, OutputEvent):
                got.append(delivery.event)
    return got


def _text(outputs: list[OutputEvent]) -> str:
    return "".join(o.text for o in outputs)


async def demonstrate(
    stack: LocalStack, pipeline: PipelineConfig, out: Callable[..., object] = print
) -> bool:
    """Drive one session through the stack, narrating; True when every check held."""
    coordinator = Coordinator(stack.settings, pipeline)
    sid = f"demo-{uuid.uuid4().hex[:8]}"
    ok = True
    try:
        fence = await coordinator.open(sid)
        out(f"opened session {sid} at fence {fence}")
        said = "full duplex sessions over a message queue"
        for word in said.split(" "):
            await coordinator.append(sid, "append_text", TextPayload(word + " "))
        got = await _drain(coordinator, lambda got: _text(got).strip() == said, 30)
        out(f"streamed back in {len(got)} chunks: {_text(got).strip()!r}")
        ok &= _text(got).strip() == said

        await coordinator.append(sid, "append_text", TextPayload("interrupt me " * 20))
        await _drain(coordinator, lambda got: len(got) >= 2, 10)
        result = await coordinator.cancel(sid, reason="barge_in")
        out(f"barge-in acknowledged: epoch {result.cancelled.epoch} -> {result.fence.epoch}")
        await coordinator.append(sid, "append_text", TextPayload("after the interruption"))
        late = await _drain(coordinator, lambda got: "interruption" in _text(got), 30)
        stale = [o for o in late if o.fence.epoch < result.fence.epoch]
        out(f"after the barge-in: {len(stale)} stale outputs delivered, "
            f"{coordinator.reader.dropped.total()} dropped by the reader")  # fmt: skip
        ok &= not stale
        ok &= await _demonstrate_failover(stack, coordinator, pipeline, sid, out)
    finally:
        await coordinator.close(sid)
        await coordinator.aclose()
    return ok


async def _demonstrate_failover(
    stack: LocalStack,
    coordinator: Coordinator,
    pipeline: PipelineConfig,
    sid: str,
    out: Callable[..., object],
) -> bool:
    stage = pipeline.stages[0].name
    raw = await coordinator.bus.client.get(coordinator.bus.keys.session(sid).lease(stage))
    owner = raw.decode().split()[0] if raw else None
    if owner not in stack.procs:
        out("failover: skipped (no local owner found)")
        return True
    stack.kill(owner)
    killed_at = time.monotonic()
    await coordinator.append(sid, "append_text", TextPayload("still here"))
    got = await _drain(coordinator, bool, 30)
    if not got:
        out("failover: no output after the worker was killed")
        return False
    elapsed = time.monotonic() - killed_at
    raw = await coordinator.bus.client.get(coordinator.bus.keys.session(sid).lease(stage))
    heir = raw.decode().split()[0] if raw else "?"
    out(f"failover: killed {owner} with SIGKILL; {heir} answered {elapsed * 1000:.0f} ms "
        f"later at incarnation {got[-1].fence.incarnation}")  # fmt: skip
    return True
