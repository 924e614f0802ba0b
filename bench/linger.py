"""11. Linger: CPU per event and latency with the shipped linger and without it.

``python -m bench --only linger``: paced sessions (25 chunks/s each, as
section 2) on one echo worker, each session count measured with
``linger_ms=0`` and then with the shipped ``linger_ms``, the pair repeated
``plan.linger_repeats`` times so that both settings see the machine in the
same states. The linger (``dataplane/pacing.py``) trades at most its own
length per hop for fewer, fuller rounds: the figures say what it saves and
what it adds.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common import PrivateRedis
from bench.latency import measure
from bench.mdformat import f, failed, table, x
from schemas.config import Settings


def _median(points: list[dict[str, Any]], pick: Any) -> float | None:
    values = [pick(p) for p in points if "error" not in p]
    return statistics.median(values) if values else None


async def run(
    server: PrivateRedis, plan: Any, _raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    shipped = Settings().linger_ms
    rows = []
    for sessions in plan.linger_sessions:
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "shipped": []}
        for repeat in range(plan.linger_repeats):
            for label, linger in (("off", 0.0), ("shipped", shipped)):
                name = f"linger{label}{sessions}r{repeat}"
                point = await measure(server, log_dir, name, 1, sessions, plan.latency_seconds,
                                      plan.warmup_seconds, linger_ms=linger)  # fmt: skip
                runs[label].append(point)
        row: dict[str, Any] = {"sessions": sessions}
        for label, points in runs.items():
            row[label] = {
                "cpu_us_per_event": _median(points, lambda p: p["cpu_us_per_event"]["total"]),
                "p50_ms": _median(points, lambda p: p["latency"]["p50_ms"]),
                "p99_ms": _median(points, lambda p: p["latency"]["p99_ms"]),
                "delivered_eps": _median(points, lambda p: p["delivered_eps"]),
                "errors": [p["error"] for p in points if "error" in p],
            }
        off, on = row["off"], row["shipped"]
        if off["cpu_us_per_event"] and on["cpu_us_per_event"]:
            row["cpu_ratio"] = round(on["cpu_us_per_event"] / off["cpu_us_per_event"], 3)
        rows.append(row)
        print(f"  linger {sessions:>4} sessions: CPU per event {f(off['cpu_us_per_event'])} -> "
              f"{f(on['cpu_us_per_event'])} us, p50 {f(off['p50_ms'])} -> {f(on['p50_ms'])} ms, "
              f"p99 {f(off['p99_ms'])} -> {f(on['p99_ms'])} ms", flush=True)  # fmt: skip
    return {"linger_ms": shipped, "repeats": plan.linger_repeats, "points": rows}


def summary_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """The summary table's rows for section 11."""
    if not s or "error" in s:
        return []
    return [
        ["11", f"CPU per event, {p['sessions']} paced sessions, linger {s['linger_ms']:g} ms",
         f"{f(p['shipped']['cpu_us_per_event'], 0)} us",
         f"linger off {f(p['off']['cpu_us_per_event'], 0)} us", x(p.get("cpu_ratio"))]
        for p in s["points"]
    ]  # fmt: skip


def section(s: dict[str, Any] | None) -> str:
    """The report's section 11."""
    out = ["## 11. Linger", ""]
    if (msg := failed("linger", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "Paced sessions (25 chunks/s each) on one echo worker, with the linger off and at\n"
        f"its shipped {s['linger_ms']:g} ms (`linger_ms`, `dataplane/pacing.py`): a read or a\n"
        "batch of script calls that would follow a round carrying several items within the\n"
        "linger waits out the rest, so the work arriving meanwhile joins it (a lone caller\n"
        "never waits). Each setting was measured\n"
        f"{s['repeats']} times, alternating with the other; the medians are shown.\n"
    )
    rows = []
    for p in s["points"]:
        off, on = p["off"], p["shipped"]
        rows.append([
            f(p["sessions"]),
            f"{f(off['cpu_us_per_event'], 0)} -> {f(on['cpu_us_per_event'], 0)} us",
            x(p.get("cpu_ratio")),
            f"{f(off['p50_ms'])} -> {f(on['p50_ms'])} ms",
            f"{f(off['p99_ms'])} -> {f(on['p99_ms'])} ms",
            f"{f(off['delivered_eps'], 0)} -> {f(on['delivered_eps'], 0)}",
        ])  # fmt: skip
    out.append(table(["sessions", "CPU per event (off -> on)", "ratio", "p50", "p99",
                      "delivered ev/s"], rows))  # fmt: skip
    return "\n".join(out)
