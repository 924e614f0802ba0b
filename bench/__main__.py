"""``python -m bench``: run the benchmarks and regenerate docs/benchmarks.md.

    python -m bench                      # the full run (about 10 minutes on 2 cores)
    python -m bench --quick              # a smoke run (about 2 minutes)
    python -m bench --only failover,raw  # some sections; the others keep their last results
    python -m bench --report-only        # redraw the page and chart from bench/results.json

Every section starts its own redis-server (free port, temp dir on the machine's
disk) with the persistence the product ships (AOF, fsynced before every reply);
the raw limit, latency and throughput sections run a second time on a twin
Redis without persistence, so that what the fsync costs stands beside them. The
raw limit runs first whenever a section compares against it, so every ratio is
against a reference measured in the same run, on a Redis persisting alike. Results
go to ``bench/results.json``; the page and its chart (``docs/benchmarks.md``,
``docs/benchmarks.png``) are generated from that file. Benchmarks are not
tests: pytest never collects this package.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import (
    backlog,
    bargein,
    chart,
    coalesce_report,
    failover,
    latency,
    linger,
    primaries,
    raw,
    report,
    takein,
    throughput,
    voice,
)
from bench.common import ROOT, machine_info, private_redis, write_json
from bench.fsync import TWINNED
from bench.plan import FULL, QUICK, SECTIONS, Plan

NEEDS_RAW = {"latency", "throughput", "bargein", "backlog", "scaling", "primaries"}
RESULTS = ROOT / "bench" / "results.json"
DOC = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "benchmarks.png"

Section = Callable[[Any, Plan, dict[str, Any], Path], Awaitable[dict[str, Any]]]

RUNNERS: dict[str, Section] = {
    "latency": latency.run_latency,
    "throughput": throughput.run,
    "bargein": bargein.run,
    "failover": lambda server, plan, _raw, logs: failover.run(server, plan, logs),
    "backlog": backlog.run,
    "scaling": latency.run_scaling,
    "takein": takein.run,
    "primaries": primaries.run,
    "linger": linger.run,
    "coalesce": coalesce_report.run,
    "voice": voice.run,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="the fast smoke plan")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--report-only", action="store_true",
                        help="regenerate the page and chart from the results file")  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--chart", type=Path, default=CHART)
    parser.add_argument("--keep-logs", action="store_true", help="keep worker logs")
    args = parser.parse_args(argv)
    chosen = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    args.sections = chosen
    return args


def command_line(argv: list[str] | None) -> str:
    return " ".join(["python -m bench", *(sys.argv[1:] if argv is None else argv)])


async def _on_redis(
    name: str, plan: Plan, reference: dict[str, Any], logs: Path, *, persistent: bool
) -> dict[str, Any]:
    with private_redis(name, persistent=persistent) as server:
        if name == "raw":
            return await raw.run(server, plan, logs)
        return await RUNNERS[name](server, plan, reference, logs)


async def _section(name: str, plan: Plan, reference: dict[str, Any], logs: Path) -> dict[str, Any]:
    """``name`` on the shipped persistence, and for a ``TWINNED`` one again without."""
    result = await _on_redis(name, plan, reference, logs, persistent=True)
    if name in TWINNED:
        print(f"[{name}] again on a Redis without persistence", flush=True)
        try:
            twin = await _on_redis(name, plan, reference.get("unpersisted", {}), logs,
                                   persistent=False)  # fmt: skip
        except Exception as exc:  # the twin failing leaves the shipped figures standing
            traceback.print_exc()
            twin = {"error": f"{type(exc).__name__}: {exc}"}
        result["unpersisted"] = twin
    return result


async def run(plan: Plan, sections: tuple[str, ...], logs: Path) -> dict[str, Any]:
    """Run ``sections`` (and the raw limit they compare against); their results."""
    order = [s for s in SECTIONS if s in sections or (s == "raw" and NEEDS_RAW & set(sections))]
    out: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    for name in order:
        began = time.monotonic()
        print(f"[{name}]", flush=True)
        try:
            result = await _section(name, plan, reference, logs)
        except Exception as exc:  # a failed section is reported, the run goes on
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
            if name == "raw":
                out[name] = result
                print("the raw limit failed; nothing else can be compared", file=sys.stderr)
                break
        result["_seconds"] = round(time.monotonic() - began, 1)
        result["_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        result["_plan"] = plan.name
        out[name] = result
        if name == "raw":
            reference = result
        print(f"[{name}] done in {result['_seconds']} s", flush=True)
    return out


def raise_open_files_limit() -> None:
    """A thousand sessions mean a thousand concurrent appends, each on its own socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()
    previous: dict[str, Any] = {}
    if args.results.exists():
        previous = json.loads(args.results.read_text())
    if args.report_only:
        if not previous:
            print(f"no results at {args.results}; run python -m bench first", file=sys.stderr)
            return 2
        publish(previous, args)
        return 0
    plan = QUICK if args.quick else FULL
    logs = Path(tempfile.mkdtemp(prefix="duplexq-bench-logs-"))
    began = time.monotonic()
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with private_redis("probe") as probe:
        machine = machine_info(probe.version())
    sections = asyncio.run(run(plan, args.sections, logs))
    machine["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    partial = set(args.sections) != set(SECTIONS)
    same_plan = previous.get("run", {}).get("plan", {}).get("name") == plan.name
    if partial and previous and not same_plan:
        print(f"the previous results were measured under another plan; {args.results} now "
              f"holds only this run's sections", file=sys.stderr)  # fmt: skip
    results = {**previous} if partial and same_plan else {}
    results.setdefault("sections", {})
    results["sections"].update(sections)
    results["run"] = {
        "command": command_line(argv),
        "plan": plan.to_dict(),
        "started": started,
        "wall_seconds": round(time.monotonic() - began, 1),
        "sections": list(sections),
        "partial": partial,
    }
    results["machine"] = machine
    write_json(args.results, results)
    publish(results, args)
    failed = [name for name, result in sections.items() if "error" in result]
    if failed or args.keep_logs:
        print(f"worker and peer logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(f"done in {results['run']['wall_seconds']} s; results in {args.results}, "
          f"page in {args.doc}")  # fmt: skip
    return 1 if failed else 0


def publish(results: dict[str, Any], args: argparse.Namespace) -> None:
    args.chart.parent.mkdir(parents=True, exist_ok=True)
    chart.render(results.get("sections", {}), args.chart)
    rel_chart = os.path.relpath(args.chart, args.doc.parent)
    args.doc.write_text(report.render(results, rel_chart))


if __name__ == "__main__":
    sys.exit(main())
