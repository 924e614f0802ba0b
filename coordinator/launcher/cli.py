"""The ``duplexq`` command line.

duplexq up                 the whole stack on this machine (Redis, workers, control)
duplexq down               stop the stack ``up`` runs in --workdir (default var)
duplexq coordinator        the client API: /v1/realtime, /healthz, /readyz, /metrics
duplexq worker --stage S   one stage worker (same as ``python -m workers``)
duplexq control            the control plane (lease audit, trimming, expiry, replays)
duplexq replay SRC DST     replay a recorded session into a new one, compare outputs
duplexq sessions [SID]     list open sessions, or one session's fence, owners and lag
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from coordinator.controlplane.inspect import inspect_session, list_sessions, render_session
from coordinator.launcher import control_cli, replay_cli
from coordinator.launcher.local_stack import (
    STOP_WITHIN_S,
    LocalStack,
    StartFailed,
    check_stage_options,
    demonstrate,
    free_port,
    port_taken,
)
from coordinator.launcher.stack_state import StackLock, add_workdir_option, running, settings_for
from dataplane import heap, lifeline
from dataplane.bus import RedisBus
from dataplane.config import (
    RedisUnreachable,
    check_environment,
    ensure_redis,
    load_pipeline_for,
    load_settings,
    pipeline_path,
    redacted,
)
from dataplane.logs import WithoutQueryStrings, setup_logging
from dataplane.redis_config import check_at_start
from schemas.config import ConfigError, PipelineConfig, Settings, StageConfig
from schemas.keys import Keys


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", type=Path, help="pipeline file (.toml/.json)")
    parser.add_argument("--settings", type=Path, help="settings file (.toml/.json)")
    parser.add_argument("--redis-url", help="overrides settings.redis_url")
    add_workdir_option(parser)


class Console:
    """``up``'s lines to the person who started it. A closed stdout (``duplexq up | head
    -3``) does not stop the stack: ``up`` says so once on stderr, writes its later lines
    there and goes on serving until Ctrl-C, SIGTERM or ``duplexq down``."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.stream = sys.stdout

    def __call__(self, *parts: object, flush: bool = True) -> None:
        try:
            print(*parts, file=self.stream, flush=True)
        except BrokenPipeError:
            if self.stream is sys.stderr:
                return
            # Whatever Python still holds for stdout goes nowhere instead of failing
            # again at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            self.stream = sys.stderr
            self(
                "duplexq up: stdout is closed; still serving, saying the rest here "
                f"(Ctrl-C or `duplexq down --workdir {self.workdir}` stops it)"
            )
            self(*parts)


def _redis_source(settings: Settings, flag: str | None) -> str | None:
    """Where a Redis given to ``up`` comes from, or None when none is (``up`` then starts
    its own)."""
    if flag:
        return "--redis-url"
    if "redis_url" not in settings.model_fields_set:
        return None
    return "DUPLEXQ_REDIS_URL" if "DUPLEXQ_REDIS_URL" in os.environ else "the settings file"


def cmd_up(args: argparse.Namespace) -> int:
    settings = load_settings(args.settings, args.redis_url)
    workdir = Path(args.workdir).resolve()
    if settings.models_dir == Settings.model_fields["models_dir"].default:
        # Everything one `up` writes lives in its workdir; setup prepares var/models.
        settings = settings.model_copy(update={"models_dir": str(workdir / "models")})
    pipeline = load_pipeline_for(settings, args.pipeline)
    chosen = pipeline_path(settings, args.pipeline).resolve()
    check_stage_options(chosen, settings)
    own_redis = _redis_source(settings, args.redis_url)
    if own_redis:  # a Redis of the caller's: checked before anything starts on it
        asyncio.run(check_at_start(settings))
    lock = StackLock(workdir)
    other = lock.acquire()
    if other is not None:
        print(f"duplexq up: error: a stack is already running in {other.describe()}; "
              f"stop it with: duplexq down --workdir {args.workdir}", file=sys.stderr)  # fmt: skip
        return 1
    try:
        port = args.port if args.port is not None else settings.port
        port = port or free_port()  # 0: any free port
        if port_taken(settings.host, port):
            print(f"duplexq up: error: port {port} on {settings.host} is already in use "
                  "(choose another: --port)", file=sys.stderr)  # fmt: skip
            return 1
        return _run_up(settings, pipeline, chosen, lock, own_redis, port, args)
    finally:
        lock.release()


def _run_up(
    settings: Settings,
    pipeline: PipelineConfig,
    chosen: Path,
    lock: StackLock,
    own_redis: str | None,
    port: int,
    args: argparse.Namespace,
) -> int:
    key_note = "API key: one of DUPLEXQ_API_KEYS" if settings.api_keys else "no API key needed"
    if not settings.api_keys and not settings.allow_anonymous:
        # A fresh key for this run, in a file only its owner reads: never printed, so it
        # lands in no terminal log or URL.
        key_file = lock.workdir / "api_key"
        settings = settings.model_copy(update={"api_keys": (secrets.token_urlsafe(16),)})
        key_file.touch(mode=0o600)
        key_file.chmod(0o600)
        key_file.write_text(settings.api_keys[0] + "\n")
        key_note = f"API key for this run: in {key_file}"
    stack = LocalStack(settings, chosen, lock.workdir)
    out = Console(args.workdir)
    # SIGTERM (and `duplexq down`) stops the stack the way Ctrl-C does: in order, within
    # STOP_WITHIN_S. SIGINT is handled explicitly too: a process started in the
    # background by a non-interactive shell inherits SIGINT ignored, and Python then
    # leaves it so, and such an up ignored every SIGINT sent to it.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        if own_redis:
            out(f"redis: yours, from {own_redis}: {redacted(settings.redis_url)} "
                "(up starts no Redis of its own)")  # fmt: skip
        else:
            stack.start_redis()
            out(f"redis: ready at {stack.settings.redis_url} (this stack's own; "
                "DUPLEXQ_REDIS_URL or --redis-url would use another)")  # fmt: skip
        lock.publish(redis_url=stack.settings.redis_url, key_prefix=settings.key_prefix,
                     pipeline=str(chosen), workdir=str(lock.workdir))  # fmt: skip
        return _serve_up(stack, pipeline, args, port, key_note, lock, out)
    except StartFailed as exc:
        print(f"duplexq up: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        out(f"stopping (within {STOP_WITHIN_S:g} s)")
        stack.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _loads(stage: StageConfig) -> str:
    model = stage.options.get("model")
    return f"{stage.backend}, model {model}" if model else stage.backend


def _serve_up(
    stack: LocalStack,
    pipeline: PipelineConfig,
    args: argparse.Namespace,
    port: int,
    key_note: str,
    lock: StackLock,
    out: Console,
) -> int:
    for stage in pipeline.stages:
        for n in range(args.workers):
            stack.start_worker(stage.name, f"{stage.name}-{n}")
        out(f"stage {stage.name}: {args.workers} worker(s) starting ({_loads(stage)})")
    stack.start_control()
    base = stack.start_coordinator(port)
    lock.publish(base_url=base)
    stack.check_alive()
    out(f"duplexq up: pipeline {pipeline.name} ({' -> '.join(pipeline.stage_names)}"
        f" -> client), {args.workers} worker(s) per stage, Redis at "
        f"{stack.settings.redis_url}, logs in {args.workdir}/logs")  # fmt: skip
    out(f"demo page: {base}/ ({key_note}; the page asks for it)")
    out(f"realtime API: {base.replace('http', 'ws', 1)}/v1/realtime  metrics: {base}/metrics")
    out("waiting for every stage to load its model (the demo page shows which are ready)")
    asyncio.run(stack.wait_ready(pipeline.stage_names, out))
    if not args.no_demo:
        out("demonstration: a typed turn, a barge-in and a failover")
        ok = asyncio.run(demonstrate(stack, pipeline, out))
        for notice in stack.fallback_notices():
            out(notice)
        out("demonstration " + ("passed" if ok else "FAILED"))
        if args.demo_only:
            return 0 if ok else 1
    scrape = stack.write_scrape_config(base.split("://", 1)[1])
    out(f"worker metrics: {', '.join(stack.metrics.values())} (Prometheus config: {scrape})")
    out(f"serving; Ctrl-C or `duplexq down --workdir {args.workdir}` to stop")
    while True:
        stack.check_alive()
        time.sleep(1)


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the stack ``up`` runs in ``--workdir``: SIGTERM to ``up``, which stops its
    children in order; returns once ``up`` let go of the workdir."""
    check_environment()
    workdir = Path(args.workdir).resolve()
    stack = running(workdir)
    if stack is None:
        print(f"duplexq down: no stack is running in {workdir}", file=sys.stderr)
        return 1
    if stack.pid <= 0:
        print(f"duplexq down: error: the stack in {workdir} did not say its pid", file=sys.stderr)
        return 1
    print(f"stopping the stack in {stack.describe()}", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.kill(stack.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while running(workdir) is not None:
        if time.monotonic() >= deadline:
            print(f"duplexq down: error: the stack in {workdir} (pid {stack.pid}) still runs "
                  f"after {args.timeout:g} s", file=sys.stderr)  # fmt: skip
            return 1
        time.sleep(0.1)
    print(f"stopped the stack in {workdir}")
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.app import create_app
    from coordinator.server_options import websocket_options

    settings = settings_for(args, "coordinator")
    pipeline = load_pipeline_for(settings, args.pipeline)
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    app = create_app(settings, pipeline)
    # uvicorn's own lines (startup, access, WebSocket) go through duplexq's JSON logs,
    # their request paths without query strings.
    setup_logging(args.log_level)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(WithoutQueryStrings())
    # Serves nothing on a Redis that cannot keep what it acknowledges (RedisRefused: one
    # line, exit 2); waits for one that does not answer yet.
    asyncio.run(check_at_start(settings, logging.getLogger("duplexq.coordinator"), wait=True))
    logging.getLogger("duplexq.coordinator").info(
        "coordinator serving pipeline %s (%s) on http://%s:%s, Redis at %s",
        pipeline.name, " -> ".join(pipeline.stage_names), host, port,
        redacted(settings.redis_url),
    )  # fmt: skip
    heap.settle()  # what was imported and built to start is long-lived
    # Frames up to 4 x max_event_bytes reach the connection (``event_too_large``, the
    # connection goes on); keep-alive leaves a stalled client to the 4008 close.
    uvicorn.run(app, host=host, port=port, log_config=None, log_level=args.log_level,
                **websocket_options(settings))  # fmt: skip
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = settings_for(args, "worker")
    # What it found (a running stack's Redis, key prefix and pipeline) goes to the worker
    # as the variables it reads anyway.
    os.environ.update({f"DUPLEXQ_{name.upper()}": str(getattr(settings, name))
                       for name in ("redis_url", "key_prefix", "pipeline")})  # fmt: skip
    forwarded = ["--stage", args.stage]
    for flag in ("pipeline", "settings", "redis_url", "worker_id"):
        value = getattr(args, flag)
        if value:
            forwarded += [f"--{flag.replace('_', '-')}", str(value)]
    if args.burst:
        forwarded.append("--burst")
    if args.metrics_port is not None:
        forwarded += ["--metrics-port", str(args.metrics_port)]
    # The worker is its own program (``python -m workers``): this process becomes it,
    # so the coordinator package never imports the workers' one.
    os.execv(sys.executable, [sys.executable, "-m", "workers", *forwarded])


def cmd_sessions(args: argparse.Namespace) -> int:
    settings = settings_for(args, "sessions")
    pipeline = load_pipeline_for(settings, args.pipeline)
    return asyncio.run(_sessions(settings, pipeline, args.session_id))


async def _sessions(settings: Settings, pipeline: PipelineConfig, session_id: str | None) -> int:
    await ensure_redis(settings.redis_url)
    bus = RedisBus(settings.redis_url, Keys(settings.key_prefix))
    try:
        if session_id is None:
            sessions = await list_sessions(bus)
            for sid in sessions:
                print(sid)
            if not sessions:
                print(f"no open sessions in Redis at {redacted(settings.redis_url)}",
                      file=sys.stderr)  # fmt: skip
            return 0
        try:
            print(render_session(await inspect_session(bus, pipeline, session_id)))
        except KeyError as exc:
            print(exc.args[0], file=sys.stderr)
            return 1
        return 0
    finally:
        await bus.aclose()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duplexq", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the whole stack on this machine")
    _common(up)
    up.add_argument("--workers", type=int, default=2, help="worker processes per stage")
    up.add_argument("--demo-only", action="store_true", help="stop after the demonstration")
    up.add_argument("--no-demo", action="store_true", help="serve without the demonstration")
    up.add_argument("--port", type=int, help="client API port (default: settings.port)")
    up.set_defaults(func=cmd_up)

    down = commands.add_parser("down", help="stop the stack `duplexq up` runs in --workdir")
    add_workdir_option(down)
    down.add_argument("--timeout", type=float, default=60.0, help="longest wait for it (s)")
    down.set_defaults(func=cmd_down)

    coordinator = commands.add_parser("coordinator", help="serve the client API")
    _common(coordinator)
    coordinator.add_argument("--host")
    coordinator.add_argument("--port", type=int)
    coordinator.add_argument("--log-level", default="info")
    coordinator.set_defaults(func=cmd_coordinator)

    worker = commands.add_parser("worker", help="run one stage worker")
    _common(worker)
    worker.add_argument("--stage", required=True)
    worker.add_argument("--worker-id")
    worker.add_argument("--burst", action="store_true")
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    worker.set_defaults(func=cmd_worker)

    control_cli.add_commands(commands)
    replay_cli.add_commands(commands)

    sessions = commands.add_parser("sessions", help="list sessions or inspect one")
    _common(sessions)
    sessions.add_argument("session_id", nargs="?")
    sessions.set_defaults(func=cmd_sessions)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A configuration mistake is one line and exit code 2; Redis
    not answering is one line and exit code 1."""
    lifeline.watch()  # a child of `duplexq up` dies with it
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ConfigError as exc:
        print(f"duplexq {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RedisUnreachable as exc:
        print(f"duplexq {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
