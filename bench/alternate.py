"""Product settings measured side by side: one echo worker saturated under each setting
in turn, between runs of the raw batched stream, on one Redis.

    python -m bench.alternate '[{}, {"append_batch": 24}]' --rounds 3
    python -m bench.alternate '[{}, {"linger_ms": 0}]' --no-persistence

Each setting is a JSON object of ``Settings`` fields overriding the shipped defaults
(``{}`` is the shipped configuration). Every round runs the raw batched stream, then
each setting once; a last raw run closes the series, so every setting's run has raw runs
of its own round before and after it. The Redis runs the shipped persistence unless
``--no-persistence``; its fsyncs are counted per run (``bench.fsync``). docs/scaling.md
quotes what this printed when a default was chosen. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from bench import raw, throughput
from bench.common import private_redis
from bench.fsync import fsync_time
from bench.plan import QUICK

PLAN = dataclasses.replace(QUICK, throughput_sessions=64, throughput_window=512,
                           throughput_seconds=4.0)  # fmt: skip
"""The full plan's sessions and window, measured a little longer than the quick plan."""


def _per_fsync(run: dict[str, Any]) -> str:
    return str(run.get("fsync", {}).get("events_per_fsync", "-"))


async def alternate(settings: list[dict[str, Any]], rounds: int, persistent: bool) -> None:
    logs = Path(tempfile.mkdtemp(prefix="duplexq-bench-alternate-"))
    with private_redis("alternate", persistent=persistent) as server:
        if persistent:
            print(f"one fsync: {fsync_time(server.workdir)}", flush=True)

        async def raw_run(name: str) -> None:
            run = await raw.stream(server, name, PLAN.raw_stream_events * 5, raw.BATCH, logs)
            server.flush()
            print(f"raw batched: {run['events_per_s']:,.0f} ev/s, "
                  f"{_per_fsync(run)} events per fsync", flush=True)  # fmt: skip

        for index in range(rounds):
            await raw_run(f"r{index}")
            for number, overrides in enumerate(settings):
                point = await throughput.saturated(server, logs, f"a{index}x{number}", 1, PLAN,
                                                   **overrides)  # fmt: skip
                latency = point["latency_at_saturation"]
                print(f"  {json.dumps(overrides)}: {point['events_per_s']:,.0f} ev/s, "
                      f"{_per_fsync(point)} events per fsync, CPU "
                      f"{point['cpu_us_per_event'].get('total')} us per event, p50/p99 "
                      f"{latency['p50_ms']}/{latency['p99_ms']} ms", flush=True)  # fmt: skip
        await raw_run("last")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.alternate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("settings", help="a JSON list of Settings overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-persistence", action="store_true")
    args = parser.parse_args()
    settings = json.loads(args.settings)
    asyncio.run(alternate(settings, args.rounds, not args.no_persistence))


if __name__ == "__main__":
    main()
