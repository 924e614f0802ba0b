"""``duplexq up``: the whole stack on one machine, for development and demos.

Starts Redis (a private redis-server with AOF under ``var/`` unless a Redis
URL is given), one worker process per pipeline stage and the control plane,
then drives a demonstration session through the pipeline: a typed turn
answered end to end, a barge-in after which nothing stale is delivered, and a
worker killed with SIGKILL whose session another worker takes over (a new worker
then takes the killed one's place). It keeps serving until
Ctrl-C (``--demo-only`` stops after the demonstration).

Nothing it starts outlives it. Each child runs in a process group of its own, and
``stop`` ends whatever is left in each group (a worker's vLLM engine processes) before
it returns; if ``up`` dies without stopping (kill -9), its children die with it
(``dataplane.lifeline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.hub import terminal_stages
from coordinator.service import Coordinator
from dataplane.bus import RedisBus
from dataplane.lifeline import LIFELINE_ENV, die_with_parent
from dataplane.readiness import StageModel, read_stage
from schemas.config import REDIS_PERSISTENCE, ConfigError, PipelineConfig, Settings
from schemas.events import OutputEvent, OutputKind, TextPayload
from schemas.keys import Keys


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env_for(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(settings.to_env())
    return env


STOP_WITHIN_S = 10.0
"""The whole stack stops within this long on Ctrl-C or SIGTERM; a child still running
when its turn's share is spent is killed."""
STOP_ORDER = (("coordinator",), ("worker",), ("control",), ("redis",))
"""Who stops first: the coordinator (it closes its clients' connections), then every
worker at once (they hand their sessions back), then the control plane, Redis last."""
LOADING_NOTE_S = 15.0
"""While models load, ``up`` says every this many seconds which stages it waits for."""


class StartFailed(RuntimeError):
    """A part of the stack could not start; the message says which and why, in one line."""


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_stage_options(pipeline_path: Path, settings: Settings) -> None:
    """ConfigError, in one line, when a stage's options are wrong (a misspelt vLLM
    option, say), before anything starts. The workers' own code checks them
    (``python -m workers --check``; the coordinator does not import the workers)."""
    args = [sys.executable, "-m", "workers", "--check", "--pipeline", str(pipeline_path)]
    done = subprocess.run(args, env=_env_for(settings), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.strip()]
        if done.returncode != 2:  # not a verdict on the options: show how it ended
            lines = [f"checking the stages' options failed: {(lines or ['no output'])[-1]}"]
        raise ConfigError("; ".join(lines))


class LocalStack:
    """Child processes of one local deployment; stopped together."""

    def __init__(self, settings: Settings, pipeline_path: Path, workdir: Path) -> None:
        self.settings = settings
        self.pipeline_path = pipeline_path
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.metrics: dict[str, str] = {}
        """Every worker's ``/metrics`` address (``host:port``), by worker name."""
        self.stage_workers: dict[str, list[str]] = {}
        """The names of each stage's workers started here."""
        self.loaded: dict[str, StageModel] = {}
        """What each worker serves, by worker name, once ``wait_ready`` saw it loaded."""
        self.started: dict[str, int] = {}
        """How many workers of each stage were started here (names are never reused)."""
        # Held here only: when this process ends, however it ends, the Python children
        # reading the other end kill their process groups.
        self._lifeline_read, self._lifeline_write = os.pipe()

    def start_redis(self) -> Settings:
        """Start a private redis-server; returns the settings pointing at it."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup installs it)")
        port = free_port()
        data = self.workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        args = [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            *REDIS_PERSISTENCE, "--save", "", "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        self._spawn("redis", args, python=False)
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
        """Start one worker of ``stage``, serving its metrics on a port of its own."""
        port = free_port()
        args = [
            sys.executable, "-m", "workers", "--stage", stage,
            "--pipeline", str(self.pipeline_path), "--worker-id", name,
            "--metrics-port", str(port),
        ]  # fmt: skip
        self._spawn(name, args)
        self.metrics[name] = f"{self.settings.host}:{port}"
        self.stage_workers.setdefault(stage, []).append(name)
        self.started[stage] = self.started.get(stage, 0) + 1

    def add_worker(self, stage: str) -> str:
        """Start one more worker of ``stage``, named ``<stage>-<n>`` with a fresh n."""
        name = f"{stage}-{self.started.get(stage, 0)}"
        self.start_worker(stage, name)
        return name

    def write_scrape_config(self, coordinator: str) -> Path:
        """A Prometheus configuration scraping the coordinator (``host:port``) and every
        worker of this stack, written to ``<workdir>/prometheus.yml``."""
        jobs = [
            ("duplexq-coordinator", [coordinator]),
            ("duplexq-workers", list(self.metrics.values())),
        ]
        lines = ["# Written by duplexq up: prometheus --config.file=<this file>", "scrape_configs:"]
        for job, targets in jobs:
            lines += [f"  - job_name: {job}", "    static_configs:",
                      f"      - targets: [{', '.join(repr(t) for t in targets)}]"]  # fmt: skip
        path = self.workdir / "prometheus.yml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_control(self) -> None:
        args = [sys.executable, "-m", "coordinator.launcher.cli", "control"]
        args += ["--pipeline", str(self.pipeline_path)]
        self._spawn("control", args)

    def start_coordinator(self, port: int) -> str:
        """Serve the client API on ``port``; returns its http:// base URL once it answers."""
        if port and port_taken(self.settings.host, port):
            raise StartFailed(
                f"port {port} on {self.settings.host} is already in use (choose another: --port)"
            )
        args = [sys.executable, "-m", "coordinator.launcher.cli", "coordinator", "--pipeline",
                str(self.pipeline_path), "--port", str(port)]  # fmt: skip
        self._spawn("coordinator", args)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                socket.create_connection((self.settings.host, port), timeout=0.2).close()
                return f"http://{self.settings.host}:{port}"
            except OSError:
                time.sleep(0.1)
        raise StartFailed("the coordinator did not start within 30 s")

    def _spawn(self, name: str, args: list[str], python: bool = True) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = _env_for(self.settings)
        with (logs / f"{name}.log").open("ab") as log:
            # A session of its own: Ctrl-C reaches `up` alone, which then stops the
            # children in order (Redis must not die first), and the child's process
            # group is the child and what it starts. A Python child watches the
            # lifeline; Redis gets the kernel's parent-death signal (sent when the
            # thread that starts it ends: every child is started on the main thread).
            if python:
                env[LIFELINE_ENV] = str(self._lifeline_read)
                self.procs[name] = subprocess.Popen(
                    args, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(self._lifeline_read,),
                )  # fmt: skip
            else:
                # Redis starts first, before `up` runs any thread: the preexec_fn is safe.
                self.procs[name] = subprocess.Popen(
                    args, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=die_with_parent(),  # noqa: PLW1509
                )  # fmt: skip

    def kill(self, name: str) -> None:
        """SIGKILL a child and everything it started."""
        proc = self.procs.pop(name)
        self.metrics.pop(name, None)
        for names in self.stage_workers.values():
            if name in names:
                names.remove(name)
        _kill_group(proc.pid)
        proc.wait()
        _end_group(proc.pid, within_s=5.0)

    def log_tail(self, name: str, lines: int = 3) -> str:
        """The last lines of a child's log, joined into one line."""
        try:
            text = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [_readable(line) for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(tail) or "(empty log)"

    def check_alive(self) -> None:
        """StartFailed naming the first child that exited, with the tail of its log."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise StartFailed(
                    f"{name} exited with code {proc.returncode}: {self.log_tail(name)} "
                    f"(log: {self.workdir / 'logs' / name}.log)"
                )

    async def wait_ready(self, stages: Sequence[str], out: Callable[..., object] = print) -> None:
        """Say ``stage X: ready`` as soon as every worker of X started here has loaded its
        model (a worker heartbeats only then: ``dataplane.readiness``), and announce a
        worker serving the random-weight fallback. Waits as long as loading takes,
        saying every ``LOADING_NOTE_S`` what it still waits for; StartFailed as soon as
        a child dies (a model that cannot load ends its worker)."""
        bus = RedisBus(self.settings.redis_url, Keys(self.settings.key_prefix))
        fresh_ms = 5 * self.settings.heartbeat_ms
        waiting = [stage for stage in stages if self.stage_workers.get(stage)]
        started = time.monotonic()
        note_at = started + LOADING_NOTE_S
        try:
            while waiting:
                self.check_alive()
                for stage in list(waiting):
                    live = (await read_stage(bus, stage, fresh_ms)).models
                    names = self.stage_workers[stage]
                    if all(name in live for name in names):
                        waiting.remove(stage)
                        self.loaded.update((name, live[name]) for name in names)
                        out(_ready_line(stage, [live[name] for name in names]), flush=True)
                        for notice in self.fallback_notices(names):
                            out(notice, flush=True)
                if waiting and time.monotonic() >= note_at:
                    note_at += LOADING_NOTE_S
                    elapsed = time.monotonic() - started
                    out(f"still loading: {', '.join(waiting)} ({elapsed:.0f} s)", flush=True)
                await asyncio.sleep(0.2)
        finally:
            await bus.aclose()

    def fallback_notices(self, names: Sequence[str] | None = None) -> list[str]:
        """One line per worker (of ``names``, default all) that serves the random-weight
        fallback model, as ``wait_ready`` saw them."""
        found = []
        for name in self.loaded if names is None else names:
            model = self.loaded.get(name)
            if model is not None and model.fallback:
                found.append(
                    f"WARNING: {name} serves a tiny RANDOM-WEIGHT model (answers are "
                    f"gibberish): its model {model.model} is not available. Run "
                    f"scripts/setup, or set the stage's model (docs/models.md); "
                    f"log: {self.workdir / 'logs' / name}.log"
                )
        return found

    def stop(self, within_s: float = STOP_WITHIN_S) -> None:
        """Stop every child in ``STOP_ORDER`` within ``within_s`` seconds in all."""
        share = within_s / len(STOP_ORDER)
        for kinds in STOP_ORDER:
            group = [
                (name, proc)
                for name, proc in self.procs.items()
                if _kind(name) in kinds and proc.poll() is None
            ]
            for _, proc in group:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + share
            for _, proc in group:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # What a child started and left behind (a worker killed before its vLLM engine
        # shut down) is ended too: nothing of the stack outlives `stop`.
        for proc in self.procs.values():
            _end_group(proc.pid, within_s=2.0)
        self.procs.clear()


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _end_group(pgid: int, within_s: float) -> None:
    """SIGKILL what is left of process group ``pgid`` and wait (at most ``within_s``)
    until none of it runs."""
    deadline = time.monotonic() + within_s
    while group_members(pgid) and time.monotonic() < deadline:
        _kill_group(pgid)
        time.sleep(0.02)


def _ready_line(stage: str, models: Sequence[StageModel]) -> str:
    """``stage X: ready`` with what its workers loaded and how long the slowest took."""
    loaded = [m for m in models if m.model]
    if not loaded:
        return f"stage {stage}: ready"
    names = ", ".join(sorted({m.model + (" (RANDOM-WEIGHT fallback)" if m.fallback else "")
                              for m in loaded}))  # fmt: skip
    return f"stage {stage}: ready ({names} loaded in {max(m.load_s for m in loaded):.1f} s)"


def _kind(name: str) -> str:
    """``coordinator``, ``control``, ``redis`` or ``worker`` (``<stage>-<n>``)."""
    return name if name in ("coordinator", "control", "redis") else "worker"


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


async def demonstrate(
    stack: LocalStack, pipeline: PipelineConfig, out: Callable[..., object] = print
) -> bool:
    """Drive one session through the stack, narrating; True when every check held.

    Works for any pipeline: it types its turns (every stage passes typed text on),
    and a turn is answered when a client-facing chain end says ``done``.
    """
    coordinator = Coordinator(stack.settings, pipeline)
    ends = set(terminal_stages(pipeline))
    sid = f"demo-{uuid.uuid4().hex[:8]}"
    ok = True

    def answered(got: list[OutputEvent]) -> bool:
        return any(o.kind is OutputKind.DONE and o.stage in ends for o in got)

    try:
        fence = await coordinator.open(sid)
        out(f"opened session {sid} at fence {fence}")
        await coordinator.append(sid, "append_text", TextPayload("hello, who are you?"))
        await coordinator.commit(sid)
        got = await _drain(coordinator, answered, 300)
        out(f"answered with {len(got)} outputs: {_summary(got)}")
        ok &= answered(got)

        await coordinator.append(sid, "append_text", TextPayload("tell me a long story " * 8))
        await coordinator.commit(sid)
        await _drain(coordinator, bool, 120)
        result = await coordinator.cancel(sid, reason="barge_in")
        out(f"barge-in acknowledged: epoch {result.cancelled.epoch} -> {result.fence.epoch}")
        late = await _drain(coordinator, lambda got: False, 2)
        stale = [o for o in late if o.fence.epoch < result.fence.epoch]
        out(f"after the barge-in: {len(stale)} stale outputs delivered, "
            f"{coordinator.reader.dropped.total()} dropped by the reader")  # fmt: skip
        ok &= not stale
        ok &= await _demonstrate_failover(stack, coordinator, pipeline, sid, out)
    finally:
        await coordinator.close(sid)
        await coordinator.aclose()
    return ok


def _summary(got: list[OutputEvent]) -> str:
    text = "".join(o.text for o in got if o.kind is OutputKind.TEXT_DELTA)
    audio = sum(len(o.data) for o in got if o.kind is OutputKind.AUDIO_DELTA)
    parts = [f"text {text[:80]!r}"] if text else []
    if audio:
        parts.append(f"{audio // 48} ms of 24 kHz speech")
    return ", ".join(parts) or "no text or audio"


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
    replicas = [name for name in stack.procs if name.startswith(f"{stage}-")]
    if owner not in stack.procs or len(replicas) < 2:
        out("failover: skipped (it needs two local workers of the stage; use --workers 2)")
        return True
    stack.kill(owner)
    killed_at = time.monotonic()
    await coordinator.append(sid, "append_text", TextPayload("are you still there?"))
    await coordinator.commit(sid)
    got = await _drain(coordinator, bool, 120)
    if not got:
        out("failover: no output after the worker was killed")
        return False
    elapsed = time.monotonic() - killed_at
    raw = await coordinator.bus.client.get(coordinator.bus.keys.session(sid).lease(stage))
    heir = raw.decode().split()[0] if raw else "?"
    out(f"failover: killed {owner} with SIGKILL; {heir} answered {elapsed * 1000:.0f} ms "
        f"later at incarnation {got[-1].fence.incarnation}")  # fmt: skip
    # The stack goes on serving with the workers it was asked for.
    replacement = stack.add_worker(stage)
    out(f"failover: started {replacement} in {owner}'s place", flush=True)
    await stack.wait_ready([stage], out)
    return True


def _readable(line: str) -> str:
    """A log line as a person reads it: a JSON line (``dataplane.logs``) as its message
    and, for a traceback, only its last line (the error itself)."""
    line = line.strip()
    if not line.startswith("{"):
        return line
    try:
        entry = json.loads(line)
    except ValueError:
        return line
    if not isinstance(entry, dict) or "msg" not in entry:
        return line
    text = str(entry["msg"])
    error = str(entry.get("exc") or "").strip().splitlines()[-1:]
    if error and error[0] not in text:
        text += f": {error[0]}"
    return text
