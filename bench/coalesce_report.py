"""12. Streamed tokens: what coalescing their publishes saves and what latency it adds.

``python -m bench --only coalesce`` runs ``bench.coalesce``'s measurement
``plan.coalesce_repeats`` times on one private redis-server: session actors
of a client-facing stage stream answers token by token, paced (``Load.rate``
tokens/s, as a model decodes) and as fast as the loop turns, each with the
shipped ``coalesce_ms`` / ``coalesce_max`` and with coalescing off. Latency is
from a token being yielded to its output being readable in the client
journal (where a client-facing stage that no stage reads publishes); the
difference between the two settings is what coalescing adds.
Each figure is the median over the repeats.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.coalesce import Load, added, measure
from bench.common import PrivateRedis
from bench.mdformat import f, failed, table, x
from schemas.config import Settings

SPEEDS = ("paced", "full")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _figures(row: dict[str, Any]) -> dict[str, float]:
    """One row's figures: publishes and CPU (this process plus Redis) per token, latency."""
    return {
        "publishes_per_token": row["publishes_per_token"],
        "cpu_us_per_token": row["worker_cpu_us_per_token"] + row["redis_cpu_us_per_token"],
        "p50_ms": row["latency"]["p50_ms"],
        "p99_ms": row["latency"]["p99_ms"],
        "delivered": row["seen"] / row["tokens"],
    }


def _medians(runs: list[list[dict[str, Any]]], name: str) -> dict[str, float]:
    """The median of each figure of the row called ``name`` over the runs."""
    per_run = [_figures(next(row for row in rows if row["name"] == name)) for rows in runs]
    return {key: _median([fig[key] for fig in per_run]) for key in per_run[0]}


async def run(server: PrivateRedis, plan: Any, _raw: dict[str, Any], _logs: Path) -> dict[str, Any]:
    settings = Settings()
    load = Load(answers=plan.coalesce_answers)
    runs = [await measure(server, load, f"r{repeat}") for repeat in range(plan.coalesce_repeats)]
    deltas_per_run = [added(rows) for rows in runs]
    speeds: dict[str, Any] = {}
    for speed in SPEEDS:
        on = _medians(runs, f"{speed}-{settings.coalesce_ms}")
        off = _medians(runs, f"{speed}-0")
        deltas = [run_deltas[speed] for run_deltas in deltas_per_run]
        speeds[speed] = {
            "on": on,
            "off": off,
            "added_p50_ms": _median([d["p50"] for d in deltas]),
            "added_p99_ms": _median([d["p99"] for d in deltas]),
            "cpu_ratio": round(on["cpu_us_per_token"] / off["cpu_us_per_token"], 3),
        }
        print(f"  coalesce {speed}: added p50 {speeds[speed]['added_p50_ms']} ms, p99 "
              f"{speeds[speed]['added_p99_ms']} ms; CPU per token {on['cpu_us_per_token']:.0f} "
              f"vs {off['cpu_us_per_token']:.0f} us off", flush=True)  # fmt: skip
    return {
        "coalesce_ms": settings.coalesce_ms,
        "coalesce_max": settings.coalesce_max,
        "load": asdict(load),
        "repeats": plan.coalesce_repeats,
        "speeds": speeds,
    }


def _label(s: dict[str, Any], speed: str) -> str:
    return f"{s['load']['rate']:g} tokens/s" if speed == "paced" else "full speed"


def summary_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """The summary table's rows for section 12."""
    if not s or "error" in s:
        return []
    rows = []
    for speed in SPEEDS:
        p = s["speeds"][speed]
        on, off = p["on"], p["off"]
        rows.append(
            [
                "12",
                f"streamed tokens at {_label(s, speed)}, coalescing {s['coalesce_ms']} "
                "ms: added p50 / p99",
                f"{f(p['added_p50_ms'])} / {f(p['added_p99_ms'])} ms",
                f"coalescing off {f(off['p50_ms'])} / {f(off['p99_ms'])} ms",
                "-",
            ]
        )
        rows.append(["12", f"CPU per streamed token, {_label(s, speed)}, worker + Redis",
                     f"{f(on['cpu_us_per_token'], 0)} us ({f(on['publishes_per_token'])} "
                     "publishes/token)", f"coalescing off {f(off['cpu_us_per_token'], 0)} us",
                     x(p["cpu_ratio"])])  # fmt: skip
    return rows


def section(s: dict[str, Any] | None) -> str:
    """The report's section 12."""
    out = ["## 12. Streamed tokens: coalesced publishes", ""]
    if (msg := failed("coalesce", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    load = s["load"]
    out.append(
        f"{load['sessions']} sessions of a client-facing stage (session actors holding real\n"
        f"leases, in the benchmark's process) each stream {load['answers']} answers of "
        f"{load['tokens']} tokens,\n"
        f"paced at {load['rate']:g} tokens/s and at full speed. A streaming stage publishes an\n"
        "answer's first token at once and the next ones at most once per `coalesce_ms`\n"
        f"({s['coalesce_ms']} ms) or per `coalesce_max` ({s['coalesce_max']}) tokens, each "
        "token still its own output\n"
        "(`workers/coalesce.py`); off means one publish per token. Latency runs from a\n"
        "token being yielded to its output being readable in the client journal (read by\n"
        f"another process). Medians of {s['repeats']} runs of each setting; CPU is the\n"
        "benchmark's process plus Redis.\n"
    )
    rows = []
    for speed in SPEEDS:
        p = s["speeds"][speed]
        on, off = p["on"], p["off"]
        rows.append([
            _label(s, speed),
            f"{f(off['publishes_per_token'])} -> {f(on['publishes_per_token'])}",
            f"{f(off['cpu_us_per_token'], 0)} -> {f(on['cpu_us_per_token'], 0)} us",
            x(p["cpu_ratio"]),
            f"{f(off['p50_ms'])} -> {f(on['p50_ms'])} ms",
            f"{f(off['p99_ms'])} -> {f(on['p99_ms'])} ms",
            f"{f(p['added_p50_ms'])} / {f(p['added_p99_ms'])} ms",
            f"{f(100 * on['delivered'], 0)} %",
        ])  # fmt: skip
    out.append(table(["stream", "publishes per token (off -> on)", "CPU per token", "ratio",
                      "p50", "p99", "added p50 / p99", "delivered"], rows))  # fmt: skip
    out.append(
        "\nAt a decoding pace, coalescing holds a token back by up to the window (added\n"
        "latency about half of it at p50); at full speed it removes the queue that one\n"
        "publish per token builds, so latency falls (a negative figure)."
    )
    return "\n".join(out)
