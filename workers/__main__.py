"""``python -m workers --stage NAME``: run one stage worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from schemas.config import PipelineConfig, Settings, echo_pipeline, load_mapping, load_pipeline
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
    return parser.parse_args(argv)


def load_settings(path: Path | None, redis_url: str | None) -> Settings:
    settings = Settings.model_validate(load_mapping(path)) if path else Settings()
    settings = settings.with_env()
    if redis_url:
        settings = settings.model_copy(update={"redis_url": redis_url})
    return settings


def load_pipeline_or_echo(path: Path | None) -> PipelineConfig:
    return load_pipeline(path) if path else echo_pipeline()


async def serve(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    await worker.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    settings = load_settings(args.settings, args.redis_url)
    pipeline = load_pipeline_or_echo(args.pipeline)
    worker = Worker(settings, pipeline, args.stage, worker_id=args.worker_id, burst=args.burst)
    try:
        asyncio.run(serve(worker))
    except Exception:
        logging.getLogger("duplexq.worker").exception("worker %s failed", worker.worker_id)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
