"""Taking sessions in: how long one worker needs to own and answer N waiting sessions.

``python -m bench --only takein`` (or ``python -m bench.takein``): N sessions
are opened and each is sent one 40 ms chunk while no worker runs; then one
echo worker process starts (capacity N) and the clock runs from its first
heartbeat to the echo of the last session's chunk: reading the assignments,
acquiring N leases, rebuilding N sessions, reading their inputs and
publishing N answers. Taking in must be linear in N: the figure to watch is
the time per session as N grows.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.common import (
    PrivateRedis,
    WorkerPool,
    bench_settings,
    now_ns,
    private_redis,
    wait_workers,
)
from bench.load import Collector, open_sessions, send
from bench.mdformat import f, failed, table
from coordinator.service import Coordinator
from schemas.config import echo_pipeline

STAGE = "echo"


async def take_in(server: PrivateRedis, log_dir: Path, sessions: int) -> dict[str, Any]:
    name = f"take{sessions}"
    settings = bench_settings(server, name, worker_capacity=sessions)
    pipeline = echo_pipeline(STAGE)
    pool = WorkerPool(settings, pipeline, STAGE, log_dir / name)
    coordinator = Coordinator(settings, pipeline)
    collector = Collector(coordinator)
    ids = [f"{name}-{i}" for i in range(sessions)]
    try:
        await open_sessions(coordinator, ids)
        for start in range(0, sessions, 64):
            await asyncio.gather(*(send(coordinator, sid, 0) for sid in ids[start : start + 64]))
        collector.start()
        pool.start(1)
        await wait_workers(coordinator.bus, STAGE, 1, limit_s=60)
        began = now_ns()
        if not await collector.wait_for(((sid, 0) for sid in ids), 300):
            missing = sum((sid, 0) not in collector.delivered for sid in ids)
            return {"sessions": sessions, "error": f"{missing} sessions not answered in 300 s"}
        seconds = (now_ns() - began) / 1e9
    finally:
        await collector.stop()
        await coordinator.aclose()
        pool.stop_all()
        server.flush()
    return {
        "sessions": sessions,
        "seconds": round(seconds, 3),
        "ms_per_session": round(seconds * 1000 / sessions, 3),
    }


async def run(
    server: PrivateRedis, plan: Any, _raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    points = []
    for sessions in plan.takein_sessions:
        point = await take_in(server, log_dir, sessions)
        points.append(point)
        if "error" in point:
            print(f"  take in {sessions:>5} sessions: failed: {point['error']}", flush=True)
        else:
            print(f"  take in {sessions:>5} sessions: {point['seconds']:.2f} s "
                  f"({point['ms_per_session']:.2f} ms per session)", flush=True)  # fmt: skip
    return {"points": points}


def summary_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """The summary table's rows for section 9."""
    return [
        ["9", f"{p['sessions']:,} waiting sessions taken in by 1 worker", f"{p['seconds']:.2f} s",
         "-", f"{p['ms_per_session']:.2f} ms per session"]
        for p in (s or {}).get("points", [])
        if "error" not in p
    ]  # fmt: skip


def section(s: dict[str, Any] | None) -> str:
    """The report's section 9."""
    out = ["## 9. Taking sessions in", ""]
    if (msg := failed("takein", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "N sessions are opened and each sent one chunk while no worker runs; then one echo\n"
        "worker starts (capacity N) and the clock runs from its first heartbeat to the echo\n"
        "of the last session: assignments read, N leases acquired, N sessions rebuilt, read\n"
        "and answered. The time per session must stay flat as N grows.\n"
    )
    rows = [
        [f(p["sessions"]), "failed: " + p["error"], "-"] if "error" in p
        else [f(p["sessions"]), f"{p['seconds']:.2f} s", f"{p['ms_per_session']:.2f} ms"]
        for p in s["points"]
    ]  # fmt: skip
    out.append(table(["sessions", "taken in", "per session"], rows))
    return "\n".join(out)


def main() -> None:
    import tempfile

    from bench.plan import FULL

    with private_redis("takein") as server:
        logs = Path(tempfile.mkdtemp(prefix="duplexq-takein-"))
        asyncio.run(run(server, FULL, {}, logs))


if __name__ == "__main__":
    main()
