"""3, second part. Adding workers with their sessions: CPU per event as workers grow.

The saturation points of section 3 share one fixed set of sessions between
more and more worker processes on the same two cores: each worker then gets a
smaller share of the same rate, its rounds carry fewer events, and what a
round costs (a wake-up, a read, a publish) is paid by fewer events. That
measures how a fixed load is split, not what adding a worker costs.

Scaling out is adding workers *with* load: here every worker process serves
``plan.scaleout_sessions_per_worker`` paced sessions (25 chunks/s each, as in
section 2), so ``W`` workers serve ``W`` times the sessions, each worker at the
same rate. The cost of scaling out is then what one event costs as ``W`` grows:
CPU time of every process (coordinator and client, Redis, every worker) per
event delivered. Flat (or falling, as the coordinator and Redis batch more)
means a worker added with its sessions costs what the first one did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import PrivateRedis, cpu_of
from bench.latency import measure, served


async def run(server: PrivateRedis, plan: Any, log_dir: Path) -> list[dict[str, Any]]:
    """One paced point per worker count of ``plan.throughput_workers``."""
    per = plan.scaleout_sessions_per_worker
    points = []
    for workers in plan.throughput_workers:
        point = await measure(
            server, log_dir, f"so{workers}", workers, per * workers,
            plan.latency_seconds, plan.warmup_seconds,
        )  # fmt: skip
        point["served"] = "error" not in point and served(point)
        points.append(point)
        cpu = (point.get("cpu_us_per_event") or {}).get("total")
        eps = point.get("delivered_eps", 0)
        print(f"  scaled out, {workers} worker(s) x {per} sessions: {eps:.0f} ev/s, "
              f"CPU per event {cpu} us", flush=True)  # fmt: skip
    return points


def rows(points: list[dict[str, Any]]) -> list[list[str]]:
    """The section's table: one row per worker count."""
    one = (points[0].get("cpu_us_per_event") or {}).get("total") if points else None
    out = []
    for p in points:
        cpu = p.get("cpu_us_per_event") or {}
        if "error" in p or not cpu:
            out.append([f"{p['workers']}", f"{p['sessions']:,}", "-", "-", "-", "-", "-", "-",
                        "-", p.get("error", "no CPU figures")])  # fmt: skip
            continue
        workers_us, redis_us = cpu_of(cpu, "worker"), cpu_of(cpu, "redis")
        per_worker = p["delivered_eps"] / p["workers"]
        lat = p["latency"]
        out.append([
            f"{p['workers']}", f"{p['sessions']:,}", f"{p['delivered_eps']:,.0f}",
            f"{per_worker:,.0f}", f"{lat['p50_ms']:.2f} / {lat['p99_ms']:.2f}",
            f"**{cpu['total']:,.0f}** us", f"{workers_us:,.0f} us", f"{redis_us:,.0f} us",
            f"{cpu['total'] / one:.2f}x" if one else "-", "yes" if p["served"] else "**no**",
        ])  # fmt: skip
    return out


HEADER = ["workers", "sessions", "delivered ev/s", "ev/s per worker", "p50 / p99 ms",
          "CPU per event", "in workers", "in Redis", "against 1 worker", "served"]  # fmt: skip


def summary_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    """Summary rows: CPU per event with more workers (each with its sessions), against
    one worker with its own."""
    one = (points[0].get("cpu_us_per_event") or {}).get("total") if points else None
    out = []
    for p in points[1:]:
        cpu = p.get("cpu_us_per_event") or {}
        if cpu and one:
            out.append(["3", f"CPU per event, {p['workers']} workers with "
                        f"{p['sessions'] // p['workers']} paced sessions each",
                        f"{cpu['total']:,.0f} us", f"1 worker, {points[0]['sessions']} sessions: "
                        f"{one:,.0f} us", f"{cpu['total'] / one:.2f}x"])  # fmt: skip
    return out
