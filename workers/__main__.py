"""``python -m workers --stage NAME``: run one stage worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from dataplane import lifeline
from dataplane.config import (
    check_stage,
    load_pipeline_for,
    load_settings,
    pipeline_path,
)
from dataplane.logs import setup_logging
from dataplane.metrics import serve_metrics
from dataplane.redis_config import RedisRefused, check_at_start
from schemas.config import ConfigError
from workers.check import pipeline_problems
from workers.loading import ModelLoadFailed
from workers.runtime import Worker, WorkerState


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--stage", help="stage name from the pipeline config")
    parser.add_argument(
        "--check", action="store_true", help="check every stage's options, load nothing, exit"
    )
    parser.add_argument("--pipeline", type=Path, help="pipeline file (.toml/.json)")
    parser.add_argument("--settings", type=Path, help="settings file (.toml/.json)")
    parser.add_argument("--redis-url", help="overrides settings.redis_url")
    parser.add_argument("--worker-id", help="stable worker id (default: host-pid-stage)")
    parser.add_argument("--burst", action="store_true", help="drain what is queued, then exit")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    return parser.parse_args(argv)


STOP_GRACE_S = 6.0
"""After SIGTERM a worker hands its sessions back and exits; one still busy after this
long (a model loading in a thread cannot be interrupted) exits anyway."""


def _exit_late() -> None:
    logging.getLogger("duplexq.worker").error(
        "still busy %.0f s after the stop signal: exiting now", STOP_GRACE_S
    )
    _exit_now(1)


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def serve(worker: Worker, metrics_port: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    late = threading.Timer(STOP_GRACE_S, _exit_late)
    late.daemon = True

    def stop() -> None:
        worker.request_stop()
        if not late.is_alive():
            late.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    # Nothing is served on a Redis that cannot keep what it acknowledges (RedisRefused);
    # one that does not answer yet is waited for, and a stop signal then ends the wait.
    checked = await check_at_start(
        worker.settings, logging.getLogger("duplexq.worker"), wait=True,
        stopping=lambda: worker.state is not WorkerState.STARTING,
    )  # fmt: skip
    if checked is None:
        _exit_now(0)  # stopped before Redis answered: nothing was taken, nothing to hand back
    server = None
    if metrics_port is not None:
        server = serve_metrics(worker.settings.host, metrics_port)
    try:
        await worker.run()
    finally:
        if server is not None:
            server.close()
    # Stopped cleanly: sessions handed back, the backend and Redis closed. The process
    # ends here rather than at the end of asyncio.run, which (like the interpreter's
    # exit) waits for the threads still running blocking model calls: a transcription
    # cut by the stop would hold the exit up for as long as it takes, and nobody is
    # left to read its result.
    _exit_now(0)


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after a clean stop, 1 when the worker failed, 2 for a configuration
    mistake (said in one line), a Redis that cannot keep acknowledged inputs included
    (``dataplane.redis_config``)."""
    lifeline.watch()  # a child of `duplexq up` dies with it, its vLLM engine with it
    args = parse_args(argv)
    try:
        settings = load_settings(args.settings, args.redis_url)
        path = pipeline_path(settings, args.pipeline)
        pipeline = load_pipeline_for(settings, args.pipeline)
        if args.check:
            problems = pipeline_problems(pipeline)
            for line in problems:
                print(f"error: pipeline {path}: {line}", file=sys.stderr)
            return 2 if problems else 0
        if not args.stage:
            raise ConfigError("--stage is required (or --check)")
        check_stage(pipeline, args.stage, path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    # Backends find prepared models through the environment, which vLLM's own engine
    # processes inherit (workers.backends.packaged_model).
    os.environ["DUPLEXQ_MODELS_DIR"] = settings.models_dir
    log = logging.getLogger("duplexq.worker")
    try:
        worker = Worker(
            settings, pipeline, args.stage, worker_id=args.worker_id, burst=args.burst,
            settle_heap=True,
        )  # fmt: skip
    except ValueError as exc:  # the stage's options (a backend refuses them as it starts)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(worker, args.metrics_port))
    except RedisRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadFailed as exc:
        # One line for whoever reads the log's tail, the cause's traceback with it.
        log.error("%s", exc, exc_info=exc.__cause__ or exc)
        return 1
    except Exception:
        log.exception("worker %s failed", worker.worker_id)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
