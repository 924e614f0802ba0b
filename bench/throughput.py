"""3. Throughput: events/s through coordinator + echo workers, driven to saturation.

The client side sends 40 ms chunks over ``plan.throughput_sessions`` sessions
as fast as their echoes come back, with at most ``plan.throughput_window``
events in flight (sent, not yet delivered), for 1, 2 and 4 echo worker
processes. The figure is events delivered per second once warm. Then the same
worker counts each serve their own paced sessions (``bench.scaleout``): what an
event costs as workers are added with their load.

The references are the raw Python stream limits measured in the same run, on a
Redis persisting as this section's (``bench.raw``): ``unbatched`` (one command
per message on every side, as the coordinator's appends are) and ``batched``
(64-message pipelines, as a stage catching up reads). CPU use per process is
recorded with each point so that the report can say which process saturated
first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import raw, scaleout
from bench.common import BenchRedis, PrivateRedis, cpu_of, median_run, ratio
from bench.fsync import FsyncCounter, per_event
from bench.load import saturate
from bench.rig import echo_rig


async def saturated(
    server: BenchRedis, log_dir: Path, name: str, workers: int, plan: Any, **overrides: Any
) -> dict[str, Any]:
    """One saturation point: ``workers`` echo workers driven as fast as they answer,
    with each process's CPU share and CPU per event, and on a persistent single Redis the
    fsyncs it made per event sent. ``overrides`` change the product's settings."""
    async with echo_rig(server, log_dir, name=name, workers=workers,
                        sessions=plan.throughput_sessions, **overrides) as rig:  # fmt: skip
        counter = None
        if server.persistent and isinstance(server, PrivateRedis):
            counter = FsyncCounter(server.pid).start()
        meter = rig.cpu_meter().start()
        point = await saturate(
            rig.coordinator, rig.collector, rig.session_ids, seconds=plan.throughput_seconds,
            warmup=plan.warmup_seconds, window=plan.throughput_window,
        )  # fmt: skip
        point["cpu_percent"] = meter.read()
        point["cpu_us_per_event"] = meter.per_event_us(point["sent"])
        if counter is not None:
            point["fsync"] = per_event(counter.stop(), point["sent"])
    return point


async def run(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    unbatched = raw["unbatched"]["events_per_s"]
    batched = raw["batched"]["events_per_s"]
    points = []
    for workers in plan.throughput_workers:
        point = await saturated(server, log_dir, f"tp{workers}", workers, plan)
        point.update({
            "workers": workers,
            "sessions": plan.throughput_sessions,
            "window": plan.throughput_window,
            "ratio_to_raw_unbatched": ratio(point["events_per_s"], unbatched),
            "ratio_to_raw_batched": ratio(point["events_per_s"], batched),
        })  # fmt: skip
        points.append(point)
        print(f"  throughput {workers} worker(s): {point['events_per_s']:.0f} ev/s "
              f"({point['ratio_to_raw_unbatched']:.2f} x raw unbatched, "
              f"{point['ratio_to_raw_batched']:.2f} x raw batched)", flush=True)  # fmt: skip
    return {
        "reference_unbatched_eps": unbatched,
        "reference_batched_eps": batched,
        "points": points,
        "paired": await paired(server, plan, log_dir),
        "scaled_out": await scaleout.run(server, plan, log_dir),
    }


async def paired(server: PrivateRedis, plan: Any, log_dir: Path) -> dict[str, Any]:
    """The one-worker ratio to the raw batched stream, side by side: ``plan.throughput_pairs``
    saturation points, each bracketed by raw runs just before and just after it (a raw run
    between two points serves both), so that the machine drifting during a pair moves both
    sides of its ratio; each point's reference is the mean of its two raw runs. The median
    pair's ratio, and every pair's."""

    async def raw_run(index: int) -> dict[str, Any]:
        result = await raw.stream(server, f"pair{index}", plan.raw_stream_events, raw.BATCH,
                                  log_dir)  # fmt: skip
        server.flush()
        return result

    pairs = []
    before = await raw_run(0)
    for index in range(plan.throughput_pairs):
        point = await saturated(server, log_dir, f"pair{index}", 1, plan)
        after = await raw_run(index + 1)
        reference = (before["events_per_s"] + after["events_per_s"]) / 2
        raw_cpu = [r["cpu_us_per_event"].get("total") for r in (before, after)]
        pairs.append({
            "raw_batched_eps": round(reference, 1),
            "raw_batched_eps_before_after": [before["events_per_s"], after["events_per_s"]],
            "events_per_s": point["events_per_s"],
            "ratio": ratio(point["events_per_s"], reference),
            "cpu_us_per_event": point["cpu_us_per_event"].get("total"),
            "raw_cpu_us_per_event": (
                round(sum(raw_cpu) / 2, 1) if None not in raw_cpu else None
            ),
            "events_per_fsync": point.get("fsync", {}).get("events_per_fsync"),
            "raw_events_per_fsync": _mean_per_fsync(before, after),
        })  # fmt: skip
        print(f"  pair {index + 1}: raw batched {before['events_per_s']:.0f} / "
              f"{after['events_per_s']:.0f} ev/s around 1 worker {point['events_per_s']:.0f} "
              f"ev/s ({pairs[-1]['ratio']:.2f}x)", flush=True)  # fmt: skip
        before = after
    if not pairs:
        return {}
    return {"pairs": pairs, "median": median_run(pairs, lambda pair: pair["ratio"])}


def _mean_per_fsync(*runs: dict[str, Any]) -> float | None:
    """The raw runs' mean events per fsync; None without persistence or perf."""
    values = [r.get("fsync", {}).get("events_per_fsync") for r in runs]
    return round(sum(values) / len(values), 1) if values and None not in values else None


CORES = 16
"""The bigger machine the per-worker table projects to."""


def projected_eps(cpu: dict[str, float], cores: int = CORES) -> float:
    """Events/s on ``cores`` cores from measured CPU per event: the processes' total CPU
    spread over the cores, but Redis (one thread) capped at one core."""
    total = cpu.get("total", 0.0)
    redis_us = cpu_of(cpu, "redis")
    limits = [cores * 1e6 / total if total else 0.0]
    if redis_us:
        limits.append(1e6 / redis_us)
    return min(limits)


def per_worker_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    """Per worker count: events/s per worker process, CPU per event (all processes, the
    workers together, Redis) and the projection to ``CORES`` cores."""
    rows = []
    for p in points:
        cpu = p.get("cpu_us_per_event") or {}
        if not cpu:
            continue
        workers_us, redis_us = cpu_of(cpu, "worker"), cpu_of(cpu, "redis")
        rows.append([
            f"{p['workers']}", f"{p['events_per_s'] / p['workers']:,.0f}",
            f"{cpu['total']:,.0f} us", f"{workers_us:,.0f} us", f"{redis_us:,.0f} us",
            f"{projected_eps(cpu):,.0f} ev/s",
        ])  # fmt: skip
    return rows


def cpu_growth_rows(points: list[dict[str, Any]]) -> list[list[Any]]:
    """Summary rows: CPU per event with more workers, against one worker's."""
    one = (points[0].get("cpu_us_per_event") or {}).get("total") if points else None
    rows: list[list[Any]] = []
    for p in points[1:]:
        cpu = p.get("cpu_us_per_event") or {}
        if cpu and one:
            rows.append(["3", f"CPU per event, all processes, {p['workers']} workers sharing "
                         f"{p['sessions']} sessions, saturated",
                         f"{cpu['total']:,.0f} us", f"1 worker {one:,.0f} us",
                         f"{cpu['total'] / one:.2f}x"])  # fmt: skip
    return rows
