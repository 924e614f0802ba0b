"""``python -m chaos``: run the nemesis suite and write its report.

    python -m chaos --ci                       # the short seeded run CI asserts on
    python -m chaos --ci --seed 5              # the same run under another schedule
    python -m chaos --seed 7 --duration 600    # a long run
    python -m chaos --faults kill_worker,kill_redis --clients 40
    python -m chaos --ci --redis-cluster       # the same on a Redis Cluster
    python -m chaos --ci --hosts               # the cluster and processes on 4 simulated
                                               # hosts, partitioned (root only)

The report (JSON, plus a Markdown table beside it) has, per client and in
total, what the checker counted, the recovery time of each fault class and those
slower than their bound (``over_bound``, asserted by the CI test), the
faults struck and what the clients did, and the one-owner check of what the
stages published as Redis kept it (``chaos.owners``). The exit code is 0 only
when lost, stale, duplicated, out-of-order, dead and stalled are all zero and
no stage's outputs show two owners.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from chaos.checker import (
    COUNTS,
    Verdict,
    bound_of,
    check,
    summarize,
)
from chaos.client import ChaosClient, ClientConfig
from chaos.cluster import Cluster
from chaos.hosts import Hosts
from chaos.nemesis import Nemesis, faults_for
from chaos.owners import handovers, read_outputs, two_owners
from chaos.partition import layout
from dataplane.bus import RedisBus
from schemas.config import PipelineConfig, StageConfig
from schemas.keys import Keys

CI = {"seed": 1, "duration": 75.0, "clients": 20, "coordinators": 2, "workers": 2}
"""The CI mode: a couple of minutes, every fault class, every count asserted."""
HOSTS = 4
"""Simulated hosts of ``--hosts``: three with the Redis Cluster's nodes, one more."""


def nemesis_pipeline() -> PipelineConfig:
    """Two chained stages; the talker answers each input in four deltas."""
    return PipelineConfig(
        name="nemesis",
        stages=(
            StageConfig(name="thinker", backend="echo"),
            StageConfig(name="talker", backend="echo", input="thinker", to_client=True,
                        options={"chunks": 4, "step_ms": 25}),
        ),
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ci", action="store_true", help="the short seeded CI run")
    parser.add_argument("--seed", type=int, help="the fault schedule's seed (default 1)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of faults")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--coordinators", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3, help="workers per stage")
    parser.add_argument("--faults", help="fault classes, comma-separated (default: every "
                        "class the kind of Redis has: " + ", ".join(faults_for(True)) + "; "
                        "restart_primary and promote_replica need --redis-cluster, "
                        "partition needs --hosts)")  # fmt: skip
    parser.add_argument("--stall-s", type=float, default=20.0)
    parser.add_argument(
        "--every", default="2.5,5", help="seconds between faults: low,high (uniform)"
    )
    parser.add_argument("--redis-cluster", action="store_true",
                        help="run on a Redis Cluster (3 primaries with replicas)")  # fmt: skip
    parser.add_argument("--hosts", action="store_true",
                        help="run the cluster and the processes on simulated hosts (network "
                        "namespaces, chaos.hosts) and partition them; implies --redis-cluster; "
                        "needs root")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="logs and Redis data (default: a temp dir)")
    parser.add_argument("--report", type=Path, help="report path (default: WORKDIR/report.json)")
    args = parser.parse_args(argv)
    if args.ci:
        chosen_seed = args.seed
        for name, value in CI.items():
            setattr(args, name, value)
        if chosen_seed is not None:  # the CI run's shape under another fault schedule
            args.seed = chosen_seed
    if args.seed is None:
        args.seed = 1
    args.redis_cluster = args.redis_cluster or args.hosts
    known = faults_for(args.redis_cluster, args.hosts)
    args.faults = args.faults or ",".join(known)
    unknown = set(args.faults.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown fault classes {sorted(unknown)} for this Redis; known: "
                     f"{', '.join(known)}")  # fmt: skip
    return args


async def wait_for_workers(cluster: Cluster, within_s: float = 120) -> None:
    bus = RedisBus(cluster.settings.redis_url, Keys(cluster.settings.key_prefix))
    try:
        deadline = time.monotonic() + within_s
        for stage in cluster.pipeline.stage_names:
            while await bus.client.zcard(bus.keys.workers(stage)) < cluster.workers_per_stage:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stage {stage} has no workers after {within_s} s")
                await asyncio.sleep(0.2)
    finally:
        await bus.aclose()


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    cluster = Cluster(workdir, nemesis_pipeline(), coordinators=args.coordinators,
                      workers_per_stage=args.workers, redis_cluster=args.redis_cluster,
                      hosts=Hosts(HOSTS) if args.hosts else None)  # fmt: skip
    try:  # ``stop`` takes down whatever started, the hosts last, on every way out
        await asyncio.to_thread(cluster.start)
        await wait_for_workers(cluster)
        started = time.monotonic()
        config = ClientConfig(api_key=cluster.api_key)
        clients = [
            ChaosClient(i, random.Random(rng.random()), cluster.endpoints, config, started)
            for i in range(args.clients)
        ]
        low, high = (float(v) for v in args.every.split(","))
        nemesis = Nemesis(cluster, clients, random.Random(rng.random()), started,
                          faults=args.faults.split(","), every_s=(low, high))  # fmt: skip
        nemesis.notes.extend(await asyncio.to_thread(layout, cluster))
        stop_clients, stop_faults = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(c.run(stop_clients)) for c in clients]
        await asyncio.sleep(3)  # every client's session is up before the first fault
        faults = asyncio.create_task(nemesis.run(stop_faults))
        await asyncio.sleep(args.duration)
        stop_faults.set()
        await faults
        await nemesis.heal()
        stop_clients.set()  # each client finishes the input it is on, then stops
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        keys = Keys(cluster.settings.key_prefix, cluster=args.redis_cluster)
        sessions = [c.session_id for c in clients if c.session_id]
        published = await read_outputs(cluster.settings.redis_url, keys, cluster.pipeline,
                                       sessions)  # fmt: skip
    finally:
        await asyncio.to_thread(cluster.stop)
    verdict = check([c.history for c in clients], nemesis.log, stall_s=args.stall_s)
    write_histories(workdir / "histories.jsonl", clients)
    result = report(args, verdict, clients, nemesis, elapsed)
    owners = two_owners(published)
    result["owners"] = {"outputs": len(published), "handovers": handovers(published),
                        "two_owners": len(owners), "examples": owners[:10]}  # fmt: skip
    result["ok"] = result["ok"] and not owners
    return result


def write_histories(path: Path, clients: list[ChaosClient]) -> None:
    """Every client's history, one operation a line (for finding what a count means)."""
    with path.open("w") as out:
        for client in clients:
            for op in client.history.ops:
                row = {"client": client.index, "t": round(op.t, 4), "kind": op.kind,
                       "attempt": list(op.attempt) if op.attempt else None, "block": op.block,
                       "epoch": op.epoch, "detail": op.detail}  # fmt: skip
                out.write(json.dumps(row) + "\n")


def report(
    args: argparse.Namespace,
    verdict: Verdict,
    clients: list[ChaosClient],
    nemesis: Nemesis,
    elapsed: float,
) -> dict[str, Any]:
    ops = summarize(op for c in clients for op in c.history.ops)
    return {
        "ok": verdict.ok,
        "seed": args.seed,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "clients": args.clients,
        "coordinators": args.coordinators,
        "workers_per_stage": args.workers,
        "redis": ("cluster on hosts" if args.hosts else "cluster")
        if args.redis_cluster
        else "single",
        "totals": dict(verdict.totals),
        "recovery": verdict.recovery_summary(),
        "over_bound": verdict.over_bound(),
        "faults": {
            kind: sum(f.kind == kind for f in nemesis.log) for kind in args.faults.split(",")
        },
        "operations": dict(ops),
        "errors": dict(
            Counter(op.detail for c in clients for op in c.history.ops if op.kind == "error")
        ),
        "per_client": [
            {
                "client": r.client,
                "session": clients[r.client].session_id,
                **{name: r.counts[name] for name in COUNTS},
                "examples": r.examples,
            }
            for r in verdict.clients
        ],
        "fault_log": [
            {"t": round(f.t, 3), "kind": f.kind, "target": f.target} for f in nemesis.log
        ],
        "notes": nemesis.notes,
    }


def markdown(result: dict[str, Any]) -> str:
    totals = result["totals"]
    lines = [
        f"seed {result['seed']}, {result['duration_s']:.0f} s of faults, {result['clients']} "
        f"clients, {result['coordinators']} coordinators, {result['workers_per_stage']} "
        f"workers per stage: **{'PASS' if result['ok'] else 'FAIL'}**",
        "",
        "| " + " | ".join(COUNTS) + " |",
        "|" + "---|" * len(COUNTS),
        "| " + " | ".join(str(totals[name]) for name in COUNTS) + " |",
        "",
        "| fault | count | recovery p50 (s) | recovery max (s) | bound (s) |",
        "|---|---|---|---|---|",
    ]
    for kind, count in result["faults"].items():
        rec = result["recovery"].get(kind, {})
        bound = bound_of(kind)
        over = " **over**" if kind in result.get("over_bound", {}) else ""
        lines.append(f"| {kind} | {count} | {rec.get('p50_s', '-')} | {rec.get('max_s', '-')} "
                     f"| {bound:g}{over} |")  # fmt: skip
    ops = result["operations"]
    owners = result.get("owners", {})
    lines += [
        "",
        f"outputs in Redis {owners.get('outputs', 0)} (handovers {owners.get('handovers', 0)}), "
        f"of two owners {owners.get('two_owners', 0)}",
        *(f"- {e}" for e in owners.get("examples", [])),
    ]
    notes = [f"- {note}" for note in result.get("notes", [])]
    lines += ["", "notes:", *notes] if notes else []
    lines += [
        "",
        f"inputs sent {ops.get('send', 0)}, acknowledged {ops.get('ack', 0)}, answer blocks "
        f"{ops.get('block', 0)}, cancels {ops.get('cancel_sent', 0)} (refused as too late "
        f"{ops.get('cancel_refused', 0)}), sockets dropped "
        f"{ops.get('drop', 0)}, given up as silent {ops.get('silent', 0)}, resumes "
        f"{ops.get('resume', 0)}, errors {ops.get('error', 0)}, "
        f"function calls {ops.get('call', 0)} (results sent {ops.get('result_sent', 0)})",
    ]
    if result.get("errors"):
        codes = ", ".join(f"{code} {n}" for code, n in result["errors"].items())
        lines.append(f"errors by code: {codes}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="duplexq-nemesis-"))
    result = asyncio.run(run(args, workdir))
    path = args.report or workdir / "report.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"report: {path} (logs in {workdir}/logs)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
