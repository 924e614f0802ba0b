"""A running echo pipeline for one measurement: worker processes, sessions, a collector.

``echo_rig`` starts ``workers`` echo worker processes (``python -m workers``)
on the benchmark's private Redis under a fresh key prefix, opens ``sessions``
sessions through a ``Coordinator`` in this process, and sends every session
one chunk and waits for its echo, so that every session has an owner before
anything is timed. Each worker's capacity is ``ceil(sessions / workers)``:
the product's own admission rule (a worker takes sessions only while it has
capacity) is what spreads the sessions evenly.

On the way out the workers are killed and the server flushed: the next
measurement starts from an empty Redis.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    BenchRedis,
    CpuMeter,
    WorkerPool,
    bench_settings,
    now_ns,
    wait_workers,
)
from bench.load import Collector, open_sessions, prime
from coordinator.service import Coordinator
from dataplane import heap
from schemas.config import Settings, echo_pipeline

STAGE = "echo"


@dataclass
class Rig:
    settings: Settings
    coordinator: Coordinator
    collector: Collector
    session_ids: list[str]
    pool: WorkerPool
    server: BenchRedis
    primed_s: float
    """Seconds from sending every new session its first chunk to the last echo: how long
    the workers took to take all the sessions (and answer once)."""

    def cpu_meter(self) -> CpuMeter:
        pids = {"coordinator+client": os.getpid(), **self.server.pids}
        pids.update({f"worker {c.name}": c.pid for c in self.pool.children})
        return CpuMeter(pids)


@contextlib.asynccontextmanager
async def echo_rig(
    server: BenchRedis,
    log_dir: Path,
    *,
    name: str,
    workers: int,
    sessions: int,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    capacity = max(1, math.ceil(sessions / workers))
    settings = bench_settings(server, name, worker_capacity=capacity, **overrides)
    pipeline = echo_pipeline(STAGE)
    pool = WorkerPool(settings, pipeline, STAGE, log_dir / name)
    coordinator = Coordinator(settings, pipeline)
    heap.settle()  # as ``duplexq coordinator`` does once it has started
    collector = Collector(coordinator)
    try:
        pool.start(workers)
        await wait_workers(coordinator.bus, STAGE, workers)
        session_ids = [f"{name}-{i}" for i in range(sessions)]
        await open_sessions(coordinator, session_ids)
        collector.start()
        began = now_ns()
        await prime(coordinator, collector, session_ids)
        primed_s = (now_ns() - began) / 1e9
        del collector.latencies[:]
        yield Rig(settings, coordinator, collector, session_ids, pool, server, primed_s)
    finally:
        await collector.stop()
        await coordinator.aclose()
        pool.stop_all()
        server.flush()
