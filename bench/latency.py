"""2. Per-hop latency and 7. the scaling curve, both under paced audio load.

Sessions send a 40 ms chunk every 40 ms (25 events/s each) through
coordinator -> echo stage -> output reader; the latency of a chunk is from
the moment it is handed to ``Coordinator.append`` to the moment the output
reader returns its echo, in one process, on one clock.

The reference is the raw round trip (``bench.raw``): the same two hops made
with bare XADD/XREADGROUP/XACK, measured again right before each load point
(500 round trips) so that both see the machine in the same state. Added
latency is the pipeline's p50 (p99) minus the raw p50 (p99): what fences,
leases, ordering, the Lua scripts, encoding and the product's event loops
cost.

A load point is *served* when nothing is lost, deliveries keep up with what
was offered (at least 95 %) and at most 1 % of the sends started more than
a chunk late. The scaling curve is the most sessions served within the
latency budget (p99 added latency at most ``plan.budget_ms``) for each
number of worker processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.common import PrivateRedis, median_run, ratio
from bench.load import paced_load
from bench.raw import round_trip
from bench.rig import echo_rig

KEEP_UP = 0.95
REFERENCE_SAMPLES = 500
"""Raw round trips measured just before each load point, as its own reference."""
LATE_SHARE = 0.01
"""Share of sends allowed to start more than a period late (a scheduling hiccup)."""


def _added(load: dict[str, Any]) -> dict[str, float]:
    rtt = load["reference_round_trip"]
    p50 = load["latency"]["p50_ms"] - rtt["p50_ms"]
    p99 = load["latency"]["p99_ms"] - rtt["p99_ms"]
    return {
        "added_p50_ms": round(p50, 3),
        "added_p99_ms": round(p99, 3),
        "ratio_p50": ratio(load["latency"]["p50_ms"], rtt["p50_ms"]),
        "ratio_p99": ratio(load["latency"]["p99_ms"], rtt["p99_ms"]),
    }


def served(load: dict[str, Any]) -> bool:
    """Whether the pipeline kept up with the offered load."""
    return bool(
        load["lost"] == 0
        and load["undelivered_at_cutoff"] == 0
        and load["late_slots"] <= LATE_SHARE * load["sent"]
        and load["delivered_eps"] >= KEEP_UP * load["offered_eps"]
    )


async def measure(
    server: PrivateRedis, log_dir: Path, name: str, workers: int, sessions: int,
    seconds: float, warmup: float, **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """One load point: ``sessions`` paced sessions on ``workers`` echo workers, right
    after its own raw round-trip reference (so both see the machine in the same state).
    A point whose sessions could not all get an owner is returned as failed, not raised.
    ``overrides`` change the product's settings for this point only."""
    reference = (await round_trip(server, REFERENCE_SAMPLES, 50, log_dir))["round_trip"]
    server.flush()
    try:
        async with echo_rig(server, log_dir, name=name, workers=workers,
                            sessions=sessions, **overrides) as rig:  # fmt: skip
            meter = rig.cpu_meter().start()
            result = await paced_load(
                rig.coordinator, rig.collector, rig.session_ids, seconds=seconds, warmup=warmup
            )
            result.cpu_percent = meter.read()
            cpu_us = meter.per_event_us(result.sent)
            primed_s = rig.primed_s
    except TimeoutError as exc:
        return {"sessions": sessions, "workers": workers, "offered_eps": sessions / 0.040,
                "error": str(exc), "served": False, "within_budget": False}  # fmt: skip
    point = result.to_dict()
    point["cpu_us_per_event"] = cpu_us
    point["sessions_taken_s"] = round(primed_s, 2)
    point["workers"] = workers
    point["reference_round_trip"] = reference
    point.update(_added(point))
    return point


async def run_latency(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    points = []
    for sessions in plan.latency_sessions:
        point = await _repeated(server, log_dir, sessions, plan)
        points.append(point)
        if "error" in point:
            print(f"  latency {sessions:>5} sessions: failed: {point['error']}", flush=True)
            continue
        lat = point["latency"]
        rate = f"{point['delivered_eps']:.0f}/{point['offered_eps']:.0f} ev/s"
        print(f"  latency {sessions:>5} sessions: p50 {lat['p50_ms']:.2f} ms "
              f"p99 {lat['p99_ms']:.2f} ms, delivered {rate}", flush=True)  # fmt: skip
    return {"workers": 1, "reference_round_trip": raw["round_trip"], "points": points}


async def _repeated(
    server: PrivateRedis, log_dir: Path, sessions: int, plan: Any
) -> dict[str, Any]:
    """A latency point run ``plan.latency_repeats`` times, each after its own reference: the
    run with the median added p99, with every run's added p99. A point not served (or
    failed) is not run again: its latency is queueing, and the next runs would be too."""
    runs: list[dict[str, Any]] = []
    for index in range(plan.latency_repeats):
        point = await measure(server, log_dir, f"lat{sessions}r{index}", 1, sessions,
                              plan.latency_seconds, plan.warmup_seconds)  # fmt: skip
        if "error" in point:
            return point
        point["served"] = served(point)
        runs.append(point)
        if not point["served"]:
            break
    runs.sort(key=lambda run: run["added_p99_ms"])
    median = median_run(runs, lambda run: run["added_p99_ms"])
    median["runs_added_p99_ms"] = [run["added_p99_ms"] for run in runs]
    return median


def _within(point: dict[str, Any], plan: Any) -> bool:
    return served(point) and point["added_p99_ms"] <= plan.budget_ms


async def run_scaling(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    curve = []
    for workers in plan.scaling_workers:
        tried = []
        best = 0
        for sessions in plan.scaling_sessions:
            point = await measure(server, log_dir, f"sc{workers}x{sessions}", workers, sessions,
                                  plan.scaling_seconds, 1.0)  # fmt: skip
            if "error" not in point and not _within(point, plan):
                # One stall of the machine puts a few events over budget in one run; the
                # point counts as over only if a second run of it is over too.
                first = point
                point = await measure(server, log_dir, f"sc{workers}x{sessions}b", workers,
                                      sessions, plan.scaling_seconds, 1.0)  # fmt: skip
                point["first_run_added_p99_ms"] = first.get("added_p99_ms")
            tried.append(point)
            if "error" in point:
                print(f"  scaling {workers} worker(s) x {sessions:>4} sessions: failed: "
                      f"{point['error']}", flush=True)  # fmt: skip
                break
            ok = _within(point, plan)
            point["within_budget"] = ok
            print(f"  scaling {workers} worker(s) x {sessions:>4} sessions: added p99 "
                  f"{point['added_p99_ms']:.2f} ms, delivered {point['delivered_eps']:.0f}/"
                  f"{point['offered_eps']:.0f} ev/s -> {'ok' if ok else 'over'}",
                  flush=True)  # fmt: skip
            if not ok:
                break
            best = sessions
        curve.append({
            "workers": workers,
            "sessions_within_budget": best,
            "events_per_s_within_budget": round(best / 0.040, 1),
            "ceiling_not_reached": bool(tried) and tried[-1]["within_budget"],
            "points": tried,
        })  # fmt: skip
    base = curve[0]["sessions_within_budget"] if curve else 0
    for row in curve:
        row["ratio_to_one_worker"] = (
            ratio(row["sessions_within_budget"], base) if base else math.nan
        )
    return {"budget_ms": plan.budget_ms, "reference_round_trip": raw["round_trip"], "curve": curve}
