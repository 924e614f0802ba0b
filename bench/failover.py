"""5. Failover: from ``kill -9`` of a worker to its sessions' next output from the heir.

For each lease TTL (1, 2 and 5 s): one echo worker process takes
``plan.failover_sessions`` sessions, then a second (the heir) starts with
spare capacity. Every session streams 40 ms chunks at 25/s throughout. The
first worker is killed with SIGKILL (no hand-back: its leases simply stop
being renewed); the heir finds the expired leases in its orphan scan, takes
the sessions over (incarnation + 1), rebuilds from the session log and goes
on from where the dead worker's last publish left off.

Per session, the failover time is from the kill to the first output of the
new incarnation delivered to the client. Inputs lost are inputs accepted by
the coordinator whose echo was never delivered (must be 0); inputs answered
twice are the at-least-once redo of an event the dead worker had read but
not published, which the client sees once (the reader drops duplicates).

Reference: the lease TTL, the time the design gives a dead owner before its
sessions move. Heartbeats every TTL/4, orphan scan every 100 ms.
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
    ratio,
    summarize_ns,
    wait_workers,
)
from bench.load import Collector, open_sessions, paced_load, prime
from coordinator.service import Coordinator
from schemas.config import echo_pipeline
from schemas.events import OutputEvent

STAGE = "echo"
BEFORE_KILL_S = 1.0
AFTER_TTL_S = 3.0


async def one_ttl(server: PrivateRedis, plan: Any, ttl_ms: int, log_dir: Path) -> dict[str, Any]:
    settings = bench_settings(
        server, f"fo{ttl_ms}", lease_ttl_ms=ttl_ms, heartbeat_ms=max(50, ttl_ms // 4),
        orphan_scan_ms=100, worker_capacity=plan.failover_sessions,
    )  # fmt: skip
    pipeline = echo_pipeline(STAGE)
    pool = WorkerPool(settings, pipeline, STAGE, log_dir / f"failover-{ttl_ms}")
    coordinator = Coordinator(settings, pipeline)
    collector = Collector(coordinator)
    killed_at = 0
    first_new: dict[str, int] = {}

    def note(sid: str, event: OutputEvent, arrived: int) -> None:
        if killed_at and event.fence.incarnation > 0 and sid not in first_new:
            first_new[sid] = arrived - killed_at

    collector.on_output = note
    try:
        victim = pool.spawn("victim")
        await wait_workers(coordinator.bus, STAGE, 1)
        ids = [f"fo{ttl_ms}-{i}" for i in range(plan.failover_sessions)]
        await open_sessions(coordinator, ids)
        collector.start()
        await prime(coordinator, collector, ids)
        pool.spawn("heir")
        await wait_workers(coordinator.bus, STAGE, 2)
        load = asyncio.create_task(paced_load(
            coordinator, collector, ids, seconds=ttl_ms / 1000 + AFTER_TTL_S,
            warmup=BEFORE_KILL_S,
        ))  # fmt: skip
        await asyncio.sleep(BEFORE_KILL_S)
        killed_at = now_ns()
        victim.kill()
        result = await load
    finally:
        await collector.stop()
        await coordinator.aclose()
        pool.stop_all()
        server.flush()
    times = [first_new[sid] for sid in ids if sid in first_new]
    summary = summarize_ns(times)
    return {
        "lease_ttl_ms": ttl_ms,
        "sessions": len(ids),
        "sessions_moved": len(times),
        "failover": summary,
        "ratio_p50_to_ttl": ratio(summary["p50_ms"], ttl_ms),
        "ratio_max_to_ttl": ratio(summary["max_ms"], ttl_ms),
        "inputs_sent": result.sent,
        "inputs_lost": result.lost,
        "inputs_undelivered_at_cutoff": result.undelivered_at_cutoff,
        "inputs_answered_twice": collector.arrivals - len(collector.delivered),
    }


async def run(server: PrivateRedis, plan: Any, log_dir: Path) -> dict[str, Any]:
    rows = []
    for ttl_ms in plan.failover_ttls_ms:
        row = await one_ttl(server, plan, ttl_ms, log_dir)
        rows.append(row)
        print(f"  failover ttl {ttl_ms} ms: p50 {row['failover']['p50_ms']:.0f} ms, max "
              f"{row['failover']['max_ms']:.0f} ms, moved {row['sessions_moved']}/"
              f"{row['sessions']}, lost {row['inputs_lost']}", flush=True)  # fmt: skip
    return {"reference": "lease TTL", "orphan_scan_ms": 100, "rows": rows}
