"""``duplexq control``: the command that runs the control plane
(``coordinator.controlplane.control``), and the options every command shares."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from coordinator.controlplane.control import run_control
from coordinator.launcher.stack_state import add_workdir_option

log = logging.getLogger("duplexq.control")


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """``--pipeline``, ``--settings``, ``--redis-url`` and ``--workdir``, as every command
    has them."""
    parser.add_argument("--pipeline", type=Path, help="pipeline file (.toml/.json)")
    parser.add_argument("--settings", type=Path, help="settings file (.toml/.json)")
    parser.add_argument("--redis-url", help="overrides settings.redis_url")
    add_workdir_option(parser)


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``duplexq control [--burst]``."""
    parser = subparsers.add_parser(
        "control", help="run the control plane (lease audit, trimming, expiry, replay jobs)"
    )
    add_common_options(parser)
    parser.add_argument("--burst", action="store_true", help="run each job once, then exit")
    parser.set_defaults(func=control_command)


def control_command(args: argparse.Namespace) -> int:
    from coordinator.launcher.stack_state import settings_for
    from dataplane.config import load_pipeline_for
    from dataplane.redis_config import check_at_start

    settings = settings_for(args, "control")
    pipeline = load_pipeline_for(settings, args.pipeline)
    # RedisRefused (one line, exit 2) on a Redis that cannot keep acknowledged inputs.
    # One that does not answer: a one-shot run says so (exit 1); the long-running
    # control plane says it in its log and waits for it.
    asyncio.run(check_at_start(settings, log, wait=not args.burst))
    worker = asyncio.run(run_control(settings, pipeline, burst=args.burst))
    return 1 if worker.jobs_failed else 0
