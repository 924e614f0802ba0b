"""``python -m workers --stage NAME``: run one stage worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from dataplane.config import load_pipeline_or_echo, load_settings
from dataplane.logs import setup_logging
from dataplane.metrics import serve_metrics
from workers.runtime import Worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--stage", required=True, help="stage name from the pipeline config")
    parser.add_argument("--pipeline", type=Path, help="pipeline file (.toml/.json)")
    parser.add_argument("--settings", type=Path, help="settings file (.toml/.json)")
    parser.add_argument("--redis-url", help="overrides settings.redis_url")
    parser.add_argument("--worker-id", help="stable worker id (default: host-pid-stage)")
    parser.add_argument("--burst", action="store_true", help="drain what is queued, then exit")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    return parser.parse_args(argv)


async def serve(worker: Worker, metrics_port: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    server = None
    if metrics_port is not None:
        server = await serve_metrics(worker.settings.host, metrics_port)
    try:
        await worker.run()
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    settings = load_settings(args.settings, args.redis_url)
    # Backends find prepared models through the environment, which vLLM's own engine
    # processes inherit (workers.backends.packaged_model).
    os.environ["DUPLEXQ_MODELS_DIR"] = settings.models_dir
    pipeline = load_pipeline_or_echo(args.pipeline)
    worker = Worker(settings, pipeline, args.stage, worker_id=args.worker_id, burst=args.burst)
    try:
        asyncio.run(serve(worker, args.metrics_port))
    except Exception:
        logging.getLogger("duplexq.worker").exception("worker %s failed", worker.worker_id)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
