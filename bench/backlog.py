"""6. Backlog and replay: a worker catching up, and a recorded session run again.

Backlog: with no worker running, the coordinator accepts ``plan.backlog_events``
40 ms chunks spread over ``plan.backlog_sessions`` sessions (they wait in the
session logs, as the design promises). Then one echo worker process starts
and drains them, reading up to ``read_batch`` (64) entries per session per
read and publishing each batch's outputs with its progress in one script.
Catch-up is timed from the worker's spawn (start-up included) and, server
side, from its first output to its last (the steady rate). The reference is
the raw batched Python stream limit of the same run.

Replay: one of those recorded sessions is replayed with
``coordinator.controlplane.replay.replay_session`` (as fast as possible, into a new
session, through the same worker) and its outputs compared with the
original's. The reference is Python's XADD one at a time (``bench.raw``):
a replay appends one input at a time, in order. Accepting the backlog is
compared with XADD 64 at a time, as the benchmark appends.
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
)
from bench.load import chunk, open_sessions
from coordinator.controlplane.replay import replay_session
from coordinator.service import Coordinator
from dataplane import session_meta
from schemas.config import echo_pipeline
from schemas.events import InputMode

STAGE = "echo"
APPEND_WINDOW = 64


async def _fill(coordinator: Coordinator, ids: list[str], per_session: int) -> float:
    """Append ``per_session`` chunks to each session, 64 appends in flight; seconds taken."""
    began = now_ns()
    work = [(sid, n) for n in range(1, per_session + 1) for sid in ids]
    for start in range(0, len(work), APPEND_WINDOW):
        await asyncio.gather(*(
            coordinator.append(sid, InputMode.APPEND_AUDIO_CHUNK, chunk(now_ns(), n))
            for sid, n in work[start : start + APPEND_WINDOW]
        ))  # fmt: skip
    return (now_ns() - began) / 1e9


async def _applied(coordinator: Coordinator, ids: list[str]) -> int:
    return sum(await session_meta.applied_by_many(coordinator.bus, ids, STAGE))


async def _output_span_s(coordinator: Coordinator, ids: list[str]) -> float:
    """Server time from the first to the last output any session's journal got."""
    firsts, lasts = [], []
    for sid in ids:
        journal = coordinator.bus.keys.session(sid).client
        head = await coordinator.bus.client.xrange(journal, count=1)
        tail = await coordinator.bus.client.xrevrange(journal, count=1)
        if head and tail:
            firsts.append(int(head[0][0].split(b"-")[0]))
            lasts.append(int(tail[0][0].split(b"-")[0]))
    return max(0.001, (max(lasts) - min(firsts)) / 1000) if firsts else float("nan")


async def run(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    sessions = plan.backlog_sessions
    per_session = plan.backlog_events // sessions
    total = per_session * sessions
    settings = bench_settings(server, "bl", worker_capacity=sessions + 1)
    pipeline = echo_pipeline(STAGE)
    pool = WorkerPool(settings, pipeline, STAGE, log_dir / "backlog")
    coordinator = Coordinator(settings, pipeline)
    ids = [f"bl-{i}" for i in range(sessions)]
    try:
        await open_sessions(coordinator, ids)
        fill_s = await _fill(coordinator, ids, per_session)
        print(f"  backlog: {total} events accepted in {fill_s:.1f} s with no worker", flush=True)
        began = now_ns()
        pool.spawn("catchup")
        while await _applied(coordinator, ids) < total:
            if now_ns() - began > 600e9:
                raise TimeoutError("backlog was not drained in 600 s")
            await asyncio.sleep(0.05)
        drain_s = (now_ns() - began) / 1e9
        steady_s = await _output_span_s(coordinator, ids)
        print(f"  backlog: drained in {drain_s:.1f} s ({total / drain_s:.0f} ev/s)", flush=True)

        marks: list[int] = []
        report = await replay_session(
            coordinator.bus, pipeline, ids[0], "bl-replay", pace="fast",
            progress=lambda done, _total: marks.append(now_ns()), quiet_s=3.0,
        )  # fmt: skip
    finally:
        await coordinator.aclose()
        pool.stop_all()
        server.flush()
    append_s = (marks[-1] - marks[0]) / 1e9 if len(marks) > 1 else float("nan")
    batched = raw["batched"]["events_per_s"]
    sequential = raw["xadd_sequential"]["events_per_s"]
    concurrent = raw["xadd_concurrent"]["events_per_s"]
    backlog = {
        "events": total,
        "sessions": sessions,
        "accept_seconds": round(fill_s, 2),
        "accept_events_per_s": round(total / fill_s, 1),
        "accept_reference_eps": concurrent,
        "accept_ratio_to_raw_xadd": ratio(total / fill_s, concurrent),
        "drain_seconds": round(drain_s, 2),
        "events_per_s": round(total / drain_s, 1),
        "steady_events_per_s": round(total / steady_s, 1),
        "reference_eps": batched,
        "ratio_to_raw_batched": ratio(total / drain_s, batched),
        "steady_ratio_to_raw_batched": ratio(total / steady_s, batched),
    }
    replay = {
        "inputs": report.inputs,
        "identical": report.identical,
        "seconds": round(report.elapsed_s, 2),
        "inputs_per_s": round(report.inputs / report.elapsed_s, 1),
        "append_inputs_per_s": round(report.inputs / append_s, 1) if append_s else None,
        "reference_eps": sequential,
        "ratio_to_raw_xadd": ratio(report.inputs / report.elapsed_s, sequential),
        "append_ratio_to_raw_xadd": ratio(report.inputs / append_s, sequential)
        if append_s
        else None,
    }
    print(f"  replay: {report.inputs} inputs in {report.elapsed_s:.1f} s, "
          f"{'identical' if report.identical else 'DIFFERENT'}", flush=True)  # fmt: skip
    return {"backlog": backlog, "replay": replay}
