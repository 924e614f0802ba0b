"""What fsync costs a cluster against one Redis: side-by-side pairs under three policies.

``python -m bench.cluster_fsync [--pairs 3] [--seconds 8] [--policy shipped]``:
section 10's saturated point (one echo worker, the full plan's 64 sessions and window
of 512), on a private Redis and on a private cluster of 3 primaries with a replica
each, alternating, one Redis first in each pair; CPU per event over every process,
and the cluster's ratios to one Redis. Three fsync policies (``--policy``: some of
them), each set with ``CONFIG SET`` once the servers run:

- ``shipped``: ``appendfsync always`` on every server (``REDIS_PERSISTENCE``);
- ``replicas everysec``: the cluster's replicas fsync once a second, its primaries and
  the one Redis before every reply;
- ``everysec everywhere``: every server, the one Redis too, fsyncs once a second: the
  data plane's own cost on a cluster, apart from how often six nodes fsync.

The two relaxed policies run the product with ``redis_durability`` relaxed (it refuses
them otherwise: ``dataplane.redis_config``). docs/scaling.md quotes the figures and why
the shipped policy stays. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import PrivateRedis, private_redis
from bench.plan import FULL
from bench.primaries import private_cluster
from bench.throughput import saturated

POLICIES = {
    # policy -> (one Redis everysec, cluster replicas everysec, cluster primaries everysec)
    "shipped": (False, False, False),
    "replicas everysec": (False, True, False),
    "everysec everywhere": (True, True, True),
}


def everysec(server: PrivateRedis) -> None:
    server.command(b"CONFIG", b"SET", b"appendfsync", b"everysec")


def is_replica(server: PrivateRedis) -> bool:
    return b"slave" in server.command(b"ROLE")[:32]


async def point(server: Any, relaxed: bool, plan: Any, name: str) -> dict[str, Any]:
    overrides = {"redis_durability": "relaxed"} if relaxed else {}
    log_dir = Path(tempfile.mkdtemp(prefix="duplexq-bench-fsync-"))
    return await saturated(server, log_dir, name, 1, plan, **overrides)


def line(where: str, p: dict[str, Any]) -> str:
    cpu = ", ".join(f"{k} {v:.0f}" for k, v in p["cpu_us_per_event"].items())
    return f"    {where}: {p['events_per_s']:.0f} ev/s; CPU per event (us): {cpu}"


async def pair(policy: str, plan: Any, at: int) -> tuple[float, float]:
    one_sec, replicas_sec, primaries_sec = POLICIES[policy]
    with private_redis(f"fsync{at}") as redis:
        if one_sec:
            everysec(redis)
        one = await point(redis, one_sec, plan, f"one{at}")
    with private_cluster() as cluster:
        for node in cluster.nodes:
            if primaries_sec if not is_replica(node) else replicas_sec:
                everysec(node)
        many = await point(cluster, replicas_sec or primaries_sec, plan, f"clu{at}")
    print(line("one Redis", one), flush=True)
    print(line("cluster", many), flush=True)
    cpu = many["cpu_us_per_event"]["total"] / one["cpu_us_per_event"]["total"]
    events = many["events_per_s"] / one["events_per_s"]
    print(f"  pair {at}: CPU per event {cpu:.2f}x, events/s {events:.2f}x", flush=True)
    return cpu, events


async def run(pairs: int, seconds: float, policies: list[str]) -> None:
    plan = dataclasses.replace(FULL, throughput_seconds=seconds)
    for policy in policies:
        print(f"{policy}:", flush=True)
        ratios = [await pair(policy, plan, at) for at in range(pairs)]
        print(f"  median: CPU per event {statistics.median(r[0] for r in ratios):.2f}x, "
              f"events/s {statistics.median(r[1] for r in ratios):.2f}x", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--policy", action="append", choices=list(POLICIES), help="only these (repeatable)"
    )
    args = parser.parse_args()
    asyncio.run(run(args.pairs, args.seconds, args.policy or list(POLICIES)))


if __name__ == "__main__":
    main()
