"""The ``duplexq`` command line.

duplexq up                 the whole stack on this machine (Redis, workers, control)
duplexq coordinator        the client API: /v1/realtime, /healthz, /readyz, /metrics
duplexq worker --stage S   one stage worker (same as ``python -m workers``)
duplexq control            the control plane (lease audit, trimming, expiry, replays)
duplexq replay SRC DST     replay a recorded session into a new one, compare outputs
duplexq sessions [SID]     list open sessions, or one session's fence, owners and lag
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from coordinator import control, replay
from coordinator.inspect import inspect_session, list_sessions, render_session
from coordinator.local_stack import (
    STOP_WITHIN_S,
    LocalStack,
    StartFailed,
    check_stage_options,
    demonstrate,
)
from dataplane import heap
from dataplane.bus import RedisBus
from dataplane.config import (
    RedisUnreachable,
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


def cmd_up(args: argparse.Namespace) -> int:
    settings = load_settings(args.settings, args.redis_url)
    if settings.models_dir == Settings.model_fields["models_dir"].default:
        # Everything one `up` writes lives in its workdir; setup prepares var/models.
        models = Path(args.workdir).resolve() / "models"
        settings = settings.model_copy(update={"models_dir": str(models)})
    pipeline = load_pipeline_for(settings, args.pipeline)
    chosen = pipeline_path(settings, args.pipeline).resolve()
    check_stage_options(chosen, settings)
    if args.redis_url:  # a Redis of the caller's: checked before anything starts on it
        asyncio.run(check_at_start(settings))
    key_note = "API key: one of DUPLEXQ_API_KEYS" if settings.api_keys else "no API key needed"
    if not settings.api_keys and not settings.allow_anonymous:
        # A fresh key for this run, in a file only its owner reads: never printed, so it
        # lands in no terminal log or URL.
        key_file = Path(args.workdir).resolve() / "api_key"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        settings = settings.model_copy(update={"api_keys": (secrets.token_urlsafe(16),)})
        key_file.touch(mode=0o600)
        key_file.chmod(0o600)
        key_file.write_text(settings.api_keys[0] + "\n")
        key_note = f"API key for this run: in {key_file}"
    stack = LocalStack(settings, chosen, Path(args.workdir).resolve())
    # SIGTERM stops the stack the way Ctrl-C does: in order, within STOP_WITHIN_S.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _serve_up(stack, pipeline, args, key_note)
    except StartFailed as exc:
        print(f"duplexq up: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print(f"stopping (within {STOP_WITHIN_S:g} s)", flush=True)
        stack.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _loads(stage: StageConfig) -> str:
    model = stage.options.get("model")
    return f"{stage.backend}, model {model}" if model else stage.backend


def _serve_up(
    stack: LocalStack, pipeline: PipelineConfig, args: argparse.Namespace, key_note: str
) -> int:
    if not args.redis_url:
        stack.start_redis()
        print(f"redis: ready at {stack.settings.redis_url}", flush=True)
    for stage in pipeline.stages:
        for n in range(args.workers):
            stack.start_worker(stage.name, f"{stage.name}-{n}")
        print(
            f"stage {stage.name}: {args.workers} worker(s) starting ({_loads(stage)})", flush=True
        )
    stack.start_control()
    base = stack.start_coordinator(args.port if args.port is not None else stack.settings.port)
    stack.check_alive()
    print(f"duplexq up: pipeline {pipeline.name} ({' -> '.join(pipeline.stage_names)}"
          f" -> client), {args.workers} worker(s) per stage, Redis at "
          f"{stack.settings.redis_url}, logs in {args.workdir}/logs")  # fmt: skip
    print(f"demo page: {base}/ ({key_note}; the page asks for it)")
    print(f"realtime API: {base.replace('http', 'ws', 1)}/v1/realtime  metrics: {base}/metrics")
    print(
        "waiting for every stage to load its model (the demo page shows which are ready)",
        flush=True,
    )
    asyncio.run(stack.wait_ready(pipeline.stage_names))
    if not args.no_demo:
        print("demonstration: a typed turn, a barge-in and a failover", flush=True)
        ok = asyncio.run(demonstrate(stack, pipeline))
        for notice in stack.fallback_notices():
            print(notice)
        print("demonstration " + ("passed" if ok else "FAILED"), flush=True)
        if args.demo_only:
            return 0 if ok else 1
    # Written once the demonstration is over: its failover stops a worker for good.
    scrape = stack.write_scrape_config(base.split("://", 1)[1])
    print(f"worker metrics: {', '.join(stack.metrics.values())} (Prometheus config: {scrape})")
    print("serving; Ctrl-C to stop", flush=True)
    while True:
        stack.check_alive()
        time.sleep(1)


def cmd_coordinator(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.app import create_app
    from coordinator.server_options import websocket_options

    settings = load_settings(args.settings, args.redis_url)
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
    settings = load_settings(args.settings, args.redis_url)
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
    up.add_argument("--workdir", default="var", help="where Redis data and logs go")
    up.add_argument("--demo-only", action="store_true", help="stop after the demonstration")
    up.add_argument("--no-demo", action="store_true", help="serve without the demonstration")
    up.add_argument("--port", type=int, help="client API port (default: settings.port)")
    up.set_defaults(func=cmd_up)

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

    control.add_commands(commands)
    replay.add_commands(commands)

    sessions = commands.add_parser("sessions", help="list sessions or inspect one")
    _common(sessions)
    sessions.add_argument("session_id", nargs="?")
    sessions.set_defaults(func=cmd_sessions)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A configuration mistake is one line and exit code 2; Redis
    not answering is one line and exit code 1."""
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
